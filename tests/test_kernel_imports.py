"""No import cycle among the ``kvtune.kernels`` modules, read from their source with ``ast``.

The rule: module A depends on module B (both in ``kernels/``) when importing A runs an import of B, that is an
``import`` or ``from ... import`` statement

* at module level, also inside module-level ``if``/``try``/``with``/``for`` blocks and class bodies, except
  under ``if TYPE_CHECKING:`` (never run);
* or inside a module-level function that the module itself calls while it is imported: by name, in a
  module-level statement (``x = f()``) or as a decorator of a module-level function or class.

Imports inside functions that run later (a dispatcher's lazy import of its Triton module on first use) do not
count: by then both modules are imported. These dependencies must form no cycle, so that any kernel module
imports on its own, in any order.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import kvtune.kernels

PACKAGE = "kvtune.kernels"
KERNELS = Path(kvtune.kernels.__path__[0])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The ``kernels`` modules (names without the package) an import statement imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level:  # relative: ``from . import x`` or ``from .x import y`` inside the package
        names = [node.module] if node.module else [a.name for a in node.names]
        names = [f"{PACKAGE}.{n}" for n in names]
    elif node.module == PACKAGE:  # ``from kvtune.kernels import x``
        names = [f"{PACKAGE}.{a.name}" for a in node.names]
    else:
        names = [node.module or ""]
    out = set()
    for name in names:
        parts = name.split(".")
        if ".".join(parts[:2]) == PACKAGE and len(parts) > 2 and parts[2] in modules:
            out.add(parts[2])
    return out


def _run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body that run when it is imported, with nested blocks flattened (function
    bodies excluded; class bodies included; ``if TYPE_CHECKING:`` blocks left out)."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                out += _run_at_import(stmt.body)
            out += _run_at_import(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                out += _run_at_import(block)
        elif isinstance(stmt, (ast.With, ast.For, ast.While, ast.ClassDef)):
            out += _run_at_import(stmt.body)
    return out


def import_edges(source: str, modules: set[str]) -> set[str]:
    """The ``kernels`` modules that importing a module of this source imports (the module docstring)."""
    tree = ast.parse(source)
    top = _run_at_import(tree.body)
    functions = {s.name: s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called: set[str] = set()
    for stmt in top:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nodes: list[ast.AST] = list(stmt.decorator_list)
        else:
            nodes = [stmt]
        for node in nodes:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id in functions:
                    called.add(sub.id)
    edges: set[str] = set()
    for stmt in top:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            edges |= _imported(stmt, modules)
    for name in called:
        for sub in ast.walk(functions[name]):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                edges |= _imported(sub, modules)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def kernels_graph() -> dict[str, set[str]]:
    sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted(KERNELS.glob("*.py"))}
    modules = set(sources) - {"__init__"}
    return {name: import_edges(src, modules) - {name} for name, src in sources.items() if name in modules}


def test_kernels_import_graph_has_no_cycle() -> None:
    graph = kernels_graph()
    assert {"decode_attention", "triton_decode", "gluon_decode", "triton_common"} <= set(graph)
    assert "decode_attention" in graph["triton_decode"]  # the reader sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among kvtune.kernels modules: " + " -> ".join(cycle or [])


def test_triton_launchers_do_not_import_each_other_for_helpers() -> None:
    """Host helpers shared by the Triton launchers live in ``triton_common``, not in ``triton_decode``."""
    graph = kernels_graph()
    for name, deps in graph.items():
        if name != "triton_decode":
            assert "triton_decode" not in deps, name


@pytest.mark.parametrize(
    ("graph", "cyclic"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),  # a diamond is no cycle
        ({"a": {"a"}}, True),
        ({"a": {"b"}, "b": {"a"}}, True),
        ({"x": set(), "a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ],
)
def test_find_cycle(graph: dict[str, set[str]], cyclic: bool) -> None:
    cycle = find_cycle(graph)
    assert (cycle is not None) == cyclic
    if cycle:
        assert cycle[0] == cycle[-1] and all(b in graph[a] for a, b in itertools.pairwise(cycle))


@pytest.mark.parametrize(
    ("source", "edges"),
    [
        ("from kvtune.kernels.b import f\nimport kvtune.kernels.c\n", {"b", "c"}),
        ("from kvtune.kernels import b, nothing\nfrom . import c\nfrom .d import g\n", {"b", "c", "d"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtune.kernels.b import T\n", set()),
        ("def f():\n    from kvtune.kernels.b import g\n    return g()\n", set()),  # lazy: later
        ("def f():\n    from kvtune.kernels.b import g\n    return g\nX = f()\n", {"b"}),  # run at import
        ("def deco(fn):\n    import kvtune.kernels.c\n    return fn\n@deco\ndef h():\n    pass\n", {"c"}),
        ("try:\n    from kvtune.kernels.b import g\nexcept ImportError:\n    g = None\n", {"b"}),
        ("class K:\n    from kvtune.kernels.c import x\n", {"c"}),
        ("from kvtune.kernels_extra.b import f\nfrom torch import b\n", set()),
    ],
)
def test_import_edges(source: str, edges: set[str]) -> None:
    assert import_edges(source, {"b", "c", "d"}) == edges


def test_a_cycle_through_the_edges_is_found() -> None:
    """The reader and the cycle finder together: two modules importing each other at import time."""
    modules = {"a", "b"}
    graph = {
        "a": import_edges("from kvtune.kernels.b import f\n", modules),
        "b": import_edges("def g():\n    from kvtune.kernels.a import h\n    return h\nY = g()\n", modules),
    }
    assert find_cycle(graph) == ["a", "b", "a"]
