"""One worker in the engine's process: no process group, no messages."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from vpage import ops
from vpage.config import EngineConfig
from vpage.distributed import parallel_state
from vpage.executor.abstract import Executor
from vpage.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.parallel.num_threads is not None:
            ops.set_num_threads(config.parallel.num_threads)
        with parallel_state.single_rank():
            self.driver_worker = Worker(config)
        self.num_gpu_blocks, self.num_cpu_blocks = self.driver_worker.determine_num_blocks()
        self.driver_worker.init_cache(self.num_gpu_blocks, self.num_cpu_blocks)

    def execute(self, plan, logit_rows: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
        return self.driver_worker.execute(plan, logit_rows)
