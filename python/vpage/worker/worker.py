"""One rank's share of the model: its shard of the weights, its heads' slice of the KV cache
(device and swap pools, the same block ids on every rank), and the step it runs.

The executor creates the workers: in its own process for one rank (and for rank 0 of a
tensor-parallel group, the driver, which is handed each plan), in worker processes or Ray
actors for the other ranks, which loop on ``receive_step``. A worker reads only the resolved
``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Optional

import psutil
import torch

from vpage import ops
from vpage.config import EngineConfig
from vpage.distributed import parallel_state as ps
from vpage.distributed.step_message import LoraUpdate, StepReceiver
from vpage.model_executor.config import ModelConfig
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.layers.quant_linear import repack_quantized_weights
from vpage.model_executor.layers.parallel_linear import local_kv_heads
from vpage.model_executor.loader.model_loader import LoadedModel, load_model
from vpage.lora.manager import LoRAManager
from vpage.lora.request import LoRARequest
from vpage.worker.cache_engine import CacheEngine, bytes_per_block, default_cpu_kv_gib, resolve_kv_cache_dtype
from vpage.spec_decode.draft_runner import DraftRunner, shares_target_kv
from vpage.worker.cuda_graphs import DecodeGraphs
from vpage.worker.graph_buckets import MAX_GRAPH_CONTEXT, graph_batch_sizes
from vpage.worker.input_staging import StepInputs
from vpage.worker.kv_disk import DiskTierFiles, kv_tier_directory
from vpage.worker.model_runner import ModelRunner
from vpage.worker.pipeline import PipelineStage
from vpage.worker.step_io import DraftRequest, ModelRunnerOutput, SamplingMetadata

logger = logging.getLogger("vpage")
_GIB = 1 << 30


class Worker:
    """Loads this rank's shard (after ``parallel_state`` is set up), sizes and owns its KV
    cache, and runs steps: ``determine_num_blocks``, then ``init_cache``, then ``execute``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tp_size = ps.tp_size()  # fixed at construction, like the layers' shards
        self.world_size = config.parallel.world_size
        m = config.model
        self.loaded: LoadedModel = load_model(m.model, m.dtype, m.device, m.quantization,
                                              with_tokenizer=not m.skip_tokenizer_init, pooling=m.pooler is not None)
        self.device = self.loaded.device
        spec = config.speculative
        # Speculative decoding's draft model: its own dtype (a GGUF draft stays quantized), whole
        # on the driver rank only (drafting is the driver's alone; the other ranks verify).
        self.draft: Optional[LoadedModel] = None
        if spec is not None and spec.model is not None and ps.tp_rank() == 0:
            with ps.single_rank():
                self.draft = load_model(spec.model, "auto", m.device, "auto")
            check_same_vocabulary(self.loaded, self.draft)
        if self.device.type == "cpu":
            for loaded in (self.loaded, self.draft):
                if loaded is not None:
                    pack_dense_weights(loaded.model)
                    repack_quantized_weights(loaded.model)
        # LoRA adapters attach to the packed (or quantized) projections.
        self.lora: Optional[LoRAManager] = None
        if config.lora is not None:
            self.lora = LoRAManager(self.loaded.model, self.loaded.hf_config, config.lora, self.loaded.config.dtype,
                                    self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.loaded.config.dtype,
                                                     self.device)
        # A draft that is the target in another form reads the target's KV cache (draft_runner.py).
        self.draft_shares_kv = self.draft is not None and shares_target_kv(self.loaded, self.draft, self.tp_size,
                                                                           self.kv_cache_dtype)
        self._non_torch_baseline = 0  # CUDA memory outside torch's allocator after loading
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._non_torch_baseline = total - free - torch.cuda.memory_reserved(self.device)
        self.cache_engine: Optional[CacheEngine] = None
        self.model_runner: Optional[ModelRunner] = None
        self.draft_cache: Optional[CacheEngine] = None  # the draft's own KV, in the same block ids
        self.kv_disk: Optional[DiskTierFiles] = None  # the KV cache's disk tier (kv_offloading_disk_path)
        self.draft_runner: Optional[DraftRunner] = None
        self.profile: Optional[dict] = None  # CUDA memory profile (GiB), set by determine_num_blocks

    @property
    def cache_config(self) -> ModelConfig:
        """The model config with this rank's head counts and its stage's layers (what its KV
        cache holds)."""
        c = self.loaded.config
        size = self.tp_size
        num_layers = sum(end - start for start, end in ps.stage_layers(c.num_layers))
        return dataclasses.replace(c, num_layers=num_layers, num_heads=c.num_heads // size,
                                   num_kv_heads=local_kv_heads(c.num_kv_heads, size), kv_cache_dtype=self.kv_cache_dtype)

    @property
    def draft_cache_config(self) -> Optional[ModelConfig]:
        """The config of the draft model's own KV cache (its activations' dtype), or None
        (no draft, or one that shares the target's cache)."""
        if self.draft is None or self.draft_shares_kv:
            return None
        return dataclasses.replace(self.draft.config, kv_cache_dtype=self.draft.config.dtype)

    def block_bytes(self) -> int:
        """Bytes of one KV block of this rank (all layers, keys and values; on the driver the
        draft model's too)."""
        bs = self.config.cache.block_size
        draft = self.draft_cache_config
        return bytes_per_block(self.cache_config, bs) + (bytes_per_block(draft, bs) if draft is not None else 0)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, swap blocks) of this rank's budget; the smallest rank decides."""
        cache = self.config.cache
        block_bytes = self.block_bytes()
        host_pool_gib = cache.swap_space + cache.kv_offloading_size  # one pool: swap and the CPU tier
        host_gib = host_pool_gib + (cache.kv_cache_memory or 0.0) * (self.device.type == "cpu")
        total_gib = psutil.virtual_memory().total / _GIB
        if host_gib > total_gib:
            raise ValueError(f"kv_cache_memory, swap_space and kv_offloading_size ask for {host_gib:.1f} GiB of host "
                             f"memory, more than this machine's {total_gib:.1f} GiB")
        if cache.kv_cache_memory is not None:
            gpu = int(cache.kv_cache_memory * _GIB // block_bytes)
        elif self.device.type == "cpu":  # the ranks share this machine's memory
            gpu = int(default_cpu_kv_gib() / self.world_size * _GIB // block_bytes)
        else:
            gpu = self._profile_cuda_blocks(block_bytes)
        cpu = int(host_pool_gib * _GIB // block_bytes)
        gpu, cpu = ps.all_reduce_min(gpu), ps.all_reduce_min(cpu)  # (every rank's, under parallelism)
        if gpu <= 0 and self.profile is not None:  # after the reduction: every rank raises alike
            p = self.profile
            raise ValueError(
                f"no GPU memory left for the KV cache on {self.device}: the model and a forward of "
                f"max_num_batched_tokens={self.config.scheduler.max_num_batched_tokens} tokens peak at "
                f"{p['peak_gib']:.2f} GiB, and gpu_memory_utilization={cache.gpu_memory_utilization} allows "
                f"{cache.gpu_memory_utilization * p['total_gib']:.2f} of {p['total_gib']:.2f} GiB. Raise "
                "gpu_memory_utilization, lower max_num_batched_tokens or max_model_len, use a smaller dtype, "
                "or split the model with tensor_parallel_size > 1")
        return gpu, cpu

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the KV cache; on CUDA also the input staging buffers and, unless
        ``enforce_eager`` (or under tensor parallelism), the decode graphs."""
        block_size = self.config.cache.block_size
        self._init_target_cache(num_gpu_blocks, num_cpu_blocks)
        if self.draft is not None:
            if not self.draft_shares_kv:
                self.draft_cache = CacheEngine(self.draft_cache_config, block_size, num_gpu_blocks, num_cpu_blocks,
                                               self.device)
            self.draft_runner = DraftRunner(self.draft, (self.draft_cache or self.cache_engine).gpu_cache, block_size)
        disk_path = self.config.cache.kv_offloading_disk_path
        if disk_path is not None:
            if self.draft_cache is not None:
                raise ValueError("the KV disk tier does not keep a draft model's own KV cache: use a draft that "
                                 "shares the target's cache, or no kv_offloading_disk_path")
            self.kv_disk = DiskTierFiles(os.path.join(kv_tier_directory(self.config, self.loaded.config), "rank0"),
                                         self.cache_engine.cpu_cache)

    def _init_target_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        block_size = self.config.cache.block_size
        pipeline = None
        if ps.pp_size() > 1:
            c = self.loaded.config
            pipeline = PipelineStage(self.loaded.model, c.hidden_size, c.dtype, c.vocab_size, self.device,
                                     self.config.parallel.pipeline_microbatches)
        if self.device.type != "cuda":
            self.cache_engine = CacheEngine(self.cache_config, block_size, num_gpu_blocks, num_cpu_blocks, self.device)
            self.model_runner = ModelRunner(self.loaded, self.cache_engine.gpu_cache, lora=self.lora, pipeline=pipeline)
            return
        sched = self.config.scheduler
        # A captured graph cannot follow a step's adapter rows: with LoRA, decode runs eager.
        use_graphs = not self.config.enforce_eager and self.world_size == 1 and self.lora is None
        self.cache_engine = CacheEngine(self.cache_config, block_size, num_gpu_blocks, num_cpu_blocks, self.device,
                                        scratch_blocks=1 if use_graphs else 0)
        max_blocks = math.ceil(sched.max_model_len / block_size)
        staging = StepInputs(self.device, sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks, pin=True)
        graphs = None
        if use_graphs:
            graphs = DecodeGraphs(self.loaded.model, self.cache_engine.gpu_cache, self.device,
                                  graph_batch_sizes(min(sched.max_num_seqs, sched.max_num_batched_tokens)),
                                  min(sched.max_model_len, MAX_GRAPH_CONTEXT), block_size,
                                  self.cache_engine.scratch_block)
        self.model_runner = ModelRunner(self.loaded, self.cache_engine.gpu_cache, staging, graphs, self.lora, pipeline)

    def add_lora(self, request: LoRARequest) -> bool:
        """Loads an adapter (``LoRAManager.add_adapter``); ValueError without enable_lora."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return self.lora.add_adapter(request)

    def remove_lora(self, adapter_id: int) -> bool:
        return self.lora is not None and self.lora.remove_adapter(adapter_id)

    def list_loras(self) -> list[int]:
        return [] if self.lora is None else self.lora.list_adapters()

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization of the device's memory after this
        process's peak without them: torch's peak (weights, and the activations of a forward at
        the largest batch: max_num_batched_tokens tokens in one sequence, the logits of up to
        max_num_seqs rows and their softmax) plus what the CUDA memory outside torch's
        allocator grew by since the model was loaded (cuBLAS workspaces...). At most what is
        free on the device now. 0 when nothing is left (``determine_num_blocks`` raises)."""
        sched, dev = self.config.scheduler, self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        n = min(sched.max_num_batched_tokens, sched.max_model_len)
        bs = self.config.cache.block_size
        probe = CacheEngine(self.cache_config, bs, math.ceil(n / bs), 0, dev)
        runner = ModelRunner(self.loaded, probe.gpu_cache)
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.arange(n, dtype=torch.int64, device=dev),
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            block_tables=torch.arange(math.ceil(n / bs), dtype=torch.int32, device=dev)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_context_len=n, max_query_len=n)
        c = self.loaded.config
        intermediate = None if ps.is_first_stage() else torch.zeros(2, n, c.hidden_size, dtype=c.dtype, device=dev)
        logits = None
        with torch.inference_mode():
            hidden = runner.model(batch, probe.gpu_cache, intermediate)  # a pipeline stage: its layers
            if ps.is_last_stage():
                logits = runner.model.compute_logits(hidden[-min(sched.max_num_seqs, n):])
                if logits is not None:  # (None on other tensor ranks)
                    logits.softmax(dim=-1)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev) - self._non_torch_baseline)
        del probe, runner, batch, hidden, logits, intermediate
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(dev)
        budget = total * self.config.cache.gpu_memory_utilization - peak - non_torch
        self.profile = dict(peak_gib=(peak + non_torch) / _GIB, budget_gib=budget / _GIB, total_gib=total / _GIB)
        blocks = max(int(budget // block_bytes), 0)
        if blocks * block_bytes > free:
            logger.warning("vpage: only %.2f GiB free on %s (other processes?): the KV cache gets %d blocks, not %d",
                           free / _GIB, dev, free // block_bytes, blocks)
            blocks = int(free // block_bytes)
        return blocks

    def close(self) -> None:
        """Finishes this worker's queued disk writes (idempotent)."""
        if self.kv_disk is not None:
            self.kv_disk.close()

    def take_kv_loads(self, wait_s: float = 0.0) -> tuple[list, list]:
        """The disk tier's loads (``KvBlockLoad``) that finished since the last call: (read,
        failed); ``wait_s``: how long to wait for all of them."""
        if self.kv_disk is None:
            return [], []
        return self.kv_disk.take_loads(wait_s)

    def execute(self, plan, sampling: Optional[SamplingMetadata],
                drafts: Optional[DraftRequest] = None) -> Optional[ModelRunnerOutput]:
        """One step on this rank alone: ``prepare``, then ``run``."""
        self.prepare(plan, drafts)
        return self.run(plan, sampling)

    def prepare(self, plan, drafts: Optional[DraftRequest] = None) -> None:
        """A step's first part: its block moves (swap out, swap in, copy: in that order); then,
        with ``drafts`` (the driver), the draft model's proposals, written into the plan."""
        if self.kv_disk is not None and (plan.kv_saves or plan.kv_loads or plan.kv_deletes):
            self.cache_engine.synchronize_swaps()  # the files move CPU blocks that queued swaps use
            self.kv_disk.apply(plan)
        for cache in (self.cache_engine, self.draft_cache):
            if cache is not None:
                cache.swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
                cache.copy(plan.blocks_to_copy)
        if self.draft_cache is not None:
            self.draft_cache.wait_for_swaps()  # the draft's forwards do not wait per layer
        if drafts is None:
            return
        inputs = drafts.inputs
        if self.draft_shares_kv:
            self.cache_engine.wait_for_swaps()
            inputs = inputs.from_row_starts()
        with ps.single_rank():  # the unsharded draft's collectives are no-ops
            drafts.fill(self.draft_runner.propose(inputs))

    def run(self, plan, sampling: Optional[SamplingMetadata]) -> Optional[ModelRunnerOutput]:
        """A prepared step's forward and, on the driver, its sampling; None without rows.
        On CUDA the swaps overlap the forward: layer i waits only for layer i's swaps."""
        cache = self.cache_engine
        if not plan.num_seqs:
            cache.wait_for_swaps()  # later writes to swapped-out blocks come after the copies
            return None
        return self.model_runner.execute(plan, sampling, cache.take_layer_events())

    def serve_steps(self) -> None:
        """A non-driver rank: runs the driver's steps until it sends shutdown (the forward and
        the logits of the same rows as the driver's, which the vocabulary-parallel head gathers)."""
        receiver = StepReceiver(self.device if self.device.type == "cuda" else torch.device("cpu"),
                                self.config.cache.block_size)
        while True:
            step = receiver.receive()
            if step is None:
                return
            if isinstance(step, LoraUpdate):  # the driver loaded it first: the files are sound
                if step.add is not None:
                    self.add_lora(step.add)
                else:
                    self.remove_lora(step.remove)
                continue
            self.prepare(step)
            if not step.num_seqs:
                self.cache_engine.wait_for_swaps()
                continue
            self.model_runner.logits(step, self.cache_engine.take_layer_events(), step.logit_rows)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raises ValueError unless the draft model proposes tokens of the target's vocabulary."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the target's "
                         f"{target.config.vocab_size}: speculative decoding needs the same tokenizer")
    if draft.tokenizer is None or target.tokenizer is None:
        return
    draft_vocab = draft.tokenizer.get_vocab()
    differ = [t for t, i in target.tokenizer.get_vocab().items() if draft_vocab.get(t) != i]
    if differ:
        raise ValueError(f"the draft model's tokenizer gives {len(differ)} of the target's tokens other ids (e.g. "
                         f"{differ[0]!r}): speculative decoding needs the same tokenizer")


def init_worker(config: EngineConfig, rank: int, init_method: str, backend: str, timeout_s: float) -> Worker:
    """Joins the model-parallel group as global ``rank``, sets threads (and the CUDA device),
    and loads the shard (of its pipeline stage)."""
    threads = config.parallel.rank_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    ops.set_num_threads(threads)
    if backend == "nccl":
        local = int(os.environ.get("VPAGE_LOCAL_RANK", rank))
        torch.cuda.set_device(local if torch.cuda.device_count() > local else 0)
    parallel = config.parallel
    ps.init_tensor_parallel(rank, parallel.tensor_parallel_size, init_method, backend, timeout_s,
                            parallel.pipeline_layers, parallel.pipeline_parallel_size)
    torch.manual_seed(config.model.seed)
    return Worker(config)
