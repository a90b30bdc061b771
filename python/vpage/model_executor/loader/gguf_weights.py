"""Weights of a GGUF file, renamed to Hugging Face's convention through the architecture's
description (``GgufArch``): tensors in a block format vpage's kernels read come as their raw
GGUF rows (``QuantizedTensor``, which a float layer dequantizes when it loads it), the others
dequantized to float32."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from vpage import ops
from vpage.model_executor.layers.weight_utils import QuantizedTensor
from vpage.model_executor.loader.gguf_file import GgufFile, GgufTensor
from vpage.model_executor.models.arch import GgufArch

_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_RAW_TYPE_IDS = {type_id for type_id, _, _ in ops.QUANT_TYPES.values()}


def hf_tensor_name(gguf_name: str, arch: GgufArch) -> str | None:
    """Hugging Face name for a GGUF tensor name, or None for tensors vpage does not use."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = arch.layer_names.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    hf = arch.global_names.get(base)
    return None if hf is None else f"{hf}.{kind}"


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection (weight or bias; float
    or raw block rows: a row moves whole).

    llama.cpp stores each head's rows as (pairs, 2) where Hugging Face stores (2, pairs);
    w ``[num_heads * head_size, ...]``.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_types(reader: GgufFile, arch: GgufArch) -> dict[str, int]:
    """Hugging Face name -> ggml type id of every used tensor of the GGUF file."""
    names = ((hf_tensor_name(t.name, arch), t.tensor_type) for t in reader.tensors)
    return {name: type_id for name, type_id in names if name is not None}


def _raw_rows(tensor: GgufTensor, permuted_heads: int | None) -> QuantizedTensor:
    """A GGUF tensor's block rows as a QuantizedTensor (a view of the file mapping, or a copy
    with the Q/K rows un-permuted)."""
    cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
    if permuted_heads is not None:
        rows = np.ascontiguousarray(unpermute_rotary_rows(tensor.data, permuted_heads))
        return QuantizedTensor(torch.from_numpy(rows), tensor.tensor_type, cols)
    with warnings.catch_warnings():  # a read-only file mapping, only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    return QuantizedTensor(data, tensor.tensor_type, cols)


def iterate_gguf(reader: GgufFile, path: Path, arch: GgufArch, num_heads: int,
                 num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (Hugging Face name, tensor) for each used tensor of the GGUF file: raw rows for
    the block formats of ``ops.QUANT_TYPES``, float32 for the others. Q/K rows permuted by
    llama.cpp's converter are un-permuted either way (quantization is per row), and
    ``arch.tensor_transform`` (if any) applies last."""
    transform = arch.tensor_transform
    for name, tensor in _iterate_gguf(reader, path, arch, num_heads, num_kv_heads):
        yield name, tensor if transform is None else transform(name, tensor)


def _iterate_gguf(reader: GgufFile, path: Path, arch: GgufArch, num_heads: int,
                  num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            continue
        heads = None
        if arch.permuted_qk and ".q_proj." in name:
            heads = num_heads
        elif arch.permuted_qk and ".k_proj." in name:
            heads = num_kv_heads
        if tensor.tensor_type in _RAW_TYPE_IDS:
            yield name, _raw_rows(tensor, heads)
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {tensor.name} ({e})") from e
        if heads is not None:
            w = unpermute_rotary_rows(w, heads)
        if not w.flags.writeable:  # unquantized tensors come as read-only file mappings
            w = w.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(w))
