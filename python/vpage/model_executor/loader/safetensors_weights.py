"""Weights of a Hugging Face model folder (``*.safetensors``, optionally sharded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: those named by the shard index, else ``*.safetensors``.

    Raises FileNotFoundError when there are none or a listed shard is missing, ValueError
    when the index is unreadable.
    """
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files (other formats are not supported)")
    return files


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of ``files``, one tensor in memory at a time.

    Raises ValueError naming the file when one is corrupt or truncated.
    """
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read safetensors file ({e})") from e


def has_tensor(files: list[Path], name: str) -> bool:
    """Whether one of the safetensors ``files`` holds a tensor ``name`` (headers only)."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return True
    return False
