"""Bad pooling input: a clear ValueError, nothing left queued, and the engine serves the next
request. Runner mix-ups: generating with a pooling model, pooling with a generating one."""

from __future__ import annotations

import json

import pytest

from model_fixtures import save_tiny_model
from pooling_fixtures import TINY_VOCAB, save_encoder, save_sentence_transformer, text_of
from vpage import LLM
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine
from vpage.pooling import PoolingEngine
from vpage.pooling_params import PoolingParams
from vpage.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st")
    save_sentence_transformer(folder, "bert", "mean")
    return LLM(str(folder / "st"), max_num_batched_tokens=64)


def _still_serves(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    out = llm.embed([text_of(5), [0, 9, 2]], use_tqdm=False)
    assert [len(o.outputs.embedding) for o in out] == [64, 64]


@pytest.mark.parametrize("prompts, message", [
    ([], "no prompts"),
    ([text_of(4), []], "prompt 1: the prompt is empty"),
    ([{"prompt_token_ids": []}], "empty"),
    ([text_of(4), [0, 5, TINY_VOCAB, 2]], f"token id {TINY_VOCAB} is outside the vocabulary"),
    ([[0, -1, 2]], "outside the vocabulary"),
    ([text_of(4), text_of(300)], "300 tokens, more than max_model_len 256"),
    ([[0] * 257], "max_model_len"),
    ([{"prompt": "x", "cache_salt": "s"}], "unsupported prompt keys"),
])
def test_bad_prompts_raise_and_leave_nothing_queued(embedder, prompts, message):
    with pytest.raises(ValueError, match=message):
        embedder.embed(prompts, use_tqdm=False)
    _still_serves(embedder)


def test_truncation_keeps_long_prompts(embedder):
    long_text = text_of(300)
    out = embedder.embed([long_text, list(range(3, 303))], use_tqdm=False, truncate_prompt_tokens=-1)
    assert [len(o.prompt_token_ids) for o in out] == [256, 256]
    assert out[1].prompt_token_ids == list(range(47, 303))  # token prompts keep their last k ids
    assert out[0].prompt_token_ids[-1] == embedder.get_tokenizer().sep_token_id  # text: the tokenizer's way
    short = embedder.embed(long_text, PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert len(short.prompt_token_ids) == 10
    _still_serves(embedder)


def test_wrong_tasks_and_parameters(embedder):
    with pytest.raises(ValueError, match="does not support task 'classify'"):
        embedder.classify([text_of(4)], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize applies to embeddings"):
        embedder.engine.add_request("x", [0, 5, 2], PoolingParams(task="score", normalize=True))
    with pytest.raises(ValueError, match="cosine similarity"):
        embedder.engine.add_request("x", [0, 5, 2], PoolingParams(task="score"))
    with pytest.raises(ValueError, match="use_activation applies"):
        embedder.embed([text_of(4)], PoolingParams(use_activation=True), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 pooling parameters"):
        embedder.embed([text_of(4)] * 2, [PoolingParams()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task"):
        embedder.encode([text_of(4)], pooling_task="score", use_tqdm=False)
    with pytest.raises(ValueError, match="generating model"):
        embedder.generate([text_of(4)], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="generating model"):
        embedder.chat([{"role": "user", "content": "hi"}])
    for bad in (dict(task="generate"), dict(dimensions=0), dict(truncate_prompt_tokens=0)):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    engine = embedder.engine
    engine.add_request("dup", [0, 5, 2], PoolingParams())
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request("dup", [0, 6, 2], PoolingParams())
    with pytest.raises(ValueError, match="token_type_ids has 2 entries"):
        engine.add_request("types", [0, 6, 2], PoolingParams(), token_type_ids=[0, 0])
    with pytest.raises(ValueError, match="token type ids must be in"):
        engine.add_request("types", [0, 6, 2], PoolingParams(), token_type_ids=[0, 0, 2])
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    _still_serves(embedder)


def test_classifier_refuses_embedding(tmp_path):
    save_encoder(tmp_path, "xlm-roberta", num_labels=2)
    llm = LLM(str(tmp_path))
    assert llm.engine.max_model_len == 256  # 258 positions less XLM-R's offset of pad_token_id + 1
    with pytest.raises(ValueError, match="does not support task 'embed'"):
        llm.embed([text_of(5)], use_tqdm=False)
    assert len(llm.classify([text_of(5)], use_tqdm=False)[0].outputs.probs) == 2


def test_generating_model_cannot_pool(tmp_path):
    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="this model cannot pool: 'LlamaForCausalLM'.*BertModel"):
        LLM(str(tmp_path), runner="pooling")
    with pytest.raises(ValueError, match="this model cannot pool"):
        PoolingEngine(EngineArgs(model=str(tmp_path)))
    llm = LLM(str(tmp_path), kv_cache_memory=0.01)  # runner "auto": a decoder generates
    assert llm.runner == "generate"
    with pytest.raises(ValueError, match="needs a pooling model"):
        llm.embed([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(ValueError, match="needs a pooling model"):
        llm.score("a", "b")
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_runner_and_engine_mixups(tmp_path):
    save_encoder(tmp_path, "bert")
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineArgs(model=str(tmp_path), runner="embed")
    with pytest.raises(ValueError, match="PoolingEngine"):
        LLMEngine(EngineArgs(model=str(tmp_path), runner="pooling"))
    with pytest.raises(ValueError, match="LLMEngine"):
        PoolingEngine(EngineArgs(model=str(tmp_path), runner="generate"))
    assert PoolingEngine(EngineArgs(model=str(tmp_path))).max_num_batched_tokens == 8192
    assert EngineArgs().create_engine_config().scheduler.max_num_batched_tokens == 2048


def test_unsupported_sentence_transformers_modules(tmp_path):
    save_sentence_transformer(tmp_path, "bert", "mean")
    folder = tmp_path / "st"
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                                "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="module 'sentence_transformers.models.Dense' is not supported"):
        LLM(str(folder))
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="pooling mode \\['max'\\] is not supported"):
        LLM(str(folder))
