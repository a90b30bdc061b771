"""The LoRA adapters a server serves, by the name a request's ``model`` field gives: from
``--lora-modules`` at start-up and, when runtime updating is allowed
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, vLLM's switch), ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``. Each adapter is loaded in the engine core (its files read and
checked against the model) before its name is served."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Optional

from vpage.entrypoints.openai.protocol import ApiError
from vpage.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VPAGE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in RUNTIME_UPDATING_ENV)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """(name, path) of each ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``. ValueError for anything else."""
    modules = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                modules.append((str(entry["name"]), str(entry["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules entry {spec!r} is not {{\"name\": ..., \"path\": ...}}: {e}") from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
        modules.append((name, path))
    return modules


class ServedAdapters:
    """Name -> ``LoRARequest`` of the adapters served, ids given out in order."""

    def __init__(self, base_name: str):
        self.base_name = base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            served = ", ".join(f"`{name}`" for name in [self.base_name, *self.by_name])
            raise ApiError(404, f"the model `{model}` does not exist; this server serves {served}",
                           kind="not_found_error", param="model")
        return lora

    async def load(self, client: Any, name: str, path: str) -> LoRARequest:
        """Loads adapter ``name`` from ``path`` in the engine core, then serves it. ApiError: 400
        for a name in use or a bad adapter, 404 for missing files."""
        if not name or not path:
            raise ApiError(400, "lora_name and lora_path are required", param="lora_name" if not name else "lora_path")
        if name == self.base_name or name in self.by_name:
            raise ApiError(400, f"the LoRA adapter `{name}` is already loaded", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        reply = await client.lora_command(add=lora)
        if reply.error is not None:
            raise ApiError(reply.status, reply.error, param="lora_path",
                           kind="not_found_error" if reply.status == 404 else "invalid_request_error")
        self.by_name[name] = lora
        return lora

    async def unload(self, client: Any, name: str) -> None:
        """Stops serving ``name`` (requests running under it finish first); 404 when unknown."""
        lora = self.by_name.get(name)
        if lora is None:
            raise ApiError(404, f"no LoRA adapter `{name}` is loaded", kind="not_found_error", param="lora_name")
        del self.by_name[name]
        await client.lora_command(remove=lora.lora_int_id)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """``/v1/models`` entries of the adapters (vLLM's: the base model as ``parent``)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "vpage", "root": lora.lora_path,
                 "parent": self.base_name, "max_model_len": max_model_len} for name, lora in self.by_name.items()]
