"""From the encoder's last hidden states to what a request asked for: pooled vectors (the first
token, the mean, the last token), Matryoshka truncation and L2 normalisation, classification
probabilities, cross-encoder scores, and the cosine similarity of two embeddings."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from vpage.pooling.batch import PackedBatch

Activation = Callable[[torch.Tensor], torch.Tensor]
# sentence-transformers' CrossEncoder activations by class name (its config stores the path).
_NAMED_ACTIVATIONS: dict[str, Activation] = {
    "Sigmoid": torch.sigmoid, "Identity": lambda x: x, "Tanh": torch.tanh,
    "Softmax": lambda x: torch.softmax(x, dim=-1),
}


def pooled_rows(pooling_type: str, batch: PackedBatch) -> Optional[list[int]]:
    """The rows the pooler reads, one per sequence (CLS: first, LAST: last); None for MEAN,
    which reads every row."""
    if pooling_type == "CLS":
        return batch.first_rows()
    if pooling_type == "LAST":
        return batch.last_rows()
    return None


def pool(hidden: torch.Tensor, batch: PackedBatch, pooling_type: str) -> torch.Tensor:
    """``[num_seqs, hidden]`` float32 from the last hidden states: for MEAN ``hidden`` is every
    row ``[num_tokens, hidden]`` (summed in float32, as sentence-transformers does for 16-bit
    models); for CLS and LAST it is already the pooled rows."""
    if pooling_type != "MEAN":
        return hidden.float()
    sums = hidden.new_zeros(len(batch.lens), hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, batch.sequence_index(), hidden.float())
    return sums / torch.tensor(batch.lens, dtype=torch.float32, device=sums.device).unsqueeze(1)


def embedding(pooled: torch.Tensor, dimensions: Optional[int], normalize: bool) -> torch.Tensor:
    """One pooled vector ``[hidden]``: its first ``dimensions`` values (Matryoshka), then
    L2-normalised when ``normalize``."""
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def classification_activation(hf_config: Any) -> Activation:
    """Class probabilities from logits as vLLM's classify gives them: sigmoid for one label or
    multi-label models, softmax otherwise."""
    if int(hf_config.num_labels) == 1 or getattr(hf_config, "problem_type", None) == "multi_label_classification":
        return torch.sigmoid
    return lambda x: torch.softmax(x, dim=-1)


def score_activation(hf_config: Any) -> Activation:
    """A cross-encoder's activation, as sentence-transformers' CrossEncoder picks it: the one
    its config names (``sentence_transformers.activation_fn``, or the older
    ``sbert_ce_default_activation_function``), else sigmoid for one label."""
    st = getattr(hf_config, "sentence_transformers", None)
    path = (st.get("activation_fn") if isinstance(st, dict) else None) or getattr(
        hf_config, "sbert_ce_default_activation_function", None)
    if path:
        name = str(path).rsplit(".", 1)[-1]
        if name not in _NAMED_ACTIVATIONS:
            raise ValueError(f"cross-encoder activation {path!r} is not supported; supported: "
                             f"{sorted(_NAMED_ACTIVATIONS)}")
        return _NAMED_ACTIVATIONS[name]
    return torch.sigmoid if int(hf_config.num_labels) == 1 else _NAMED_ACTIVATIONS["Identity"]


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (how an embedding model scores a pair)."""
    return float(F.cosine_similarity(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32),
                                     dim=0))
