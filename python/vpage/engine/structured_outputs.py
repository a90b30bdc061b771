"""The engine's side of structured outputs: requests wait here until their grammar compiles,
then enter the scheduler with one matcher per sequence; each step gets its token bitmask.

A request whose grammar is ready (cached) enters the scheduler at once; others wait in
``pending`` while the compiler's threads work, and every step admits those whose compile has
finished (others go on meanwhile). A compile that fails ends its request with an error that
``take_errors`` hands out; aborting a waiting request just forgets it.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from vpage.config import StructuredOutputsConfig
from vpage.engine.core_requests import CoreRequest
from vpage.reasoning import get_reasoning_parser
from vpage.sampling_params import SamplingParams
from vpage.structured_output import SequenceConstraint, StepBitmask, StructuredOutputCompiler
from vpage.structured_output.compiler import backend_class, validate_structured_outputs

# How long a step with nothing else to run waits for a compile to finish (seconds).
_IDLE_WAIT_S = 0.02


@dataclass
class _Waiting:
    future: concurrent.futures.Future
    admit: Callable[[Any], None]  # enters the request into the scheduler, given its grammar


class StructuredOutputs:
    """Compiles, holds waiting requests, and builds each step's bitmask."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Callable[[], Any], has_tokenizer: bool,
                 vocab_size: int, eos_token_ids: list[int], max_num_seqs: int, device: torch.device):
        """``tokenizer()`` gives the model's tokenizer when the first grammar needs it (an engine
        core without text work loads it only then); ``has_tokenizer``: whether there is one."""
        self.config = config
        self._tokenizer, self._has_tokenizer = tokenizer, has_tokenizer
        self._vocab_size, self._eos_token_ids = vocab_size, eos_token_ids
        backend_class(config.backend)  # an unknown backend or reasoning parser fails now
        if config.reasoning_parser:
            get_reasoning_parser(config.reasoning_parser)
        self._compiler: Optional[StructuredOutputCompiler] = None
        self.reasoning = None
        self.pending: dict[str, _Waiting] = {}
        self._errors: list[tuple[str, str]] = []
        self._live: dict[str, CoreRequest] = {}  # requests in the scheduler with a grammar
        self._bitmask = StepBitmask(vocab_size, max_num_seqs, device)

    @property
    def compiler(self) -> StructuredOutputCompiler:
        """The grammar compiler (and the reasoning parser), built with the tokenizer on first need."""
        if self._compiler is None:
            tokenizer = self._tokenizer()
            self._compiler = StructuredOutputCompiler(self.config.backend, tokenizer, self._vocab_size,
                                                      self._eos_token_ids)
            if self.config.reasoning_parser:
                self.reasoning = get_reasoning_parser(self.config.reasoning_parser)(tokenizer)
        return self._compiler

    # ------------------------------------------------------------------ requests

    def validate(self, params: SamplingParams) -> None:
        """ValueError when the request's constraint is invalid (parsed, not compiled)."""
        if params.structured_outputs is not None and not self._has_tokenizer:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        validate_structured_outputs(params, self.config.backend)

    def submit(self, request_id: str, params: SamplingParams, admit: Callable[[Any], None]) -> None:
        """Starts (or finds) the compile of a validated request's grammar: ``admit(grammar)``
        runs now when it is ready, else at a later ``admit_ready``. A grammar that already
        failed to compile raises ValueError now."""
        future = self.compiler.submit(params.structured_outputs)
        if future.done():
            admit(future.result())  # raises the compile's ValueError
        else:
            self.pending[request_id] = _Waiting(future, admit)

    def attach(self, state: CoreRequest, grammar: Any) -> None:
        """Gives each sequence of a request entering the scheduler its own matcher."""
        for seq in state.seqs.values():
            seq.constraint = SequenceConstraint(self.compiler.matcher(grammar), state.prompt_token_ids,
                                                seq.output_token_ids, self.reasoning)
        self._live[state.request_id] = state

    def is_pending(self, request_id: str) -> bool:
        return request_id in self.pending

    def abort(self, request_id: str) -> bool:
        """Forgets a waiting request; False when it is not waiting."""
        return self.pending.pop(request_id, None) is not None

    def admit_ready(self, wait: bool = False) -> None:
        """Admits the waiting requests whose compile has finished, in arrival order; a failed
        compile becomes an error. ``wait``: first wait a little for one to finish (the engine
        has nothing else to run)."""
        if wait:
            concurrent.futures.wait([w.future for w in self.pending.values()], timeout=_IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, waiting in list(self.pending.items()):
            if not waiting.future.done():
                continue
            del self.pending[request_id]
            try:
                waiting.admit(waiting.future.result())
            except Exception as exc:  # noqa: BLE001 -- the compile's ValueError, or its cancellation at shutdown
                self._errors.append((request_id, str(exc) or type(exc).__name__))

    def take_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests that failed since the last call; they are
        no longer in the engine."""
        errors, self._errors = self._errors, []
        return errors

    # --------------------------------------------------------------------- steps

    def bitmask(self, seq_ids: list[int], seq_owner: dict[int, CoreRequest]) -> Optional[torch.Tensor]:
        """The step's token bitmask for its sampled sequences (None when none is constrained)."""
        if not self._live:
            return None
        self._live = {rid: state for rid, state in self._live.items() if not state.finished}
        return self._bitmask.build([seq_owner[s].seqs[s].constraint for s in seq_ids])

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
