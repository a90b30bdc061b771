"""Which layers of a model attend through a sliding window, read from its transformers config."""

from __future__ import annotations

from typing import Any, Optional


def sliding_windows(hf_config: Any) -> tuple[Optional[int], ...]:
    """Per layer, the sliding window W (a query at position p sees keys p - W < j <= p, itself
    included, as transformers masks them) or None for global attention.

    ``layer_types`` (transformers' "sliding_attention"/"full_attention", set by Qwen2/Qwen3,
    Gemma 2/3) decides where the config has it; otherwise a ``sliding_window`` applies to
    every layer (Mistral, Phi-3) unless ``use_sliding_window`` is false.
    """
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers for {num_layers}")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def uniform_sliding_window(hf_config: Any) -> Optional[int]:
    """The window when every layer has the same one (the block manager may then free blocks
    that fall out of it), else None (no window, or windowed and global layers mixed)."""
    windows = set(sliding_windows(hf_config))
    return windows.pop() if len(windows) == 1 else None
