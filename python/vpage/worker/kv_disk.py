"""The disk tier of the KV cache: one file per block, below the CPU pool.

The block manager decides (``SchedulePlan.kv_saves/kv_loads/kv_deletes``); this module moves
the bytes between files and the CPU pool's blocks, and lets a new engine index the files an
earlier one left (``scan``). A tier lives in ``<disk path>/<fingerprint>/``: the fingerprint
names the model and KV layout (another model, dtype, block size or weights file never reads
these files), ``hash_key`` holds the secret key of the block hashes (so the names outlive the
process) and ``rank0/<key hex>.kv`` the blocks (the disk tier runs on one rank).

A file: a header (magic, the block's 16-byte key, whether it is a sequence's first block, the
lengths of the salt, tokens and payload, a CRC-32 of all that follows), the cache salt (first
blocks), the block's token ids (int32), then the K/V bytes of every layer (keys, values). A load
checks the magic, the key, the sizes and the CRC before a byte reaches the pool: a missing,
truncated or corrupt file is a failed load, and its tokens are computed instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import struct
import zlib
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from vpage.model_executor.loader.model_loader import resolve_model_source

logger = logging.getLogger("vpage")

_MAGIC = b"VPAGEKV1"
_HEADER = struct.Struct("<8s16s?IIQI")  # magic, key, first, salt bytes, tokens, payload bytes, crc32


@dataclass
class DiskBlock:
    """A block file's header: what ``Scheduler.add_disk_block`` indexes."""

    key: bytes
    first: bool
    salt: bytes
    tokens: list[int]


def tier_directory(root: str, model: Optional[str], layout: dict) -> str:
    """``<root>/<fingerprint>``: the model (its name or path, and the sizes and times of its
    files when it is a local path) and the KV layout (``layout``: dtype, shapes, block size,
    ranks) hashed together."""
    files = []
    if model and os.path.exists(model):
        paths = [model] if os.path.isfile(model) else [os.path.join(model, n) for n in sorted(os.listdir(model))]
        files = [(os.path.basename(p), os.path.getsize(p), os.path.getmtime(p)) for p in paths if os.path.isfile(p)]
    identity = json.dumps({"model": model, "files": files, "layout": layout}, sort_keys=True, default=str)
    return os.path.join(root, hashlib.sha256(identity.encode()).hexdigest()[:24])


def kv_tier_directory(config, model_config) -> str:
    """The tier directory of an engine (``EngineConfig``) serving ``model_config`` (the loaded
    model's ``ModelConfig``)."""
    layout = {"architecture": model_config.architecture, "layers": model_config.num_layers,
              "kv_heads": model_config.num_kv_heads, "head_size": model_config.head_size,
              "dtype": str(model_config.dtype), "kv_cache_dtype": config.cache.kv_cache_dtype,
              "block_size": config.cache.block_size, "quantization": config.model.quantization,
              "tensor_parallel_size": config.parallel.tensor_parallel_size,
              "data_parallel_rank": config.parallel.data_parallel_rank}  # each replica its own tier
    model_path = str(resolve_model_source(config.model.model).path)  # the default model's file too
    return tier_directory(config.cache.kv_offloading_disk_path, model_path, layout)


@dataclass
class DiskTier:
    """An engine's disk tier: its size in blocks, the key of its block hashes, and the folder
    of the driver rank's files (the index a new engine rebuilds)."""

    num_blocks: int
    key: tuple[int, int]
    directory: str


