"""Model execution: the step's inputs, model classes, and loading them from disk."""

from vpage.model_executor.config import ModelConfig
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.loader.model_loader import LoadedModel, load_model, resolve_device
from vpage.model_executor.model_info import ModelFacts, inspect_model

__all__ = ["ForwardBatch", "LoadedModel", "ModelConfig", "ModelFacts", "inspect_model", "load_model", "resolve_device"]
