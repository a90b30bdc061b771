"""Decoder embedding models (Qwen3-Embedding's kind: a Llama / Qwen folder whose
sentence-transformers config pools the last token) on the paged engine.

An ``LLMEngine`` started with runner "pooling" prefills each request's prompt through the
scheduler like any other (continuous batching, chunked prefill, the prefix cache: a shared
instruction prefix is computed once, tensor parallelism) and returns the final hidden state of
its last prompt token, pooled, instead of a generated token. ``DecoderPoolingEngine`` gives it
``PoolingEngine``'s interface, so ``LLM.embed`` and the server's pooling routes take either.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence, Union

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine
from vpage.outputs import PoolingRequestOutput
from vpage.pooling.engine import tokenize
from vpage.pooling_params import PoolingParams


class DecoderPoolingEngine:
    """A pooling decoder's engine with ``PoolingEngine``'s interface (``add_request``, ``step``,
    ``tokenize``, ``supported_tasks``, ...). Tasks: an embedding model "embed", and "score" by
    the cosine of two embeddings (the front end's); a classifier of next-token logits
    (``hf_overrides``) "classify", and "score" as a cross-encoder when it gives one score
    (Qwen3-Reranker). Not thread-safe: one thread drives it."""

    def __init__(self, args: EngineArgs):
        self.engine = LLMEngine(dataclasses.replace(args, runner="pooling"))
        classes = self.engine.config.model.classifier_token_ids
        binary = self.engine.config.model.binary_classifier
        self.is_cross_encoder = binary
        self.num_labels: Optional[int] = None if classes is None else (1 if binary else len(classes))
        self.supported_tasks = ({"embed", "score"} if classes is None else
                                {"classify", "score"} if binary else {"classify"})
        # The classes' names: the class tokens (a reranker's one class is its score).
        self.labels: Optional[list[str]] = (None if classes is None else ["score"] if binary else
                                            [str(t) for t in args.hf_overrides["classifier_from_token"]])
        config = self.engine.model_config
        self.model_name = str(args.model)
        self.architecture = config.architecture
        self.tokenizer: Any = self.engine.tokenizer
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.pooler_config = self.engine.config.model.pooler
        self.max_model_len: int = self.engine.max_model_len - 1  # the engine keeps a position for a sample

    def tokenize(self, text: str, text_pair: Optional[str] = None,
                 truncate_prompt_tokens: Optional[int] = None) -> tuple[list[int], Optional[list[int]]]:
        return tokenize(self.tokenizer, self.max_model_len, text, text_pair, truncate_prompt_tokens)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams,
                    token_type_ids: Optional[Sequence[int]] = None) -> None:
        """Queues a request (ValueError, nothing queued, for a task the model has not, token
        type ids, or what ``LLMEngine.add_request`` refuses)."""
        params.verify()
        if params.task == "score" and not self.is_cross_encoder:
            raise ValueError("an embedding model scores a pair by the cosine similarity of the two texts' "
                             "embeddings: add each text with task 'embed' (LLM.score does this)")
        if token_type_ids is not None:
            raise ValueError("a decoder takes no token type ids")
        self.engine.add_request(request_id, list(prompt_token_ids), params)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        self.engine.abort_request([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def step(self) -> list[PoolingRequestOutput]:
        return [out for out in self.engine.step() if isinstance(out, PoolingRequestOutput)]

    def shutdown(self) -> None:
        self.engine.shutdown()
