"""A GGUF file's metadata and tensor table, parsed straight from its mapped bytes.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every array, which takes
~5 s on a 49k-token vocabulary (and vpage read the file three times per load); this reader
turns the same metadata into plain Python values in a few hundredths of that. Tensor data
stays in the file mapping with gguf-py's shapes, so ``gguf.quants.dequantize`` takes it."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml type id -> numpy element type for the unblocked types (the others come as bytes).
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int  # ggml type id
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists it
    data: np.ndarray  # read-only; outermost first; block types as uint8 [..., bytes per row]


class GgufFile:
    """``metadata`` (key -> str, number, bool or list) and ``tensors`` of a GGUF v2/v3 file.

    Raises ValueError naming the path for anything that is not a well-formed GGUF file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from e
        try:
            self._pos = 0
            self.metadata, self.tensors = self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: GGUF file has no general.architecture")
        return arch

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._map):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS:  # numbers in one read
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                values = np.frombuffer(self._map, np.dtype(fmt), count, self._pos).tolist()
                self._pos += size * count
                return values
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self._unpack(_SCALARS[value_type])

    def _parse(self) -> tuple[dict[str, Any], list[GgufTensor]]:
        if self._map[:4] != _MAGIC:
            raise ValueError("no GGUF magic bytes")
        self._pos = 4
        version = self._unpack("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (this reader takes {_VERSIONS})")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        table = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            table.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        return metadata, [self._tensor(data_start, *entry) for entry in table]

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GgufTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except ValueError:
            raise ValueError(f"tensor {name} has unknown ggml type {type_id}") from None
        outer_first = tuple(reversed(dims))
        elements = int(np.prod(dims, dtype=np.int64))
        if dims[0] % block:
            raise ValueError(f"tensor {name}: {dims[0]} columns are not whole blocks of {block}")
        nbytes = elements // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(self._map):
            raise ValueError(f"tensor {name} ends at byte {start + nbytes}, past the file's {len(self._map)}")
        if type_id in _PLAIN_TYPES:
            data = np.frombuffer(self._map, _PLAIN_TYPES[type_id], elements, start).reshape(outer_first)
        else:
            row_bytes = dims[0] // block * block_bytes
            data = np.frombuffer(self._map, np.uint8, nbytes, start).reshape(*outer_first[:-1], row_bytes)
        return GgufTensor(name, type_id, dims, data)
