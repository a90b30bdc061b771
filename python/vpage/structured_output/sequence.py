"""One sequence's constraint: its grammar matcher, gated by the end of its reasoning."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from vpage.structured_output.backend import GrammarMatcher

logger = logging.getLogger("vpage")


class SequenceConstraint:
    """Advances a sequence's matcher over its committed tokens.

    With a reasoning parser the sequence is free until ``is_reasoning_end(prompt + output)``
    holds (checked on the prompt first, then after every token); the grammar applies to the
    tokens after the one that ended the reasoning. ``output_token_ids`` is the sequence's own
    list, read when a token is accepted (after the caller appended it)."""

    def __init__(self, matcher: GrammarMatcher, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                 reasoning: Optional[Any] = None):
        self.matcher = matcher
        self._prompt = prompt_token_ids
        self._output = output_token_ids
        self._reasoning = reasoning
        self.started = reasoning is None or reasoning.is_reasoning_end(list(prompt_token_ids))
        self.rejected = False  # a committed token the grammar did not allow

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (its bitmask row must be filled)."""
        return self.started and not self.rejected and not self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Takes the committed ``token``; True when the sequence must end here: its grammar
        terminated, or it refused the token (a token the sampler could not avoid, e.g. when
        a ban left nothing the grammar allows)."""
        if not self.started:
            self.started = self._reasoning.is_reasoning_end(list(self._prompt) + list(self._output))
            return False
        if not self.active:
            return True
        if not self.matcher.accept_token(token):
            logger.warning("vpage: token %d is outside the sequence's grammar; the sequence ends", token)
            self.rejected = True
            return True
        return self.matcher.is_terminated()
