"""One engine step as the tensor-parallel workers receive it: a fixed 12-int64 header, then
one packed int64 payload, each sent with one broadcast from the driver.

The driver packs the scheduler plan's flat buffers (input ids, positions, slot mapping,
block tables, context lengths, query start offsets, sampled rows) and the block operations
(swap out, swap in, copy); a worker unpacks them into a ``StepInput`` with the plan's field
names, which the cache engine and ``ModelRunner`` read like a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vpage.distributed.parallel_state import broadcast

CMD_STEP, CMD_SHUTDOWN = 1, 2
HEADER_LEN = 12
# Order of the payload's parts; the header gives their sizes.
_FLAT = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
         "sample_token_indices", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")
_INT32 = ("block_tables", "context_lens", "query_start_loc")


@dataclass
class StepInput:
    """A plan's buffers as numpy arrays (dtypes and shapes of ``_core.SchedulePlan``)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    sample_token_indices: np.ndarray
    blocks_to_swap_out: np.ndarray
    blocks_to_swap_in: np.ndarray
    blocks_to_copy: np.ndarray
    max_context_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def has_work(plan) -> bool:
    """Whether a plan needs the workers: rows to compute or blocks to move."""
    return bool(plan.num_seqs or len(plan.blocks_to_swap_out) or len(plan.blocks_to_swap_in)
                or len(plan.blocks_to_copy))


def send_step(plan, device: torch.device) -> None:
    """Driver: broadcasts ``plan`` (a SchedulePlan) to the workers (header, then payload)."""
    parts = [np.asarray(getattr(plan, name)) for name in _FLAT]
    rows, width = plan.block_tables.shape
    header = [CMD_STEP, len(parts[0]), rows, width, len(parts[6]), len(parts[7]), len(parts[8]), len(parts[9]),
              plan.max_context_len, plan.max_query_len, 0, 0]
    broadcast(torch.tensor(header, dtype=torch.int64, device=device), control=True)
    payload = torch.from_numpy(np.concatenate([p.reshape(-1).astype(np.int64, copy=False) for p in parts]))
    broadcast(payload.to(device), control=False)


def send_shutdown(device: torch.device) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0] = CMD_SHUTDOWN
    broadcast(header, control=True)


def receive_step(device: torch.device) -> StepInput | None:
    """Worker: waits for the next step; None when the driver shuts down."""
    header = broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=device), control=True).tolist()
    if header[0] != CMD_STEP:
        return None
    num_tokens, rows, width, num_samples, n_out, n_in, n_copy = header[1:8]
    sizes = [num_tokens] * 3 + [rows * width, rows, rows + 1, num_samples, 2 * n_out, 2 * n_in, 2 * n_copy]
    payload = broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=device), control=False).cpu().numpy()
    arrays = {}
    offset = 0
    for name, size in zip(_FLAT, sizes):
        part = payload[offset:offset + size]
        offset += size
        arrays[name] = part.astype(np.int32) if name in _INT32 else part
    arrays["block_tables"] = arrays["block_tables"].reshape(rows, width)
    for name in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
        arrays[name] = np.ascontiguousarray(arrays[name].reshape(-1, 2))
    return StepInput(**arrays, max_context_len=header[8], max_query_len=header[9])
