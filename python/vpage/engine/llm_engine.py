"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out: the front end
(tokenizing, text, outputs) around an ``EngineCore`` in the same process."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence, Union

import torch

from vpage.config import EngineConfig
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core import EngineCore
from vpage.engine.core_io import EngineCoreRequest
from vpage.engine.metrics import EngineStats
from vpage.engine.output_processor import OutputProcessor
from vpage.engine.request_state import RequestState
from vpage.lora.request import LoRARequest
from vpage.outputs import PoolingRequestOutput, RequestOutput
from vpage.pooling_params import PoolingParams
from vpage.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("vpage")

PromptType = Union[str, Sequence[int], dict]  # dict: vLLM's {"prompt": ...} or {"prompt_token_ids": ...}


class LLMEngine:
    """Continuous-batching engine over one model.

    ``add_request`` tokenizes and hands the prompt to the engine core; ``step`` runs one core
    step (schedule, then swap/copy blocks, forward and sampling in the executor, then commit),
    detokenizes, matches stop strings and returns the outputs of the requests that advanced or
    finished, each in the shape its ``SamplingParams.output_kind`` asks for. Bad requests raise ValueError and leave the
    engine untouched; a failed step leaves it consistent (nothing was committed).
    """

    def __init__(self, args: EngineArgs):
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs replicas behind a server: use `vpage serve "
                             "--data-parallel-size N`; LLM and LLMEngine run one engine")
        self.config: EngineConfig = args.create_engine_config()
        torch.manual_seed(args.seed)
        self.core = EngineCore(self.config)
        self.executor = self.core.executor
        self.model_config = self.core.model_config
        self.tokenizer = self.core.tokenizer
        self.device = self.core.device
        self.max_model_len = self.core.max_model_len
        self.num_gpu_blocks = self.core.num_gpu_blocks
        self.outputs = OutputProcessor(self.tokenizer)
        self._errors: list[tuple[str, str]] = []
        cache = self.config.cache
        logger.info("vpage: %s on %s (%s), KV cache %d blocks x %d tokens (%.1f KiB per block) = %d tokens, "
                    "swap %d blocks, max_model_len %d", self.model_config.architecture, self.device,
                    str(self.model_config.dtype).removeprefix("torch."), self.core.num_gpu_blocks, cache.block_size,
                    self.executor.block_bytes() / 1024, self.core.num_gpu_blocks * cache.block_size,
                    self.executor.num_cpu_blocks, self.max_model_len)

    @property
    def scheduler(self) -> Any:
        """The core's C++ scheduler."""
        return self.core.scheduler

    @property
    def metrics(self) -> Any:
        return self.core.metrics

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----------------------------------------------------------------- requests

    def _prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def add_request(self, request_id: str, prompt: PromptType, params: Union[SamplingParams, PoolingParams, None] = None,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """Queues a request. Raises ValueError for a duplicate id, an empty or too long prompt,
        or parameters the engine cannot serve; the engine is unchanged then. A request with
        structured outputs waits in the engine until its grammar compiles; one whose grammar
        fails to compile then ends without output (``take_request_errors``). An engine started
        with runner "pooling" takes PoolingParams instead: its output is an
        ``EmbeddingRequestOutput`` (the last prompt token's hidden state, pooled), or for a token
        classifier a ``ClassificationRequestOutput`` or ``ScoringRequestOutput``. ``lora_request``:
        the LoRA adapter it runs under (an engine with enable_lora; ValueError for an adapter
        that cannot serve this model)."""
        params = params or SamplingParams()
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = params, SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
            prompt = self._truncated(prompt, pooling.truncate_prompt_tokens)
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        request_id = str(request_id)
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; this model has none")
            params.update_from_tokenizer(self.tokenizer)
        text, ids = self._prompt_ids(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(EngineCoreRequest(request_id, ids, params, arrival, cache_salt, pooling, lora_request))
        state = RequestState(request_id, text, ids, params, self.tokenizer, arrival)
        state.pooling_task = pooling.task if pooling is not None else None
        state.lora_request = lora_request
        self.outputs.add(state)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a LoRA adapter ahead of its requests (True when read now); ValueError for one
        that cannot serve this model."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (requests running under it finish first); False when unknown."""
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters added and not removed."""
        return self.core.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's name): True when done, False (nothing changed) while
        unfinished requests hold KV blocks."""
        return self.core.reset_prefix_cache()

    def _truncated(self, prompt: PromptType, k: Optional[int]) -> list[int]:
        """A pooling prompt's token ids, cut to its last ``k`` (-1: the last max_model_len - 1)."""
        ids = self._prompt_ids(prompt)[1]
        if k is None:
            return ids
        return ids[-(self.max_model_len - 1 if k == -1 else k):]

    def abort_request(self, request_id: Union[str, Sequence[str]]) -> None:
        """Aborts unfinished requests (unknown ids are ignored) and frees their blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core.abort_requests(ids)
        for rid in ids:
            self.outputs.abort(rid)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests by id (read-only: the output processor owns them)."""
        return self.outputs.requests

    def check_health(self) -> None:
        """Raises WorkerDiedError when a tensor-parallel worker has died (the engine can no
        longer step and must be recreated); a no-op with one rank."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests) or self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests that ended in an error since the last call
        (a grammar that did not compile): they produced no output and are gone."""
        errors, self._errors = self._errors, []
        return errors

    def get_stats(self) -> EngineStats:
        """The engine's statistics, computed now (not kept up to date every step)."""
        return self.core.get_stats()

    # --------------------------------------------------------------------- step

    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """Runs one engine step (the core's schedule, execute and update), then turns its news
        into text and outputs; returns the outputs of requests that advanced or finished."""
        core_outputs = self.core.step()
        for request_id, message in self.core.take_request_errors():  # e.g. a grammar that did not compile
            self.outputs.requests.pop(request_id, None)
            self._errors.append((request_id, message))
        outputs, stopped = self.outputs.process(core_outputs)
        if stopped:
            self.core.finish_sequences(stopped)
        return outputs

    # ----------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Stops the executor's workers (idempotent; nothing to stop with one rank). The engine
        cannot step afterwards."""
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 -- interpreter teardown
            pass
