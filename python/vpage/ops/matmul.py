"""CPU matmuls on weights laid out at load time: GGUF block formats kept quantized
(``QUANT_TYPES``; also dequantizing picked rows) and float weights packed in panels of
``DENSE_PANEL_ROWS`` rows, and batched LoRA adapters on those matmuls' outputs."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from vpage import _ops_cpu
from vpage.ops._common import _SUPPORTED_DTYPES, _check_tensor, _checking


# GGUF block formats the CPU keeps quantized: name -> (ggml type id, values per block, bytes per block).
QUANT_TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
# Layouts the CPU repacks GGUF rows into at load (not in any file): Q4_1x4 and Q8_0x4 are
# Q4_1 and Q8_0 rows in groups of four for the decode kernel (repack_x4), Q4_1x8 and Q8_0x8 in
# groups of eight for the VNNI one (repack_x8).
REPACKED_TYPES = {"Q4_1x4": (259, 32, 20), "Q8_0x4": (264, 32, 34),
                  "Q4_1x8": (515, 32, 20), "Q8_0x8": (520, 32, 34)}
REPACK_GROUP_ROWS = {"Q4_1x4": 4, "Q8_0x4": 4, "Q4_1x8": 8, "Q8_0x8": 8}  # rows addressable only together
_X4_OF = {"Q4_1": "Q4_1x4", "Q8_0": "Q8_0x4"}
_X8_OF = {"Q4_1": "Q4_1x8", "Q8_0": "Q8_0x8"}
_FORMATS = {**QUANT_TYPES, **REPACKED_TYPES}
_QUANT_BY_ID = {tid: (name, values, size) for name, (tid, values, size) in _FORMATS.items()}


def _quant_format(qtype: object) -> Tuple[int, int, int]:
    """(type id, values per block, bytes per block) of a type name or id (or a gguf enum)."""
    if isinstance(qtype, str) and qtype in _FORMATS:
        return _FORMATS[qtype]
    key = getattr(qtype, "name", qtype)
    if isinstance(key, str) and key in _FORMATS:
        return _FORMATS[key]
    if isinstance(qtype, int) and qtype in _QUANT_BY_ID:
        return (int(qtype),) + _QUANT_BY_ID[int(qtype)][1:]
    raise ValueError(f"unsupported quantization type {qtype!r}; supported: {sorted(_FORMATS)}")


def quant_row_bytes(qtype: object, k: int) -> int:
    """Bytes of one weight row of ``k`` values in block format ``qtype`` (a name such as
    ``"Q4_K"`` or its ggml type id); ValueError unless ``k`` is a positive multiple of the
    block size (32, or 256 for the K types)."""
    _, values, size = _quant_format(qtype)
    if not isinstance(k, int) or k <= 0 or k % values:
        raise ValueError(f"k = {k!r} must be a positive multiple of {values} for {qtype}")
    return k // values * size


def _check_qweight(qweight: object, qtype: object, n: int, k: int) -> Tuple[int, int]:
    """qweight: contiguous CPU uint8 holding n rows of k values; returns (type id, row bytes)."""
    type_id = _quant_format(qtype)[0]
    row_bytes = quant_row_bytes(qtype, k)
    _check_tensor("qweight", qweight, dtype=torch.uint8, device=torch.device("cpu"))
    if not isinstance(n, int) or n < 0 or qweight.numel() != n * row_bytes:
        raise ValueError(f"qweight has {qweight.numel()} bytes; {n!r} rows of {k} values in {qtype} need "
                         f"{n} x {row_bytes}")
    return type_id, row_bytes


def _checked_matmul_rows(x: torch.Tensor, k: int, n: int, out: Optional[torch.Tensor],
                         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Checks a CPU matmul's 2-D x as ``[m, k]`` (float, contiguous columns, rows at least k
    apart) and ``out`` as ``[m, n]`` of ``out_dtype`` (default x's) on x's device (None: a new
    one); returns out."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.dtype not in _SUPPORTED_DTYPES or x.shape[1] != k or (x.shape[0] > 1 and x.stride(0) < k) or (
            k > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be a float [m, {k}] tensor with contiguous columns, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=out_dtype)
    _check_tensor("out", out, dtype=out_dtype, ndim=2, device=x.device, contiguous=False)
    if tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n):
        raise ValueError(f"out must be [{m}, {n}] with contiguous columns, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    return out


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: object, n: int, k: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = x @ W.T`` with ``W`` ``[n, k]`` kept in a GGUF block format (CPU only).

    x ``[m, k]`` float32, bfloat16 or float16 (rows may be strided, columns contiguous);
    qweight uint8, the n rows' raw GGUF blocks (``[n, quant_row_bytes(qtype, k)]`` or flat);
    qtype a name of ``QUANT_TYPES`` or its ggml id, or one of ``REPACKED_TYPES`` (rows as
    :func:`repack_x4` regroups them). Returns out ``[m, n]`` in x's dtype
    (float32 accumulation). The weights are dequantized inside the kernel, never copied.
    With Q4_0, Q4_1, Q8_0 or Q4_K, x is rounded to 8 bits per 32 values and multiplied in
    integers, as llama.cpp does (the decode path up to ``_core.QUANT_INTEGER_PATH_ROWS`` rows,
    the integer GEMM beyond)."""
    if not _checking():
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
        _ops_cpu.quant_matmul(out, x, qweight, _quant_format(qtype)[0], n, k)
        return out
    type_id, _ = _check_qweight(qweight, qtype, n, k)
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.device.type != "cpu":
        raise ValueError(f"quant_matmul runs on the CPU, x is on {x.device} (on CUDA, GGUF weights are "
                         "dequantized at load)")
    out = _checked_matmul_rows(x, k, n, out)
    _ops_cpu.quant_matmul(out, x, qweight, type_id, n, k)
    return out


