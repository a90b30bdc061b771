"""LLM: offline batched generation over an LLMEngine, or embeddings, classification and scores
over a PoolingEngine (``runner="pooling"``), with a progress bar."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence, Union

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine, PromptType
from vpage.entrypoints.llm_pooling import PoolingFrontEnd
from vpage.lora.request import LoRARequest
from vpage.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                           ScoringRequestOutput)
from vpage.pooling import make_pooling_engine, resolve_runner
from vpage.pooling_params import PoolingParams
from vpage.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, str]
# vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}, optionally with "cache_salt".
PromptDict = dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def _unpack_prompt(prompt: Union[PromptType, PromptDict]) -> tuple[PromptType, Optional[str]]:
    """(text or token ids, cache salt) of a prompt given as text, token ids or a vLLM prompt dict."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - _PROMPT_KEYS
    if unknown:
        raise ValueError(f"unsupported prompt keys {sorted(unknown)}; a prompt dict has 'prompt' or "
                         "'prompt_token_ids' (and optionally 'cache_salt')")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"], prompt.get("cache_salt")
    if "prompt" not in prompt:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return prompt["prompt"], prompt.get("cache_salt")


class LLM:
    """Generates for many prompts at once with continuous batching; or, with a pooling model,
    embeds, classifies and scores them.

    >>> llm = LLM()  # the default model (SmolLM2-135M-Instruct), CPU unless a GPU is present
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    >>> LLM("path/to/bert-folder").embed(["Hello"])[0].outputs.embedding  # runner "auto": pooling

    runner: "generate", "pooling" or "auto" (pooling for ``vpage.pooling.pooling_architectures()``,
    generation otherwise), as vLLM names them. A generating LLM refuses embed/classify/score/
    encode and a pooling one generate/chat, with ValueError.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        self.runner = resolve_runner(model, kwargs.pop("runner", "auto"))
        self._ids = itertools.count()
        if self.runner == "pooling":
            self.engine: Any = make_pooling_engine(EngineArgs(model=model, runner="pooling", **kwargs))
            self._pooling: Optional[PoolingFrontEnd] = PoolingFrontEnd(self.engine, self._ids)
        else:
            self.engine = LLMEngine(EngineArgs(model=model, runner="generate", **kwargs))
            self._pooling = None

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel workers (also done at exit); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, so that later prompts compute every block again (vLLM's
        name; e.g. between benchmark runs). An encoder has no cache: True."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        return True if reset is None else reset()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (``generation_config="auto"``)
        over SamplingParams' own; what ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.config.model.generation_defaults)

    def generate(self, prompts: Union[PromptType, PromptDict, Sequence[Union[PromptType, PromptDict]]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Runs every prompt (text, token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``) to completion; outputs in prompt order. A single
        SamplingParams applies to all prompts; a list gives one per prompt; None takes
        ``get_default_sampling_params()``. ``lora_request``: the LoRA adapter of every prompt, or a
        list with one per prompt (None: the base model); needs ``enable_lora=True``."""
        self._generating("generate")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        default = self.get_default_sampling_params()
        order = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = str(next(self._ids))
                final_only = dataclasses.replace(p or default, output_kind=RequestOutputKind.FINAL_ONLY)
                prompt, cache_salt = _unpack_prompt(prompt)
                self.engine.add_request(request_id, prompt, final_only, cache_salt=cache_salt, lora_request=lora)
                order[request_id] = len(order)
            return self._run(order, use_tqdm)
        except BaseException:
            self.engine.abort_request(list(order))  # a bad prompt or Ctrl-C leaves nothing queued
            raise

    def chat(self, messages: Union[list[Message], Sequence[list[Message]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        self._generating("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, return_dict=False))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _generating(self, method: str) -> None:
        if self.runner != "generate":
            raise ValueError(f"{method}() needs a generating model; this LLM runs a pooling model "
                             "(runner='pooling'): use embed, classify, score or encode")

    def _pooling_front_end(self, method: str) -> PoolingFrontEnd:
        if self._pooling is None:
            raise ValueError(f"{method}() needs a pooling model; this LLM generates (runner='generate'): load an "
                             "embedding or classification model, or pass runner='pooling'")
        return self._pooling

    def embed(self, prompts: Any, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              use_tqdm: bool = True, truncate_prompt_tokens: Optional[int] = None) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (text, token ids, or vLLM's prompt dicts), in prompt order;
        ``pooling_params`` (one, or one per prompt) may set dimensions and normalize."""
        return self._pooling_front_end("embed").run("embed", prompts, pooling_params, use_tqdm,
                                                    truncate_prompt_tokens)

    def classify(self, prompts: Any, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: Optional[int] = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (softmax; sigmoid for one label), in prompt order."""
        return self._pooling_front_end("classify").run("classify", prompts, pooling_params, use_tqdm,
                                                       truncate_prompt_tokens)

    def encode(self, prompts: Any, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               use_tqdm: bool = True, pooling_task: Optional[str] = None,
               truncate_prompt_tokens: Optional[int] = None) -> list[PoolingRequestOutput]:
        """The pooled tensor per prompt (``outputs.data``) of ``pooling_task`` ("embed" or
        "classify"; default the task of ``pooling_params``)."""
        return self._pooling_front_end("encode").encode(prompts, pooling_params, use_tqdm, pooling_task,
                                                        truncate_prompt_tokens)

    def score(self, data_1: Any, data_2: Any, use_tqdm: bool = True,
              pooling_params: Optional[PoolingParams] = None,
              truncate_prompt_tokens: Optional[int] = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs, as vLLM pairs them: one text against one, one against N, or N
        against N (pairwise). A cross-encoder reads each pair in the tokenizer's pair
        encoding; an embedding model scores the cosine similarity of the two embeddings."""
        return self._pooling_front_end("score").score(data_1, data_2, use_tqdm, pooling_params,
                                                      truncate_prompt_tokens)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", unit="req", dynamic_ncols=True)
        generated = 0
        while len(finished) < len(order):
            outputs = self.engine.step()
            for request_id, message in self.engine.take_request_errors():
                if request_id in order:
                    raise ValueError(f"request {request_id} (prompt {order[request_id]}): {message}")
            for out in outputs:
                if out.finished and out.request_id in order:
                    finished[out.request_id] = out
                    generated += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s", refresh=False)
        if bar is not None:
            bar.close()
        return sorted(finished.values(), key=lambda o: order[o.request_id])
