"""The model's own sampling defaults, as vLLM's ``--generation-config`` takes them: from a
Hugging Face folder's generation_config.json, or from a GGUF file's ``general.sampling.*``
metadata (the keys llama.cpp's converter writes). Only keys the model sets are returned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vpage.model_executor.loader.gguf_file import GgufFile
from vpage.model_executor.loader.model_loader import resolve_model_source
from vpage.sampling_params import SamplingParams

_FILE_NAME = "generation_config.json"
_JSON_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
_INT_PARAMS = ("top_k", "max_tokens")


def generation_defaults(model: str | None, mode: str = "auto") -> dict[str, Any]:
    """SamplingParams keyword arguments the model sets (empty for ``mode="vpage"``).

    ``mode`` is "auto" (read ``model``'s files), "vpage", or a folder with a
    generation_config.json. Reads metadata only, never weights. ValueError when the file
    is unreadable, the folder lacks it, or its values are not valid sampling parameters.
    """
    if mode == "vpage":
        return {}
    if mode == "auto":
        source = resolve_model_source(model)
        if source.gguf_file:
            return _checked(_from_gguf(source.path), source.path)
        path = source.folder / _FILE_NAME
        return _checked(_from_json(path), path) if path.is_file() else {}
    path = Path(mode) / _FILE_NAME
    if not path.is_file():
        raise ValueError(f"generation_config must be 'auto', 'vpage' or a folder with {_FILE_NAME}; "
                         f"{path} does not exist")
    return _checked(_from_json(path), path)


def _from_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {param: config[key] for key, param in _JSON_KEYS.items() if config.get(key) is not None}


def _from_gguf(path: Path) -> dict[str, Any]:
    metadata = GgufFile(path).metadata
    return {param: metadata[key] for key, param in _GGUF_KEYS.items() if key in metadata}


def _checked(defaults: dict[str, Any], path: Path) -> dict[str, Any]:
    """``defaults`` with integer parameters as ints, once SamplingParams accepts them."""
    try:
        defaults = {k: int(v) if k in _INT_PARAMS else float(v) for k, v in defaults.items()}
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: invalid generation defaults {defaults} ({e})") from e
    return defaults
