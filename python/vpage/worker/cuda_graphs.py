"""Decode steps as captured CUDA graphs: one graph per batch-size bucket, all sharing one
memory pool, replayed after the step's inputs are copied into their static buffers.

Invariants: the static input buffers are allocated once, before capture, and every graph
reads a prefix of them; a graph's output tensor is read (by the logits) before any other
graph is replayed, because graphs of one pool may reuse each other's intermediate memory.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from vpage import ops
from vpage.worker.graph_buckets import fill_padded_decode, graph_batch_for
from vpage.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger("vpage")

_WARMUP_RUNS = 2  # eager runs on a side stream before each capture (lazy initialisations)


class DecodeGraphs:
    """Captures ``model`` over ``kv_caches`` for every batch size in ``sizes`` (ascending),
    with contexts up to ``max_context_len``; padding rows read ``scratch_block`` (zeroed, owned
    by no sequence) and write nothing."""

    def __init__(self, model, kv_caches, device: torch.device, sizes: list[int], max_context_len: int,
                 block_size: int, scratch_block: int):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = sizes
        self.max_context_len = max_context_len
        self.max_blocks = math.ceil(max_context_len / block_size)
        self.scratch_block = scratch_block
        rows = sizes[-1]
        shapes = {"input_ids": ((rows,), torch.int64), "positions": ((rows,), torch.int64),
                  "slot_mapping": ((rows,), torch.int64), "context_lens": ((rows,), torch.int32),
                  "block_tables": ((rows, self.max_blocks), torch.int32)}
        self.host = {name: torch.zeros(shape, dtype=dtype, pin_memory=True) for name, (shape, dtype) in shapes.items()}
        self.host_np = {name: t.numpy() for name, t in self.host.items()}
        self.static = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._copied = torch.cuda.Event()
        self._pending = False
        self._capture()

    def _batch(self, rows: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(input_ids=s["input_ids"][:rows], positions=s["positions"][:rows],
                            slot_mapping=s["slot_mapping"][:rows], block_tables=s["block_tables"][:rows],
                            context_lens=s["context_lens"][:rows], query_start_loc=self.query_start_loc[: rows + 1],
                            max_context_len=self.max_context_len, max_query_len=1)

    def _capture(self) -> None:
        start = time.perf_counter()
        # While capturing, every row is padding: no K/V is written, only the scratch block read.
        self.static["slot_mapping"].fill_(-1)
        self.static["context_lens"].fill_(1)
        self.static["block_tables"][:, 0] = self.scratch_block
        compute = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        pool = None
        with torch.cuda.device(self.device), torch.inference_mode():
            for rows in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
                batch = self._batch(rows)
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    for _ in range(_WARMUP_RUNS):
                        self.model(batch, self.kv_caches)
                compute.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with ops.trusted_arguments(), torch.cuda.graph(graph, pool=pool):
                    self.outputs[rows] = self.model(batch, self.kv_caches)
                pool = graph.pool()
                self.graphs[rows] = graph
        torch.cuda.synchronize(self.device)
        logger.info("vpage: captured %d decode CUDA graphs (batch %d-%d, contexts up to %d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], self.max_context_len,
                    time.perf_counter() - start)

    def batch_size_for(self, plan) -> int | None:
        """The graph batch size that runs ``plan``, None for an eager step."""
        return graph_batch_for(plan.num_seqs, plan.max_query_len, plan.max_context_len, plan.block_tables.shape[1],
                               self.sizes, self.max_context_len, self.max_blocks)

    def run(self, plan, rows: int) -> torch.Tensor:
        """Replays the graph of ``rows`` (from ``batch_size_for``) on the plan's inputs; returns
        the hidden states of the plan's rows, a view of the graph's output (read it before
        the next replay)."""
        if self._pending:
            self._copied.synchronize()  # the last step's copies out of the host buffers are done
        fill_padded_decode(self.host_np, plan.input_ids, plan.positions, plan.slot_mapping, plan.context_lens,
                           plan.block_tables, rows, self.scratch_block)
        for name, host in self.host.items():
            self.static[name][:rows].copy_(host[:rows], non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        self._copied.record(compute)
        self._pending = True
        with torch.cuda.device(self.device):
            self.graphs[rows].replay()
        return self.outputs[rows][: plan.num_seqs]
