"""The package's imports point one way: entrypoints -> engine -> executor -> worker ->
spec_decode -> model_executor -> ops -> _core. Every ``vpage`` import in every module (function-local ones
included) is read from the source and checked against the layer order."""

from __future__ import annotations

import ast
from pathlib import Path

import vpage

PACKAGE = Path(vpage.__file__).parent

# Highest layer first; a module may import its own layer and the layers below it.
LAYERS = [
    ("entrypoints", {"cli", "entrypoints", "benchmarks"}),
    ("engine", {"engine", "pooling"}),  # the pooling runner is an engine of its own beside LLMEngine
    ("executor", {"executor"}),
    ("worker", {"worker"}),
    ("spec_decode", {"spec_decode"}),  # proposers and verifier: the engine's and the worker's sides
    ("lora", {"lora"}),  # adapters: requests (engine), loading and slots (worker), hooks on the layers
    ("model_executor", {"model_executor"}),
    # Shared plain modules every layer above may use: parameters, outputs, text, sampling,
    # grammars (structured outputs) and reasoning formats.
    ("common", {"sampling_params", "pooling_params", "outputs", "tokenizer", "sampler", "structured_output",
                "reasoning"}),
    ("distributed", {"distributed"}),
    ("ops", {"ops", "_ops_cpu", "_ops_cuda"}),
    ("config", {"config"}),  # plain data, imports nothing from vpage
    ("_core", {"_core", "_cuda"}),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def _top(module: str) -> str | None:
    """The first component under ``vpage`` of a dotted module name, None outside vpage."""
    parts = module.split(".")
    if parts[0] != "vpage":
        return None
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level vpage component) of every vpage import in ``path``."""
    package = ".".join(("vpage",) + path.relative_to(PACKAGE).with_suffix("").parts[:-1])
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> list[tuple[int, str]]:
    """(line, top-level vpage component) of every vpage import in module ``source`` of
    ``package`` (for relative imports)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] if base != "vpage" else [f"vpage.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, top) for top in map(_top, names) if top]
    return found


def _layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_belongs_to_a_layer():
    tops = {_layer_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert tops <= set(RANK), f"modules outside the layer map: {sorted(tops - set(RANK))}"


def test_imports_point_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer_of(path)
        if layer == "__init__":  # the package's lazy exports name the public entry points
            continue
        for line, top in _imports(path):
            if top in RANK and RANK[top] < RANK[layer]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({layer}) imports vpage.{top}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_nothing_below_the_engine_imports_the_engine():
    below = {top for top, rank in RANK.items() if rank > RANK["engine"]}
    offenders = [f"{p.relative_to(PACKAGE)}:{line}" for p in PACKAGE.rglob("*.py") if _layer_of(p) in below
                 for line, top in _imports(p) if top == "engine"]
    assert not offenders, offenders


def test_the_checker_sees_function_local_and_relative_imports():
    source = "import os\ndef f():\n    from vpage.engine import llm_engine\n    from ..entrypoints import llm\n" \
             "    import vpage.ops\n    from vpage import sampler\n"
    assert [top for _, top in _imports_in(source, "vpage.worker")] == ["engine", "entrypoints", "ops", "sampler"]
