"""The Python/C++ boundary: what Python holds of the scheduler are copies that outlive their
requests, a failing commit changes nothing, and the raw pointer-taking kernels are private."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import vpage
from vpage import _core as core


def scheduler() -> core.Scheduler:
    return core.Scheduler(core.SchedulerConfig(max_num_batched_tokens=64),
                          core.BlockManagerConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, watermark=0.0))


def test_snapshots_stay_readable_after_abort_and_finish():
    s = scheduler()
    seq_ids = s.add_sequence_group("r", [5, 6, 7, 8, 9, 10], 2, core.StopConditions(max_tokens=3), 0.0)
    plan = s.schedule()
    group, seq = s.find_group("r"), s.find_sequence(seq_ids[1])
    assert s.abort("r")
    assert s.find_group("r") is None and s.find_sequence(seq_ids[1]) is None
    assert group.request_id == "r" and group.num_seqs == 2 and group.seq(0).tokens == [5, 6, 7, 8, 9, 10]
    assert seq.status == core.SequenceStatus.RUNNING and len(seq.block_table) == 2
    with pytest.raises(IndexError):
        group.seq(2)
    del s
    assert plan.input_ids.tolist() == [5, 6, 7, 8, 9, 10]  # the plan keeps its own buffers alive
    assert group.seq(1).prompt_len == 6


def test_a_failing_commit_changes_nothing():
    s = scheduler()
    s.add_sequence_group("a", list(range(1, 10)), 1, core.StopConditions(max_tokens=2), 0.0)
    plan = s.schedule()
    ids = plan.sample_seq_ids.copy()
    used = s.usage().free_gpu_blocks
    for bad_ids, bad_tokens, needle in [([ids[0], 999], [1, 1], "never issued"), ([ids[0]] * 2, [1, 1], "2 tokens for 0 drafts"),
                                        ([ids[0]], [-5], "negative token")]:
        with pytest.raises(ValueError, match=needle):
            s.commit(np.array(bad_ids, dtype=np.int64), np.array(bad_tokens, dtype=np.int32))
        s.check_invariants()
        assert s.usage().free_gpu_blocks == used and s.find_group("a").seq(0).num_computed_tokens == 0
    result = s.commit(ids, np.array([4], dtype=np.int32))
    assert result.statuses.tolist() == [int(core.SequenceStatus.RUNNING)]
    assert s.find_group("a").seq(0).tokens[-1] == 4


def test_raw_kernel_entry_points_are_private():
    public = [name for name in dir(core) if name.startswith("cpu_") and name != "cpu_isa"]
    assert public == []
    assert all(hasattr(core, f"_cpu_{k}") for k in ("paged_attention", "reshape_and_cache", "swap_blocks"))
    stubs = (Path(vpage.__file__).parent / "_core.pyi").read_text()
    assert not re.search(r"^def _?cpu_(?!isa)", stubs, re.M)
