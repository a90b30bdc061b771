"""GGUF block bytes for the quantized-weight tests: the gguf package's own quantizer where it
has one (Q4_0, Q4_1, Q8_0), else random blocks written bit-exactly by hand with finite,
moderate f16 scales (Q4_K, Q5_K, Q6_K: every byte pattern is a valid block)."""

from __future__ import annotations

import numpy as np

from vpage import ops

ALL_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")


def _f16_bytes(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    values = rng.uniform(low, high, size=shape).astype(np.float16)
    return values.view(np.uint8).reshape(*shape, 2)


def quantized_rows(qtype: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, row bytes]`` for float ``w`` ``[rows, k]``: ``w`` quantized by gguf for
    the 32-blocks types; for the K types random blocks (``w`` gives only the shape and the
    scale of the values) with d (and dmin) drawn so values stay near ``w``'s magnitude."""
    import gguf

    if qtype in _QUANTIZABLE:
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    rows, k = w.shape
    _, values, size = ops.QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // values, size), dtype=np.uint8)
    amp = float(np.abs(w).max())
    if qtype == "Q6_K":  # value = d * scale(int8) * (q - 32): |value| <= d * 128 * 32
        blocks[:, :, 208:210] = _f16_bytes(rng, (rows, k // values), 0.1 * amp / 4096, amp / 4096)
    else:  # value = d * sc * q - dmin * mn with sc, mn < 64 and q < 16 (Q4_K) or 32 (Q5_K)
        top = 63 * (15 if qtype == "Q4_K" else 31)
        blocks[:, :, 0:2] = _f16_bytes(rng, (rows, k // values), 0.2 * amp / top, 2 * amp / top)
        blocks[:, :, 2:4] = _f16_bytes(rng, (rows, k // values), 0.1 * amp / 63, amp / 63)
    return blocks.reshape(rows, -1)


def dequantized(qtype: str, rows: np.ndarray) -> np.ndarray:
    """gguf's own dequantization of ``rows`` as float64 ``[rows, k]``."""
    import gguf

    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
