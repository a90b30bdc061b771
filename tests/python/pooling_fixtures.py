"""Builders for the pooling tests: tiny random BERT / XLM-R encoders (embedding and
classification) with a WordPiece tokenizer written locally, saved as Hugging Face folders and
as sentence-transformers folders."""

from __future__ import annotations

import string
import warnings
from pathlib import Path
from typing import Optional

import torch

SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]  # [PAD] is 1, as XLM-R's <pad>
WORDS = [f"w{i}" for i in range(240)]
VOCAB = SPECIALS + list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase] + WORDS
TINY_VOCAB = 320  # the model's vocabulary: the tokenizer's tokens and some ids only token prompts reach
HIDDEN = 64
_TINY = dict(vocab_size=TINY_VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, pad_token_id=1, hidden_act="gelu", initializer_range=0.1)


def text_of(num_tokens: int, offset: int = 0) -> str:
    """A text the tokenizer encodes as ``num_tokens`` tokens ([CLS] + words + [SEP]), >= 2."""
    return " ".join(WORDS[(offset + 7 * i) % len(WORDS)] for i in range(num_tokens - 2))


def save_tokenizer(folder: Path, token_types: bool = True) -> None:
    """A WordPiece tokenizer of VOCAB; without ``token_types`` it gives no token type ids (as
    XLM-R's, whose model has one token type)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    names = {} if token_types else {"model_input_names": ["input_ids", "attention_mask"]}
    BertTokenizerFast.from_pretrained(str(folder), **names).save_pretrained(str(folder))


def tiny_config(kind: str, num_labels: Optional[int] = None):
    """A tiny BertConfig ("bert") or XLMRobertaConfig ("xlm-roberta"; positions offset by
    pad_token_id + 1, so it has two more)."""
    import transformers

    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=256, **_TINY)
    else:
        config = transformers.XLMRobertaConfig(max_position_embeddings=258, type_vocab_size=1, **_TINY)
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random LayerNorm scales and biases, so that a swapped or missed parameter shows."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def save_encoder(folder: Path, kind: str, num_labels: Optional[int] = None, seed: int = 0):
    """A random tiny encoder (``num_labels``: a ``*ForSequenceClassification``) and the
    tokenizer, saved in ``folder``; returns the transformers model (eval)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(kind, num_labels)
    family = "Bert" if kind == "bert" else "XLMRoberta"
    cls = getattr(transformers, f"{family}ForSequenceClassification" if num_labels else f"{family}Model")
    model = cls(config).eval()
    _perturb(model, seed)
    model.save_pretrained(str(folder))
    save_tokenizer(folder, token_types=kind == "bert")
    return model


def save_sentence_transformer(folder: Path, kind: str, pooling_mode: str, normalize: bool = True, seed: int = 0):
    """A sentence-transformers folder (Transformer, Pooling(``pooling_mode``), Normalize) on a
    random tiny encoder; returns the SentenceTransformer."""
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models

    save_encoder(folder / "hf", kind, seed=seed)
    modules = [models.Transformer(str(folder / "hf")), models.Pooling(HIDDEN, pooling_mode)]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(folder / "st"))
    return st
