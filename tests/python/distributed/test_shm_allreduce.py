"""The shared-memory all-reduce between spawned ranks joined by gloo: awkward sizes (one
element, a few, many slots' worth so it goes in chunks, a non-contiguous view) in float32,
bfloat16 and float16 against a float64 sum, bitwise the same on every rank; a peer that dies
makes the other raise within seconds; rank 0's VPAGE_TP_ALLREDUCE=gloo turns it off for all;
no segment is ever left under /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from vpage.distributed import shm_comm

SLOT_BYTES = 256  # 64 float32 per chunk
SIZES = [1, 7, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

pytestmark = pytest.mark.skipif(not os.path.isdir(shm_comm.SHM_DIR), reason="no /dev/shm")


def segments() -> set[str]:
    return {name for name in os.listdir(shm_comm.SHM_DIR) if name.startswith("vpage-tp-")}


def inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Non-zero values of either sign, exactly representable in ``dtype``."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    x = torch.rand(numel, generator=g, dtype=torch.float64) * 3 + 0.25
    sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    return (x * sign).to(dtype)


def _sum_cases(rank: int, comm) -> list:
    out = []
    for dtype in DTYPES:
        for numel in SIZES:
            x = inputs(rank, numel, dtype)
            comm.all_reduce(x)
            out.append(x.view(INT_VIEW[dtype]).numpy().copy())
    strided = inputs(rank, 12 * 10, torch.float32).reshape(12, 10).t()  # [10, 12], not contiguous
    comm.all_reduce(strided)
    out.append(strided.contiguous().view(torch.int32).numpy().copy())
    return out


def _die_or_wait(rank: int, comm) -> str:
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(torch.ones(10))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("the all-reduce returned although rank 1 died")


def _rank_main(rank: int, size: int, port: int, mode: str, job: str, out) -> None:
    os.environ["VPAGE_TP_ALLREDUCE"] = mode
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=size, timeout=timedelta(seconds=60))
        comm = shm_comm.connect(rank, size, timeout_s=60, slot_bytes=SLOT_BYTES)
        if job == "connect":
            result = comm is not None
        else:
            result = {"sum": _sum_cases, "die": _die_or_wait}[job](rank, comm)
        out.put((rank, result))
    except BaseException as e:  # noqa: BLE001 -- reported to the test
        out.put((rank, f"error: {type(e).__name__}: {e}"))


def launch(size: int, job: str, modes: list[str], expect: int) -> dict:
    """Runs ``job`` on ``size`` spawned ranks; the results of the first ``expect`` to answer, by rank."""
    from vpage.executor.tensor_parallel import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, modes[r], job, out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(expect))
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
    for rank, result in results.items():
        assert not (isinstance(result, str) and result.startswith("error")), f"rank {rank}: {result}"
    return results


def test_three_ranks_sum_awkward_sizes_bitwise_equal_everywhere():
    before = segments()
    results = launch(3, "sum", ["auto"] * 3, expect=3)
    cases = [(d, n) for d in DTYPES for n in SIZES] + [(torch.float32, "strided")]
    for i, (dtype, numel) in enumerate(cases):
        got = [torch.from_numpy(results[r][i]) for r in range(3)]
        assert all(torch.equal(got[0], g) for g in got[1:]), f"ranks differ: {dtype}, {numel}"
        if numel == "strided":
            ref = sum(inputs(r, 120, dtype).reshape(12, 10).t().double() for r in range(3)).contiguous().flatten()
        else:
            ref = sum(inputs(r, numel, dtype).double() for r in range(3))
        value = got[0].view(dtype).double().flatten()
        # float32: the float32 sum; 16-bit types: summed in float32 and rounded once.
        torch.testing.assert_close(value, ref.to(dtype).double() if dtype != torch.float32 else ref,
                                   rtol=0 if dtype != torch.float32 else 1e-6, atol=1e-5)
    assert segments() == before


def test_a_dead_peer_makes_the_other_rank_raise_within_seconds():
    before = segments()
    results = launch(2, "die", ["auto"] * 2, expect=1)
    # rank 1 died 1 s in; the wait checks the peers every POLL_S, long before its 60 s timeout
    assert "rank 1" in results[0] and "ended while this rank waited" in results[0], results[0]
    assert segments() == before


def test_rank_0s_gloo_mode_turns_shm_off_on_every_rank():
    assert launch(2, "connect", ["gloo", "shm"], expect=2) == {0: False, 1: False}
