"""The tensor-parallel step message: workers rebuild every plan exactly (its block tables from
the previous step's plus the entries that changed), and a steady decode batch sends only the
blocks it gained."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from vpage.distributed.step_message import StepReceiver, StepSender

BLOCK = 4


@dataclass
class FakePlan:
    """The fields of a SchedulePlan the message carries, for a decode batch."""

    seq_ids: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    sample_token_indices: np.ndarray
    blocks_to_swap_out: np.ndarray
    blocks_to_swap_in: np.ndarray
    blocks_to_copy: np.ndarray
    lora_ids: np.ndarray
    max_context_len: int
    max_query_len: int = 1
    num_prefill_tokens: int = 0
    num_draft_tokens: int = 0


def plan_of(tables: dict[int, list[int]], lens: dict[int, int], rng: random.Random) -> FakePlan:
    ids = list(tables)
    rng.shuffle(ids)  # rows need not keep their order from step to step
    width = max((len(tables[i]) for i in ids), default=0)
    block_tables = np.full((len(ids), width), -7, dtype=np.int32)  # junk past each row's blocks
    for r, i in enumerate(ids):
        block_tables[r, :len(tables[i])] = tables[i]
    n = len(ids)
    pairs = np.array([[rng.randrange(100), rng.randrange(100)]] * rng.randrange(3), dtype=np.int64).reshape(-1, 2)
    return FakePlan(
        seq_ids=np.array(ids, dtype=np.int64), block_tables=block_tables,
        context_lens=np.array([lens[i] for i in ids], dtype=np.int32),
        input_ids=np.arange(n, dtype=np.int64) + 11, positions=np.array([lens[i] - 1 for i in ids], dtype=np.int64),
        slot_mapping=np.arange(n, dtype=np.int64) * 3, query_start_loc=np.arange(n + 1, dtype=np.int32),
        sample_token_indices=np.arange(n, dtype=np.int64), blocks_to_swap_out=pairs, blocks_to_swap_in=pairs[:1],
        blocks_to_copy=pairs[1:], lora_ids=np.array([rng.randrange(4) for _ in ids], dtype=np.int32),
        max_context_len=max(lens.values(), default=0),
        num_prefill_tokens=rng.randrange(3), num_draft_tokens=rng.randrange(3))


def roundtrip(sender: StepSender, receiver: StepReceiver, plan: FakePlan):
    header, payload = sender.pack(plan)
    assert len(payload) == receiver.payload_size(header)
    step = receiver.unpack(header, payload.copy())
    assert (step.num_prefill_tokens, step.num_draft_tokens) == (plan.num_prefill_tokens, plan.num_draft_tokens)
    return step, header[8]


def test_workers_rebuild_every_plan_through_random_traces():
    rng = random.Random(0)
    cpu = torch.device("cpu")
    sender, receiver = StepSender(cpu, BLOCK), StepReceiver(cpu, BLOCK)
    tables: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    next_id, next_block = 0, 0
    for step in range(300):
        for seq in list(tables):
            action = rng.random()
            if action < 0.05:  # finished
                del tables[seq], lens[seq]
            elif action < 0.1:  # copy-on-write of the last block / swapped back in elsewhere
                tables[seq][-1] = next_block
                next_block += 1
            else:  # one more token, sometimes into a new block
                lens[seq] += 1
                if (lens[seq] + BLOCK - 1) // BLOCK > len(tables[seq]):
                    tables[seq].append(next_block)
                    next_block += 1
        for _ in range(rng.randrange(3)):  # new sequences (some prompts of several blocks)
            length = rng.randrange(1, 30)
            tables[next_id] = list(range(next_block, next_block + (length + BLOCK - 1) // BLOCK))
            next_block += len(tables[next_id])
            lens[next_id] = length
            next_id += 1
        plan = plan_of(tables, lens, rng)
        got, _ = roundtrip(sender, receiver, plan)
        for name in ("input_ids", "positions", "slot_mapping", "context_lens", "query_start_loc",
                     "sample_token_indices", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "lora_ids"):
            assert np.array_equal(getattr(got, name), getattr(plan, name)), (step, name)
            assert getattr(got, name).dtype == getattr(plan, name).dtype, name
        assert got.block_tables.shape == plan.block_tables.shape and got.block_tables.dtype == np.int32
        for r, seq in enumerate(plan.seq_ids.tolist()):
            used = (lens[seq] + BLOCK - 1) // BLOCK
            assert got.block_tables[r, :used].tolist() == tables[seq][:used], (step, seq)
        assert got.max_context_len == plan.max_context_len and got.num_seqs == len(tables)


def test_a_steady_decode_batch_sends_only_new_blocks():
    rng = random.Random(1)
    cpu = torch.device("cpu")
    sender, receiver = StepSender(cpu, BLOCK), StepReceiver(cpu, BLOCK)
    tables = {i: [10 * i] for i in range(8)}
    lens = {i: 1 for i in range(8)}
    sent = []
    for step in range(16):
        plan = plan_of(tables, lens, rng)
        _, entries = roundtrip(sender, receiver, plan)
        sent.append(entries)
        for seq in tables:
            lens[seq] += 1
            if (lens[seq] + BLOCK - 1) // BLOCK > len(tables[seq]):
                tables[seq].append(tables[seq][-1] + 1)
    # The first step sends every table; then a block per sequence every BLOCK steps, nothing else.
    assert sent[0] == 8
    assert sent[1:] == [8 if step % BLOCK == 0 else 0 for step in range(1, 16)]


def test_blocks_freed_before_a_sliding_window_arrive_as_minus_one():
    """Random decode traces whose sequences free the blocks before their window (-1 entries,
    table length kept): the workers' tables match, and a steady batch sends per sequence the
    new block and the freed one, once every BLOCK steps."""
    rng = random.Random(2)
    cpu = torch.device("cpu")
    window = 6
    sender, receiver = StepSender(cpu, BLOCK), StepReceiver(cpu, BLOCK)
    tables = {i: list(range(10 * i, 10 * i + 1 + i % 3)) for i in range(6)}
    lens = {i: 1 + BLOCK * (i % 3) for i in range(6)}
    sent = []
    for step in range(40):
        plan = plan_of(tables, lens, rng)
        got, entries = roundtrip(sender, receiver, plan)
        sent.append(entries)
        for r, seq in enumerate(plan.seq_ids.tolist()):
            used = (lens[seq] + BLOCK - 1) // BLOCK
            assert got.block_tables[r, :used].tolist() == tables[seq][:used], (step, seq)
        for seq in tables:
            # Position lens[seq] is the next query: blocks wholly before its window are freed.
            lens[seq] += 1
            if (lens[seq] + BLOCK - 1) // BLOCK > len(tables[seq]):
                tables[seq].append(1000 + 10 * seq + len(tables[seq]))
            first = max(0, lens[seq] - window) // BLOCK
            tables[seq][:first] = [-1] * first
    assert any(-1 in t for t in tables.values())
    # Each sequence gains a block at one step of every BLOCK and frees one at another.
    assert max(sent[1:]) <= 2 * len(tables) and sum(sent[16:40]) == 2 * len(tables) * 24 // BLOCK


def test_extra_logit_rows_travel_after_the_tables():
    """Prompt rows of prompt_logprobs requests: sent with some steps, absent (None) otherwise,
    and the tables still change against the previous step's."""
    rng = random.Random(3)
    cpu = torch.device("cpu")
    sender, receiver = StepSender(cpu, BLOCK), StepReceiver(cpu, BLOCK)
    tables = {i: [10 * i, 10 * i + 1] for i in range(5)}
    lens = {i: 5 + i for i in range(5)}
    for step in range(6):
        plan = plan_of(tables, lens, rng)
        rows = np.array(rng.sample(range(40), rng.randrange(1, 9)), dtype=np.int64) if step % 2 else None
        header, payload = sender.pack(plan, rows)
        assert len(payload) == receiver.payload_size(header)
        got = receiver.unpack(header, payload.copy())
        assert (got.logit_rows is None) if rows is None else np.array_equal(got.logit_rows, rows), step
        for r, seq in enumerate(plan.seq_ids.tolist()):
            assert got.block_tables[r, :2].tolist() == tables[seq], (step, seq)
        for seq in tables:
            tables[seq][1] += 100 * (step % 3 == 0)
