"""Tensor-parallel execution: the per-rank worker and the executors that start the ranks
(``mp``: local processes; ``ray``: Ray actors)."""
