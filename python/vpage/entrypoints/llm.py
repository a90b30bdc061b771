"""LLM: offline batched generation over an LLMEngine, with a progress bar."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence, Union

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine, PromptType
from vpage.outputs import RequestOutput
from vpage.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, str]


class LLM:
    """Generates for many prompts at once with continuous batching.

    >>> llm = LLM()  # the default model (SmolLM2-135M-Instruct), CPU unless a GPU is present
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel workers (also done at exit); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (``generation_config="auto"``)
        over SamplingParams' own; what ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.config.model.generation_defaults)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt (text or token ids) to completion; outputs in prompt order.
        A single SamplingParams applies to all prompts; a list gives one per prompt; None
        takes ``get_default_sampling_params()``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        default = self.get_default_sampling_params()
        order = {}
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                final_only = dataclasses.replace(p or default, output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, final_only)
                order[request_id] = len(order)
            return self._run(order, use_tqdm)
        except BaseException:
            self.engine.abort_request(list(order))  # a bad prompt or Ctrl-C leaves nothing queued
            raise

    def chat(self, messages: Union[list[Message], Sequence[list[Message]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, return_dict=False))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
