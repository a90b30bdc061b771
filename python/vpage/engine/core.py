"""The engine core: numbers in, numbers out. ``step()`` is schedule -> execute -> update.

It owns the C++ scheduler (blocks, sequences, preemption), the executor (the workers and their
KV caches), structured outputs' grammars, the draft model's bookkeeping, the statistics and the
KV-events publisher (the prefix cache's changes, sent after each step). It
takes tokenized requests (``EngineCoreRequest``) and returns, per step, the news of each
request that advanced or ended (``EngineCoreOutput``). It handles no text: detokenizing, stop
strings and ``RequestOutput``s are the front end's (``output_processor``), which tells the core
when a stop string ended a sample (``finish_sequences``). Bad requests raise ValueError and
leave the core untouched; a failed step leaves it consistent (nothing was committed).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import secrets
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from vpage import _core
from vpage.config import CacheConfig, EngineConfig, SchedulerConfig
from vpage.distributed.kv_events import make_publisher, wire_events
from vpage.engine.beam_search import BeamSearch
from vpage.engine.core_io import EngineCoreOutput, EngineCoreRequest
from vpage.engine.core_requests import CoreRequest, CoreSequence
from vpage.engine.metrics import EngineMetrics, EngineStats
from vpage.engine.prompt_logprobs import PromptLogprobs
from vpage.engine.structured_outputs import StructuredOutputs
from vpage.executor.abstract import Executor
from vpage.model_executor.loader.model_loader import load_tokenizer, model_has_tokenizer
from vpage.pooling.pooler import embedding
from vpage.sampler import beam_candidates
from vpage.sampling_params import SamplingParams
from vpage.spec_decode.draft_proposer import DraftModelProposer
from vpage.worker.kv_disk import index_disk_tier, open_disk_tier
from vpage.worker.step_io import DraftRequest, ModelRunnerOutput, SamplingMetadata

logger = logging.getLogger("vpage")

_PREEMPTION = {"auto": _core.PreemptionMode.AUTO, "recompute": _core.PreemptionMode.RECOMPUTE,
               "swap": _core.PreemptionMode.SWAP}
_STOPPED = int(_core.SequenceStatus.FINISHED_STOPPED)
# What a pooling request samples: its prefill's one token (dropped), which ends it.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
_FINISH_REASONS = {
    _STOPPED: "stop",
    int(_core.SequenceStatus.FINISHED_LENGTH): "length",
    int(_core.SequenceStatus.FINISHED_ABORTED): "abort",
    int(_core.SequenceStatus.FINISHED_IGNORED): "length",
}


def blocks_per_sequence(max_model_len: int, cache: CacheConfig, sched: SchedulerConfig) -> int:
    """The most KV blocks one sequence holds: one per block_size tokens of its context, or with a
    sliding window W at most ceil((W - 1 + max_num_batched_tokens) / block_size) + 1 (the blocks
    of its window and of one step; the C++ block manager's bound)."""
    full = math.ceil(max_model_len / cache.block_size)
    if not cache.sliding_window:
        return full
    return min(full, math.ceil((cache.sliding_window - 1 + sched.max_num_batched_tokens) / cache.block_size) + 1)


# (sequence id, token, its request, its logprob, its top logprobs) of one token to commit.
_Commit = tuple[int, int, CoreRequest, float, Optional[list]]


class EngineCore:
    """Schedules, runs and commits steps over tokenized requests."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = Executor.create(config)
        self.model_config = self.executor.model_config
        self.device = self.executor.device
        self.max_model_len = config.scheduler.max_model_len
        cache, sched = config.cache, config.scheduler
        num_gpu_blocks, num_cpu_blocks = self.executor.num_gpu_blocks, self.executor.num_cpu_blocks
        if num_gpu_blocks < blocks_per_sequence(self.max_model_len, cache, sched):
            self.shutdown()
            held = (f"a sequence of max_model_len {self.max_model_len} tokens" if not cache.sliding_window else
                    f"one sequence's window of {cache.sliding_window} and a step of {sched.max_num_batched_tokens}")
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks * cache.block_size} tokens, less than {held}: raise "
                f"{'gpu_memory_utilization' if self.device.type == 'cuda' else 'kv_cache_memory'} or lower max_model_len")
        self.num_gpu_blocks = num_gpu_blocks
        if cache.kv_offloading_size and cache.sliding_window:
            logger.warning("vpage: a sliding-window model keeps its prefix cache on the device: kv_offloading_size "
                           "holds no evicted blocks for it")
        disk = (open_disk_tier(config, self.model_config, self.executor.block_bytes())
                if cache.kv_offloading_disk_path else None)
        spec = config.speculative
        self.scheduler = _core.Scheduler(
            _core.SchedulerConfig(max_num_batched_tokens=sched.max_num_batched_tokens,
                                  max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len,
                                  enable_chunked_prefill=sched.enable_chunked_prefill,
                                  preemption_mode=_PREEMPTION[sched.preemption_mode],
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                  prompt_lookup_min=spec.prompt_lookup_min if spec else 5,
                                  prompt_lookup_max=spec.prompt_lookup_max if spec else 5,
                                  speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else 0,
                                  external_drafts=spec is not None and spec.model is not None,
                                  max_loras=config.lora.max_loras if config.lora is not None else 0),
            _core.BlockManagerConfig(block_size=cache.block_size, num_gpu_blocks=num_gpu_blocks,
                                     num_cpu_blocks=num_cpu_blocks, watermark=cache.watermark,
                                     enable_prefix_caching=cache.enable_prefix_caching,
                                     sliding_window=cache.sliding_window or 0,
                                     enable_kv_cache_events=self._kv_events_wanted(config),
                                     enable_kv_offload=cache.kv_offloading_size > 0,
                                     num_disk_blocks=disk.num_blocks if disk else 0,
                                     prefix_hash_key0=disk.key[0] if disk else 0,
                                     prefix_hash_key1=disk.key[1] if disk else 0))
        if disk is not None:
            index_disk_tier(self.scheduler, disk.directory)
        self.drafter = (DraftModelProposer(cache.block_size, 4 * sched.max_num_seqs)
                        if spec is not None and spec.model is not None else None)
        self.metrics = EngineMetrics()
        try:
            self.kv_events = make_publisher(config.kv_events,  # the prefix cache's changes, per step
                                            config.parallel.data_parallel_rank or 0)
        except ValueError:
            self.shutdown()
            raise
        self._lora_names: dict[int, str] = {}  # adapter id -> name, for the KV events
        # A data-parallel replica hands its KV events to the API process's router too.
        self.reported_kv_events: Optional[list[dict]] = (
            [] if config.parallel.data_parallel_rank is not None and cache.enable_prefix_caching else None)
        self.pooler = config.model.pooler  # runner "pooling": how requests pool (else None)
        self.classifier_token_ids = config.model.classifier_token_ids  # a token classifier's classes
        self.binary_classifier = config.model.binary_classifier
        self.requests: dict[str, CoreRequest] = {}
        self.seq_owner: dict[int, CoreRequest] = {}
        self.unscheduled: dict[str, CoreRequest] = {}  # added, never in a step yet (queue time)
        self.prompt_logprobs = PromptLogprobs()  # requests whose prompt rows need logits
        # Salts this process makes up name its own things (a prompt-logprobs request, an adapter
        # id): the nonce keeps another process's disk tier from ever matching them.
        self._private_salts = itertools.count()
        self._salt_nonce = secrets.token_hex(8)
        # LoRA adapters: unfinished requests per adapter, and adapters removed while some ran
        # (the workers forget them when their last request ends).
        self._lora_users: dict[int, int] = {}
        self._lora_removals: set[int] = set()
        # Grammars need the vocabulary: the tokenizer loaded with the model, or (a server's core,
        # which loads none) one loaded when the first grammar is compiled.
        loaded, model = self.executor.tokenizer, config.model.model
        has_tokenizer = loaded is not None or (config.model.skip_tokenizer_init and model_has_tokenizer(model))
        try:
            self.structured = StructuredOutputs(config.structured_outputs,
                                                lambda: loaded if loaded is not None else load_tokenizer(model),
                                                has_tokenizer, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids, sched.max_num_seqs, self.device)
        except ValueError:  # an unknown reasoning parser
            self.shutdown()
            raise

    @property
    def tokenizer(self) -> Any:
        """The tokenizer loaded with the model (None with ``skip_tokenizer_init``: the core itself
        handles no text)."""
        return self.executor.tokenizer

    # ----------------------------------------------------------------- requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a tokenized request. Raises ValueError for a duplicate id, an empty or too long
        prompt, token ids out of the vocabulary, or parameters the engine cannot serve; the core
        is unchanged then. A request with structured outputs waits until its grammar compiles;
        one whose grammar fails to compile ends without output (``take_request_errors``)."""
        if request.pooling is not None or self.pooler is not None:
            request = self._pooling_request(request)
        params, ids, request_id = request.params, request.prompt_token_ids, request.request_id
        if request_id in self.requests or self.structured.is_pending(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params.verify_token_ids(self.model_config.vocab_size)  # logit_bias, allowed_token_ids, bad_words
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        cache = self.config.cache
        capacity = self.num_gpu_blocks - math.ceil(cache.watermark * self.num_gpu_blocks)
        if blocks_per_sequence(len(ids), cache, self.config.scheduler) > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens; the KV cache holds {capacity * cache.block_size} "
                             "tokens for one request: raise kv_cache_memory")
        if params.structured_outputs is not None:
            self.structured.validate(params)
        lora_id = self._lora_id(request)
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
        cache_salt = request.cache_salt
        if params.prompt_logprobs is not None:
            # Cached prompt tokens get no logits: a salt no other request has keeps this one off
            # others' cached blocks. (Its own blocks may serve its recompute after a preemption;
            # their positions are scored already.)
            cache_salt = f"\x00prompt-logprobs-{self._salt_nonce}-{next(self._private_salts)}"
        if lora_id:  # a prefix computed under one adapter is no hit for another or the base model
            cache_salt = f"{cache_salt or ''}\x00lora-{self._salt_nonce}-{lora_id}"

        def admit(grammar=None) -> None:
            # Drafts are verified by the sampler alone: not for beams or grammar-constrained rows.
            speculate = beam is None and params.structured_outputs is None
            seq_ids = self.scheduler.add_sequence_group(request_id, ids, params.best_of, stop, request.arrival_time,
                                                        cache_salt or "", speculate, lora_id)
            state = CoreRequest(request, seq_ids, self.device, beam)
            if lora_id:
                self._lora_users[lora_id] = self._lora_users.get(lora_id, 0) + 1
            if grammar is not None:
                self.structured.attach(state, grammar)
            self.requests[request_id] = state
            self.unscheduled[request_id] = state
            for seq_id in state.seqs:
                self.seq_owner[seq_id] = state
            self.prompt_logprobs.add(state)

        if params.structured_outputs is None:
            admit()
        else:
            self.structured.submit(request_id, params, admit)

    def _lora_id(self, request: EngineCoreRequest) -> int:
        """The adapter id of ``request`` (0: the base model), its adapter loaded on the workers;
        ValueError when LoRA is off or the adapter cannot serve this model."""
        lora = request.lora_request
        if lora is None:
            return 0
        if self.config.lora is None:
            raise ValueError(f"request {request.request_id!r} asks for LoRA adapter {lora.lora_name!r}; this "
                             "engine was started without enable_lora")
        self.add_lora(lora)
        self._lora_names[lora.lora_int_id] = lora.lora_name
        return lora.lora_int_id

    # ------------------------------------------------------------------ adapters

    def add_lora(self, lora_request: Any) -> bool:
        """Loads a LoRA adapter on the workers (True when read now). ValueError for one that
        cannot serve this model (missing files, a rank above max_lora_rank, another base)."""
        try:
            added = self.executor.add_lora(lora_request)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        self._lora_removals.discard(lora_request.lora_int_id)
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter; requests running under it finish first. False when unknown."""
        if lora_id not in self.executor.list_loras():
            return False
        if self._lora_users.get(lora_id):
            self._lora_removals.add(lora_id)
            return True
        return self.executor.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.executor.list_loras()) - self._lora_removals

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (its KV events say AllBlocksCleared at once); False, with
        nothing changed, while requests hold KV blocks."""
        if not self.scheduler.reset_prefix_cache():
            return False
        self._publish_kv_events()
        return True

    def _pooling_request(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """A pooling request as the core runs it (its prefill samples one token, which ends it);
        ValueError when the engine and the request disagree on pooling."""
        pooling = request.pooling
        if self.pooler is None:
            raise ValueError("this engine generates; pooling requests need an engine started with runner='pooling'")
        if pooling is None:
            raise ValueError("this engine pools (runner='pooling'): it takes pooling requests, not generation")
        pooling.verify()
        tasks = ("embed",) if self.classifier_token_ids is None else (
            ("score", "classify") if self.binary_classifier else ("classify",))
        if pooling.task not in tasks:
            raise ValueError(f"this model's pooling tasks are {list(tasks)}, not {pooling.task!r}")
        hidden = self.model_config.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > hidden:
            raise ValueError(f"dimensions is {pooling.dimensions}; this model's embeddings have {hidden}")
        return dataclasses.replace(request, params=_POOLING_SAMPLING)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Aborts unfinished requests (unknown ids are ignored) and frees their blocks."""
        for request_id in request_ids:
            if self.structured.abort(request_id):
                continue
            state = self.requests.get(request_id)
            if state is not None:
                self.scheduler.abort(request_id)
                self._forget(state)

    def finish_sequences(self, samples: Sequence[tuple[str, int]]) -> None:
        """Ends the (request id, sample index) samples that a stop string ended in the front end:
        their later tokens are dropped, and a request whose samples have all ended is done."""
        for request_id, index in samples:
            state = self.requests.get(request_id)
            seq = state.sample(index) if state is not None else None
            if seq is None or seq.finish_reason is not None:
                continue
            seq.finish("stop")
            seq.delta()  # the front end knows: nothing more to report of it
            if self.scheduler.finish_sequence(seq.seq_id, _core.SequenceStatus.FINISHED_STOPPED):
                self._finish_request(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.structured.pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self.structured.pending)

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests that ended in an error since the last call
        (a grammar that did not compile): they produced no output and are gone."""
        return self.structured.take_errors()

    def get_stats(self) -> EngineStats:
        stats = self.metrics.snapshot(self.scheduler)
        if self.config.lora is None:
            return stats
        running, waiting = set(), set()
        for state in self.requests.values():
            if state.lora_name is not None:
                (waiting if state.request_id in self.unscheduled else running).add(state.lora_name)
        return dataclasses.replace(stats, max_lora=self.config.lora.max_loras,
                                   running_lora_adapters=tuple(sorted(running)),
                                   waiting_lora_adapters=tuple(sorted(waiting)))

    def _forget(self, state: CoreRequest) -> None:
        if self.requests.pop(state.request_id, None) is not None and state.lora_id:
            users = self._lora_users[state.lora_id] - 1
            self._lora_users[state.lora_id] = users
            if users == 0:
                del self._lora_users[state.lora_id]
                if state.lora_id in self._lora_removals:
                    self._lora_removals.discard(state.lora_id)
                    self.executor.remove_lora(state.lora_id)
        self.unscheduled.pop(state.request_id, None)
        for seq_id in state.seqs:
            self.seq_owner.pop(seq_id, None)
        self.prompt_logprobs.forget(state)

    def _finish_request(self, state: CoreRequest) -> None:
        state.finish_all("stop")  # samples that ended have their own reasons already
        self.metrics.on_request_finished(state.arrival_time, state.first_token_time,
                                         max((len(s.output_token_ids) for s in state.seqs.values()), default=0))
        self._forget(state)

    # --------------------------------------------------------------------- step

    def step(self) -> list[EngineCoreOutput]:
        """Schedules one step, executes it (cache operations, forward, sampling) and updates the
        requests from its output; returns the news of the requests that advanced or ended."""
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
            prompt_rows = self.prompt_logprobs.rows(plan)
            sampling = SamplingMetadata([self.seq_owner[s].seqs[s].row for s in seq_ids],
                                        self.structured.bitmask(seq_ids, self.seq_owner),
                                        prompt_rows.scored if prompt_rows is not None else None,
                                        list(range(len(seq_ids))) if self.pooler else None,  # all pool, or none
                                        list(self.classifier_token_ids) if self.classifier_token_ids else None)
        sampled = self.executor.execute(plan, sampling, drafts)
        if self.config.cache.kv_offloading_disk_path:  # reads from the disk tier that finished
            done, failed = self.executor.take_kv_loads(wait_s=0.0 if plan.num_seqs else 0.02)
            if done or failed:
                self.scheduler.complete_kv_loads(done, failed)
        if sampled is not None:
            if prompt_rows is not None:
                self.prompt_logprobs.record(sampled.prompt_logprobs, prompt_rows)
            self.metrics.spec.add_step(sampled.num_drafts, sampled.num_accepted)
        outputs = self.update(plan, seq_ids, sampled, scheduled_at)
        self._publish_kv_events()
        elapsed = time.perf_counter() - start
        self.scheduler.observe_step_time(elapsed)  # what a draft row costs here (speculative decoding)
        self.metrics.on_step(elapsed, plan.num_tokens)
        return outputs

    @staticmethod
    def _kv_events_wanted(config: EngineConfig) -> bool:
        """Whether the scheduler records KV cache events: for a publisher, or for the router of
        a data-parallel server."""
        events = config.kv_events
        published = events is not None and events.enable_kv_cache_events and events.publisher != "null"
        return published or (config.parallel.data_parallel_rank is not None and config.cache.enable_prefix_caching)

    def _publish_kv_events(self) -> None:
        """Hands the scheduler's new KV events to the publisher and the data-parallel router."""
        if self.kv_events is None and self.reported_kv_events is None:
            return
        events = self.scheduler.take_kv_events()
        if not events:
            return
        wire = wire_events(events, self.config.cache.block_size, self._lora_names.get)
        if self.kv_events is not None:
            self.kv_events.publish(wire)
        if self.reported_kv_events is not None:
            self.reported_kv_events.extend(wire)

    def take_reported_kv_events(self) -> list[dict]:
        """The KV events since the last call, for a data-parallel router ([] when not a replica)."""
        if not self.reported_kv_events:
            return []
        events, self.reported_kv_events = self.reported_kv_events, []
        return events

    def update(self, plan: _core.SchedulePlan, seq_ids: list[int], sampled: Optional[ModelRunnerOutput],
               scheduled_at: float) -> list[EngineCoreOutput]:
        """Commits the step's tokens (beams advanced first), applies the stop rules (stop tokens,
        lengths, grammars, beams), finishes requests and returns the news of the requests that
        advanced or ended. ``seq_ids``: the plan's sampled sequences, whose tokens ``sampled``
        holds; ``scheduled_at``: time.monotonic() when the step was scheduled."""
        now = time.monotonic()
        if self.unscheduled and plan.num_seqs:
            self._mark_scheduled(plan, scheduled_at)
        touched: dict[str, CoreRequest] = {}
        finished: dict[str, CoreRequest] = {}
        for request_id, _reason in plan.ignored:
            state = self.requests[request_id]
            state.finish_all("length")
            touched[request_id] = state
            self._forget(state)
        commits: list[_Commit] = []
        if sampled is not None:
            if sampled.pooled is not None:
                self._pool(seq_ids, sampled.pooled)
            commits = self._commits(seq_ids, sampled, touched, finished)
        result = self.scheduler.commit(np.array([c[0] for c in commits], dtype=np.int64),
                                       np.array([c[1] for c in commits], dtype=np.int32))
        statuses = result.statuses.tolist()
        stop_tokens = result.stop_token_ids.tolist()
        for (seq_id, token, owner, logprob, top), status, stop_token in zip(commits, statuses, stop_tokens):
            touched[owner.request_id] = owner
            if owner.first_token_time is None:
                owner.first_token_time = now
            seq = owner.seqs[seq_id]
            if owner.beam is not None:
                seq.output_token_ids.append(token)
                seq.cumulative_logprob = logprob  # beams carry the cumulative value
            elif seq.finish_reason is None and self._apply_token(seq, token, logprob, top, status, stop_token):
                if self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED):
                    finished[owner.request_id] = owner
        for request_id in result.finished_request_ids:
            finished[request_id] = touched[request_id]
        for state in finished.values():
            self._finish_request(state)
        self.metrics.on_generated(len(commits))
        return [state.output() for state in touched.values()]

    def _pool(self, seq_ids: list[int], hidden: torch.Tensor) -> None:
        """Stores the pooled outputs of the requests sampled this step (a pooling engine's requests
        all pool; in plan order): embeddings of their last prompt token's final hidden state, or a
        token classifier's class probabilities (or score) of its next-token logits; the token each
        request samples then ends it."""
        for owner, vector in zip((self.seq_owner[s] for s in seq_ids), hidden):
            pooling = owner.pooling
            if self.classifier_token_ids is not None:  # ``vector``: the class tokens' logits
                activate = pooling.use_activation is not False
                if self.binary_classifier:  # one score: sigmoid(logit of the second - logit of the first)
                    logit = vector[1] - vector[0]
                    owner.pooled = [float(torch.sigmoid(logit) if activate else logit)]
                else:
                    owner.pooled = (torch.softmax(vector, 0) if activate else vector).tolist()
                continue
            normalize = self.pooler.normalize if pooling.normalize is None else pooling.normalize
            owner.pooled = embedding(vector, pooling.dimensions, normalize).tolist()

    def _mark_scheduled(self, plan: _core.SchedulePlan, now: float) -> None:
        """Stamps first_scheduled_time on the requests this step ran for the first time (only
        while some request has never run, so a steady decode batch pays nothing)."""
        for seq_id in plan.seq_ids.tolist():
            state = self.seq_owner.get(seq_id)
            if state is not None and self.unscheduled.pop(state.request_id, None) is not None:
                state.first_scheduled_time = now
                if not self.unscheduled:
                    return

    def _commits(self, seq_ids: list[int], sampled: ModelRunnerOutput, touched: dict[str, CoreRequest],
                 finished: dict[str, CoreRequest]) -> list[_Commit]:
        owners = [self.seq_owner[s] for s in seq_ids]
        for owner in dict.fromkeys(owners):
            if owner.first_token_time is None:  # read before commit may remove the group
                owner.num_cached_tokens = self.scheduler.find_group(owner.request_id).num_cached_prompt_tokens
        tokens, logprobs, top_logprobs = sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        commits = []
        beam_rows: dict[str, list[tuple[int, int]]] = {}
        for i, (seq_id, owner) in enumerate(zip(seq_ids, owners)):
            start, count = sampled.runs[i]
            if owner.beam is not None:  # beams never speculate: one row
                beam_rows.setdefault(owner.request_id, []).append((seq_id, start))
                continue
            for r in range(start, start + count):  # accepted drafts, then the verified token
                commits.append((seq_id, tokens[r], owner, logprobs[r], top_logprobs[r]))
        for request_id, rows in beam_rows.items():
            owner = self.requests[request_id]
            touched[request_id] = owner
            beams = [(seq_id, top_logprobs[r]) for seq_id, r in rows]
            for seq_id, token, cumulative in self._advance_beams(owner, beams, finished):
                commits.append((seq_id, token, owner, cumulative, None))
        return commits

    @staticmethod
    def _apply_token(seq: CoreSequence, token: int, logprob: float, top: Optional[list[tuple[int, float]]],
                     status: int, stop_token: int) -> bool:
        """Records a committed token and the stop rules' verdict on it (the grammar of a
        structured output accepts it). Returns True when the grammar ended (the caller finishes
        the sequence in the scheduler)."""
        seq.append(token, logprob, top)
        grammar_ended = seq.constraint is not None and seq.constraint.accept(token)
        if status in _FINISH_REASONS:
            by_token = status == _STOPPED
            seq.finish(_FINISH_REASONS[status], stop_token if by_token and stop_token >= 0 else None, by_token)
            return False
        if grammar_ended:  # its stop token under ignore_eos, or a token outside the grammar
            seq.finish("stop")
            return True
        return False

    def _advance_beams(self, state: CoreRequest, beams: list[tuple[int, list]],
                       finished: dict[str, CoreRequest]) -> list[tuple[int, int, float]]:
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
            finished[state.request_id] = state
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

    def _tokens_of(self, seq_id: int) -> list[int]:
        """A running sequence's prompt and output tokens."""
        seq = self.seq_owner[seq_id].seqs[seq_id]
        return list(seq.row.prompt_token_ids) + seq.output_token_ids

    # ----------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Stops the executor's workers and the grammar compiler (idempotent). The core cannot
        step afterwards."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
        structured = getattr(self, "structured", None)
        if structured is not None:
            structured.shutdown()
        kv_events = getattr(self, "kv_events", None)
        if kv_events is not None:
            kv_events.shutdown()
