"""Per-request pooling settings (embeddings, classification, scores), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """What a pooling request asks for.

    task: "embed" (a vector), "classify" (class probabilities) or "score" (one number for a
    text pair given as the tokenizer's pair encoding, from a cross-encoder). dimensions: keep
    the first ``dimensions`` values of an embedding (Matryoshka), then normalise when
    normalising. normalize: L2-normalise an embedding (None: the model's default, from its
    sentence-transformers config). use_activation: softmax (or sigmoid, for one label) on
    classification logits and scores (None: the model's default, on). truncate_prompt_tokens:
    keep only the last k prompt token ids (-1: the last max_model_len), as vLLM does for token
    prompts. ValueError for a value out of range; ``verify`` checks the fields against the task.
    """

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")

    def verify(self) -> None:
        """ValueError for a field that ``task`` does not take (checked when the request is
        added, so that parameters can be built before the task is set, as ``LLM.classify``
        sets it)."""
        if self.task != "embed":
            for name in ("dimensions", "normalize"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to embeddings, not to task {self.task!r}")
        elif self.use_activation is not None:
            raise ValueError("use_activation applies to classification and scores, not to embeddings")
