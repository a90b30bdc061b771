"""The executor's error, importable without torch (the API process of a server reads it)."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot step any more."""
