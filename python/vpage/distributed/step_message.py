"""One engine step as the tensor-parallel workers receive it: a fixed 14-int64 header, then
one packed int64 payload, each sent with one broadcast from the driver.

The payload holds the plan's flat buffers (input ids, positions, slot mapping, context lengths,
query start offsets, sampled rows), the block operations (swap out, swap in, copy) and the
block tables as a change against the previous step's: both ends keep the last step's tables,
and for each row the driver sends which previous row it continues (the same sequence), how many
leading entries it takes from that row, and then only the (position, block id) entries that
differ from it (a copy-on-write copy; -1 for a block freed before a sliding window) or lie past
it, so a steady decode batch sends one entry per sequence every ``block_size`` tokens (two with
a sliding window) instead of every table every step. Only the first
``ceil(context_len / block_size)`` entries of a row are meaningful (the kernels read no others);
the worker's tables hold zeros elsewhere. Last come the extra rows whose logits the step
computes besides the sampled ones (prompt rows of prompt_logprobs requests; usually none).

LoRA adapters reach the workers as their own message (``CMD_LORA``: the header's second entry
is the length of a pickled ``LoraUpdate``, its bytes the payload) before the first step that
runs them; each step carries the adapter id of its rows (``lora_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pickle

import numpy as np
import torch

from vpage.distributed.parallel_state import broadcast

CMD_STEP, CMD_SHUTDOWN, CMD_LORA = 1, 2, 3
HEADER_LEN = 14
# Order of the payload's parts; the header gives their sizes.
_FLAT = ("input_ids", "positions", "slot_mapping", "context_lens", "query_start_loc", "sample_token_indices",
         "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "lora_ids")
_TABLE = ("prev_rows", "kept_blocks", "entry_index", "entry_block")
_INT32 = ("context_lens", "query_start_loc", "lora_ids")


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
    lora_ids: np.ndarray  # [num_seqs] int32, each row's LoRA adapter (0: none)
    max_context_len: int
    max_query_len: int
    logit_rows: Optional[np.ndarray] = None  # [n] int64 token indices, or None
    num_prefill_tokens: int = 0  # the plan's counts (draft tokens decide how attention runs)
    num_draft_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class LoraUpdate:
    """Load (``add``, a LoRARequest) or forget (``remove``, an adapter id) a LoRA adapter."""

    add: Optional[object] = None
    remove: Optional[int] = None


def has_work(plan) -> bool:
    """Whether a plan needs the workers: rows to compute or blocks to move."""
    return bool(plan.num_seqs or len(plan.blocks_to_swap_out) or len(plan.blocks_to_swap_in)
                or len(plan.blocks_to_copy))


def _used_blocks(context_lens: np.ndarray, block_size: int) -> np.ndarray:
    return (context_lens.astype(np.int64) + block_size - 1) // block_size


class StepSender:
    """Driver side: packs plans against the tables of the last step it sent."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size
        self._seq_ids = np.empty(0, dtype=np.int64)
        self._tables = np.empty((0, 0), dtype=np.int32)
        self._used = np.empty(0, dtype=np.int64)

    def _table_change(self, seq_ids: np.ndarray, tables: np.ndarray, used: np.ndarray) -> list[np.ndarray]:
        rows, width = tables.shape
        prev_rows = np.full(rows, -1, dtype=np.int64)
        kept = np.zeros(rows, dtype=np.int64)
        differs = np.zeros((rows, width), dtype=bool)
        common = min(width, self._tables.shape[1])
        if len(self._seq_ids) and rows and common:
            order = np.argsort(self._seq_ids, kind="stable")
            at = np.minimum(np.searchsorted(self._seq_ids[order], seq_ids), len(order) - 1)
            found = self._seq_ids[order[at]] == seq_ids
            prev_rows = np.where(found, order[at], -1)
            source = np.maximum(prev_rows, 0)
            # The worker takes the entries both steps use from the previous row, then the sent ones.
            kept = np.where(found, np.minimum(np.minimum(used, self._used[source]), common), 0)
            differs[:, :common] = tables[:, :common] != self._tables[source, :common]
        columns = np.arange(width)
        send = (columns < used[:, None]) & ((columns >= kept[:, None]) | differs)
        index = np.flatnonzero(send)
        return [prev_rows, kept, index.astype(np.int64), tables.reshape(-1)[index].astype(np.int64)]

    def pack(self, plan, logit_rows: Optional[np.ndarray] = None) -> tuple[list[int], np.ndarray]:
        """(header, payload) of ``plan`` and its extra ``logit_rows``; remembers its tables for
        the next step."""
        parts = [np.asarray(getattr(plan, name)) for name in _FLAT]
        tables = np.asarray(plan.block_tables)
        seq_ids = np.asarray(plan.seq_ids, dtype=np.int64)
        used = _used_blocks(np.asarray(plan.context_lens), self.block_size)
        table_parts = self._table_change(seq_ids, tables, used)
        extra = [] if logit_rows is None else [np.asarray(logit_rows)]
        rows, width = tables.shape
        header = [CMD_STEP, len(parts[0]), rows, width, len(parts[5]), len(parts[6]), len(parts[7]), len(parts[8]),
                  len(table_parts[2]), plan.max_context_len, plan.max_query_len, len(extra[0]) if extra else 0,
                  plan.num_prefill_tokens, plan.num_draft_tokens]
        payload = np.concatenate([p.reshape(-1).astype(np.int64, copy=False) for p in parts + table_parts + extra])
        self._seq_ids, self._tables, self._used = seq_ids.copy(), tables.copy(), used
        return header, payload

    def send(self, plan, logit_rows: Optional[np.ndarray] = None) -> None:
        """Broadcasts ``plan`` (a SchedulePlan) and its extra ``logit_rows`` to the workers:
        header, then payload."""
        header, payload = self.pack(plan, logit_rows)
        broadcast(torch.tensor(header, dtype=torch.int64, device=self.device), control=True)
        broadcast(torch.from_numpy(payload).to(self.device), control=False)


