"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Optional, Sequence, Union

import torch

from vpage import _core
from vpage.config import CacheConfig, EngineConfig, SchedulerConfig
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.beam_search import BeamSearch
from vpage.engine.metrics import EngineMetrics, EngineStats
from vpage.engine.output_processor import OutputProcessor
from vpage.engine.request_state import RequestState
from vpage.engine.structured_outputs import StructuredOutputs
from vpage.executor.abstract import Executor
from vpage.outputs import RequestOutput
from vpage.sampler import beam_candidates
from vpage.sampling_params import SamplingParams
from vpage.spec_decode.draft_proposer import DraftModelProposer
from vpage.worker.step_io import DraftRequest, SamplingMetadata

logger = logging.getLogger("vpage")

_PREEMPTION = {"auto": _core.PreemptionMode.AUTO, "recompute": _core.PreemptionMode.RECOMPUTE,
               "swap": _core.PreemptionMode.SWAP}

PromptType = Union[str, Sequence[int]]


def blocks_per_sequence(max_model_len: int, cache: CacheConfig, sched: SchedulerConfig) -> int:
    """The most KV blocks one sequence holds: one per block_size tokens of its context, or with a
    sliding window W at most ceil((W - 1 + max_num_batched_tokens) / block_size) + 1 (the blocks
    of its window and of one step; the C++ block manager's bound)."""
    full = math.ceil(max_model_len / cache.block_size)
    if not cache.sliding_window:
        return full
    return min(full, math.ceil((cache.sliding_window - 1 + sched.max_num_batched_tokens) / cache.block_size) + 1)


