"""The engine: arguments, KV cache, model runner and the add_request / step loop."""

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine

__all__ = ["EngineArgs", "LLMEngine"]
