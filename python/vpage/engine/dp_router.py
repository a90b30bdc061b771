"""Which data-parallel replica serves a request: the one whose prefix cache holds the longest
prefix of its prompt, unless that replica is too busy; else the least loaded.

What each replica caches comes from its own KV cache events (``BlockStored``/``BlockRemoved``,
the wire maps of :mod:`vpage.distributed.kv_events`, sent with every step's outputs), so the
index follows evictions as they happen. A block is known here by a key chained like the
engines' hashes (the parent's key, the adapter id, the block's tokens), computed from token ids
alone: engines key their hashes per process, so the router cannot compute theirs, and maps each
engine hash to its key as the events arrive. Blocks of a request just routed count for its
replica at once (a bounded LRU of recent keys), so that a burst sharing one prefix goes to one
replica before its first block is even computed. Cache salts are not part of the key: the
router may send two tenants' equal prompts to one replica, where the engine still keeps their
blocks apart.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Hashable, Mapping, Optional, Sequence


def block_keys(token_ids: Sequence[int], block_size: int, lora_id: int = 0) -> list[int]:
    """The chained keys of the prompt's full blocks, first block first."""
    keys, key = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, lora_id, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


class _ReplicaIndex:
    """The block keys one replica holds (per its events) or was just sent (recent)."""

    def __init__(self, max_recent: int):
        self.key_of: dict[bytes, int] = {}  # engine block hash -> key
        self.cached: Counter[int] = Counter()  # key -> engine blocks holding it (salts can split one key)
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.max_recent = max_recent

    def has(self, key: int) -> bool:
        return key in self.cached or key in self.recent

    def stored(self, event: dict) -> None:
        parent = event.get("parent_block_hash")
        key = 0 if parent is None else self.key_of.get(bytes(parent))
        if key is None:  # the parent left before this event was read: the chain cannot be keyed
            return
        tokens, size, lora_id = event["token_ids"], event["block_size"], event.get("lora_id") or 0
        for i, block_hash in enumerate(event["block_hashes"]):
            key = hash((key, lora_id, tuple(tokens[i * size:(i + 1) * size])))
            block_hash = bytes(block_hash)
            if block_hash not in self.key_of:
                self.key_of[block_hash] = key
                self.cached[key] += 1

    def removed(self, event: dict) -> None:
        for block_hash in event["block_hashes"]:
            key = self.key_of.pop(bytes(block_hash), None)
            if key is not None:
                self.cached[key] -= 1
                if self.cached[key] <= 0:
                    del self.cached[key]

    def routed(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.recent[key] = None
            self.recent.move_to_end(key)
        while len(self.recent) > self.max_recent:
            self.recent.popitem(last=False)


class PrefixRouter:
    """Chooses a replica per request from its prompt's block keys and the replicas' loads.
    Replicas are named by any hashable key (an index, a Ray Serve replica id); one is known
    from its first load, event or choice.

    ``imbalance``: the replica with the longest cached prefix wins unless it has more than this
    many unfinished requests beyond the least loaded replica (then the least loaded one does);
    ``max_recent_blocks``: the recently routed keys remembered per replica."""

    def __init__(self, block_size: int, imbalance: int = 16, max_recent_blocks: int = 16384):
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_recent_blocks = max_recent_blocks
        self.replicas: dict[Hashable, _ReplicaIndex] = {}
        self._last_chosen: dict[Hashable, int] = {}  # replica -> when it was last chosen (a counter)
        self._clock = 0

    def index(self, replica: Hashable) -> _ReplicaIndex:
        if replica not in self.replicas:
            self.replicas[replica] = _ReplicaIndex(self.max_recent_blocks)
        return self.replicas[replica]

    def choose(self, token_ids: Sequence[int], loads: Mapping[Hashable, Optional[int]], lora_id: int = 0) -> Hashable:
        """The replica for a prompt; ``loads[r]`` is replica r's unfinished requests, None for a
        replica that cannot serve. Equally loaded replicas without a cached prefix take turns.
        ValueError when none can serve."""
        alive = [r for r, load in loads.items() if load is not None]
        if not alive:
            raise ValueError("no engine replica is serving")
        order = sorted(alive, key=lambda r: (loads[r], self._last_chosen.get(r, -1)))
        least = order[0]
        keys = block_keys(token_ids, self.block_size, lora_id)
        best, best_match = least, 0
        for r in order:  # the least loaded first, so a tie in matched blocks goes to it
            matched = self.matched_blocks(r, keys)
            if matched > best_match:
                best, best_match = r, matched
        if best_match and loads[best] - loads[least] <= self.imbalance:
            least = best
        self.index(least).routed(keys)
        self._clock += 1
        self._last_chosen[least] = self._clock
        return least

    def matched_blocks(self, replica: Hashable, keys: Sequence[int]) -> int:
        """How many of the leading blocks ``keys`` replica holds (or was just sent)."""
        index = self.index(replica)
        count = 0
        for key in keys:
            if not index.has(key):
                break
            count += 1
        return count

    def on_events(self, replica: Hashable, events: Sequence[dict]) -> None:
        """A step's KV cache events of one replica, in order."""
        index = self.index(replica)
        for event in events:
            if event["type"] == "BlockStored":
                index.stored(event)
            elif event["type"] == "BlockRemoved":
                index.removed(event)
            elif event["type"] == "AllBlocksCleared":
                index = self.replicas[replica] = _ReplicaIndex(self.max_recent_blocks)

    def forget(self, replica: Hashable) -> None:
        """Drops all a replica was known to hold (it died, or left)."""
        self.replicas.pop(replica, None)
        self._last_chosen.pop(replica, None)
