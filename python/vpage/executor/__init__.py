"""Executors: how the engine's plans reach the model. One interface (``Executor``) with a
one-process, an ``mp`` (local worker processes) and a ``ray`` (Ray actors) implementation."""
