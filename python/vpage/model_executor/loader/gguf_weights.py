"""Weights of a GGUF file, renamed to Hugging Face's convention: dequantized to float32, or
(for the names the model asks for) kept as their raw GGUF block rows."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Collection, Iterator

import numpy as np
import torch

from vpage.model_executor.layers.quant_linear import QuantizedTensor

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


def gguf_tensor_types(reader: Any) -> dict[str, int]:
    """Hugging Face name -> ggml type id of every used tensor of the GGUF file."""
    names = ((hf_tensor_name(t.name), int(t.tensor_type)) for t in reader.tensors)
    return {name: type_id for name, type_id in names if name is not None}


def _raw_rows(tensor: Any) -> QuantizedTensor:
    """A GGUF tensor's block rows as a QuantizedTensor (a view of the file mapping)."""
    cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
    with warnings.catch_warnings():  # a read-only file mapping, only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    return QuantizedTensor(data, int(tensor.tensor_type), cols)


def iterate_gguf(reader: Any, path: Path, num_heads: int, num_kv_heads: int,
                 keep_quantized: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (Hugging Face name, float32 tensor) for each used tensor of the GGUF file, or
    (name, QuantizedTensor of its raw rows) for the names in ``keep_quantized``. Q/K rows
    permuted by llama.cpp's converter are un-permuted either way (quantization is per row)."""
    from gguf.quants import dequantize

    permuted = gguf_architecture(reader) in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        if name in keep_quantized:
            raw = _raw_rows(tensor)
            if permuted and (".q_proj." in name or ".k_proj." in name):
                heads = num_heads if ".q_proj." in name else num_kv_heads
                raw.data = torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(tensor.data, heads)))
            yield name, raw
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
