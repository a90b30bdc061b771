"""The CUDA batched LoRA kernel (``_ops_cuda.lora_add``) against a float64 torch reference of the
same values: awkward sizes, ranks 1, 8 and 16 mixed in one batch, rows of no adapter, a slot
without an A, an untargeted slice, strided x and out; every element no adapter reaches keeps its
bits, and a row alone gives the bits it gets in its batch. Then ``LoraHook.add_`` on CUDA (its
device table, slot changes). Skipped without a GPU (tests marked ``cuda``)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from device_marks import requires_cuda
from vpage import _ops_cuda
from vpage.lora.layers import LoraHook, LoraState, LoraTarget, ProjectionLora
from vpage.model_executor.layers.parallel_linear import RowPart

DEVICE = "cuda"
# One rounding of out to its dtype (unit roundoff doubled for margin).
_EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
_F32_ULP = 2.4e-7  # twice float32's unit roundoff, per term of a sum


class _Adapter:
    """One slot's weights on a projection, plain row-major on the device: A ``[slices * rank,
    k]`` (None: the slot leaves the projection alone) and per slice a B ``[rows, rank]`` (None:
    untargeted)."""

    def __init__(self, k: int, slice_rows: list[int], rank: int, dtype: torch.dtype, gen: torch.Generator,
                 untargeted: Optional[int] = None, no_a: bool = False):
        self.rank = rank
        a = (torch.rand(len(slice_rows) * rank, k, generator=gen) - 0.5).to(dtype)
        self.a = None if no_a else a.to(DEVICE)
        self.b = [None if j == untargeted else (torch.rand(rows, rank, generator=gen) - 0.5).to(dtype).to(DEVICE)
                  for j, rows in enumerate(slice_rows)]

    def row(self) -> list[int]:
        if self.a is None:
            return [0] * 5
        b = [0 if t is None else t.data_ptr() for t in self.b]
        return [self.a.data_ptr(), *b, *[0] * (3 - len(b)), self.rank]


def _table(adapters: list[Optional[_Adapter]]) -> torch.Tensor:
    rows = [[0] * 5 if ad is None else ad.row() for ad in adapters]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(DEVICE)


def _reference(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, adapters: list[Optional[_Adapter]],
               slice_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out + each row's adapter update, the bound of float32 sums over those products), float64 on
    the CPU."""
    out, x = out.cpu().double(), x.cpu().double()
    want, magnitude = out.clone(), torch.zeros(out.shape, dtype=torch.float64)
    offsets = [0]
    for rows in slice_rows:
        offsets.append(offsets[-1] + rows)
    for t, slot in enumerate(slots.tolist()):
        ad = None if slot < 0 else adapters[slot]
        if ad is None or ad.a is None:
            continue
        xa = x[t] * ad.a.cpu().double()  # [slices * rank, k] products
        shrunk, shrunk_abs = xa.sum(1), xa.abs().sum(1)
        for j, b in enumerate(ad.b):
            if b is None:
                continue
            part = slice(j * ad.rank, (j + 1) * ad.rank)
            cols = slice(offsets[j], offsets[j + 1])
            b = b.cpu().double()
            want[t, cols] += b @ shrunk[part]
            magnitude[t, cols] += b.abs() @ shrunk_abs[part]
    return want, magnitude


def _assert_close(out: torch.Tensor, before: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, k: int,
                  rank: int) -> None:
    """Within float32 sums' error and one rounding of out; no adapter's elements keep their bits."""
    got = out.cpu()
    assert not torch.isnan(got).any()
    bound = (k + rank + 8) * _F32_ULP * magnitude + _EPS[out.dtype] * want.abs() + 1e-30
    excess = (got.double() - want).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"
    untouched = magnitude == 0  # no adapter reaches the element
    assert torch.equal(got[untouched], before.cpu()[untouched])


def _padded(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, scale: float,
            pad: int = 3) -> torch.Tensor:
    """[rows, cols + pad] random values: the test's tensors are its first cols columns (strided rows)."""
    return ((torch.rand(rows, cols + pad, generator=gen) - 0.5) * scale).to(dtype).to(DEVICE)


# (m, k, slice_rows, pad): x's rows are k + pad values apart, 16-byte aligned for pad 0 and 8 (the
# vector loops over k), not for pad 3; k = 35 has no 16-byte rows of A either.
CASES = [(1, 72, [96, 32, 32], 8), (300, 72, [96, 32, 32], 3), (1, 576, [1536, 1536], 3),
         (300, 576, [1536, 1536], 0), (37, 35, [72], 8)]
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.bfloat16)]