def dequantize_rows(qweight: torch.Tensor, qtype: object, k: int) -> torch.Tensor:
    """float32 ``[rows, k]`` from ``rows`` weight rows of ``k`` values in block format ``qtype``
    (qweight: contiguous CPU uint8 ``[rows, quant_row_bytes(qtype, k)]``), e.g. the rows of an
    embedding table picked by token id."""
    row_bytes = quant_row_bytes(qtype, k)
    _check_tensor("qweight", qweight, dtype=torch.uint8, device=torch.device("cpu"))
    if qweight.numel() % row_bytes:
        raise ValueError(f"qweight has {qweight.numel()} bytes, not a whole number of {row_bytes}-byte rows")
    rows = qweight.numel() // row_bytes
    out = torch.empty(rows, k, dtype=torch.float32)
    _ops_cpu.dequantize_rows(out, qweight, _quant_format(qtype)[0], rows, k)
    return out


DENSE_PANEL_ROWS = 32  # weight rows per packed panel (_core.DENSE_PANEL_ROWS)


def pack_dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight ``[n, k]`` (float32, bfloat16 or float16, CPU, contiguous columns)
    packed for :func:`dense_matmul`: ``[ceil(n / 32), k, 32]`` of its dtype, panel p holding
    rows ``[32 p, 32 p + 32)`` column by column (zeros past row n). Packed once at load time,
    so no matmul repacks it."""
    _check_tensor("weight", weight, ndim=2, device=torch.device("cpu"), contiguous=False)
    n, k = weight.shape
    if weight.dtype not in _SUPPORTED_DTYPES or k == 0 or (k > 1 and weight.stride(1) != 1) or (
            n > 1 and weight.stride(0) < k):
        raise ValueError(f"weight must be a float [n, k > 0] tensor with contiguous columns, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    packed = torch.empty(-(-n // DENSE_PANEL_ROWS), k, DENSE_PANEL_ROWS, dtype=weight.dtype)
    if n:
        _ops_cpu.dense_pack(packed, weight)
    return packed


def dense_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[r]``) of the weight that ``packed`` holds, ``[r, k]`` (embedding
    lookups in a table packed for its tied output projection)."""
    return packed[rows // DENSE_PANEL_ROWS, :, rows % DENSE_PANEL_ROWS]


def dense_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` with ``W`` ``[n, k]`` packed by :func:`pack_dense_weight` (CPU only).

    x ``[m, k]`` float32, bfloat16 or float16 (rows may be strided, columns contiguous); bias
    float32 ``[n]`` or None. Returns out ``[m, n]`` in ``out_dtype``: x's dtype or float32 (a
    16-bit model's logits; default out's dtype, else x's). float32 accumulation, each output
    summed in k order (a row's result does not depend on its batch); 16-bit weights are widened
    in registers, so no 16-bit arithmetic is needed (bfloat16 x and weights use bf16 dot
    products where the CPU has them: ``dense_matmul_isa``)."""
    if out_dtype is None:
        out_dtype = x.dtype if out is None else out.dtype
    if not _checking():
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=out_dtype)
        _ops_cpu.dense_matmul(out, x, packed, bias, n)
        return out
    _check_tensor("packed", packed, ndim=3, device=torch.device("cpu"))
    if packed.dtype not in _SUPPORTED_DTYPES or packed.shape[2] != DENSE_PANEL_ROWS or not isinstance(n, int) or not (
            0 <= n <= packed.shape[0] * DENSE_PANEL_ROWS and packed.shape[0] == -(-n // DENSE_PANEL_ROWS)):
        raise ValueError(f"packed {packed.dtype} {tuple(packed.shape)} does not hold {n!r} rows packed by "
                         "pack_dense_weight")
    k = packed.shape[1]
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.device.type != "cpu":
        raise ValueError(f"dense_matmul runs on the CPU, x is on {x.device}")
    if bias is not None:
        _check_tensor("bias", bias, dtype=torch.float32, ndim=1, device=torch.device("cpu"))
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"dense_matmul writes x's dtype ({x.dtype}) or float32, not {out_dtype}")
    out = _checked_matmul_rows(x, k, n, out, out_dtype)
    _ops_cpu.dense_matmul(out, x, packed, bias, n)
    return out


LORA_TABLE_WIDTH = 5  # a table row: A, B of slices 0-2 (data pointers, 0 = none), rank
_MAX_LORA_SLICES = 3  # kMaxLoraSlices


def lora_add(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, table: torch.Tensor,
             slice_rows: Sequence[int], weight_dtype: torch.dtype) -> torch.Tensor:
    """Adds each row's LoRA adapter to a projection's output, in place (CPU only): for every row
    t with slot ``s = token_slots[t] >= 0`` whose A is set, ``out[t, slice j] += (x[t] @ A_s[j
    rank : (j + 1) rank].T) @ B_{s,j}.T`` for each slice j whose B is set; returns out.

    out ``[m, sum(slice_rows)]`` and x ``[m, k]`` of one float dtype (rows may be strided,
    columns contiguous); token_slots int32 ``[m]`` in ``[-1, num_slots)`` (-1: no adapter);
    table contiguous int64 ``[num_slots, 5]``, a slot's row ``(A, B0, B1, B2, rank)``: data
    pointers (0: none) of weights packed by :func:`pack_dense_weight` in ``weight_dtype``, A
    ``[len(slice_rows) * rank, k]``, slice j's B ``[slice_rows[j], rank]`` (the scaling folded
    in). The packed tensors must outlive the call. slice_rows: 1 to 3 output slices (qkv: q, k,
    v rows). float32 intermediates, each sum in k order: a row's result does not depend on the
    other rows of the batch."""
    if not _checking():
        _ops_cpu.lora_add(out, x, token_slots, table, slice_rows, weight_dtype)
        return out
    for name, t in (("out", out), ("x", x), ("token_slots", token_slots), ("table", table)):
        _check_tensor(name, t, contiguous=False)
        if t.device.type != "cpu":
            raise ValueError(f"lora_add runs on the CPU, {name} is on {t.device}")
    rows = list(slice_rows)
    if not 1 <= len(rows) <= _MAX_LORA_SLICES or not all(isinstance(r, int) and r > 0 for r in rows):
        raise ValueError(f"slice_rows must be 1 to {_MAX_LORA_SLICES} positive ints, got {slice_rows!r}")
    if weight_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"weight_dtype must be one of {_SUPPORTED_DTYPES}, got {weight_dtype}")
    _check_tensor("x", x, ndim=2, contiguous=False)
    m, k = x.shape
    if k == 0:
        raise ValueError("x must have at least one column")
    _checked_matmul_rows(x, k, sum(rows), out)
    _check_tensor("token_slots", token_slots, dtype=torch.int32, ndim=1)
    if token_slots.shape[0] != m:
        raise ValueError(f"token_slots must be [{m}], got {tuple(token_slots.shape)}")
    _check_tensor("table", table, dtype=torch.int64, ndim=2)
    if table.shape[1] != LORA_TABLE_WIDTH:
        raise ValueError(f"table must be [num_slots, {LORA_TABLE_WIDTH}], got {tuple(table.shape)}")
    _ops_cpu.lora_add(out, x, token_slots, table, rows, weight_dtype)
    return out


def repack_x4(qweight: torch.Tensor, qtype: str, rows: int, k: int) -> Optional[torch.Tensor]:
    """``rows`` Q4_1 or Q8_0 rows of ``k`` values (contiguous CPU uint8, ``[rows,
    quant_row_bytes(qtype, k)]``) in the ``"Q4_1x4"`` / ``"Q8_0x4"`` layout of the CPU decode
    kernel: the same bytes regrouped, four rows at a time, so that quant_matmul reads a block
    pair of four rows in a few whole-vector loads (the same results, bitwise). None when that
    cannot be: another type, rows not a multiple of 4, k not of 64, or a Q8_0 quant of -128. A
    repacked row cannot be picked alone (dequantize_rows takes whole groups)."""
    if qtype not in _X4_OF:
        return None
    _check_qweight(qweight, qtype, rows, k)
    if rows % 4 or k % 64:
        return None
    out = torch.empty_like(qweight)
    return out if _ops_cpu.repack_x4(out, qweight, QUANT_TYPES[qtype][0], rows, k) else None


def repack_x8(qweight: torch.Tensor, qtype: str, rows: int, k: int) -> Optional[torch.Tensor]:
    """``rows`` Q4_1 or Q8_0 rows of ``k`` values (as :func:`repack_x4` takes them) in the
    ``"Q4_1x8"`` / ``"Q8_0x8"`` layout of the VNNI decode kernel: eight rows at a time, so that
    each vector lane holds one row (the same results, bitwise, on every CPU; faster where
    ``_core.quant_reads_x8()``). None for another type or rows not a multiple of 8."""
    if qtype not in _X8_OF:
        return None
    _check_qweight(qweight, qtype, rows, k)
    if rows % 8:
        return None
    out = torch.empty_like(qweight)
    _ops_cpu.repack_x8(out, qweight, QUANT_TYPES[qtype][0], rows, k)
    return out


def repack_for_cpu(qweight: torch.Tensor, qtype: str, rows: int, k: int) -> Optional[Tuple[torch.Tensor, str]]:
    """The layout this CPU's decode kernel reads fastest, as (rows, type name): x8 where the
    selected instruction set has VNNI, else x4; None when neither takes the rows."""
    if _ops_cpu.quant_reads_x8():
        packed = repack_x8(qweight, qtype, rows, k)
        if packed is not None:
            return packed, _X8_OF[qtype]
    packed = repack_x4(qweight, qtype, rows, k)
    return None if packed is None else (packed, _X4_OF[qtype])