class StepReceiver:
    """Worker side: unpacks steps, rebuilding the tables from the previous step's."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size
        self._tables = np.empty((0, 0), dtype=np.int32)

    @staticmethod
    def payload_size(header: list[int]) -> int:
        num_tokens, rows, _, num_samples, n_out, n_in, n_copy, n_entries = header[1:9]
        return (3 * num_tokens + 2 * rows + 1 + num_samples + 2 * (n_out + n_in + n_copy) + rows + 2 * rows
                + 2 * n_entries + header[11])

    def unpack(self, header: list[int], payload: np.ndarray) -> StepInput:
        num_tokens, rows, width, num_samples, n_out, n_in, n_copy, n_entries = header[1:9]
        sizes = [num_tokens] * 3 + [rows, rows + 1, num_samples, 2 * n_out, 2 * n_in, 2 * n_copy, rows,
                                    rows, rows, n_entries, n_entries]
        arrays = {}
        offset = 0
        for name, size in zip(_FLAT + _TABLE, sizes):
            part = payload[offset:offset + size]
            offset += size
            arrays[name] = part.astype(np.int32) if name in _INT32 else part
        for name in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
            arrays[name] = np.ascontiguousarray(arrays[name].reshape(-1, 2))
        prev_rows, kept = arrays.pop("prev_rows"), arrays.pop("kept_blocks")
        index, blocks = arrays.pop("entry_index"), arrays.pop("entry_block")
        tables = np.zeros((rows, width), dtype=np.int32)
        common = min(width, self._tables.shape[1])
        if common and rows and len(self._tables):
            keep = np.arange(common) < kept[:, None]
            tables[:, :common] = np.where(keep, self._tables[np.maximum(prev_rows, 0), :common], 0)
        tables.reshape(-1)[index] = blocks
        self._tables = tables
        logit_rows = payload[offset:offset + header[11]] if header[11] else None
        return StepInput(**arrays, block_tables=tables, max_context_len=header[9], max_query_len=header[10],
                         logit_rows=logit_rows, num_prefill_tokens=header[12], num_draft_tokens=header[13])

    def receive(self) -> StepInput | LoraUpdate | None:
        """Waits for the next step (or adapter update); None when the driver shuts down."""
        header = broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device), control=True).tolist()
        if header[0] == CMD_LORA:
            data = broadcast(torch.empty(-(-header[1] // 8), dtype=torch.int64, device=self.device), control=False)
            return pickle.loads(data.cpu().numpy().tobytes()[:header[1]])
        if header[0] != CMD_STEP:
            return None
        payload = broadcast(torch.empty(self.payload_size(header), dtype=torch.int64, device=self.device),
                            control=False)
        return self.unpack(header, payload.cpu().numpy())


def send_lora_update(device: torch.device, update: LoraUpdate) -> None:
    """Broadcasts an adapter update to the workers (driver side; both ends are one vpage install)."""
    data = pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0], header[1] = CMD_LORA, len(data)
    broadcast(header, control=True)
    padded = np.frombuffer(data + bytes(-len(data) % 8), dtype=np.int64)
    broadcast(torch.from_numpy(padded.copy()).to(device), control=False)


def send_shutdown(device: torch.device) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0] = CMD_SHUTDOWN
    broadcast(header, control=True)
