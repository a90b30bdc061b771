"""How many decoder layers each pipeline stage holds.

The layers are cut into ``stages x VPAGE_PP_VIRTUAL_STAGES`` (default 2) consecutive ranges,
virtual stage j on stage j % stages (interleaved; vpage/worker/pipeline.py). By default the
ranges are balanced by the weights a decode token reads: every layer's (attention, and the MLP
or the experts a token is routed to) and, with the last range, the output projection's
(``vocab x hidden``: as large as eight layers of SmolLM2-135M), so the last range gets fewer
layers. ``VPAGE_PP_LAYER_PARTITION`` ("10,9,9,2", or "19,11" for one range per stage) sets the
counts instead, as vLLM's ``VLLM_PP_LAYER_PARTITION`` does.

A step's sequences run as ``VPAGE_PP_MICROBATCHES`` micro-batches (default: twice the stages),
so that the stages work at once (vpage/worker/pipeline.py).
"""

from __future__ import annotations

import os
from typing import Any

from vpage.model_executor.models.llama import head_size_of, num_kv_heads_of


def layer_weights(hf_config: Any) -> int:
    """Weights one decode token reads in one decoder layer (attention and MLP or routed experts)."""
    hidden, head = hf_config.hidden_size, head_size_of(hf_config)
    q, kv = hf_config.num_attention_heads * head, num_kv_heads_of(hf_config) * head
    attention = hidden * (q + 2 * kv) + q * hidden
    experts = getattr(hf_config, "num_experts_per_tok", None)
    if experts and getattr(hf_config, "moe_intermediate_size", None):
        mlp = 3 * hidden * (experts * hf_config.moe_intermediate_size
                            + (getattr(hf_config, "shared_expert_intermediate_size", None) or 0))
    else:
        mlp = 3 * hidden * hf_config.intermediate_size
    return attention + mlp


def pipeline_layers(hf_config: Any, stages: int) -> tuple[int, ...]:
    """The decoder layers of each virtual stage, in model order: ``VPAGE_PP_LAYER_PARTITION``,
    or ``VPAGE_PP_VIRTUAL_STAGES`` (default 2, fewer when the layers do not go round) ranges per
    stage balanced. ValueError when the model has fewer layers than stages or a variable does
    not fit the model."""
    num_layers = int(hf_config.num_hidden_layers)
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {num_layers} decoder layers")
    given = os.environ.get("VPAGE_PP_LAYER_PARTITION")
    if given:
        try:
            counts = tuple(int(n) for n in given.split(","))
        except ValueError:
            counts = ()
        if not counts or len(counts) % stages or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"VPAGE_PP_LAYER_PARTITION={given!r} must give {stages} positive layer counts (or a "
                             f"multiple of {stages}: interleaved ranges) summing to the model's {num_layers} layers")
        return counts
    return balanced_layers(hf_config, stages * min(virtual_stages(), num_layers // stages))


def virtual_stages() -> int:
    """Layer ranges per stage: ``VPAGE_PP_VIRTUAL_STAGES`` or 2."""
    given = os.environ.get("VPAGE_PP_VIRTUAL_STAGES", "2")
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"VPAGE_PP_VIRTUAL_STAGES must be a positive integer, got {given!r}")
    return int(given)


def balanced_layers(hf_config: Any, stages: int) -> tuple[int, ...]:
    """``stages`` consecutive layer counts of about equal weights, the output projection's
    counted with the last."""
    num_layers = int(hf_config.num_hidden_layers)
    layer = layer_weights(hf_config)
    head = hf_config.vocab_size * hf_config.hidden_size
    share = (num_layers * layer + head) / stages  # each stage's part of the whole
    last = min(max(1, round((share - head) / layer)), num_layers - (stages - 1))
    rest, extra = divmod(num_layers - last, stages - 1)
    return tuple(rest + (i < extra) for i in range(stages - 1)) + (last,)


def pipeline_microbatches(stages: int) -> int:
    """Micro-batches a pipelined step is cut into: ``VPAGE_PP_MICROBATCHES`` or ``2 * stages``."""
    given = os.environ.get("VPAGE_PP_MICROBATCHES")
    if not given:
        return 2 * stages
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"VPAGE_PP_MICROBATCHES must be a positive integer, got {given!r}")
    return int(given)
