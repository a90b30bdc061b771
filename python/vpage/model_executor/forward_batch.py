"""The flattened inputs of one engine step, as the model sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardBatch:
    """One engine step over several sequences, flattened with no padding.

    Tokens of sequence i occupy rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the
    per-token tensors; they are the LAST tokens of that sequence's context (a whole prompt,
    a prefill chunk, or one decode token). All tensors live on the model's device.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each token (<0 = skip)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, physical block ids
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of query lengths
    max_context_len: int  # max(context_lens)
    max_query_len: int  # longest query; 1 means a decode-only step
    # CPU: each sequence's rows are a decode token and its draft tokens (speculative decoding),
    # which attention scores as decode steps at their positions would (ops' draft_queries)
    draft_queries: bool = False
    # CUDA only: layer i's attention waits on event i (that layer's swaps); None = nothing to wait for
    layer_events: Optional[list] = None
    # [num_tokens] int32: the LoRA slot of each token (-1: none), None: no adapter in the step
    lora_token_slots: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """Number of flattened tokens (rows) in this step."""
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        """Number of sequences in this step."""
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one token."""
        return self.max_query_len == 1
