"""Imports run one way, down the request path: no module under ``pagedllm/`` imports from a
floor above its own (docs/architecture.md draws the floors).

``FLOORS`` is the one list of the layers, top first. A module may import modules of its own
floor and of any floor below. Every import counts: module level, inside functions (lazy
imports) and under ``TYPE_CHECKING``. The package façade ``pagedllm/__init__.py`` sits above
every floor (it re-exports ``LLM``); ``import pagedllm`` by itself names the package, not a layer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1] / "pagedllm"

FLOORS: list[tuple[str, ...]] = [
    ("entrypoints", "benchmarks", "testing"),
    ("engine",),
    ("metrics",),
    ("executor",),
    ("worker",),
    ("core",),
    ("structured_output",),
    ("model_executor", "lora", "spec_decode"),
    ("distributed",),
    ("attention",),
    ("config", "arch_config", "platforms", "env_override"),
    ("kernels",),
    ("messages", "sampling_params", "outputs", "tokenizer", "model_paths", "logger", "version", "lora.request", "envs"),
]
"""The layers, top first: entrypoints > engine > executor/worker > core > model_executor >
attention > kernels, with the plain-data contracts at the bottom."""

FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}


def _layer(module: str) -> str | None:
    """The layer of a dotted ``pagedllm.x.y`` module name: ``x.y`` where ``FLOORS`` names that
    module on its own (``lora.request``: plain data under a package of the model floor),
    else ``x``; None for the package itself."""
    parts = module.split(".")
    if ".".join(parts[1:3]) in FLOOR_OF:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else None


def _module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every pagedllm module the tree imports; ``from pagedllm import
    x`` counts as importing ``pagedllm.x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pagedllm":
                found += [(node.lineno, f"pagedllm.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] == "pagedllm"]


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if p != PACKAGE_DIR / "__init__.py")


def test_every_layer_is_on_a_floor():
    layers = {_layer(_module_name(p)) for p in _sources()}
    assert sorted(layers - set(FLOOR_OF)) == []


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_no_import_from_a_floor_above(path: pathlib.Path):
    importer = _layer(_module_name(path))
    upward = []
    for line, name in _imported_modules(ast.parse(path.read_text(), str(path))):
        layer = _layer(name)
        if layer is not None and FLOOR_OF.get(layer, -1) < FLOOR_OF[importer]:
            upward.append(f"line {line}: {importer} imports {name}")
    assert upward == []
