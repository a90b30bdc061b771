"""The pooling side of ``LLM``: embed, classify, encode and score over a PoolingEngine."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from vpage.outputs import PoolingOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput
from vpage.pooling import PoolingEngine, cosine_similarity
from vpage.pooling_params import PoolingParams

Params = Union[PoolingParams, Sequence[PoolingParams], None]
Tokens = tuple[list[int], Optional[list[int]]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "token_type_ids"}


def _is_single(prompts: Any) -> bool:
    """A prompt rather than a list of them: text, a prompt dict, or token ids."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                                 and isinstance(prompts[0], int))


def _as_list(prompts: Any, what: str = "prompts") -> list[Any]:
    items = [prompts] if _is_single(prompts) else list(prompts)
    if not items:
        raise ValueError(f"no {what} given")
    return items


class PoolingFrontEnd:
    """Tokenizes prompts, queues them on ``engine`` (request ids from ``ids``) and steps it
    until every request has finished; a bad prompt (ValueError naming its index) or Ctrl-C
    aborts what was queued."""

    def __init__(self, engine: PoolingEngine, ids: Iterator[int]):
        self.engine = engine
        self._ids = ids

    def _tokens(self, prompt: Any, truncate: Optional[int]) -> Tokens:
        """(ids, token types) of text (tokenized, truncated the tokenizer's way), token ids, or
        vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(f"unsupported prompt keys {sorted(unknown)}; a prompt dict has 'prompt' or "
                                 "'prompt_token_ids' (and optionally 'token_type_ids')")
            if "prompt_token_ids" in prompt:
                types = prompt.get("token_type_ids")
                return list(prompt["prompt_token_ids"]), None if types is None else list(types)
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.engine.tokenize(prompt, None, truncate)
        return list(prompt), None

    def _params(self, task: str, params: Params, n: int, truncate: Optional[int]) -> list[PoolingParams]:
        given = list(params) if isinstance(params, (list, tuple)) else [params] * n
        if len(given) != n:
            raise ValueError(f"{n} prompts but {len(given)} pooling parameters")
        out = []
        for p in given:
            p = p or PoolingParams()
            k = truncate if truncate is not None else p.truncate_prompt_tokens
            out.append(dataclasses.replace(p, task=task, truncate_prompt_tokens=k))
        return out

    def run(self, task: str, prompts: Any, params: Params, use_tqdm: bool,
            truncate: Optional[int]) -> list[Any]:
        """The outputs of ``task`` for each prompt, in order."""
        prompts = _as_list(prompts)
        params = self._params(task, params, len(prompts), truncate)
        return self.submit([self._tokens(p, q.truncate_prompt_tokens) for p, q in zip(prompts, params)], params,
                           use_tqdm)

    def submit(self, inputs: list[Tokens], params: list[PoolingParams], use_tqdm: bool) -> list[Any]:
        order: dict[str, int] = {}
        try:
            for i, ((ids, types), p) in enumerate(zip(inputs, params)):
                request_id = str(next(self._ids))
                try:
                    self.engine.add_request(request_id, ids, p, types)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                order[request_id] = i
            return self._drain(order, use_tqdm)
        except BaseException:
            self.engine.abort_request(list(order))
            raise

    def _drain(self, order: dict[str, int], use_tqdm: bool) -> list[Any]:
        finished: dict[str, Any] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", unit="req", dynamic_ncols=True)
        while len(finished) < len(order):
            for out in self.engine.step():
                if out.request_id in order:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return sorted(finished.values(), key=lambda o: order[o.request_id])

    def encode(self, prompts: Any, params: Params, use_tqdm: bool, task: Optional[str],
               truncate: Optional[int]) -> list[PoolingRequestOutput]:
        if task is None and isinstance(params, PoolingParams):
            task = params.task
        if task not in ("embed", "classify"):
            raise ValueError(f"encode needs pooling_task 'embed' or 'classify' (score() scores pairs), got {task!r}")
        outs = self.run(task, prompts, params, use_tqdm, truncate)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(_values(o.outputs))),
                                     o.prompt_token_ids, True) for o in outs]

    def score(self, data_1: Any, data_2: Any, use_tqdm: bool, params: Optional[PoolingParams],
              truncate: Optional[int]) -> list[ScoringRequestOutput]:
        engine = self.engine
        if "score" not in engine.supported_tasks:
            raise ValueError(f"this model ({engine.architecture}) does not support task 'score'; it supports "
                             f"{sorted(engine.supported_tasks)} (a classifier scores pairs with one label)")
        first, second = _as_list(data_1, "data_1"), _as_list(data_2, "data_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"score pairs one text with N texts or N with N; got {len(first)} and {len(second)}")
        if not self.engine.is_cross_encoder:
            return self._embedding_score(first, second, use_tqdm, params, truncate)
        if not all(isinstance(t, str) for t in first + second):
            raise ValueError("a cross-encoder scores text pairs (the tokenizer's pair encoding): pass text")
        p = self._params("score", params, 1, truncate)[0]
        inputs = [self.engine.tokenize(a, b, p.truncate_prompt_tokens) for a, b in zip(first, second)]
        return self.submit(inputs, [p] * len(inputs), use_tqdm)

    def _embedding_score(self, first: list[Any], second: list[Any], use_tqdm: bool, params: Optional[PoolingParams],
                         truncate: Optional[int]) -> list[ScoringRequestOutput]:
        """vLLM's score of an embedding model: the cosine similarity of each pair's embeddings
        (a text repeated against N is embedded once)."""
        unique = first[:1] if all(a is first[0] for a in first) else first
        embedded = self.run("embed", unique + second, params, use_tqdm, truncate)
        left = embedded[:len(unique)] * (len(first) if len(unique) == 1 else 1)
        right = embedded[len(unique):]
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                     ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)),
                                     a.prompt_token_ids + b.prompt_token_ids, True) for a, b in zip(left, right)]


def _values(outputs: Any) -> list[float]:
    return outputs.embedding if hasattr(outputs, "embedding") else outputs.probs
