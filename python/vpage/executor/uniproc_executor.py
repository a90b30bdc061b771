"""One worker in the engine's process: no process group, no messages."""

from __future__ import annotations

from typing import Optional

from vpage import ops
from vpage.config import EngineConfig
from vpage.distributed import parallel_state
from vpage.executor.abstract import Executor
from vpage.worker.step_io import DraftRequest, ModelRunnerOutput, SamplingMetadata
from vpage.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.parallel.num_threads is not None:
            ops.set_num_threads(config.parallel.num_threads)
        with parallel_state.single_rank():
            self.driver_worker = Worker(config)
        self.num_gpu_blocks, self.num_cpu_blocks = self.driver_worker.determine_num_blocks()
        self.driver_worker.init_cache(self.num_gpu_blocks, self.num_cpu_blocks)

    def execute(self, plan, sampling: Optional[SamplingMetadata],
                drafts: Optional[DraftRequest] = None) -> Optional[ModelRunnerOutput]:
        return self.driver_worker.execute(plan, sampling, drafts)
