"""Data parallelism behind one API server: ``data_parallel_size`` engine replicas, each a whole
engine-core process (its own KV cache, its share of the cores; a local process, or a Ray actor
with ``data_parallel_backend="ray"``), driven by one
:class:`EngineCoreClient` each, with a :class:`PrefixRouter` choosing the replica of every
request from the replicas' KV cache events and loads.

:class:`DPEngineCoreClient` offers what the server uses of an ``EngineCoreClient``. A request
lives on one replica from admission to its end. A replica that dies fails only its own requests
(503, naming the replica); the others go on serving, and the server dies with the last one.
LoRA adapters are loaded into every replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Awaitable, Callable, Optional

import torch

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_client import EngineCoreClient, EngineDeadError, RequestStream
from vpage.engine.core_messages import CommandReply, CoreReady, StepOutputs
from vpage.engine.dp_router import PrefixRouter
from vpage.lora.request import LoRARequest
from vpage.outputs import RequestOutput
from vpage.sampling_params import SamplingParams

logger = logging.getLogger("vpage")

ROUTING_POLICIES = ("prefix", "round_robin")


def replica_cores(num_replicas: int) -> list[list[int]]:
    """This process's cores split into ``num_replicas`` contiguous shares (a replica gets at least
    one; with fewer cores than replicas, shares repeat)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_replicas)
    return [[cores[(i * per + j) % len(cores)] for j in range(per)] for i in range(num_replicas)]


class DPEngineCoreClient:
    """Starts ``args.data_parallel_size`` engine-core processes and routes requests among them.
    ``routing``: "prefix" (the longest cached prefix, then the least loaded) or "round_robin"
    (for comparison). ``on_step(msg, outputs, now, engine)`` sees every replica's steps."""

    def __init__(self, args: EngineArgs, on_step: Optional[Callable[..., None]] = None,
                 on_dead: Optional[Callable[[str], None]] = None, routing: str = "prefix"):
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
        if args.device != "cpu" and torch.cuda.is_available():
            raise ValueError("data_parallel_size > 1 runs CPU replicas (one GPU per replica is not supported "
                             "yet); pass --device cpu, or run one server per GPU")
        n = args.data_parallel_size
        self.args = args
        self.on_step = on_step
        self.on_dead = on_dead
        self.routing = routing
        self.router = PrefixRouter(args.block_size)
        ray = args.data_parallel_backend == "ray"
        cores = replica_cores(n)
        threads = max(1, (args.num_threads or torch.get_num_threads()) // n)
        # A Ray actor takes as many CPUs as it runs threads (and needs none of this node's cores).
        self.replicas = [
            EngineCoreClient(dataclasses.replace(args, data_parallel_rank=i, num_threads=threads),
                             on_step=self._step_callback(i), on_dead=self._dead_callback(i),
                             cpu_ids=None if ray else cores[i], ray_cpus=threads if ray else None)
            for i in range(n)]
        self._next = 0  # round robin

    # ------------------------------------------------------------------ what the server reads

    @property
    def info(self) -> Optional[CoreReady]:
        return self.replicas[0].info

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def pid(self) -> list[Optional[int]]:
        return [r.pid for r in self.replicas]

    @property
    def dead_reason(self) -> Optional[str]:
        """None while a replica serves; the last replica's reason once all have died."""
        reasons = [r.dead_reason for r in self.replicas]
        return None if any(reason is None for reason in reasons) else reasons[-1]

    async def start(self, timeout_s: float = 1800.0) -> CoreReady:
        """Starts every replica (all or none: one that fails stops the others)."""
        results = await asyncio.gather(*(r.start(timeout_s) for r in self.replicas), return_exceptions=True)
        failed = [res for res in results if isinstance(res, BaseException)]
        if failed:
            await self.shutdown()
            raise failed[0]
        return self.info

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> RequestStream:
        replica = self.replicas[self._choose(prompt_token_ids, lora_request)]
        return replica.add_request(request_id, prompt_token_ids, params, cache_salt, lora_request)

    def _choose(self, prompt_token_ids: list[int], lora_request: Optional[LoRARequest]) -> int:
        loads = {i: None if r.dead_reason is not None else r.num_unfinished() for i, r in enumerate(self.replicas)}
        if all(load is None for load in loads.values()):
            raise EngineDeadError(self.dead_reason or "no engine replica is serving")
        if self.routing == "round_robin":
            n = len(loads)
            choice = next(i % n for i in range(self._next, self._next + n) if loads[i % n] is not None)
            self._next = (choice + 1) % n
            return choice
        return self.router.choose(prompt_token_ids, loads, lora_request.lora_int_id if lora_request else 0)

    async def lora_command(self, add: Optional[LoRARequest] = None, remove: Optional[int] = None) -> CommandReply:
        """The command on every serving replica; the first failure's reply, else success."""
        return await self._broadcast(lambda r: r.lora_command(add, remove))

    async def reset_prefix_cache(self) -> CommandReply:
        """Every serving replica's cache emptied; the first refusal's reply, else success."""
        return await self._broadcast(lambda r: r.reset_prefix_cache())

    async def _broadcast(self, command: Callable[[EngineCoreClient], Awaitable[CommandReply]]) -> CommandReply:
        live = [r for r in self.replicas if r.dead_reason is None]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine replica is serving")
        replies = await asyncio.gather(*(command(r) for r in live))
        return next((reply for reply in replies if reply.error is not None), replies[0])

    def abort(self, request_ids: list[str]) -> None:
        for replica in self.replicas:
            replica.abort(request_ids)  # each aborts the ones it holds

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def num_unfinished(self) -> int:
        return sum(r.num_unfinished() for r in self.replicas)

    def num_waiting_estimate(self) -> int:
        return sum(r.num_waiting_estimate() for r in self.replicas if r.dead_reason is None)

    def health(self, stall_s: float) -> Optional[str]:
        """None while any replica serves; else the reason of the last one."""
        reasons = [r.health(stall_s) for r in self.replicas]
        return None if any(reason is None for reason in reasons) else reasons[-1]

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))
        if self.args.data_parallel_backend == "ray":  # the local Ray instance goes now, not at exit
            import ray

            await asyncio.get_running_loop().run_in_executor(None, ray.shutdown)

    # ------------------------------------------------------------------ plumbing

    def _step_callback(self, i: int) -> Callable[[StepOutputs, list[RequestOutput], float], None]:
        def on_step(msg: StepOutputs, outputs: list[RequestOutput], now: float) -> None:
            if msg.kv_events:
                self.router.on_events(i, msg.kv_events)
            if self.on_step is not None:
                self.on_step(msg, outputs, now, i)
        return on_step

    def _dead_callback(self, i: int) -> Callable[[str], None]:
        def on_dead(reason: str) -> None:
            self.router.forget(i)
            alive = sum(r.dead_reason is None for r in self.replicas)
            logger.error("vpage: %s; %d of %d replicas serve on", reason, alive, len(self.replicas))
            if alive == 0 and self.on_dead is not None:
                self.on_dead(reason)
        return on_dead
