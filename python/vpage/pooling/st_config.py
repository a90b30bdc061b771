"""How a model folder pools: its sentence-transformers configuration (``modules.json``, the
Pooling module's ``config.json``, a ``Normalize`` module, ``sentence_bert_config.json``), or
vLLM's defaults where it has none; ``EngineArgs.pooler_config`` overrides either."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

POOLING_TYPES = ("CLS", "MEAN", "LAST")  # vLLM's PoolerConfig.pooling_type names
# sentence-transformers' pooling modes (its 3.x boolean keys and its 5+ ``pooling_mode`` names).
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: "CLS" (the first token), "MEAN" (the mean of all tokens) or "LAST" (the
    last token); normalize: embeddings are L2-normalised unless a request says otherwise."""

    pooling_type: str
    normalize: bool

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from e


def _pooling_type(path: Path) -> str:
    """The pooling type a sentence-transformers Pooling module's config.json names."""
    config = _read_json(path)
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_KEYS.items() if config.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling mode {modes} is not supported; vpage pools with one of "
                         f"{sorted(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def read_pooler_config(folder: Path, default: PoolerConfig, override: Optional[dict] = None) -> PoolerConfig:
    """The folder's pooling: its sentence-transformers modules when it has ``modules.json``
    (normalised only with a Normalize module, as sentence-transformers does), else
    ``default``; then ``override``'s fields (``pooling_type``, ``normalize``). ValueError for a
    module or pooling mode vpage does not implement (Dense projections, max pooling, ...)."""
    config = default
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        normalize, pooling_type = False, default.pooling_type
        for module in _read_json(modules_path):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                pooling_type = _pooling_type(folder / module.get("path", "") / "config.json")
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"{modules_path}: sentence-transformers module {module.get('type')!r} is not "
                                 "supported (vpage runs Transformer, Pooling and Normalize modules)")
        config = PoolerConfig(pooling_type, normalize)
    if override:
        unknown = set(override) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config takes pooling_type and normalize, not {sorted(unknown)}")
        config = replace(config, **override)
    return config


def max_seq_length(folder: Path) -> Optional[int]:
    """sentence_bert_config.json's ``max_seq_length`` (sentence-transformers truncates there),
    None without one."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = _read_json(path).get("max_seq_length")
    return int(value) if value else None