def open_disk_tier(config, model_config, block_bytes: int) -> DiskTier:
    """The disk tier of ``config`` (``kv_offloading_disk_path`` set), made if new."""
    directory = kv_tier_directory(config, model_config)
    num_blocks = int(config.cache.kv_offloading_disk_size * (1 << 30) // block_bytes)
    if num_blocks < 1:
        raise ValueError(f"kv_offloading_disk_size {config.cache.kv_offloading_disk_size} GiB holds no KV block "
                         f"of {block_bytes} bytes")
    return DiskTier(num_blocks, hash_key(directory), os.path.join(directory, "rank0"))


def hash_key(directory: str) -> tuple[int, int]:
    """The tier's key of the block hashes (two 64-bit words, not both zero: zero means "draw
    one"), made on first use and readable by this user only."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "hash_key")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(16))
        os.replace(tmp, path)
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) != 16:
        raise ValueError(f"the KV disk tier's key file {path} is damaged: delete that directory to start afresh")
    k0, k1 = struct.unpack("<QQ", raw)
    return k0 or 1, k1


def scan(directory: str) -> Iterator[DiskBlock]:
    """The readable block files of one rank's directory, oldest first; unreadable ones and
    unfinished writes are deleted."""
    if not os.path.isdir(directory):
        return
    entries = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(".kv"):
            entries.append((os.path.getmtime(path), path))
        elif name.endswith(".tmp"):
            os.remove(path)
    for _, path in sorted(entries):
        try:
            with open(path, "rb") as f:
                block = _read_header(f)
        except (OSError, ValueError, struct.error):
            block = None
        if block is None or f"{block.key.hex()}.kv" != os.path.basename(path):
            logger.warning("vpage: KV disk tier: dropping unreadable %s", path)
            os.remove(path)
            continue
        yield block


def index_disk_tier(scheduler, directory: str) -> None:
    """Indexes in ``scheduler`` (a ``_core.Scheduler``) the blocks an earlier engine left in a
    rank's folder, oldest first; those past the tier's size are deleted."""
    found = 0
    for block in scan(directory):
        found += 1
        for key in scheduler.add_disk_block(block.key, block.first, block.salt, block.tokens):
            os.remove(os.path.join(directory, f"{key.hex()}.kv"))
    if found:
        logger.info("vpage: KV disk tier: %d blocks found in %s", scheduler.usage().used_disk_blocks, directory)


def _read_header(f) -> Optional[DiskBlock]:
    raw = f.read(_HEADER.size)
    magic, key, first, salt_len, num_tokens, _, _ = _HEADER.unpack(raw)
    if magic != _MAGIC:
        return None
    salt = f.read(salt_len)
    tokens = np.frombuffer(f.read(4 * num_tokens), dtype=np.int32)
    if len(salt) != salt_len or len(tokens) != num_tokens:
        return None
    return DiskBlock(key, first, salt, tokens.tolist())


class DiskTierFiles:
    """One rank's block files and its CPU pool (``cpu_cache``: per layer (keys, values) with
    blocks along dim 0). Saves copy the block at once and write the file on a writer thread;
    deletes queue behind them. Loads read on a reader thread into CPU blocks the block manager
    holds until ``take_loads`` reports them; a load of a key still being written waits for it."""

    def __init__(self, directory: str, cpu_cache: list[tuple[torch.Tensor, torch.Tensor]]):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.cpu_cache = cpu_cache
        self.block_bytes = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in cpu_cache)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vpage-kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="vpage-kv-disk-read")
        self._pending: dict[bytes, Future] = {}  # key -> its last queued write or delete
        self._loads: list[tuple[object, Future]] = []  # (KvBlockLoad, its read: True when sound)

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, f"{key.hex()}.kv")

    def apply(self, plan) -> None:
        """Starts the plan's disk work: deletes, then saves (the blocks are copied now, before
        the plan's swap-outs rewrite them), then loads."""
        self._pending = {key: f for key, f in self._pending.items() if not f.done()}
        for key in plan.kv_deletes:
            self._pending[key] = self._writer.submit(_remove, self._path(key))
        for save in plan.kv_saves:
            self._pending[save.key] = self._writer.submit(_write, self._path(save.key), *self._file_parts(save))
        for load in plan.kv_loads:
            self._loads.append((load, self._reader.submit(self._load, load.key, load.cpu_block,
                                                          self._pending.get(load.key))))

    def take_loads(self, wait_s: float = 0.0) -> tuple[list, list]:
        """The loads that finished since the last call: (read, failed). With ``wait_s`` (a step
        with nothing else to do), waits that long at most for all of them."""
        if wait_s and self._loads:
            wait([f for _, f in self._loads], timeout=wait_s, return_when=ALL_COMPLETED)
        done, failed, running = [], [], []
        for load, future in self._loads:
            if not future.done():
                running.append((load, future))
            else:
                (done if future.result() else failed).append(load)
        self._loads = running
        return done, failed

    def close(self) -> None:
        """Finishes the queued reads and writes (idempotent)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)

    def _block_views(self, block: int) -> list[torch.Tensor]:
        return [t[block].view(torch.uint8).reshape(-1) for pair in self.cpu_cache for t in pair]

    def _file_parts(self, save) -> tuple[bytes, bool, bytes, bytes, bytearray]:
        """(key, salt, tokens, payload) of a save's file: the block's bytes copied now, once."""
        payload = bytearray(self.block_bytes)
        out = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for view in self._block_views(save.cpu_block):
            out[offset:offset + view.numel()].copy_(view)
            offset += view.numel()
        return save.key, save.first, save.salt, np.asarray(save.tokens, dtype=np.int32).tobytes(), payload

    def _load(self, key: bytes, cpu_block: int, write: Optional[Future]) -> bool:
        if write is not None:  # the file of a block saved just before
            write.result()
        path = self._path(key)
        try:
            data = bytearray(os.path.getsize(path))  # writable: torch.frombuffer reads it in place
            with open(path, "rb") as f:
                f.readinto(data)
            magic, file_key, _, salt_len, num_tokens, payload_len, crc = _HEADER.unpack_from(data)
        except (OSError, struct.error):
            logger.warning("vpage: KV disk tier: %s is missing or truncated; recomputing its tokens", path)
            return False
        body = memoryview(data)[_HEADER.size:]
        if (magic != _MAGIC or file_key != key or payload_len != self.block_bytes
                or len(body) != salt_len + 4 * num_tokens + payload_len or zlib.crc32(body) != crc):
            logger.warning("vpage: KV disk tier: %s is corrupt; recomputing its tokens", path)
            return False
        payload = body[salt_len + 4 * num_tokens:]
        offset = 0
        for view in self._block_views(cpu_block):
            view.copy_(torch.frombuffer(payload, dtype=torch.uint8, count=view.numel(), offset=offset))
            offset += view.numel()
        return True


def _write(path: str, key: bytes, first: bool, salt: bytes, tokens: bytes, payload: bytearray) -> None:
    """Writes a block file whole or not at all (a crash leaves a .tmp that ``scan`` removes)."""
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(salt)))
    header = _HEADER.pack(_MAGIC, key, first, len(salt), len(tokens) // 4, len(payload), crc)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(salt)
            f.write(tokens)
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:  # a full disk loses the block: its load fails and its tokens are computed
        logger.warning("vpage: KV disk tier: cannot write %s: %s", path, e)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
