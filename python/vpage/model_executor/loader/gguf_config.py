"""A transformers config built from a GGUF file's metadata (no second parse of the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpage.model_executor.loader.gguf_weights import gguf_architecture

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}
_MISSING = object()


def _field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks {key}")
        return default
    return field.contents()


def _rope_scaling(reader: Any, arch: str) -> dict | None:
    """The rope scaling of the metadata; ValueError for kinds vpage does not implement."""
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF per-frequency rope factors (rope_freqs) are not supported")
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear)")
    return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}


def hf_config_from_gguf(reader: Any, path: Path) -> Any:
    """A ``LlamaConfig``/``Qwen2Config`` for an open ``gguf.GGUFReader``.

    Raises ValueError naming ``path`` for unsupported architectures or missing metadata.
    """
    import transformers

    try:
        arch = gguf_architecture(reader)
        if arch not in _CONFIG_CLASSES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_CONFIG_CLASSES)}")
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        hidden = int(_field(reader, f"{arch}.embedding_length"))
        vocab = _field(reader, f"{arch}.vocab_size", None)
        if vocab is None:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        kwargs = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(reader, arch),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
    return getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)
