"""The pooling routes' answers: ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``.

Every input is tokenized and checked here first (empty, token ids outside the vocabulary,
longer than the context unless ``truncate_prompt_tokens`` cuts it, a task the model has not),
so a request reaches the engine only when all of its prompts can be served; its prompts then
run as separate engine requests, batched with everyone else's. A score needs a cross-encoder
(a classification model scores the tokenizer's pair encoding) or an embedding model (the
cosine similarity of the two embeddings), as vLLM does."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Optional, Union

import torch

from vpage.entrypoints.openai.protocol import ApiError
from vpage.entrypoints.openai.serving import ServedModel
from vpage.entrypoints.pooling.client import PoolingAborted, PoolingClient, PoolingEngineDead
from vpage.entrypoints.pooling.metrics import PoolingMetrics
from vpage.entrypoints.pooling.protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                                ScoreRequest)
from vpage.pooling_params import PoolingParams

_TASK_NAMES = {"embed": "embeddings", "classify": "classification", "score": "scores"}


class _Prompt:
    """A tokenized input: its token ids, and token type ids for a pair."""

    def __init__(self, ids: list[int], types: Optional[list[int]] = None):
        self.ids, self.types = ids, types


def _encode_vector(values: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(torch.tensor(values, dtype=torch.float32).numpy().astype("<f4").tobytes()).decode()
    return values


class PoolingServing(ServedModel):
    """A pooling model's server: ``client`` runs its engine; the model card, health, metrics
    and draining are the generation server's (api_server.py reads them alike)."""

    def __init__(self, client: PoolingClient, model_name: str, metrics: PoolingMetrics):
        super().__init__(client, model_name, metrics)
        self.engine = client.engine

    # ------------------------------------------------------------------ checks

    def _admit(self, model: Optional[str], task: str) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="service_unavailable")
        if self.client.dead_reason is not None:
            raise ApiError(503, "the engine is not available", kind="service_unavailable")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           kind="not_found_error", param="model")
        if task not in self.engine.supported_tasks:
            raise ApiError(400, f"this model does not support {_TASK_NAMES[task]}; it supports "
                                f"{sorted(_TASK_NAMES[t] for t in self.engine.supported_tasks)}", param="model")

    def _fit(self, ids: list[int], types: Optional[list[int]], truncate: Optional[int], param: str) -> _Prompt:
        """Token ids cut to their last ``truncate`` (-1: the context), then checked."""
        limit = self.client.info.max_model_len
        if truncate is not None:
            keep = limit if truncate == -1 else truncate
            if keep > limit:
                raise ApiError(400, f"truncate_prompt_tokens ({keep}) exceeds this model's maximum context length "
                                    f"({limit})", param="truncate_prompt_tokens")
            ids, types = ids[-keep:], None if types is None else types[-keep:]
        if not ids:
            raise ApiError(400, "an input is empty", param=param)
        if len(ids) > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; an input has {len(ids)} "
                                "tokens (set truncate_prompt_tokens to cut it)", param=param)
        vocab = self.client.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param=param)
        return _Prompt(ids, types)

    def _tokenize(self, item: Union[str, list[int]], truncate: Optional[int], param: str = "input",
                  pair: Optional[str] = None) -> _Prompt:
        """A text (or a text pair, a cross-encoder's input) tokenized with special tokens and cut
        to ``truncate`` tokens the tokenizer's way; token ids cut to their last ``truncate``."""
        if isinstance(item, list):
            return self._fit(list(item), None, truncate, param)
        try:
            ids, types = self.engine.tokenize(item, pair, truncate)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param) from None
        return self._fit(ids, types, None, param)

    # ------------------------------------------------------------------ running

    async def _run(self, prompts: list[_Prompt], params: PoolingParams) -> list[Any]:
        """The engine outputs of ``prompts``, in order (all or an ApiError; none left running)."""
        tasks = [asyncio.ensure_future(self.client.encode(p.ids, params, p.types)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except PoolingAborted:
            raise ApiError(503, "the request was aborted: the server is shutting down",
                           kind="service_unavailable") from None
        except PoolingEngineDead:
            raise ApiError(503, "the engine is not available", kind="service_unavailable") from None
        finally:
            for task in tasks:
                task.cancel()

    def _params(self, task: str, **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(task=task, **{k: v for k, v in fields.items() if v is not None})
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def _check_dimensions(self, dimensions: Optional[int]) -> None:
        if dimensions is not None and dimensions > self.engine.hidden_size:
            raise ApiError(400, f"dimensions is {dimensions}; this model's embeddings have {self.engine.hidden_size}",
                           param="dimensions")

    @staticmethod
    def _usage(prompts: list[_Prompt]) -> dict:
        tokens = sum(len(p.ids) for p in prompts)
        return {"prompt_tokens": tokens, "total_tokens": tokens}

    def _head(self, prefix: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name}

    # ------------------------------------------------------------------ routes

    async def embeddings(self, req: EmbeddingRequest) -> dict:
        self._admit(req.model, "embed")
        self._check_dimensions(req.dimensions)
        params = self._params("embed", dimensions=req.dimensions, normalize=req.normalize)
        prompts = [self._tokenize(item, req.truncate_prompt_tokens) for item in req.inputs()]
        outputs = await self._run(prompts, params)
        data = [{"index": i, "object": "embedding", "embedding": _encode_vector(o.outputs.embedding,
                                                                                  req.encoding_format)}
                for i, o in enumerate(outputs)]
        return {**self._head("embd"), "data": data, "usage": self._usage(prompts)}

    async def pooling(self, req: PoolingRequest) -> dict:
        task = "embed" if "embed" in self.engine.supported_tasks else "classify"
        self._admit(req.model, task)
        if task == "embed":
            self._check_dimensions(req.dimensions)
        elif req.dimensions is not None or req.normalize is not None:
            raise ApiError(400, "dimensions and normalize apply to embedding models", param="dimensions")
        params = self._params(task, dimensions=req.dimensions, normalize=req.normalize)
        prompts = [self._tokenize(item, req.truncate_prompt_tokens) for item in req.inputs()]
        outputs = await self._run(prompts, params)
        vectors = [o.outputs.embedding if task == "embed" else o.outputs.probs for o in outputs]
        data = [{"index": i, "object": "pooling", "data": _encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {**self._head("pool"), "data": data, "usage": self._usage(prompts)}

    async def classify(self, req: ClassificationRequest) -> dict:
        self._admit(req.model, "classify")
        params = self._params("classify", use_activation=req.use_activation)
        prompts = [self._tokenize(item, req.truncate_prompt_tokens) for item in req.inputs()]
        outputs = await self._run(prompts, params)
        labels = self.engine.labels
        data = [{"index": i, "label": labels[max(range(len(o.outputs.probs)), key=o.outputs.probs.__getitem__)],
                 "probs": o.outputs.probs, "num_classes": len(o.outputs.probs)} for i, o in enumerate(outputs)]
        return {**self._head("classify"), "data": data, "usage": self._usage(prompts)}

    async def _scores(self, model: Optional[str], firsts: list[str], seconds: list[str], truncate: Optional[int],
                      use_activation: Optional[bool]) -> tuple[list[float], list[_Prompt]]:
        """Scores of ``firsts[i]`` against ``seconds[i]``, and the prompts that computed them."""
        cross = self.engine.is_cross_encoder
        self._admit(model, "score")
        if cross:
            prompts = [self._tokenize(a, truncate, "text_2", pair=b) for a, b in zip(firsts, seconds)]
            outputs = await self._run(prompts, self._params("score", use_activation=use_activation))
            return [o.outputs.score for o in outputs], prompts
        if use_activation is not None:
            raise ApiError(400, "use_activation applies to cross-encoders; this model scores by embeddings",
                           param="use_activation")
        texts = list(dict.fromkeys(firsts + seconds))  # each distinct text embedded once
        prompts = [self._tokenize(t, truncate, "text_1") for t in texts]
        vectors = await self._run(prompts, self._params("embed"))
        by_text = {t: torch.tensor(o.outputs.embedding, dtype=torch.float64) for t, o in zip(texts, vectors)}
        scores = [float(torch.nn.functional.cosine_similarity(by_text[a], by_text[b], dim=0))
                  for a, b in zip(firsts, seconds)]
        return scores, prompts

    async def score(self, req: ScoreRequest) -> dict:
        firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise ApiError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as "
                                "many as text_2", param="text_1")
        scores, prompts = await self._scores(req.model, firsts, seconds, req.truncate_prompt_tokens,
                                             req.use_activation)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {**self._head("score"), "data": data, "usage": self._usage(prompts)}

    async def rerank(self, req: RerankRequest) -> dict:
        if any(not d for d in req.documents):
            raise ApiError(400, "a document is empty", param="documents")
        scores, prompts = await self._scores(req.model, [req.query] * len(req.documents), req.documents,
                                             req.truncate_prompt_tokens, req.use_activation)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        head = self._head("rerank")
        return {"id": head["id"], "model": self.model_name, "usage": {"total_tokens": self._usage(prompts)["total_tokens"]},
                "results": results}
