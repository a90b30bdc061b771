"""Property tests: random traces of add / schedule / commit / abort / fork / finish drive the
scheduler and block manager under tiny pools; the invariants hold after every operation,
every block is free once every request has finished or been aborted, and a shadow of the KV
cache (what each slot holds: the salt and the token prefix its key/value were computed from)
shows that every row reads exactly its own tokens' K/V, with prefix caching on and with every
block hash forced to collide. With a sliding window W, rows read only the keys of their window
(p - W < j <= p), the blocks before it are freed (-1 in the tables), and no sequence holds more
than ceil((W - 1 + budget) / block_size) + 1 blocks."""

import numpy as np
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vpage import _core as core

EOS = 0


def window_start(position, window):
    """First key position a query at `position` reads (0 without a window)."""
    return max(0, position - window + 1) if window else 0


def max_window_blocks(window, config, block_size):
    return -(-(window - 1 + config.max_num_batched_tokens) // block_size) + 1


def check_plan(plan, config, block_size, window=0):
    assert plan.num_tokens <= config.max_num_batched_tokens
    qsl = plan.query_start_loc
    assert qsl[0] == 0 and qsl[-1] == plan.num_tokens and np.all(np.diff(qsl) >= 1)
    assert len(plan.sample_seq_ids) == len(plan.sample_token_indices)
    assert np.all(plan.sample_token_indices < max(plan.num_tokens, 1))
    tables = plan.block_tables
    for row in range(plan.num_seqs):
        for t in range(qsl[row], qsl[row + 1]):
            pos = plan.positions[t]
            assert pos < plan.context_lens[row]
            block = tables[row, pos // block_size]
            assert plan.slot_mapping[t] == block * block_size + pos % block_size
        # Blocks wholly before the window of the row's first query are freed, the rest held.
        used = -(-int(plan.context_lens[row]) // block_size)
        first = window_start(int(plan.positions[qsl[row]]), window) // block_size
        assert np.all(tables[row, :first] == -1) and np.all(tables[row, first:used] >= 0)


def check_held_blocks(scheduler, live, window, config, block_size):
    """With a window, no sequence holds more blocks than its window and one step need."""
    if not window:
        return
    bound = max_window_blocks(window, config, block_size)
    for request_id in live:
        group = scheduler.find_group(request_id)
        for i in range(group.num_seqs):
            table = np.asarray(group.seq(i).block_table)
            assert np.count_nonzero(table >= 0) <= bound, (request_id, table)
            if np.any(table < 0):
                event("window released blocks")


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_gpu_blocks=st.integers(6, 24),
        num_cpu_blocks=st.sampled_from([0, 4, 16, 32]),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(4, 48),
        max_num_seqs=st.integers(1, 8),
        chunked=st.booleans(),
        caching=st.booleans(),
        collide=st.booleans(),
        mode=st.sampled_from(list(core.PreemptionMode.__members__.values())),
        window=st.sampled_from([0, 0, 1, 2, 5, 9, 16]),
        drafts=st.sampled_from([0, 0, 1, 3]),
    )
    def setup(self, num_gpu_blocks, num_cpu_blocks, block_size, budget, max_num_seqs, chunked, caching, collide,
              mode, window, drafts):
        self.config = core.SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=64,
            enable_chunked_prefill=chunked, preemption_mode=mode, num_speculative_tokens=drafts,
            prompt_lookup_min=1, prompt_lookup_max=2)
        self.blocks = core.BlockManagerConfig(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            watermark=0.0, enable_prefix_caching=caching, collide_prefix_hashes_for_testing=collide,
            sliding_window=window)
        self.block_size = block_size
        self.window = window
        self.scheduler = core.Scheduler(self.config, self.blocks)
        self.next_request = 0
        self.live = set()
        self.salt_of_seq: dict[int, str] = {}
        # Shadow KV: (pool, block) -> per slot (salt, token prefix) its K/V was computed from.
        self.shadow: dict[tuple[str, int], list] = {}
        self.plan = None
        self.clock = 0.0

    @rule(data=st.data(), num_seqs=st.integers(1, 3), prompt_len=st.integers(1, 20),
          max_tokens=st.integers(1, 24), salt=st.sampled_from(["", "", "tenant"]))
    def add(self, data, num_seqs, prompt_len, max_tokens, salt):
        # Prompts share prefixes (small vocabulary, common start) so the prefix cache hits.
        prefix = [7, 8, 9, 10, 11, 12, 13, 14][: prompt_len]
        rest = data.draw(st.lists(st.integers(1, 4), min_size=prompt_len - len(prefix),
                                  max_size=prompt_len - len(prefix)))
        request_id = f"r{self.next_request}"
        self.next_request += 1
        self.clock += 1.0
        stop = core.StopConditions(max_tokens=max_tokens, eos_token_ids=[EOS])
        for seq_id in self.scheduler.add_sequence_group(request_id, prefix + rest, num_seqs, stop, self.clock, salt):
            self.salt_of_seq[seq_id] = salt
        self.live.add(request_id)

    def run_shadow(self, plan):
        """Carries out the plan's block operations and its rows on the shadow KV cache, checking
        that each row reads slots holding exactly its own salt and token prefix (with a window,
        the slots of its first query's window)."""
        bs = self.block_size
        moves = [("gpu", "cpu", plan.blocks_to_swap_out), ("cpu", "gpu", plan.blocks_to_swap_in),
                 ("gpu", "gpu", plan.blocks_to_copy)]
        for src_pool, dst_pool, pairs in moves:
            for src, dst in pairs.tolist():
                self.shadow[(dst_pool, dst)] = list(self.shadow.get((src_pool, src), [None] * bs))
        qsl = plan.query_start_loc.tolist()
        positions = plan.positions.tolist()
        input_ids = plan.input_ids.tolist()
        for row, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self.scheduler.find_sequence(seq_id)
            salt = self.salt_of_seq[seq_id]
            table = plan.block_tables[row].tolist()
            for p in range(window_start(positions[qsl[row]], self.window), positions[qsl[row]]):
                held = self.shadow.get(("gpu", table[p // bs]), [None] * bs)[p % bs]
                assert held == (salt, tuple(seq.tokens[: p + 1])), f"sequence {seq_id} reads wrong K/V at {p}"
            # A row's tokens follow its computed ones; draft tokens come after the sequence's own.
            computed = tuple(seq.tokens[: positions[qsl[row]]])
            for t in range(qsl[row], qsl[row + 1]):
                p = positions[t]
                slots = self.shadow.setdefault(("gpu", table[p // bs]), [None] * bs)
                slots[p % bs] = (salt, computed + tuple(input_ids[qsl[row]: t + 1]))

    def check_waits_for_prefix(self):
        """Notes a diverged group whose later sequences wait, holding nothing, for the first."""
        for request_id in self.live:
            group = self.scheduler.find_group(request_id)
            if group is None:  # ignored in this step
                continue
            seqs = [group.seq(i) for i in range(group.num_seqs) if not core.is_finished(group.seq(i).status)]
            if (seqs and seqs[0].status == core.SequenceStatus.RUNNING
                    and any(s.num_computed_tokens == 0 and not s.block_table for s in seqs[1:])):
                event("waits for a shared prefix")

    @rule(data=st.data())
    def step(self, data):
        plan = self.scheduler.schedule()
        check_plan(plan, self.config, self.block_size, self.window)
        self.check_waits_for_prefix()
        self.run_shadow(plan)
        for request_id, _reason in plan.ignored:
            self.live.discard(request_id)
        self.scheduler.check_invariants()
        for name in ("num_preempted_swap", "num_preempted_recompute"):
            if getattr(plan, name):
                event(name)
        if len(plan.blocks_to_copy):
            event("copy-on-write")
        if len(plan.blocks_to_swap_in):
            event("swap-in")
        if plan.ignored:
            event("ignored")
        if data.draw(st.booleans()):  # most steps are committed; some forwards "fail"
            # Each sample: some of its drafts accepted, then the verified token.
            ids, tokens = [], []
            input_ids = plan.input_ids.tolist()
            for seq_id, last, d in zip(plan.sample_seq_ids.tolist(), plan.sample_token_indices.tolist(),
                                       plan.sample_num_drafts.tolist()):
                accepted = data.draw(st.integers(0, d))
                if d:
                    event(f"{accepted} of {d} drafts accepted")
                run = input_ids[last - d + 1: last - d + 1 + accepted] + [data.draw(st.integers(0, 20))]
                ids += [seq_id] * len(run)
                tokens += run
            result = self.scheduler.commit(np.array(ids, dtype=np.int64), np.array(tokens, dtype=np.int32))
            assert len(result.statuses) == len(ids)
            for request_id in result.finished_request_ids:
                self.live.discard(request_id)

    @rule(data=st.data(), repeat=st.integers(2, 6))
    def steps(self, data, repeat):
        for _ in range(repeat):
            self.step(data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.scheduler.abort(request_id)
        self.live.discard(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork_then_commit(self, data):
        plan = self.scheduler.schedule()
        check_plan(plan, self.config, self.block_size, self.window)
        self.run_shadow(plan)
        for request_id, _reason in plan.ignored:
            self.live.discard(request_id)
        ids = list(plan.sample_seq_ids)
        if ids:
            parent = data.draw(st.sampled_from(ids))
            if self.scheduler.find_sequence(parent) is not None:
                child = self.scheduler.fork_sequence(parent)
                self.salt_of_seq[child] = self.salt_of_seq[parent]
                ids.append(child)
        self.scheduler.check_invariants()
        result = self.scheduler.commit(np.array(ids, dtype=np.int64), np.full(len(ids), 3, dtype=np.int32))
        for request_id in result.finished_request_ids:
            self.live.discard(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_one(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        group = self.scheduler.find_group(request_id)
        seq = group.seq(data.draw(st.integers(0, group.num_seqs - 1)))
        if core.is_finished(seq.status):
            return
        if self.scheduler.finish_sequence(seq.seq_id, core.SequenceStatus.FINISHED_STOPPED):
            self.live.discard(request_id)

    @invariant()
    def consistent(self):
        if hasattr(self, "scheduler"):
            self.scheduler.check_invariants()
            assert {r for r in self.live if self.scheduler.find_group(r) is None} == set()
            check_held_blocks(self.scheduler, self.live, self.window, self.config, self.block_size)

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Run to completion (bounded), then abort what is left: every block must be free.
        for _ in range(200):
            if not self.scheduler.has_unfinished():
                break
            plan = self.scheduler.schedule()
            ids = np.array(plan.sample_seq_ids, dtype=np.int64)
            self.scheduler.commit(ids, np.full(len(ids), 2, dtype=np.int32))
            self.scheduler.check_invariants()
        for request_id in list(self.live):
            self.scheduler.abort(request_id)
        self.scheduler.check_invariants()
        usage = self.scheduler.usage()
        assert not self.scheduler.has_unfinished()
        assert usage.free_gpu_blocks == usage.num_gpu_blocks
        assert usage.free_cpu_blocks == usage.num_cpu_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_scheduler_traces = SchedulerMachine.TestCase


def test_block_pool_trace_keeps_counts():
    """Random allocate / incref / decref on a pool: free + used = total, no double free."""
    rng = np.random.default_rng(0)
    pool = core.BlockPool(core.Device.GPU, 16, True, block_size=2)
    held = []
    for i in range(2000):
        op = rng.integers(0, 3)
        if op == 0 and pool.num_free:
            block = pool.allocate()
            if rng.random() < 0.3:
                tokens = [int(t) for t in rng.integers(0, 4, 2)]
                key = (int(rng.integers(1, 40)), 0)
                cid = pool.register_block(block, key, tokens)
                found = pool.lookup(key, tokens, count=False)
                # Registered (or joined an equal entry): found exactly; refused: a collision.
                assert (found >= 0 and pool.content_id(found) == cid) if cid != core.NO_CONTENT else found == -1
            held.append(block)
        elif op == 1 and held:
            block = held[rng.integers(0, len(held))]
            pool.incref(block)
            held.append(block)
        elif held:
            block = held.pop(rng.integers(0, len(held)))
            pool.decref(block)
        assert pool.num_free + pool.num_used == 16
        assert pool.num_used == len(set(held))
    for block in held:
        pool.decref(block)
    assert pool.num_free == 16
    try:
        pool.decref(0)
    except ValueError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free was not detected")


def test_seeded_traces_exercise_every_mechanism():
    """Long seeded traces under tiny pools: preemption by swap and by recompute, swap-in,
    copy-on-write and prefix-cache hits all happen, and the invariants hold throughout."""
    seen = dict(swap=0, recompute=0, swap_in=0, copy=0, cached=0)
    for seed in range(24):
        rng = np.random.default_rng(seed)
        config = core.SchedulerConfig(max_num_batched_tokens=int(rng.integers(8, 64)), max_num_seqs=8,
                                      max_model_len=96, enable_chunked_prefill=bool(seed % 2),
                                      preemption_mode=list(core.PreemptionMode.__members__.values())[seed % 3])
        blocks = core.BlockManagerConfig(block_size=4, num_gpu_blocks=int(rng.integers(10, 24)),
                                         num_cpu_blocks=int(rng.choice([0, 8, 64])), watermark=0.0,
                                         enable_prefix_caching=True)
        s = core.Scheduler(config, blocks)
        live = set()
        for i in range(300):
            if rng.random() < 0.15:
                prompt = [5, 6, 7, 8, 9, 10, 11, 12][: int(rng.integers(1, 9))] + list(rng.integers(1, 30, int(rng.integers(0, 12))))
                stop = core.StopConditions(max_tokens=int(rng.integers(4, 40)), eos_token_ids=[EOS])
                s.add_sequence_group(f"r{i}", prompt, int(rng.integers(1, 4)), stop, float(i))
                live.add(f"r{i}")
            if live and rng.random() < 0.02:
                request_id = sorted(live)[int(rng.integers(0, len(live)))]
                s.abort(request_id)
                live.discard(request_id)
            plan = s.schedule()
            check_plan(plan, config, 4)
            seen["swap"] += plan.num_preempted_swap
            seen["recompute"] += plan.num_preempted_recompute
            seen["swap_in"] += len(plan.blocks_to_swap_in)
            seen["copy"] += len(plan.blocks_to_copy)
            live -= {r for r, _ in plan.ignored}
            ids = np.array(plan.sample_seq_ids, dtype=np.int64)
            result = s.commit(ids, rng.integers(0, 60, len(ids)).astype(np.int32))
            live -= set(result.finished_request_ids)
            s.check_invariants()
        seen["cached"] += s.stats.num_cached_prompt_tokens
        for request_id in list(live):
            s.abort(request_id)
        s.check_invariants()
        usage = s.usage()
        assert usage.free_gpu_blocks == usage.num_gpu_blocks and usage.free_cpu_blocks == usage.num_cpu_blocks
    assert all(v > 0 for v in seen.values()), seen
