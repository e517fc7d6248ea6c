"""Imports run one way, down the request path: no module under ``pagedllm/`` imports from a
floor above its own (docs/architecture.md draws the floors).

``FLOORS`` is the one list of the layers, top first. A module may import modules of its own
floor and of any floor below. Every import counts: module level, inside functions (lazy
imports) and under ``TYPE_CHECKING``. The package façade ``pagedllm/__init__.py`` sits above
every floor (it re-exports ``LLM``); ``import pagedllm`` by itself names the package, not a layer.

No two modules import each other, directly or around a circle, and no two layers do (the
same kinds of import count, but those under ``TYPE_CHECKING``, which never run).
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1] / "pagedllm"

FLOORS: list[tuple[str, ...]] = [
    ("entrypoints.cli",),
    ("benchmarks",),
    ("entrypoints", "preload.daemon", "preload.cli", "snapshot", "preload.fork_server"),
    ("engine",),
    ("metrics", "tracing"),
    ("executor",),
    ("worker",),
    ("core",),
    ("structured_output",),
    ("model_executor", "lora", "spec_decode", "preload"),
    ("distributed",),
    ("attention",),
    ("config", "arch_config", "platforms", "env_override", "multimodal"),
    ("kernels",),
    ("messages", "sampling_params", "pooling_params", "outputs", "tokenizer", "model_paths", "logger", "version", "lora.request", "envs",
     "reasoning", "name_registry", "multimodal.inputs", "network"),
]
"""The layers, top first: the ``pagedllm`` command (``entrypoints.cli``: ``serve`` and ``bench``)
> benchmarks > entrypoints > engine > executor/worker > core > model_executor > attention >
kernels, with the plain-data contracts at the bottom."""

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


def _runtime_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The pagedllm modules that running the tree may import (module level and inside
    functions; not under ``if TYPE_CHECKING:``): each dotted name resolved to the longest
    module of ``modules`` it starts with, so ``from pagedllm.engine import core`` is
    ``pagedllm.engine.core`` and ``from pagedllm.config import EngineArgs`` is ``pagedllm.config``."""
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """Module name -> the other pagedllm modules it imports at run time (the façade included)."""
    paths = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        graph[name] = _runtime_imports(ast.parse(path.read_text(), str(path)), set(paths)) - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles of ``graph``, each as the path that closes it (``[a, b, a]``); at least
    one for every group of nodes that reach each other (depth-first search, back edges)."""
    circles: list[list[str]] = []
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> None:
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if target in path:
                circles.append(path[path.index(target) :] + [target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return circles


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nimport pagedllm.x.y\nfrom pagedllm.x import z, Name\n"
        "def f():\n    from pagedllm.w import V\nif TYPE_CHECKING:\n    from pagedllm.t import T\n"
    )
    modules = {"pagedllm.x", "pagedllm.x.y", "pagedllm.x.z", "pagedllm.w", "pagedllm.t"}
    assert _runtime_imports(tree, modules) == {"pagedllm.x", "pagedllm.x.y", "pagedllm.x.z", "pagedllm.w"}


def test_no_module_import_circle():
    assert [" -> ".join(circle) for circle in _circles(_import_graph())] == []


def test_no_layer_import_circle():
    """Two layers of one floor may import from each other's modules only one way."""
    layers: dict[str, set[str]] = {}
    for module, imported in _import_graph().items():
        importer = _layer(module)
        if importer is not None:
            layers.setdefault(importer, set()).update(
                layer for layer in map(_layer, imported) if layer not in (None, importer)
            )
    assert [" -> ".join(circle) for circle in _circles(layers)] == []