class LLMEngine:
    """Continuous-batching engine over one model.

    ``add_request`` tokenizes and hands the prompt to the C++ scheduler; ``step`` runs one
    scheduled forward through the executor (swap/copy blocks, model), samples, commits and
    returns the outputs of the requests that advanced or finished, each in the shape its
    ``SamplingParams.output_kind`` asks for. Bad requests raise ValueError and leave the
    engine untouched; a failed step leaves it consistent (nothing was committed).
    """

    def __init__(self, args: EngineArgs):
        self.config: EngineConfig = args.create_engine_config()
        torch.manual_seed(args.seed)
        self.executor = Executor.create(self.config)
        self.model_config = self.executor.model_config
        self.tokenizer = self.executor.tokenizer
        self.device = self.executor.device
        self.max_model_len = self.config.scheduler.max_model_len
        cache, sched = self.config.cache, self.config.scheduler
        num_gpu_blocks, num_cpu_blocks = self.executor.num_gpu_blocks, self.executor.num_cpu_blocks
        if num_gpu_blocks < blocks_per_sequence(self.max_model_len, cache, sched):
            self.shutdown()
            held = (f"a sequence of max_model_len {self.max_model_len} tokens" if not cache.sliding_window else
                    f"one sequence's window of {cache.sliding_window} and a step of {sched.max_num_batched_tokens}")
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks * cache.block_size} tokens, less than {held}: raise "
                f"{'gpu_memory_utilization' if self.device.type == 'cuda' else 'kv_cache_memory'} or lower max_model_len")
        self.num_gpu_blocks = num_gpu_blocks
        spec = self.config.speculative
        self.scheduler = _core.Scheduler(
            _core.SchedulerConfig(max_num_batched_tokens=sched.max_num_batched_tokens,
                                  max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len,
                                  enable_chunked_prefill=sched.enable_chunked_prefill,
                                  preemption_mode=_PREEMPTION[sched.preemption_mode],
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                  prompt_lookup_min=spec.prompt_lookup_min if spec else 5,
                                  prompt_lookup_max=spec.prompt_lookup_max if spec else 5,
                                  speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else 0,
                                  external_drafts=spec is not None and spec.model is not None),
            _core.BlockManagerConfig(block_size=cache.block_size, num_gpu_blocks=num_gpu_blocks,
                                     num_cpu_blocks=num_cpu_blocks, watermark=cache.watermark,
                                     enable_prefix_caching=cache.enable_prefix_caching,
                                     sliding_window=cache.sliding_window or 0))
        self.drafter = (DraftModelProposer(cache.block_size, 4 * sched.max_num_seqs)
                        if spec is not None and spec.model is not None else None)
        self.metrics = EngineMetrics()
        self.outputs = OutputProcessor(self.scheduler, self.metrics)
        self._private_salts = itertools.count()
        try:
            self.structured = StructuredOutputs(self.config.structured_outputs, self.tokenizer,
                                                self.model_config.vocab_size, self.model_config.eos_token_ids,
                                                sched.max_num_seqs, self.device)
        except ValueError:  # an unknown reasoning parser
            self.shutdown()
            raise
        logger.info("vpage: %s on %s (%s), KV cache %d blocks x %d tokens (%.1f KiB per block) = %d tokens, "
                    "swap %d blocks, max_model_len %d", self.model_config.architecture, self.device,
                    str(self.model_config.dtype).removeprefix("torch."), num_gpu_blocks, cache.block_size,
                    self.executor.block_bytes() / 1024, num_gpu_blocks * cache.block_size, num_cpu_blocks,
                    self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----------------------------------------------------------------- requests

    def _prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return None, ids

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None) -> None:
        """Queues a request. Raises ValueError for a duplicate id, an empty or too long prompt,
        or parameters the engine cannot serve; the engine is unchanged then. A request with
        structured outputs waits in the engine until its grammar compiles; one whose grammar
        fails to compile then ends without output (``take_request_errors``)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.outputs.requests or self.structured.is_pending(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; this model has none")
            params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.model_config.vocab_size)  # logit_bias, allowed_token_ids, bad_words
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        block_size = self.config.cache.block_size
        capacity = self.num_gpu_blocks - math.ceil(self.config.cache.watermark * self.num_gpu_blocks)
        if blocks_per_sequence(len(ids), self.config.cache, self.config.scheduler) > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens; the KV cache holds {capacity * block_size} "
                             "tokens for one request: raise kv_cache_memory")
        if params.structured_outputs is not None:
            self.structured.validate(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        eos = [] if params.ignore_eos else self.model_config.eos_token_ids
        beam = None
        if params.use_beam_search:  # beams end in Python (BeamSearch); C++ only caps the length
            beam = BeamSearch(params.best_of, params.length_penalty, params.early_stopping, max_tokens, eos,
                              beam_candidates(params.best_of, self.model_config.eos_token_ids))
        stop = _core.StopConditions(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
                                    eos_token_ids=self.model_config.eos_token_ids,
                                    stop_token_ids=params.stop_token_ids,
                                    ignore_eos=params.ignore_eos or beam is not None)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.prompt_logprobs is not None:
            # Cached prompt tokens get no logits: a salt no other request has keeps this one off
            # others' cached blocks. (Its own blocks may serve its recompute after a preemption;
            # their positions are scored already.)
            cache_salt = f"\x00prompt-logprobs-{next(self._private_salts)}"

        def admit(grammar=None) -> None:
            # Drafts are verified by the sampler alone: not for beams or grammar-constrained rows.
            speculate = beam is None and params.structured_outputs is None
            seq_ids = self.scheduler.add_sequence_group(request_id, ids, params.best_of, stop, arrival,
                                                        cache_salt or "", speculate)
            state = RequestState(request_id, text, ids, params, seq_ids, self.tokenizer, self.device, arrival, beam)
            if grammar is not None:
                self.structured.attach(state, grammar)
            self.outputs.add(state)

        if params.structured_outputs is None:
            admit()
        else:
            self.structured.submit(request_id, params, admit)

    def abort_request(self, request_id: Union[str, Sequence[str]]) -> None:
        """Aborts unfinished requests (unknown ids are ignored) and frees their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if not self.structured.abort(rid):
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
        return bool(self.outputs.requests) or bool(self.structured.pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.requests) + len(self.structured.pending)

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests that ended in an error since the last call
        (a grammar that did not compile): they produced no output and are gone."""
        return self.structured.take_errors()

    def get_stats(self) -> EngineStats:
        """The engine's statistics, computed now (not kept up to date every step)."""
        return self.metrics.snapshot(self.scheduler)

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step: schedule, execute (cache operations, forward, sampling, in the
        executor), then update (commit, stop rules, outputs); returns the outputs of requests
        that advanced or finished."""
        start, scheduled_at = time.perf_counter(), time.monotonic()
        if self.structured.pending:  # nothing else to run: wait a little for a grammar
            self.structured.admit_ready(wait=not self.scheduler.has_unfinished())
        plan = self.scheduler.schedule()
        for request_id, reason in plan.ignored:
            logger.warning("vpage: request %s ignored: %s", request_id, reason)
        drafts = None
        if self.drafter is not None:
            self.drafter.observe(plan)
            if plan.num_draft_tokens:
                drafts = DraftRequest(self.drafter.inputs(plan, self._tokens_of), self.scheduler.fill_drafts)
        seq_ids: list[int] = []
        sampling = prompt_rows = None
        if plan.num_seqs:
            seq_ids = plan.sample_seq_ids.tolist()
            prompt_rows = self.outputs.prompt_logprobs.rows(plan)
            sampling = SamplingMetadata(self.outputs.sampling_rows(seq_ids),
                                        self.structured.bitmask(seq_ids, self.outputs.seq_owner),
                                        prompt_rows.scored if prompt_rows is not None else None)
        sampled = self.executor.execute(plan, sampling, drafts)
        if sampled is not None:
            if prompt_rows is not None:
                self.outputs.prompt_logprobs.record(sampled.prompt_logprobs, prompt_rows)
            self.metrics.spec.add_step(sampled.num_drafts, sampled.num_accepted)
        outputs = self.outputs.process(plan, seq_ids, sampled, scheduled_at)
        elapsed = time.perf_counter() - start
        self.scheduler.observe_step_time(elapsed)  # what a draft row costs here (speculative decoding)
        self.metrics.on_step(elapsed, plan.num_tokens)
        return outputs

    def _tokens_of(self, seq_id: int) -> list[int]:
        """A running sequence's prompt and output tokens."""
        seq = self.outputs.seq_owner[seq_id].seqs[seq_id]
        return list(seq.row.prompt_token_ids) + seq.output_token_ids

    # ----------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Stops the executor's workers (idempotent; nothing to stop with one rank). The engine
        cannot step afterwards."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
        structured = getattr(self, "structured", None)
        if structured is not None:
            structured.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 -- interpreter teardown
            pass
