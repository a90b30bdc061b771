"""``ray``: the extra ranks are Ray actors in one placement group (one bundle per rank, a GPU
each on CUDA), so the same code runs on a local Ray instance or a multi-node cluster
(``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others, then
run the engine on the head). The engine's process is rank 0; the actors connect to its
torch.distributed store at this node's IP address. Actors are owned by the engine's
process, so Ray stops them when it dies.
"""

from __future__ import annotations

import os

from vpage.config import EngineConfig
from vpage.executor.tensor_parallel import TensorParallelExecutor, timeout_s

_STOP_S = 5.0


class _RankActor:
    """The body of one Ray actor: a worker rank."""

    def run(self, config: EngineConfig, rank: int, init_method: str, backend: str, timeout: float) -> None:
        from vpage.executor.mp_executor import run_worker

        os.environ.setdefault("VPAGE_LOCAL_RANK", "0")  # Ray sets CUDA_VISIBLE_DEVICES per actor
        run_worker(config, rank, init_method, backend, timeout)


class RayExecutor(TensorParallelExecutor):
    def __init__(self, config: EngineConfig):
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        self.host = ray.util.get_node_ip_address()
        super().__init__(config)

    def _start_workers(self, init_method: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.backend == "nccl"
        size = self.config.parallel.world_size
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([bundle] * (size - 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=timeout_s())
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RankActor)
        self.actors, self.runs = [], []
        for rank in range(1, size):
            actor = actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank - 1)).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(self.config, rank, init_method, self.backend, timeout_s()))

    def _dead_workers(self) -> list[str]:
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        dead = []
        for rank, ref in enumerate(self.runs, start=1):
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                    dead.append(f"rank {rank} (Ray actor) left its loop")
                except Exception as e:  # noqa: BLE001 -- any actor failure is reported as is
                    dead.append(f"rank {rank} (Ray actor) failed: {type(e).__name__}: {str(e)[:500]}")
        return dead

    def _stop_workers(self, graceful: bool) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=_STOP_S)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)
