"""vpage.ops.lora_add: against a float64 torch reference of the same values on random inputs,
awkward sizes and mixed ranks (rows of no adapter, a slot without weights, an untargeted slice,
strided x and out), float32 and bfloat16; a row's result alone equals its batch's; bad
arguments raise before the kernel runs."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from vpage import ops

_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


class _Adapter:
    """One slot's weights on a projection: A ``[slices * rank, k]`` and per slice a B
    ``[rows, rank]`` (None: untargeted), and the same packed for the kernel (kept alive here)."""

    def __init__(self, k: int, slice_rows: list[int], rank: int, dtype: torch.dtype, gen: torch.Generator,
                 untargeted: Optional[int] = None):
        self.rank = rank
        self.a = (torch.rand(len(slice_rows) * rank, k, generator=gen) - 0.5).to(dtype)
        self.b = [None if j == untargeted else (torch.rand(rows, rank, generator=gen) - 0.5).to(dtype)
                  for j, rows in enumerate(slice_rows)]
        self.packed_a = ops.pack_dense_weight(self.a)
        self.packed_b = [None if b is None else ops.pack_dense_weight(b) for b in self.b]

    def row(self) -> list[int]:
        b = [0 if p is None else p.data_ptr() for p in self.packed_b]
        return [self.packed_a.data_ptr(), *b, *[0] * (3 - len(b)), self.rank]


def _table(adapters: list[Optional[_Adapter]]) -> torch.Tensor:
    return torch.tensor([[0] * 5 if ad is None else ad.row() for ad in adapters], dtype=torch.int64).reshape(-1, 5)


def _reference(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, adapters: list[Optional[_Adapter]],
               slice_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out + each row's adapter update, the bound of float32 sums over those products), float64."""
    want, magnitude = out.double().clone(), torch.zeros(out.shape, dtype=torch.float64)
    offsets = [0]
    for rows in slice_rows:
        offsets.append(offsets[-1] + rows)
    for t, slot in enumerate(slots.tolist()):
        ad = None if slot < 0 else adapters[slot]
        if ad is None:
            continue
        xa = x[t].double() * ad.a.double()  # [slices * rank, k] products
        shrunk, shrunk_abs = xa.sum(1), xa.abs().sum(1)
        for j, b in enumerate(ad.b):
            if b is None:
                continue
            part = slice(j * ad.rank, (j + 1) * ad.rank)
            cols = slice(offsets[j], offsets[j + 1])
            want[t, cols] += b.double() @ shrunk[part]
            magnitude[t, cols] += b.double().abs() @ shrunk_abs[part]
    return want, magnitude


def _strided(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return ((torch.rand(rows, cols + 3, generator=gen) - 0.5) * scale).to(dtype)[:, :cols]


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("m,k,slice_rows", [(1, 72, [96, 32, 32]), (300, 72, [96, 32, 32]), (37, 576, [45, 45]),
                                            (300, 130, [72])])
def test_lora_add_matches_float64(dtype, weight_dtype, m, k, slice_rows):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    # Ranks 8, 1, 16; slot 1 leaves its last slice alone, slot 3 the whole projection.
    adapters = [_Adapter(k, slice_rows, 8, weight_dtype, gen),
                _Adapter(k, slice_rows, 1, weight_dtype, gen, untargeted=len(slice_rows) - 1),
                _Adapter(k, slice_rows, 16, weight_dtype, gen), None]
    table = _table(adapters)
    n = sum(slice_rows)
    x = _strided(m, k, dtype, gen, 2.0)
    out = _strided(m, n, dtype, gen, 8.0)
    slots = torch.randint(-1, len(adapters), (m,), generator=gen, dtype=torch.int32)
    if m == 1:
        slots[0] = 2
    before = out.clone()
    assert ops.lora_add(out, x, slots, table, slice_rows, weight_dtype) is out
    want, magnitude = _reference(before, x, slots, adapters, slice_rows)
    rank = max(ad.rank for ad in adapters if ad is not None)
    bound = (k + rank + 4) * 1.2e-7 * magnitude + _EPS[dtype] * want.abs() + 1e-30
    assert ((out.double() - want).abs() <= bound).all()
    untouched = (want == before.double()) & (magnitude == 0)  # no adapter on the element
    assert torch.equal(out[untouched], before[untouched])
    # A row alone gives the same bits as in the batch.
    for t in (0, m - 1):
        single = before[t:t + 1].clone()
        ops.lora_add(single, x[t:t + 1], slots[t:t + 1], table, slice_rows, weight_dtype)
        assert torch.equal(single, out[t:t + 1])
    with ops.trusted_arguments():
        again = before.clone()
        ops.lora_add(again, x, slots, table, slice_rows, weight_dtype)
    assert torch.equal(again, out)


def test_lora_add_without_adapters_leaves_out_alone():
    gen = torch.Generator().manual_seed(1)
    adapters = [None, _Adapter(40, [24], 4, torch.float32, gen)]
    out = torch.randn(5, 24, generator=gen)
    before = out.clone()
    slots = torch.tensor([-1, 0, -1, 0, 0], dtype=torch.int32)
    ops.lora_add(out, torch.randn(5, 40, generator=gen), slots, _table(adapters), [24], torch.float32)
    assert torch.equal(out, before)


def test_lora_add_bad_arguments_raise():
    gen = torch.Generator().manual_seed(2)
    adapter = _Adapter(16, [8, 8], 2, torch.float32, gen)
    table = _table([adapter])
    x, out = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    slots = torch.tensor([0, -1, 0], dtype=torch.int32)
    before = out.clone()
    with pytest.raises(ValueError, match="names slot"):
        ops.lora_add(out, x, torch.tensor([0, 1, 0], dtype=torch.int32), table, [8, 8], torch.float32)
    assert torch.equal(out, before)
    with pytest.raises(TypeError, match="token_slots"):
        ops.lora_add(out, x, slots.long(), table, [8, 8], torch.float32)
    with pytest.raises(ValueError, match="token_slots"):
        ops.lora_add(out, x, slots[:2], table, [8, 8], torch.float32)
    with pytest.raises(ValueError, match="table"):
        ops.lora_add(out, x, slots, table[:, :4].contiguous(), [8, 8], torch.float32)
    with pytest.raises(ValueError, match="out"):
        ops.lora_add(out, x, slots, table, [8, 9], torch.float32)
    with pytest.raises(ValueError, match="slice_rows"):
        ops.lora_add(out, x, slots, table, [4, 4, 4, 4], torch.float32)
    with pytest.raises(TypeError, match="out"):
        ops.lora_add(out.bfloat16(), x, slots, table, [8, 8], torch.float32)
    with pytest.raises(ValueError, match="on the CPU"):
        ops.lora_add(out, x.to("meta"), slots, table, [8, 8], torch.float32)
    assert torch.equal(out, before)
