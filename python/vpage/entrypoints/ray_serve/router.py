"""Ray Serve request router for the engine deployment: the replica that was sent the longest
prefix of a request's prompt (:class:`vpage.engine.dp_router.PrefixRouter`, keyed by Serve's
replica ids), unless it is too busy; else the least loaded.

It runs in the process that holds the deployment handle (the ingress), from the prompts it
routes: Serve replicas publish no KV events to it, so a replica's prefixes are those it was
recently sent (bounded per replica), as Ray Serve LLM's prefix-aware router keeps them. Loads
are Serve's queue lengths where it has them, else the replicas' own ``record_routing_stats``.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vpage.engine.dp_router import PrefixRouter


class VpagePrefixRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 16, max_recent_blocks: int = 16384) -> None:
        self._prefix = PrefixRouter(block_size, imbalance, max_recent_blocks)

    def _load(self, replica: RunningReplica) -> int:
        queue_len = self._replica_queue_len_cache.get(replica.replica_id)
        if queue_len is not None:
            return queue_len
        return int((replica.routing_stats or {}).get("num_unfinished", 0))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else []
        # The engine deployment's generate(request_id, prompt_token_ids, params, cache_salt, lora_request).
        if len(args) < 2 or not isinstance(args[1], list):
            return [candidate_replicas]
        lora = args[4] if len(args) > 4 else None
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = self._prefix.choose(args[1], {rid: self._load(r) for rid, r in by_id.items()},
                                     lora.lora_int_id if lora is not None else 0)
        return [[by_id[chosen]]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefix.forget(replica_id)
