"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vpage import _core, ops
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.beam_search import BeamSearch
from vpage.engine.cache_engine import CacheEngine, bytes_per_block, default_cpu_kv_gib
from vpage.engine.metrics import EngineMetrics, EngineStats
from vpage.engine.model_runner import ModelRunner
from vpage.engine.request_state import RequestState
from vpage.model_executor.loader.model_loader import load_model
from vpage.outputs import RequestOutput
from vpage.sampler import Sampler
from vpage.sampling_params import SamplingParams

logger = logging.getLogger("vpage")

_GIB = 1 << 30
_WATERMARK = 0.01  # fraction of device blocks kept free when admitting prompts
_PREEMPTION = {"auto": _core.PreemptionMode.AUTO, "recompute": _core.PreemptionMode.RECOMPUTE,
               "swap": _core.PreemptionMode.SWAP}

PromptType = Union[str, Sequence[int]]


class LLMEngine:
    """Continuous-batching engine over one model.

    ``add_request`` tokenizes and hands the prompt to the C++ scheduler; ``step`` runs one
    scheduled forward (swap/copy blocks, model, sampler, commit) and returns the outputs
    of the requests that advanced or finished. Bad requests raise ValueError and leave the
    engine untouched; a failed step leaves it consistent (nothing was committed).
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        torch.manual_seed(args.seed)
        if args.num_threads is not None:
            ops.set_num_threads(args.num_threads)
        self.loaded = load_model(args.model, args.dtype, args.device, args.quantization)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.device = self.loaded.device
        self.max_model_len = min(args.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({args.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len})")
        block_bytes = bytes_per_block(self.model_config, args.block_size)
        num_gpu_blocks = self._num_device_blocks(block_bytes)
        num_cpu_blocks = int(args.swap_space * _GIB // block_bytes)
        blocks_per_seq = math.ceil(self.max_model_len / args.block_size)
        if num_gpu_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks * args.block_size} tokens, less than max_model_len "
                f"{self.max_model_len}: raise kv_cache_memory or lower max_model_len")
        self.cache = CacheEngine(self.model_config, args.block_size, num_gpu_blocks, num_cpu_blocks, self.device)
        self.scheduler = _core.Scheduler(
            _core.SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  preemption_mode=_PREEMPTION[args.preemption_mode]),
            _core.BlockManagerConfig(block_size=args.block_size, num_gpu_blocks=num_gpu_blocks,
                                     num_cpu_blocks=num_cpu_blocks, watermark=_WATERMARK,
                                     enable_prefix_caching=args.enable_prefix_caching))
        self.runner = ModelRunner(self.loaded, self.cache.gpu_cache)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, RequestState] = {}
        self.metrics = EngineMetrics()
        logger.info("vpage: %s on %s (%s), KV cache %d blocks x %d tokens (%.1f KiB per block) = %d tokens, "
                    "swap %d blocks, max_model_len %d", self.model_config.architecture, self.device,
                    str(self.model_config.dtype).removeprefix("torch."), num_gpu_blocks, args.block_size,
                    block_bytes / 1024, num_gpu_blocks * args.block_size, num_cpu_blocks, self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _num_device_blocks(self, block_bytes: int) -> int:
        if self.args.kv_cache_memory is not None:
            return int(self.args.kv_cache_memory * _GIB // block_bytes)
        if self.device.type == "cpu":
            return int(default_cpu_kv_gib() * _GIB // block_bytes)
        return self._profile_cuda_blocks(block_bytes)

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after the peak memory of a
        forward at the largest batch (max_num_batched_tokens tokens in one sequence)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        probe = CacheEngine(self.model_config, self.args.block_size, math.ceil(n / self.args.block_size), 0,
                            self.device)
        runner = ModelRunner(self.loaded, probe.gpu_cache)
        bs = self.args.block_size
        dev = self.device
        from vpage.model_executor.forward_batch import ForwardBatch

        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.arange(n, dtype=torch.int64, device=dev),
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            block_tables=torch.arange(math.ceil(n / bs), dtype=torch.int32, device=dev)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_context_len=n, max_query_len=n)
        with torch.inference_mode():
            hidden = runner.model(batch, probe.gpu_cache)
            runner.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del probe, runner, hidden
        total = torch.cuda.get_device_properties(dev).total_memory
        free_for_kv = total * self.args.gpu_memory_utilization - peak
        return max(int(free_for_kv // block_bytes), 0)

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
        or parameters the engine cannot serve; the engine is unchanged then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        capacity = self.cache.num_gpu_blocks - math.ceil(_WATERMARK * self.cache.num_gpu_blocks)
        if math.ceil(len(ids) / self.args.block_size) > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens; the KV cache holds {capacity * self.args.block_size} "
                             "tokens for one request: raise kv_cache_memory")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        eos = [] if params.ignore_eos else self.model_config.eos_token_ids
        beam = None
        if params.use_beam_search:  # beams end in Python (BeamSearch); C++ only caps the length
            beam = BeamSearch(params.best_of, params.length_penalty, params.early_stopping, max_tokens, eos,
                              self.sampler.beam_candidates(params.best_of))
        stop = _core.StopConditions(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
                                    eos_token_ids=self.model_config.eos_token_ids,
                                    stop_token_ids=params.stop_token_ids,
                                    ignore_eos=params.ignore_eos or beam is not None)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq_ids = self.scheduler.add_sequence_group(request_id, ids, params.best_of, stop, arrival,
                                                    cache_salt or "")
        state = RequestState(request_id, text, ids, params, seq_ids, self.tokenizer, self.device, arrival, beam)
        self.requests[request_id] = state
        for seq_id in seq_ids:
            self.seq_owner[seq_id] = state

    def abort_request(self, request_id: Union[str, Sequence[str]]) -> None:
        """Aborts unfinished requests (unknown ids are ignored) and frees their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            state = self.requests.get(rid)
            if state is None:
                continue
            self.scheduler.abort(rid)
            state.finish_all("abort")
            self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> EngineStats:
        return self.metrics.snapshot(self.scheduler)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for seq_id in state.seqs:
            self.seq_owner.pop(seq_id, None)

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of requests that advanced or finished."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        for request_id, reason in plan.ignored:
            logger.warning("vpage: request %s ignored: %s", request_id, reason)
            state = self.requests[request_id]
            state.finish_all("length")
            touched[request_id] = state
            self._forget(state)
        self.cache.swap_out(plan.blocks_to_swap_out)
        self.cache.swap_in(plan.blocks_to_swap_in)
        self.cache.copy(plan.blocks_to_copy)
        # What to commit: (sequence, token) pairs and, per pair, (owner, logprob, top logprobs).
        commit_ids: list[int] = []
        commit_tokens: list[int] = []
        commit_info: list[tuple[RequestState, float, Optional[list]]] = []
        finished_ids: set[str] = set()
        if plan.num_seqs:
            logits = self.runner.execute(plan)
            seq_ids = plan.sample_seq_ids.tolist()
            owners = [self.seq_owner[s] for s in seq_ids]
            for owner in owners:
                if owner.metrics.first_token_time is None:  # before commit may remove the group
                    owner.num_cached_tokens = self.scheduler.find_group(owner.request_id).num_cached_prompt_tokens
            sampled = self.sampler.sample(logits, [owner.seqs[s].row for owner, s in zip(owners, seq_ids)])
            tokens = sampled.token_ids.tolist()
            logprobs = sampled.logprobs.tolist()
            beam_rows: dict[str, list[int]] = {}
            for i, (seq_id, owner) in enumerate(zip(seq_ids, owners)):
                if owner.beam is not None:
                    beam_rows.setdefault(owner.request_id, []).append(i)
                    continue
                commit_ids.append(seq_id)
                commit_tokens.append(tokens[i])
                commit_info.append((owner, logprobs[i], sampled.top_logprobs[i]))
            for request_id, rows in beam_rows.items():
                owner = self.requests[request_id]
                touched[request_id] = owner
                beams = [(seq_ids[i], sampled.top_logprobs[i]) for i in rows]
                for seq_id, token, cumulative in self._advance_beams(owner, beams, finished_ids):
                    commit_ids.append(seq_id)
                    commit_tokens.append(token)
                    commit_info.append((owner, cumulative, None))
        result = self.scheduler.commit(np.array(commit_ids, dtype=np.int64), np.array(commit_tokens, dtype=np.int32))
        now = time.monotonic()
        finished_ids.update(result.finished_request_ids)
        for i, (seq_id, (owner, logprob, top)) in enumerate(zip(commit_ids, commit_info)):
            seq = owner.seqs[seq_id]
            touched[owner.request_id] = owner
            if owner.metrics.first_token_time is None:
                owner.metrics.first_token_time = now
            if owner.beam is not None:
                seq.add_beam_token(commit_tokens[i], logprob)
                continue
            if seq.finish_reason is not None:
                continue
            stop_string = seq.add_token(commit_tokens[i], logprob, top, int(result.statuses[i]))
            if stop_string and self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED):
                finished_ids.add(owner.request_id)
        for request_id in finished_ids:
            state = touched[request_id]
            state.finish_all("stop")  # every sequence already has its own reason
            self.metrics.on_request_finished(state.metrics.arrival_time, state.metrics.first_token_time,
                                             max((len(s.output_token_ids) for s in state.seqs.values()), default=0))
            self._forget(state)
        self.metrics.on_step(time.perf_counter() - start, len(commit_ids))
        return [state.output() for state in touched.values()]

    def _advance_beams(self, state: RequestState, beams: list[tuple[int, list]],
                       finished_ids: set[str]) -> list[tuple[int, int, float]]:
        """One beam-search step of `state` (its running beams and their top candidates):
        forks sequences whose beam continues several ways, frees the beams that lost, and
        returns the (sequence, token, cumulative logprob) pairs to commit. When the search is
        done, every beam is finished and nothing is committed."""
        search = state.beam
        running, done = search.advance(
            [(state.seqs[s].output_token_ids, state.seqs[s].cumulative_logprob, top) for s, top in beams],
            first_step=search.num_generated == 0)
        if done:
            for seq_id in list(state.seqs):
                if self.scheduler.find_sequence(seq_id) is not None:
                    self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED)
            finished_ids.add(state.request_id)
            return []
        used: set[int] = set()
        commits = []
        for c in running:
            target = parent = beams[c.parent][0]
            if parent in used:
                target = self.scheduler.fork_sequence(parent)
                state.fork(parent, target)
                self.seq_owner[target] = state
            used.add(parent)
            commits.append((target, c.token, c.cumulative_logprob))
        for seq_id, _ in beams:
            if seq_id not in used:
                self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED)
                state.drop(seq_id)
                self.seq_owner.pop(seq_id, None)
        return commits
