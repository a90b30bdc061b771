"""KV cache events in vLLM's wire format, for routers that follow each engine's prefix cache
(llm-d's precise prefix scorer, Dynamo's KV router, vLLM's own consumers).

Each step that changed the cache becomes one message of three ZeroMQ frames: the topic, the
batch's sequence number (8 bytes, big-endian, from 0) and the msgpack payload, which is what
msgspec writes for vLLM's ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]``, each
event a map tagged by ``type``:

- ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h or None,
  "token_ids": [...], "block_size": B, "lora_id": id or None, "medium": "GPU", "lora_name": ...}``:
  full blocks that entered the cache, one chain (each block's parent the one before it, the first
  one's ``parent_block_hash``), their tokens end to end;
- ``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}``: cached blocks evicted;
- ``{"type": "AllBlocksCleared"}``: the whole cache emptied (``reset_prefix_cache``).

A block hash is 16 bytes (vpage's chained 128-bit content hash, keyed per process: stable within
one engine, not across engines). With ``replay_endpoint``, a ROUTER socket answers a request
frame holding a sequence number (8 bytes, big-endian) with every kept batch from it on, each as
``(topic, seq, payload)`` after the empty delimiter, then ``("", -1, "")``: a subscriber that
joined late, or dropped messages, catches up.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import msgpack
import zmq

from vpage import _core
from vpage.config import KVEventsConfig

logger = logging.getLogger("vpage")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


def wire_events(events: Sequence[Any], block_size: int,
                lora_name: Callable[[int], Optional[str]] = lambda _: None) -> list[dict]:
    """The C++ scheduler's ``KvCacheEvent``s as vLLM's tagged event maps, in order: a stored block
    whose parent is the previous stored block (same adapter) joins its BlockStored, consecutive
    removals share one BlockRemoved; a reset of the cache is AllBlocksCleared."""
    out: list[dict] = []
    for event in events:
        last = out[-1] if out else None
        if event.kind == _core.KvCacheEventKind.STORED:
            lora_id = event.lora_id or None
            if (last is not None and last["type"] == "BlockStored" and last["lora_id"] == lora_id
                    and last["block_hashes"][-1] == event.parent_block_hash):
                last["block_hashes"].append(event.block_hash)
                last["token_ids"].extend(event.token_ids)
                continue
            out.append({"type": "BlockStored", "block_hashes": [event.block_hash],
                        "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                        "block_size": block_size, "lora_id": lora_id, "medium": MEDIUM_GPU,
                        "lora_name": lora_name(event.lora_id) if lora_id else None})
        elif event.kind == _core.KvCacheEventKind.ALL_CLEARED:
            out.append({"type": "AllBlocksCleared"})
        elif last is not None and last["type"] == "BlockRemoved":
            last["block_hashes"].append(event.block_hash)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": [event.block_hash], "medium": MEDIUM_GPU})
    return out


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int = 0) -> bytes:
    """A KVEventBatch's payload (msgspec's array form of vLLM's struct)."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict], Optional[int]]:
    """(ts, events, data_parallel_rank) of a payload: what a subscriber reads."""
    batch = msgpack.unpackb(payload, raw=False)
    return batch[0], batch[1], batch[2] if len(batch) > 2 else None


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard host or an ipc/inproc address, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes event batches from a thread of its own (the step only queues them): a PUB socket
    at ``config.endpoint`` and, with ``config.replay_endpoint``, a ROUTER that replays the last
    ``buffer_steps`` batches. The sockets are made on that thread; a bad endpoint raises here."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[dict]]] = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="vpage-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r} or {config.replay_endpoint!r}: "
                             f"{self._error}") from None

    def publish(self, events: list[dict], ts: Optional[float] = None) -> None:
        """Queues one batch; when max_queue_size batches already wait, it is dropped with a
        warning (the step never blocks on subscribers)."""
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, events))
        except queue.Full:
            logger.warning("vpage: KV events queue full (%d batches): a batch was dropped", self.config.max_queue_size)

    def shutdown(self) -> None:
        """Sends what is queued (for up to a second), then closes the sockets. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        context = zmq.Context.instance()
        pub = replay = None
        try:
            pub = context.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            (pub.bind if _binds(self.config.endpoint) else pub.connect)(self.config.endpoint)
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            for socket in (pub, replay):
                if socket is not None:
                    socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        seq, stop_by = 0, None
        try:
            while True:
                if self._stop.is_set():
                    stop_by = stop_by or time.monotonic() + 1.0
                    if self._queue.empty() or time.monotonic() > stop_by:
                        break
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                try:
                    payload = encode_batch(item[0], item[1], self.data_parallel_rank)
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except (zmq.ZMQError, TypeError, ValueError):
                    logger.exception("vpage: a KV events batch could not be published")
                    continue
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("vpage: malformed KV events replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def offset_endpoint_port(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """A data-parallel replica's endpoint: a tcp endpoint's port plus the rank (as vLLM does);
    an ipc or inproc path gets ``_dp<rank>`` appended. Rank 0 keeps the endpoint as given."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + data_parallel_rank}"
        return endpoint
    return f"{endpoint}_dp{data_parallel_rank}"


def make_publisher(config: Optional[KVEventsConfig], data_parallel_rank: int = 0) -> Optional[ZmqEventPublisher]:
    """The publisher ``config`` asks for; None when events are off or go nowhere ("null"). A
    data-parallel replica publishes on its own ports (``offset_endpoint_port``) and stamps its
    rank on every batch."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    if data_parallel_rank:
        config = dataclasses.replace(config, endpoint=offset_endpoint_port(config.endpoint, data_parallel_rank),
                                     replay_endpoint=offset_endpoint_port(config.replay_endpoint,
                                                                          data_parallel_rank))
    return ZmqEventPublisher(config, data_parallel_rank)
