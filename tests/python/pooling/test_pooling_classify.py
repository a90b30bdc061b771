"""Classification and scores against sentence-transformers' CrossEncoder and transformers:
BERT and XLM-R cross-encoders (one label, sigmoid), a 3-label classifier (softmax), and an
embedding model's cosine-similarity scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pooling_fixtures import save_encoder, save_sentence_transformer, text_of
from vpage import LLM
from vpage.pooling_params import PoolingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUERY = text_of(6, 1)
DOCS = [text_of(n, offset=n) for n in (3, 20, 90, 9)]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_encoder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"ce-{request.param}")
    save_encoder(folder, request.param, num_labels=1, seed=5)
    return folder


def test_scores_match_cross_encoder_predict(cross_encoder):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(cross_encoder), device="cpu")
    llm = LLM(str(cross_encoder), max_num_batched_tokens=128)
    assert llm.engine.is_cross_encoder and llm.engine.supported_tasks == {"classify", "score"}
    one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
    expected = ce.predict([(QUERY, d) for d in DOCS])
    assert np.abs(np.array([o.outputs.score for o in one_to_n]) - expected).max() < 1e-5
    pairs = llm.score(DOCS, DOCS[::-1], use_tqdm=False)
    expected = ce.predict(list(zip(DOCS, DOCS[::-1])))
    assert np.abs(np.array([o.outputs.score for o in pairs]) - expected).max() < 1e-5
    single = llm.score(QUERY, DOCS[0], use_tqdm=False)
    assert len(single) == 1 and abs(single[0].outputs.score - one_to_n[0].outputs.score) < 1e-6
    tokens = llm.get_tokenizer()(QUERY, DOCS[1])
    assert single[0].prompt_token_ids != tokens["input_ids"] and one_to_n[1].prompt_token_ids == tokens["input_ids"]
    # classify on one label: the sigmoid probability of that label (the same number here)
    probs = llm.classify([{"prompt_token_ids": tokens["input_ids"], "token_type_ids": tokens.get("token_type_ids")}],
                         use_tqdm=False)
    assert abs(probs[0].outputs.probs[0] - one_to_n[1].outputs.score) < 1e-6
    with pytest.raises(ValueError, match="one text with N"):
        llm.score(DOCS[:2], DOCS[:3], use_tqdm=False)


def test_three_label_classify_matches_transformers_softmax(tmp_path):
    hf = save_encoder(tmp_path, "bert", num_labels=3, seed=7)
    llm = LLM(str(tmp_path), max_num_batched_tokens=64)
    assert llm.engine.supported_tasks == {"classify"} and llm.engine.num_labels == 3
    texts = [text_of(n, offset=n) for n in (2, 11, 70, 30)]
    outs = llm.classify(texts, use_tqdm=False)
    batch = llm.get_tokenizer()(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits
    got = torch.tensor([o.outputs.probs for o in outs])
    assert got.shape == (4, 3) and (got - logits.softmax(-1)).abs().max() < 1e-5
    raw = llm.classify(texts, PoolingParams(use_activation=False), use_tqdm=False)
    assert (torch.tensor([o.outputs.probs for o in raw]) - logits).abs().max() < 1e-5
    encoded = llm.encode(texts[:1], pooling_task="classify", use_tqdm=False)
    assert (encoded[0].outputs.data - logits[0].softmax(-1)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="does not support task 'score'"):
        llm.score(texts[0], texts[1], use_tqdm=False)


def test_embedding_model_scores_by_cosine_similarity(tmp_path):
    from sentence_transformers import util

    st = save_sentence_transformer(tmp_path, "bert", "mean", seed=2)
    llm = LLM(str(tmp_path / "st"))
    assert not llm.engine.is_cross_encoder
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    emb = st.encode([QUERY] + DOCS, convert_to_tensor=True)
    expected = util.cos_sim(emb[:1], emb[1:])[0]
    assert (torch.tensor([o.outputs.score for o in scores]) - expected).abs().max() < 1e-5
    pairwise = llm.score(DOCS, DOCS[::-1], use_tqdm=False)
    expected = util.pairwise_cos_sim(emb[1:], emb[1:].flip(0))
    assert (torch.tensor([o.outputs.score for o in pairwise]) - expected).abs().max() < 1e-5
    assert len(pairwise[0].prompt_token_ids) == len(llm.get_tokenizer()(DOCS[0])["input_ids"]) + len(
        llm.get_tokenizer()(DOCS[-1])["input_ids"])
