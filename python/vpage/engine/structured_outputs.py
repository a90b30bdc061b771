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
from vpage.engine.request_state import RequestState
from vpage.sampling_params import SamplingParams
from vpage.structured_output import SequenceConstraint, StepBitmask, StructuredOutputCompiler

# How long a step with nothing else to run waits for a compile to finish (seconds).
_IDLE_WAIT_S = 0.02


@dataclass
class _Waiting:
    future: concurrent.futures.Future
    admit: Callable[[Any], None]  # enters the request into the scheduler, given its grammar


class StructuredOutputs:
    """Compiles, holds waiting requests, and builds each step's bitmask."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 max_num_seqs: int, device: torch.device):
        self.compiler = StructuredOutputCompiler(config.backend, tokenizer, vocab_size, eos_token_ids)
        self.reasoning = None
        if config.reasoning_parser:
            from vpage.reasoning import get_reasoning_parser

            self.reasoning = get_reasoning_parser(config.reasoning_parser)(tokenizer)
        self.pending: dict[str, _Waiting] = {}
        self._errors: list[tuple[str, str]] = []
        self._live: dict[str, RequestState] = {}  # requests in the scheduler with a grammar
        self._bitmask = StepBitmask(vocab_size, max_num_seqs, device)

    # ------------------------------------------------------------------ requests

    def validate(self, params: SamplingParams) -> None:
        """ValueError when the request's constraint is invalid (parsed, not compiled)."""
        self.compiler.validate(params)

    def submit(self, request_id: str, params: SamplingParams, admit: Callable[[Any], None]) -> None:
        """Starts (or finds) the compile of a validated request's grammar: ``admit(grammar)``
        runs now when it is ready, else at a later ``admit_ready``. A grammar that already
        failed to compile raises ValueError now."""
        future = self.compiler.submit(params.structured_outputs)
        if future.done():
            admit(future.result())  # raises the compile's ValueError
        else:
            self.pending[request_id] = _Waiting(future, admit)

    def attach(self, state: RequestState, grammar: Any) -> None:
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

    def bitmask(self, seq_ids: list[int], seq_owner: dict[int, RequestState]) -> Optional[torch.Tensor]:
        """The step's token bitmask for its sampled sequences (None when none is constrained)."""
        if not self._live:
            return None
        self._live = {rid: state for rid, state in self._live.items() if not state.finished}
        return self._bitmask.build([seq_owner[s].seqs[s].constraint for s in seq_ids])

    def shutdown(self) -> None:
        self.compiler.shutdown()
