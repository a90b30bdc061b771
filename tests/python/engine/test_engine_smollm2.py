"""The engine on the default model: greedy parity with transformers for a batch of prompts
run together, seeded sampling, chat, stop strings, bad input that leaves the engine running."""

from __future__ import annotations

import pytest
import torch

from bounded_loops import bounded
from default_model_prompts import PROMPTS
from vpage import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # The dequantized float32 path, token-exact against transformers (quantized: test_quant_engine.py).
    return LLM(dtype="float32", device="cpu", quantization="none", kv_cache_memory=1.0, swap_space=0.25,
               max_num_batched_tokens=512)


def test_greedy_batch_matches_transformers_one_by_one(llm, hf_model):
    tok = llm.get_tokenizer()
    eos = llm.engine.model_config.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len({len(tok.encode(p)) for p in PROMPTS}) == len(PROMPTS)  # all lengths differ
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])
        expected = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason == ("stop" if expected[-1] in eos else "length")
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    crowd = llm.generate(PROMPTS[:3] + [PROMPTS[3]] + PROMPTS[4:], [others] * 3 + [seeded] + [others] * 4,
                         use_tqdm=False)[3].outputs[0].token_ids
    assert alone == again == crowd
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([PROMPTS[3]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_chat_template_and_stop_string(llm, hf_model):
    messages = [{"role": "user", "content": "Name three colours."}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    eos = llm.engine.model_config.eos_token_ids
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)])
    with torch.no_grad():
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0])
    expected = ref[0, ids.shape[1]:].tolist()
    assert out.token_ids == expected
    assert out.text == tok.decode(expected, skip_special_tokens=True) and out.text.strip()
    assert out.finish_reason == ("stop" if expected[-1] in eos else "length")
    full = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop = full.text.strip().split()[2]  # a word the model will produce
    cut = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_bad_requests_raise_and_leave_the_engine_running(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(10, 10 + engine.max_model_len)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("vocab", [1, 2, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_abort_midway_frees_every_block(llm):
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"a{i}" for i in range(len(PROMPTS))])
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks and usage.free_cpu_blocks == usage.num_cpu_blocks


def test_n_samples_best_of_and_logprobs(llm):
    params = SamplingParams(n=2, best_of=3, temperature=0.8, seed=7, max_tokens=12, logprobs=2)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.finished
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for token, entry in zip(o.token_ids, o.logprobs):
            assert token in entry and all(lp.logprob <= 0 for lp in entry.values())
        assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)),
                                                     abs=1e-3)
    stats = llm.engine.get_stats()
    assert stats.generation_tokens > 0 and stats.mean_ttft_s is not None


@pytest.mark.parametrize("width,early_stopping,length_penalty",
                         [(2, False, 1.0), (4, False, 1.0), (4, True, 0.6), (2, "never", 1.0)])
def test_beam_search_matches_transformers(llm, hf_model, width, early_stopping, length_penalty):
    """Best beam equals transformers' generate(num_beams=width, do_sample=False, ...) with the
    same early_stopping semantics (transformers' own: False = heuristic, True, "never")."""
    tok = llm.get_tokenizer()
    eos = llm.engine.model_config.eos_token_ids
    prompts = [PROMPTS[2], "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(n=1, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=24,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                                    max_new_tokens=24, length_penalty=length_penalty,
                                    early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos[0])
        expected = ref[0, ids.shape[1]:].tolist()
        while len(expected) > 1 and expected[-1] == eos[0] and expected[-2] == eos[0]:
            expected.pop()  # padding after the EOS
        assert out.outputs[0].token_ids == expected, prompt
    usage = llm.engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks


def test_request_metrics_record_queue_time():
    # One sequence at a time: the second request waits until the first finishes, and its
    # first_scheduled_time says so (the server's request_queue_time_seconds reads it).
    from vpage.engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(dtype="float32", device="cpu", kv_cache_memory=0.25, max_num_seqs=1,
                                  max_model_len=256))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", "hello", params)
    engine.add_request("second", "world", params)
    finished = {}
    for _ in bounded(engine.has_unfinished_requests, 100, "requests still unfinished"):
        finished.update({o.request_id: o.metrics for o in engine.step() if o.finished})
    a, b = finished["first"], finished["second"]
    for m in (a, b):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert b.first_scheduled_time >= a.finished_time  # it queued behind the first request
    engine.shutdown()
