"""Weights of a GGUF file, dequantized and renamed to Hugging Face's convention."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

# GGUF architectures whose converter permuted the Q/K rows for llama.cpp's rotary layout.
_PERMUTED_ARCHS = {"llama"}


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``; ValueError naming the file when it is corrupt."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def gguf_architecture(reader: Any) -> str:
    """The ``general.architecture`` string of a GGUF file (e.g. "llama", "qwen2")."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF file has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name for a GGUF tensor name, or None for tensors vpage does not use."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{kind}"


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection (weight or bias).

    llama.cpp stores each head's rows as (pairs, 2) where Hugging Face stores (2, pairs);
    w ``[num_heads * head_size, ...]``.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf(reader: Any, path: Path, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for each used tensor of the GGUF file."""
    from gguf.quants import dequantize

    permuted = gguf_architecture(reader) in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {tensor.name} ({e})") from e
        if permuted and ".q_proj." in name:
            w = unpermute_rotary_rows(w, num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rotary_rows(w, num_kv_heads)
        if not w.flags.writeable:  # unquantized tensors come as read-only file mappings
            w = w.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(w))
