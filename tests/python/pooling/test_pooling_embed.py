"""Embeddings of the pooling runner against sentence-transformers' own, on tiny random BERT and
XLM-R encoders: mean and CLS pooling, awkward prompt lengths packed over several steps,
Matryoshka dimensions, bfloat16, and vLLM's default pooling without a sentence-transformers
config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pooling_fixtures import HIDDEN, save_encoder, save_sentence_transformer, text_of
from vpage import LLM
from vpage.engine.arg_utils import EngineArgs
from vpage.pooling import PoolingEngine
from vpage.pooling_params import PoolingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = (2, 7, 33, 130, 3, 64, 17)  # text prompts: [CLS] + words + [SEP]
BUDGET = 64  # tokens per step: the 130-token prompt runs alone, the rest over several steps


@pytest.fixture(scope="module", params=[("bert", "mean"), ("bert", "cls"), ("xlm-roberta", "mean"),
                                        ("xlm-roberta", "cls")], ids=lambda p: "-".join(p))
def st_model(request, tmp_path_factory):
    kind, mode = request.param
    folder = tmp_path_factory.mktemp(f"st-{kind}-{mode}")
    st = save_sentence_transformer(folder, kind, mode, seed=len(kind) + len(mode))
    return kind, folder / "st", st


def _texts() -> list[str]:
    return [text_of(n, offset=n) for n in LENGTHS]


def _st_forward(st, ids: list[int]) -> np.ndarray:
    """sentence-transformers' embedding of one sequence of token ids (no tokenizer)."""
    t = torch.tensor([ids])
    with torch.no_grad():
        return st({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"][0].numpy()


def test_embeddings_match_sentence_transformers(st_model):
    kind, folder, st = st_model
    texts = _texts()
    llm = LLM(str(folder), max_num_batched_tokens=BUDGET)
    assert llm.runner == "pooling" and llm.engine.pooler_config.normalize
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    outputs = llm.embed(texts, use_tqdm=False)
    assert len(steps) >= 4, "the token budget should split the batch over several steps"
    assert [len(o.prompt_token_ids) for o in outputs] == list(LENGTHS)
    got = np.array([o.outputs.embedding for o in outputs])
    expected = st.encode(texts, convert_to_numpy=True)
    assert got.shape == (len(texts), HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert np.abs(got - expected).max() < 1e-5


def test_token_prompts_of_one_token_and_a_padding_id(st_model):
    # One-token prompts and, for XLM-R, a padding id inside a prompt (its position does not
    # advance, as in transformers' create_position_ids_from_input_ids).
    kind, folder, st = st_model
    prompts = [[7], [0, 40, 1, 41, 2], [0] + list(range(50, 150)) + [2], [300]]
    llm = LLM(str(folder), max_num_batched_tokens=BUDGET)
    got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    for ids, emb in zip(prompts, got):
        assert np.abs(np.array(emb) - _st_forward(st, ids)).max() < 1e-5, ids


def test_matryoshka_dimensions_truncate_then_renormalise(st_model):
    kind, folder, st = st_model
    texts = _texts()[:3]
    llm = LLM(str(folder))
    full = torch.tensor(st.encode(texts, convert_to_numpy=True))
    short = llm.embed(texts, PoolingParams(dimensions=16), use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in short])
    assert got.shape == (3, 16)
    assert (got - F.normalize(full[:, :16], dim=1)).abs().max() < 1e-5
    raw = llm.embed(texts, PoolingParams(dimensions=16, normalize=False), use_tqdm=False)
    raw = torch.tensor([o.outputs.embedding for o in raw])
    assert (raw.norm(dim=1) - 1).abs().min() > 1e-3  # not normalised
    assert (F.normalize(raw, dim=1) - got).abs().max() < 1e-5
    with pytest.raises(ValueError, match="hidden size"):
        llm.embed(texts, PoolingParams(dimensions=HIDDEN + 1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bfloat16_close_to_float32(st_model):
    # bfloat16 keeps 8 significant bits: each rounding is within 2^-9 relative, and a few dozen
    # of them through two layers and their LayerNorms leave a unit vector's 64 entries (about
    # 0.12 each) within ~1e-2 of float32's. Bounds, with margin: max |diff| 3e-2, cosine > 0.995.
    kind, folder, st = st_model
    texts = _texts()
    f32 = np.array([o.outputs.embedding for o in LLM(str(folder)).embed(texts, use_tqdm=False)])
    bf16_llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=BUDGET)
    assert bf16_llm.engine.dtype == torch.bfloat16
    bf16 = np.array([o.outputs.embedding for o in bf16_llm.embed(texts, use_tqdm=False)])
    assert np.abs(bf16 - f32).max() < 3e-2
    assert (bf16 * f32).sum(axis=1).min() > 0.995


def test_engine_steps_by_token_budget(st_model):
    kind, folder, st = st_model
    engine = PoolingEngine(EngineArgs(model=str(folder), runner="pooling", max_num_batched_tokens=BUDGET,
                                      max_num_seqs=3))
    assert engine.max_model_len == 256 and engine.supported_tasks == {"embed", "score"}
    for i, n in enumerate(LENGTHS):
        engine.add_request(str(i), engine.tokenize(text_of(n))[0], PoolingParams())
    batches = []
    while engine.has_unfinished_requests():
        queued = {r.request_id: len(r.prompt_token_ids) for r in engine.scheduler.waiting.values()}
        out = engine.step()
        assert out and all(o.finished for o in out)
        batches.append([o.request_id for o in out])
        tokens = sum(queued[o.request_id] for o in out)
        assert len(out) <= 3 and (tokens <= BUDGET or len(out) == 1)
    assert [r for b in batches for r in b] == [str(i) for i in range(len(LENGTHS))]  # first come, first served
    assert engine.step() == []


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_default_pooling_without_sentence_transformers_config_is_normalised_cls(tmp_path, kind):
    hf = save_encoder(tmp_path, kind, seed=3)
    llm = LLM(str(tmp_path))
    assert llm.engine.pooler_config.pooling_type == "CLS" and llm.engine.pooler_config.normalize
    texts = [text_of(5), text_of(40, 3)]
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    batch = llm.get_tokenizer()(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = F.normalize(hf(**batch).last_hidden_state[:, 0], dim=1)
    assert (got - expected).abs().max() < 1e-5
    mean = LLM(str(tmp_path), pooler_config={"pooling_type": "MEAN", "normalize": False})
    got = torch.tensor(mean.embed(texts[0], use_tqdm=False)[0].outputs.embedding)
    with torch.no_grad():
        expected = hf(**llm.get_tokenizer()(texts[0], return_tensors="pt")).last_hidden_state[0].mean(0)
    assert (got - expected).abs().max() < 1e-5
    encoded = mean.encode([texts[0]], pooling_task="embed", use_tqdm=False)[0]
    assert (encoded.outputs.data - expected).abs().max() < 1e-5
