"""Structured outputs: constraints (JSON Schema, regex, choice, grammars, structural tags)
compiled by a backend (xgrammar by default, or llguidance) into per-sequence matchers that
mask the logits of every constrained row before sampling.

Common layer: the engine drives it (engine/structured_outputs.py); the API process may call
``validate_structured_outputs`` to refuse a bad constraint before it reaches the engine.
"""

from vpage.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from vpage.structured_output.bitmask import StepBitmask
from vpage.structured_output.compiler import (BACKENDS, CompileStats, StructuredOutputCompiler, backend_class,
                                              grammar_key, validate_structured_outputs)
from vpage.structured_output.sequence import SequenceConstraint

__all__ = ["BACKENDS", "CompileStats", "GrammarMatcher", "SequenceConstraint", "StepBitmask",
           "StructuredOutputBackend", "StructuredOutputCompiler", "backend_class", "grammar_key",
           "validate_structured_outputs"]
