"""Grammar compiles off the engine loop: a small thread pool, an LRU of results keyed by the
constraint, and the backend built on first use."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vpage.sampling_params import SamplingParams, StructuredOutputsParams
from vpage.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from vpage.structured_output.backend_llguidance import LLGuidanceBackend
from vpage.structured_output.backend_xgrammar import XgrammarBackend

BACKENDS: dict[str, type[StructuredOutputBackend]] = {"xgrammar": XgrammarBackend, "llguidance": LLGuidanceBackend}


def backend_class(name: str) -> type[StructuredOutputBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown structured outputs backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]


def validate_structured_outputs(params: SamplingParams, backend: str = "xgrammar") -> None:
    """Checks a request's constraint for ``backend`` without compiling it (milliseconds, no
    tokenizer needed: the API process may call it). ValueError naming what is wrong."""
    so = params.structured_outputs
    if so is None:
        return
    if params.use_beam_search:
        raise ValueError("beam search does not support structured outputs")
    backend_class(backend).validate(so)


def grammar_key(so: StructuredOutputsParams) -> tuple:
    """What identifies a compiled grammar: the kind, its canonical text and the options."""
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, sort_keys=True)
    elif kind == "choice":
        value = json.dumps(list(value))
    elif kind == "json_object":
        value = ""
    return kind, value, so.disable_any_whitespace, so.disable_additional_properties, so.whitespace_pattern


@dataclass
class CompileStats:
    """Counters of one compiler (cumulative)."""

    requests: int = 0  # submit() calls
    cache_hits: int = 0  # of those, grammars compiled or compiling already
    compiles: int = 0  # compiles finished (failed ones included)
    compile_seconds: float = 0.0  # their total time on the worker threads


class StructuredOutputCompiler:
    """One per engine. ``submit`` returns a Future of the compiled grammar (ValueError when it
    does not compile); requests with the same constraint share one compile while it stays in
    the LRU of ``cache_size`` grammars. The backend (its tokenizer tables) is built on the
    first compile, on a worker thread."""

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_workers: int = 2, cache_size: int = 256):
        self.backend_cls = backend_class(backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="vpage-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._backend: Optional[StructuredOutputBackend] = None
        self._backend_lock = threading.Lock()
        self._stats_lock = threading.Lock()  # compiles finish on several threads

    def validate(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        validate_structured_outputs(params, self.backend_cls.name)

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built now if no compile has built it yet."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self.backend_cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._backend

    def submit(self, so: StructuredOutputsParams) -> Future:
        """The compile of ``so``: cached, running, or started now."""
        self.stats.requests += 1
        key = grammar_key(so)
        future = self._cache.get(key)
        if future is not None:
            self.stats.cache_hits += 1
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, so)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, so: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.compile(so)
        finally:
            with self._stats_lock:
                self.stats.compiles += 1
                self.stats.compile_seconds += time.perf_counter() - start

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher of a compiled grammar (``submit(...).result()``)."""
        return self.backend.matcher(compiled)

    def shutdown(self) -> None:
        """Stops the worker threads (compiles under way finish; queued ones are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