@requires_cuda
@pytest.mark.parametrize("dtype,weight_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("m,k,slice_rows,pad", CASES)
def test_lora_add_matches_float64(dtype, weight_dtype, m, k, slice_rows, pad):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    # Slot 0 rank 8; slot 1 rank 1, its last slice untargeted; slot 2 rank 16; slot 3 no A.
    adapters = [_Adapter(k, slice_rows, 8, weight_dtype, gen),
                _Adapter(k, slice_rows, 1, weight_dtype, gen, untargeted=len(slice_rows) - 1),
                _Adapter(k, slice_rows, 16, weight_dtype, gen), _Adapter(k, slice_rows, 4, weight_dtype, gen, no_a=True)]
    table = _table(adapters)
    n = sum(slice_rows)
    x_full, out_full = _padded(m, k, dtype, gen, 2.0, pad), _padded(m, n, dtype, gen, 8.0, pad)
    x, out = x_full[:, :k], out_full[:, :n]
    slots = torch.randint(-1, len(adapters), (m,), generator=gen, dtype=torch.int32)
    if m == 1:
        slots[0] = 2
    else:
        slots[:5] = torch.tensor([-1, 0, 1, 2, 3], dtype=torch.int32)
    slots = slots.to(DEVICE)
    before_full, x_before = out_full.clone(), x_full.clone()
    _ops_cuda.lora_add(out, x, slots, table, slice_rows, max_rank=16, weight_dtype=weight_dtype)
    torch.cuda.synchronize()
    want, magnitude = _reference(before_full[:, :n], x, slots.cpu(), adapters, slice_rows)
    _assert_close(out, before_full[:, :n], want, magnitude, k, 16)
    assert torch.equal(out_full[:, n:], before_full[:, n:])  # past the row's columns
    assert torch.equal(x_full, x_before)
    # A row alone gives the same bits as in the batch; a larger max_rank changes nothing.
    for t in (0, m - 1):
        single = before_full[t:t + 1, :n].clone()
        _ops_cuda.lora_add(single, x[t:t + 1], slots[t:t + 1], table, slice_rows, max_rank=64,
                           weight_dtype=weight_dtype)
        assert torch.equal(single, out[t:t + 1])


@requires_cuda
def test_lora_add_skips_rows_it_may_not_serve():
    """Slot -1, a slot past the table, a slot without A, a rank above max_rank: out keeps its bits."""
    gen = torch.Generator().manual_seed(7)
    adapters = [_Adapter(64, [40], 16, torch.float32, gen), None]
    out = _padded(4, 40, torch.float32, gen, 1.0)
    before = out.clone()
    slots = torch.tensor([-1, 2, 1, 0], dtype=torch.int32, device=DEVICE)
    x = _padded(4, 64, torch.float32, gen, 1.0)[:, :64]
    _ops_cuda.lora_add(out[:, :40], x, slots, _table(adapters), [40], max_rank=8)  # slot 0's rank 16 > 8
    _ops_cuda.lora_add(out[:3, :40], x[:3], slots[:3], _table(adapters), [40], max_rank=16)
    _ops_cuda.lora_add(out[:0, :40], x[:0], slots[:0], _table(adapters), [40], max_rank=16)
    torch.cuda.synchronize()
    assert torch.equal(out, before)


def _hook(k: int, slice_rows: list[int], dtype: torch.dtype) -> LoraHook:
    parts = tuple(RowPart(None, rows, 0, rows) for rows in slice_rows)
    names = {1: "o_proj", 2: "gate_up_proj", 3: "qkv_proj"}
    target = LoraTarget(0, names[len(slice_rows)], nn.Identity(), parts, k)
    return LoraHook(LoraState(), target, max_loras=4, dtype=dtype)


def _projection(ad: _Adapter) -> ProjectionLora:
    return ProjectionLora(ad.a, list(ad.b), ad.rank)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hook_uses_the_kernel_on_cuda(dtype, monkeypatch):
    k, slice_rows, m = 72, [96, 32, 32], 45
    gen = torch.Generator().manual_seed(11)
    adapters = [_Adapter(k, slice_rows, 8, dtype, gen), None,
                _Adapter(k, slice_rows, 1, dtype, gen, untargeted=2), _Adapter(k, slice_rows, 16, dtype, gen)]
    hook = _hook(k, slice_rows, dtype)
    for slot, ad in enumerate(adapters):
        hook.set_slot(slot, None if ad is None else _projection(ad))
    assert hook.device_table is not None and hook.device_table.device.type == "cuda"
    assert hook.max_rank == 16
    assert torch.equal(hook.table, torch.zeros_like(hook.table))  # the CPU table serves packed weights only
    slots = torch.randint(-1, 4, (m,), generator=gen, dtype=torch.int32)
    hook.state.token_slots = slots.to(DEVICE)
    x = _padded(m, k, dtype, gen, 2.0)[:, :k]
    y = _padded(m, sum(slice_rows), dtype, gen, 8.0)[:, :sum(slice_rows)]
    before = y.clone()
    calls = []
    kernel = _ops_cuda.lora_add
    monkeypatch.setattr(_ops_cuda, "lora_add", lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    hook.add_(x, y)
    assert calls
    want, magnitude = _reference(before, x, slots, adapters, slice_rows)
    _assert_close(y, before, want, magnitude, k, 16)

    # The torch loop (no kernels) agrees within its extra rounding of each update.
    monkeypatch.setattr(_ops_cuda, "HAS_KERNELS", False)
    loop = before.clone()
    hook.add_(x, loop)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(loop.float(), y.float(), rtol=tol, atol=tol)
    monkeypatch.setattr(_ops_cuda, "HAS_KERNELS", True)

    # Cleared and replaced slots reach the device table: slot 3 gone, slot 0 now rank 4.
    hook.set_slot(3, None)
    adapters[3] = None
    adapters[0] = _Adapter(k, slice_rows, 4, dtype, gen)
    hook.set_slot(0, _projection(adapters[0]))
    assert hook.max_rank == 4
    assert hook.device_table[3].tolist() == [0] * 5
    again = before.clone()
    hook.add_(x, again)
    want, magnitude = _reference(before, x, slots, adapters, slice_rows)
    _assert_close(again, before, want, magnitude, k, 8)
