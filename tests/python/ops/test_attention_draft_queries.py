"""Decode attention whose result does not depend on the step around it: a query is cut into
the same context partitions whatever batch, thread count or draft row it is scored in, and
draft rows (ops.paged_prefill_attention's draft_queries) read each sequence's K/V once yet
give each position bitwise what a decode step there gives."""

import json
from pathlib import Path

import pytest
import torch

from device_marks import available_isas
from kv_reference import reference_prefill_attention
from test_ops_cpu import check_close, setup
from vpage import LLM, SamplingParams, _core, ops

SCALE = 0.125


def decode_alone(query, kc, vc, tables, seq, length, **options):
    """One decode query of sequence `seq` at context `length`, alone in its step."""
    out = torch.full_like(query[:1], float("nan"))
    ops.paged_attention(query.contiguous(), kc, vc, tables[seq:seq + 1].contiguous(),
                        torch.tensor([length], dtype=torch.int32), SCALE, out=out, **options)
    return out[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_is_bitwise_the_same_alone_or_in_a_batch(threads):
    # Long contexts (several partitions) beside short ones; one sequence alone, then all of them.
    contexts = [1200, 7, 1025, 512, 513, 90]
    query, kc, vc, tables, lens = setup(41, contexts, 6, 2, 64, 16, torch.float32)
    ops.set_num_threads(threads)
    try:
        batch = ops.paged_attention(query, kc, vc, tables, lens, SCALE)
        for s, length in enumerate(contexts):
            assert torch.equal(decode_alone(query[s:s + 1], kc, vc, tables, s, length), batch[s])
    finally:
        ops.set_num_threads(None)
    check_close(batch, reference_prefill_attention(query, kc, vc, tables, torch.arange(len(contexts) + 1,
                                                                                       dtype=torch.int32),
                                                   lens, SCALE), torch.float32)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group,num_kv_heads", [(1, 2), (3, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_rows_match_decode_steps_bitwise(isa, block_size, group, num_kv_heads, dtype):
    # Rows of 1-9 tokens (a decode token and up to 8 drafts) whose contexts start, cross and
    # end at block, 64-token group and 512-token partition boundaries; group 8 x 9 queries
    # needs several query chunks per task.
    contexts = [5, 17, 64, 66, 511, 515, 1030, 1600]
    num_queries = [5, 2, 1, 3, 4, 9, 5, 7]
    query, kc, vc, tables, lens = setup(43, contexts, group * num_kv_heads, num_kv_heads, 64, block_size, dtype,
                                        num_queries)
    starts = torch.tensor([0] + num_queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    try:
        _core.set_cpu_isa(isa)
        out = torch.full_like(query, float("nan"))
        ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, out=out, draft_queries=True)
        for s, (length, count) in enumerate(zip(contexts, num_queries)):
            for j in range(count):
                row = int(starts[s]) + j
                alone = decode_alone(query[row:row + 1], kc, vc, tables, s, length - count + 1 + j)
                assert torch.equal(alone, out[row]), (s, j)
    finally:
        _core.set_cpu_isa("auto")
    check_close(out, reference_prefill_attention(query, kc, vc, tables, starts, lens, SCALE), dtype)


@pytest.mark.parametrize("window", [16, 50, 300])
def test_draft_rows_with_a_window_match_decode_steps_bitwise(window):
    contexts = [40, 333, 1100]
    num_queries = [5, 4, 6]
    query, kc, vc, tables, lens = setup(47, contexts, 6, 2, 64, 16, torch.float32, num_queries)
    starts = torch.tensor([0] + num_queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, sliding_window=window,
                                      draft_queries=True)
    for s, (length, count) in enumerate(zip(contexts, num_queries)):
        for j in range(count):
            row = int(starts[s]) + j
            alone = decode_alone(query[row:row + 1], kc, vc, tables, s, length - count + 1 + j, sliding_window=window)
            assert torch.equal(alone, out[row]), (s, j)
    ref = reference_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, sliding_window=window)
    check_close(out, ref, torch.float32)


def test_draft_queries_need_query_rows():
    query, kc, vc, tables, lens = setup(3, [10], 2, 1, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="draft_queries needs query_start_loc"):
        _core._cpu_paged_attention(
            out=query.data_ptr(), query=query.data_ptr(), key_cache=kc.data_ptr(), value_cache=vc.data_ptr(),
            block_tables=tables.data_ptr(), context_lens=lens.data_ptr(), query_start_loc=0, num_seqs=1,
            num_query_tokens=1, num_heads=2, max_blocks_per_seq=tables.shape[1], max_context_len=10,
            query_stride=128, scale=SCALE, num_blocks=kc.shape[0], num_kv_heads=1, head_size=64, block_size=16,
            dtype=0, cache_dtype=0, num_threads=1, draft_queries=True)


def test_default_model_long_context_same_tokens_alone_batched_and_speculating():
    """Past 512 tokens a decode query's attention is cut into context partitions by its own
    length alone, so a request decodes the same tokens alone, in a batch and under speculation
    on two threads (before, a lone sequence was cut by the threads and a batch of three was
    not: this prompt's third token changed)."""
    path = Path(__file__).resolve().parents[3] / "bench" / "data" / "spec_grounded.jsonl"
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    prompts = ["\n\n".join(texts[i % 8] for i in range(start, start + 3)) for start in (7, 6, 5)]  # 640-720 tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(enable_prefix_caching=False)
        batched = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
        alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        assert batched == alone
        llm = LLM(enable_prefix_caching=False, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        assert llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids == alone
    finally:
        torch.set_num_threads(threads)
