"""Tensor parallelism on tiny random models saved to disk, on CPU (gloo): greedy outputs with
tp = 2 and 3 equal tp = 1's (KV heads split and replicated, tied and untied embeddings, a
vocabulary the ranks cannot split evenly); so do preemption by swap and by recompute, prefix
caching, seeded parallel sampling and beam search. The all-reduce goes through shared memory
by default and through gloo when VPAGE_TP_ALLREDUCE=gloo. A killed worker makes the engine
raise within seconds and leaves no process and no shared-memory segment behind; bad
configurations fail before any process starts. The Ray executor runs once on a local Ray instance the test starts and stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bounded_loops import run_requests
from model_fixtures import save_tiny_model
from vpage import EngineArgs, LLMEngine, SamplingParams
from vpage.distributed import parallel_state as ps
from vpage.distributed.shm_comm import SHM_DIR
from vpage.executor.errors import WorkerDiedError

BS = 8
PROMPTS = [[5, 9, 17], [3] * 40, list(range(10, 75)), [7, 8], list(range(100, 121))]
# (kind, tiny-config overrides, tensor_parallel_size): what each case covers.
CASES = {
    "llama kv split, untied, odd vocab": ("llama", dict(vocab_size=321), 2),
    "mistral kv replicated, tied": ("mistral", dict(num_key_value_heads=1, tie_word_embeddings=True), 2),
    "qwen2 kv split, qkv bias": ("qwen2", {}, 2),
    "llama 9 heads / 3 kv heads, tp 3, padded vocab": (
        "llama", dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, intermediate_size=192), 3),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (kind, overrides, _) in CASES.items():
        folder = tmp_path_factory.mktemp(kind)
        save_tiny_model(kind, folder, seed=3, **overrides)
        out[name] = folder
    return out


def children() -> list[psutil.Process]:
    """This test's live child processes, except multiprocessing's resource tracker (one per
    process that ever spawned, it exits with its parent and holds nothing of the engine)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def segments() -> set[str]:
    """The shared-memory all-reduce's segment names (unlinked once every rank has mapped it)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith("vpage-tp-")} if os.path.isdir(SHM_DIR) else set()


def make_engine(folder, tp: int = 1, **kwargs) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", kv_cache_memory=0.01, block_size=BS, num_threads=tp,
                tensor_parallel_size=tp)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[list[int]]]:
    """Token ids of every sample of every request, in request order."""
    return [[c.token_ids for c in out.outputs] for out in run_requests(engine, requests)]


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tp_vs_single(folder, tp: int, requests, transport: str = "shm", **kwargs):
    """(tp=1 outputs, tp outputs, tp engine stats); the tp engine is shut down."""
    expected = run(make_engine(folder, **kwargs), requests)
    engine = make_engine(folder, tp, **kwargs)
    try:
        assert ps.all_reduce_transport() == transport
        got = run(engine, requests)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert not children()
    return expected, got, stats


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_single_rank(folders, case):
    _, _, tp = CASES[case]
    expected, got, _ = tp_vs_single(folders[case], tp, [(p, greedy()) for p in PROMPTS])
    assert got == expected


def test_gloo_all_reduce_when_forced(folders, monkeypatch):
    monkeypatch.setenv("VPAGE_TP_ALLREDUCE", "gloo")  # the spawned worker inherits it
    expected, got, _ = tp_vs_single(folders["llama kv split, untied, odd vocab"], 2, [(p, greedy()) for p in PROMPTS],
                                    transport="gloo")
    assert got == expected


FEATURES = [(p, greedy(16)) for p in PROMPTS] + [
    (list(range(10, 53)), SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)),
    (list(range(30, 47)), SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True)),
    (list(range(10, 53)) + [9, 9], greedy(12)),  # shares the sampled prompt's prefix blocks
]


@pytest.mark.parametrize("mode, budget", [("swap", 2048), ("recompute", 16)])  # 16: chunked prefills
def test_preemption_sampling_and_beams_match_single_rank(folders, mode, budget):
    folder = folders["llama kv split, untied, odd vocab"]
    # 14 blocks per rank: each rank holds 1 of the 2 KV heads, so a block takes half the bytes.
    block_bytes = 2 * 2 * 1 * 16 * BS * 4
    kwargs = dict(kv_cache_memory=14 * block_bytes / 2**30, swap_space=64 * block_bytes / 2**30,
                  preemption_mode=mode, max_model_len=96, enable_prefix_caching=True, max_num_batched_tokens=budget)
    single = dict(kwargs, kv_cache_memory=2 * kwargs["kv_cache_memory"], swap_space=2 * kwargs["swap_space"])
    expected = run(make_engine(folder, **single), FEATURES)
    engine = make_engine(folder, 2, **kwargs)
    try:
        assert engine.scheduler.usage().num_gpu_blocks == 14
        got = run(engine, FEATURES)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert got == expected
    preempted = stats.num_preempted_swap if mode == "swap" else stats.num_preempted_recompute
    assert preempted > 0
    assert not children()


def test_killed_worker_raises_quickly_and_leaves_no_process(folders):
    before = segments()
    engine = make_engine(folders["qwen2 kv split, qkv bias"], 2)
    assert ps.all_reduce_transport() == "shm"
    (worker,) = children()
    engine.add_request("r", PROMPTS[2], greedy(200))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="killed by signal 9") as died:
        engine.step()  # the next step notices, by the worker's liveness
    assert "did not arrive within" not in str(died.value.__cause__)  # not the collective's backstop timeout
    with pytest.raises(WorkerDiedError):
        engine.step()
    engine.shutdown()
    assert not children()
    assert segments() == before


_DRIVER = """
import faulthandler, signal, sys, time, psutil
# Ctrl-C handled as in a terminal: a shell running the suite as a background job starts it
# with SIGINT ignored, which Python and this child would inherit (the hang seen before).
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump if it hangs
from vpage import LLM, SamplingParams
llm = LLM({folder!r}, dtype="float32", kv_cache_memory=0.01, block_size=8, tensor_parallel_size=2, num_threads=2)
print(*[p.pid for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())], flush=True)
sys.stdin.readline()
deadline = time.monotonic() + 300  # ends by itself if the test never signals (an orphan)
while time.monotonic() < deadline:  # still generating whenever the signal comes (one generate can end within a second)
    llm.generate([[5, 9, 17]] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_workers_exit_when_the_driver_dies_or_is_interrupted(folders, how):
    before = segments()
    script = _DRIVER.format(folder=str(folders["qwen2 kv split, qkv bias"]))
    driver = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ, start_new_session=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 1
        if how == "SIGKILL":
            driver.kill()
        else:
            driver.stdin.write("go\n")
            driver.stdin.flush()
            time.sleep(1.0)  # generating
            os.killpg(driver.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:  # show where it hangs
            driver.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            driver.kill()
            raise AssertionError("the driver did not exit within 60 s; its threads:\n" + driver.stderr.read()[-6000:])
        if how == "Ctrl-C":
            assert "KeyboardInterrupt" in driver.stderr.read()
        assert _gone(pids, 10)
        assert segments() == before
    finally:
        driver.kill()
        driver.wait()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), r"cannot split 4 attention heads and 2 KV heads.*sizes that work are \[1, 2, 4\]"),
    (dict(tensor_parallel_size=8), r"tensor_parallel_size 8 cannot split"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="threads"), "must be one of"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
])
def test_bad_configuration_fails_before_any_process_starts(folders, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_engine(folders["qwen2 kv split, qkv bias"], **{"num_threads": 1, **kwargs})
    assert not children()


def test_bad_all_reduce_mode_fails_before_any_process_starts(folders, monkeypatch):
    monkeypatch.setenv("VPAGE_TP_ALLREDUCE", "tcp")
    with pytest.raises(ValueError, match="VPAGE_TP_ALLREDUCE must be one of"):
        make_engine(folders["qwen2 kv split, qkv bias"], 2)
    assert not children()


def test_ray_backend_missing_is_a_clear_error(folders, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'vpage\[ray\]'"):
        make_engine(folders["qwen2 kv split, qkv bias"], 2, distributed_executor_backend="ray")
    assert not children()


def test_ray_executor_matches_single_rank(folders):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'vpage[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        folder = folders["mistral kv replicated, tied"]
        requests = [(p, greedy()) for p in PROMPTS]
        expected = run(make_engine(folder), requests)
        for pp in (1, 2):  # tensor ranks, then pipeline stages (of one layer each), as Ray actors
            engine = make_engine(folder, 3 - pp, pipeline_parallel_size=pp, distributed_executor_backend="ray")
            try:
                assert run(engine, requests) == expected
            finally:
                engine.shutdown()
    finally:
        ray.shutdown()


def test_cli_passes_the_tensor_parallel_size(folders, capsys):
    from vpage.cli import _parser
    from vpage.cli import main as cli_main

    assert _parser().parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2
    assert _parser().parse_args(["chat", "--tensor-parallel-size", "3"]).tensor_parallel_size == 3
    folder = str(folders["qwen2 kv split, qkv bias"])
    common = ["generate", "the quick brown fox", "--model", folder, "--max-tokens", "6", "--kv-cache-memory", "0.01"]
    assert cli_main(common) == 0
    single = capsys.readouterr().out
    assert cli_main(common + ["-tp", "2"]) == 0
    assert capsys.readouterr().out == single
    assert cli_main(common + ["--pipeline-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single
    assert not children()
