"""A transformers config built from a GGUF file's metadata (no second parse of the file),
through the architecture's description (``GgufArch.config_fields``)."""

from __future__ import annotations

from typing import Any

from vpage.model_executor.loader.gguf_file import GgufFile
from vpage.model_executor.models import gguf_model_class

_MISSING = object()


class GgufMetadata:
    """The metadata of a ``GgufFile`` as the config mappings read it."""

    def __init__(self, file: GgufFile):
        self.metadata, self.arch = file.metadata, file.architecture
        self._tensors = {t.name: t for t in file.tensors}

    def get(self, key: str, default: Any = _MISSING) -> Any:
        return self.get_global(f"{self.arch}.{key}", default)

    def get_global(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks {key}")
        return default

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_values(self, name: str) -> list[float]:
        from gguf.quants import dequantize

        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"GGUF file lacks tensor {name}")
        return [float(v) for v in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def hf_config_from_gguf(file: GgufFile) -> Any:
    """The transformers config (e.g. ``LlamaConfig``) for a ``GgufFile``, with
    ``architectures`` naming the model class.

    Raises ValueError naming the file for unsupported architectures or missing metadata.
    """
    import transformers

    try:
        meta = GgufMetadata(file)
        model_class = gguf_model_class(meta.arch, meta)
        kwargs = model_class.arch.gguf.config_fields(meta)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file.path}: {e}") from e
    # freq_factors is vpage's key (GGUF rope_freqs): set after transformers validated the others.
    freq_factors = (kwargs.get("rope_scaling") or {}).pop("freq_factors", None)
    config_class = getattr(transformers, model_class.arch.gguf.config_class)
    config = config_class(architectures=[model_class.arch.architectures[0]], **kwargs)
    if freq_factors is not None:
        config.rope_parameters["freq_factors"] = freq_factors
    return config
