"""ModernBERT on the pooling runner against sentence-transformers and transformers, on tiny random
models: rotary positions, global and sliding-window layers (prompts longer than the window),
GeGLU, packed over several steps; the classifier with "cls" and "mean" pooling."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pooling_fixtures import TINY_VOCAB, save_tokenizer, text_of
from vpage import LLM
from vpage.pooling.attention import packed_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HIDDEN = 64
LENGTHS = (7, 33, 130, 3, 17)  # text prompts ([CLS] + words + [SEP]); the window is 8 tokens each side
ONE_TOKEN = [37]  # a one-token prompt, given as token ids


def _config(num_labels=None, biases=False, classifier_pooling="cls"):
    import transformers

    config = transformers.ModernBertConfig(
        vocab_size=TINY_VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
        global_attn_every_n_layers=2, local_attention=16, max_position_embeddings=256, global_rope_theta=1000.0,
        local_rope_theta=100.0, pad_token_id=1, bos_token_id=0, cls_token_id=0, eos_token_id=2, sep_token_id=2,
        norm_bias=biases, attention_bias=biases, mlp_bias=biases, classifier_bias=biases,
        classifier_pooling=classifier_pooling, initializer_range=0.1, attn_implementation="eager")
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def _save(folder, num_labels=None, biases=False, classifier_pooling="cls", seed=0):
    """A random tiny ModernBERT (a classifier with ``num_labels``) and the tokenizer in ``folder``."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.ModernBertForSequenceClassification if num_labels else transformers.ModernBertModel
    model = cls(_config(num_labels, biases, classifier_pooling)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random norm scales and biases, so that a swapped or missed one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(folder))
    save_tokenizer(folder, token_types=False)
    return model


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models

    folder = tmp_path_factory.mktemp("st-modernbert")
    _save(folder / "hf", seed=3)
    modules = [models.Transformer(str(folder / "hf"), model_args={"attn_implementation": "eager"}),
               models.Pooling(HIDDEN, "mean"), models.Normalize()]
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(folder / "st"))
    return folder / "st", st


def _st_forward(st, ids):
    t = torch.tensor([ids])
    with torch.no_grad():
        return st({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"][0].numpy()


@pytest.mark.parametrize("budget", [None, 64])
def test_embeddings_match_sentence_transformers(st_model, budget):
    folder, st = st_model
    texts = [text_of(n, offset=n) for n in LENGTHS]
    llm = LLM(str(folder), max_num_batched_tokens=budget)
    assert llm.runner == "pooling" and llm.engine.architecture == "ModernBertModel"
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    outputs = llm.embed([*texts, {"prompt_token_ids": ONE_TOKEN}], use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outputs] == [*LENGTHS, 1]
    assert len(steps) >= (3 if budget else 1)  # 7 + 33 tokens, 130 alone, the rest
    got = np.array([o.outputs.embedding for o in outputs])
    expected = np.concatenate([st.encode(texts, convert_to_numpy=True), _st_forward(st, ONE_TOKEN)[None]])
    assert got.shape == (len(LENGTHS) + 1, HIDDEN)
    assert np.abs(got - expected).max() < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_matches_transformers(tmp_path, pooling):
    model = _save(tmp_path, num_labels=3, biases=True, classifier_pooling=pooling, seed=7)
    llm = LLM(str(tmp_path), max_num_batched_tokens=64)
    assert llm.engine.architecture == "ModernBertForSequenceClassification"
    prompts = [llm.get_tokenizer()(text_of(n, offset=n))["input_ids"] for n in LENGTHS] + [ONE_TOKEN]
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    with torch.no_grad():
        expected = [torch.softmax(model(torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
    assert np.abs(np.array([o.outputs.probs for o in outputs]) - np.array(expected)).max() < 1e-5


def test_windowed_attention_matches_a_masked_reference():
    """A window over packed sequences, for every query and for one query row per sequence."""
    torch.manual_seed(0)
    heads, size, lens, window = 2, 8, [5, 30, 12], 4
    starts = [0, 5, 35]
    q, k, v = (torch.randn(sum(lens), heads * size) for _ in range(3))
    got = packed_attention(q, k, v, starts, lens, starts, lens, heads, size, window=window)
    rows = [2, 5 + 20, 35 + 11]
    got_rows = packed_attention(q[rows], k, v, starts, lens, range(3), [1] * 3, heads, size, window=window,
                                q_offsets=[r - s for r, s in zip(rows, starts)])
    for start, n in zip(starts, lens):
        pos = torch.arange(n)
        mask = (pos[:, None] - pos[None, :]).abs() <= window
        qs, ks, vs = (t[start:start + n].view(n, heads, size).transpose(0, 1) for t in (q, k, v))
        scores = (qs @ ks.transpose(1, 2)) * size ** -0.5
        ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vs
        torch.testing.assert_close(got[start:start + n], ref.transpose(0, 1).reshape(n, -1))
    torch.testing.assert_close(got_rows, got[rows])
