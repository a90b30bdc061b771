"""PoolingEngine: pooling requests in (token ids + PoolingParams), one packed forward per step,
embeddings, class probabilities and scores out."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from vpage import ops
from vpage.engine.arg_utils import POOLING_MAX_NUM_BATCHED_TOKENS, EngineArgs
from vpage.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                           EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from vpage.pooling.loader import is_encoder, load_pooling_model
from vpage.pooling.runner import PoolingRunner
from vpage.pooling.scheduler import PoolingRequest, PoolingScheduler
from vpage.pooling_params import PoolingParams

logger = logging.getLogger("vpage")


def tokenize(tokenizer: Any, max_model_len: int, text: str, text_pair: Optional[str] = None,
             truncate_prompt_tokens: Optional[int] = None) -> tuple[list[int], Optional[list[int]]]:
    """(input ids, token type ids or None) of a text, or of a pair in the tokenizer's pair
    encoding (a cross-encoder's input), with special tokens; ``truncate_prompt_tokens`` k
    truncates to k tokens the tokenizer's way (-1: max_model_len)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass prompt token ids")
    kwargs: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:
        k = truncate_prompt_tokens
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        kwargs = dict(truncation=True, max_length=max_model_len if k == -1 else k)
    encoded = tokenizer(text, text_pair, **kwargs)
    types = encoded.get("token_type_ids")
    return list(encoded["input_ids"]), None if types is None else list(types)


def make_pooling_engine(args: EngineArgs) -> Any:
    """The engine that pools ``args.model``: a PoolingEngine for an encoder, the paged engine
    (``DecoderPoolingEngine``) for a decoder."""
    if is_encoder(args.model):
        return PoolingEngine(args)
    from vpage.pooling.decoder import DecoderPoolingEngine

    return DecoderPoolingEngine(args)


class PoolingEngine:
    """Continuous batching of pooling requests on one encoder model (``vpage.pooling.loader``'s
    architectures), on one device.

    ``add_request`` validates and queues (ValueError, nothing queued, for a bad request);
    ``step`` packs the oldest waiting requests up to ``max_num_batched_tokens`` tokens and
    ``max_num_seqs`` sequences (one longer request alone), runs one forward over them without
    padding and returns their finished outputs. Not thread-safe: one thread drives it.

    Tasks (``supported_tasks``): an embedding model "embed" and "score" (a pair scored by the
    cosine similarity of the two texts' embeddings: add each text as "embed", then
    ``vpage.pooling.cosine_similarity``; ``is_cross_encoder`` is False); a classification
    model "classify", and "score" when it has one label (a cross-encoder: the pair's
    ``tokenize(text_1, text_2)`` encoding is one "score" request).
    """

    def __init__(self, args: EngineArgs):
        if args.runner == "generate":
            raise ValueError("runner 'generate' is served by LLMEngine; PoolingEngine runs runner 'pooling'")
        if args.tensor_parallel_size != 1:
            raise ValueError(f"pooling runs on one device; tensor_parallel_size must be 1, got "
                             f"{args.tensor_parallel_size}")
        if args.num_threads is not None:  # the encoder runs torch's ops (attention, norms) beside vpage's
            torch.set_num_threads(args.num_threads)
            ops.set_num_threads(args.num_threads)
        loaded = load_pooling_model(args.model, args.dtype, args.device, args.pooler_config)
        hf = loaded.hf_config
        self.model_name: str = str(args.model)
        self.architecture = loaded.architecture
        self.tokenizer: Any = loaded.tokenizer
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pooler_config = loaded.pooler
        self.hidden_size: int = int(hf.hidden_size)
        self.num_labels: Optional[int] = loaded.num_labels
        # The classes' names, by index (transformers' id2label), for a classification model.
        self.labels: Optional[list[str]] = (None if self.num_labels is None else
                                            [str(hf.id2label.get(i, f"LABEL_{i}")) for i in range(self.num_labels)])
        self.vocab_size: int = int(hf.vocab_size)
        self.type_vocab_size: int = max(1, int(getattr(hf, "type_vocab_size", 1)))
        self.max_model_len: int = min(args.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.is_cross_encoder: bool = self.num_labels == 1
        if self.num_labels is None:
            self.supported_tasks: set[str] = {"embed", "score"}
        else:
            self.supported_tasks = {"classify", "score"} if self.is_cross_encoder else {"classify"}
        self.max_num_batched_tokens = args.max_num_batched_tokens or POOLING_MAX_NUM_BATCHED_TOKENS
        self.scheduler = PoolingScheduler(self.max_num_batched_tokens, args.max_num_seqs)
        self.runner = PoolingRunner(loaded)
        logger.info("vpage: pooling %s on %s (%s), tasks %s, pooling %s%s, max_model_len %d, %d tokens per step",
                    self.architecture, self.device, str(self.dtype).removeprefix("torch."),
                    sorted(self.supported_tasks), self.pooler_config.pooling_type,
                    " normalised" if self.pooler_config.normalize else "", self.max_model_len,
                    self.max_num_batched_tokens)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "PoolingEngine":
        return cls(args)

    def shutdown(self) -> None:
        """Nothing to stop (no worker processes); for symmetry with LLMEngine."""

    # ----------------------------------------------------------------- requests

    def tokenize(self, text: str, text_pair: Optional[str] = None,
                 truncate_prompt_tokens: Optional[int] = None) -> tuple[list[int], Optional[list[int]]]:
        return tokenize(self.tokenizer, self.max_model_len, text, text_pair, truncate_prompt_tokens)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams,
                    token_type_ids: Optional[Sequence[int]] = None) -> None:
        """Queues a request. ValueError (nothing queued) for a duplicate id, parameters the task
        does not take, a task this model does not serve, an empty prompt, a token id outside
        the vocabulary, a prompt longer than max_model_len (after ``truncate_prompt_tokens``,
        which keeps the last k ids), dimensions above the hidden size, or token types that do
        not match the prompt."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be PoolingParams, got {type(params).__name__}")
        if request_id in self.scheduler:
            raise ValueError(f"request id {request_id!r} is already queued")
        params.verify()
        if params.task not in self.supported_tasks:
            raise ValueError(f"this model ({self.architecture}) does not support task {params.task!r}; "
                             f"it supports {sorted(self.supported_tasks)}")
        if params.task == "score" and not self.is_cross_encoder:
            raise ValueError("an embedding model scores a pair by the cosine similarity of the two texts' "
                             "embeddings: add each text with task 'embed', then take "
                             "vpage.pooling.cosine_similarity (LLM.score does this)")
        ids = [int(t) for t in prompt_token_ids]
        types = None if token_type_ids is None else [int(t) for t in token_type_ids]
        if types is not None and len(types) != len(ids):
            raise ValueError(f"token_type_ids has {len(types)} entries for {len(ids)} prompt tokens")
        if params.truncate_prompt_tokens is not None:
            k = params.truncate_prompt_tokens
            keep = self.max_model_len if k == -1 else k
            ids, types = ids[-keep:], None if types is None else types[-keep:]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len} "
                             "(truncate_prompt_tokens truncates it)")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if types is not None and any(not 0 <= t < self.type_vocab_size for t in types):
            raise ValueError(f"token type ids must be in [0, {self.type_vocab_size})")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"dimensions {params.dimensions} is more than the model's hidden size {self.hidden_size}")
        self.scheduler.add(PoolingRequest(request_id, ids, types, params))

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Drops waiting requests (unknown ids are ignored)."""
        self.scheduler.abort([request_ids] if isinstance(request_ids, str) else request_ids)

    def has_unfinished_requests(self) -> bool:
        return len(self.scheduler) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler)

    # ----------------------------------------------------------------- steps

    def step(self) -> list[PoolingRequestOutput]:
        """Runs the next batch; its requests' outputs (all finished), in queue order. [] when
        nothing waits. A step that raises leaves its requests queued."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        vectors = self.runner.execute(batch)
        self.scheduler.finish(batch)
        return [_output(request, vector) for request, vector in zip(batch, vectors)]


def _output(request: PoolingRequest, vector: torch.Tensor) -> PoolingRequestOutput:
    task, ids = request.params.task, request.prompt_token_ids
    if task == "embed":
        return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(vector.tolist()), ids, True)
    if task == "classify":
        return ClassificationRequestOutput(request.request_id, ClassificationOutput(vector.tolist()), ids, True)
    return ScoringRequestOutput(request.request_id, ScoringOutput(float(vector[0])), ids, True)
