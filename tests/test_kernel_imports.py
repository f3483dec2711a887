"""No import cycle among kvtune's modules (``kernels/`` first, every other package too), read from their
source with ``ast``.

The rule: module A depends on module B when A's source holds an ``import`` or ``from ... import`` of B
anywhere: at module level, inside a function that runs later (a dispatcher's import of its Triton module on
first use), or under ``if TYPE_CHECKING:``. These dependencies form no cycle, lazy or not. What two modules
share lives in a module below both: a kernel's PyTorch reference in ``kernels/<op>_ref.py``, which its
dispatcher and its Triton launcher both import; the decode kernel's choice and options in
``kernels/decode_choice.py``; what ``tuner/preflight.py`` reads of a run, as a ``Protocol`` declared there.
So every module imports on its own, in any order, and reading one never leads back to itself.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

import pytest

import kvtune

ROOT = Path(kvtune.__path__[0]).resolve().parent
PACKAGES = ("kernels", "cache_impl", "engine", "search_spaces", "studies", "tuner")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _within(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` (dotted, without ``kvtune.``) is or lies in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules an import statement of ``module`` imports (names without ``kvtune.``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: ``from . import x`` or ``from .x import y``
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = (node.module or "").removeprefix("kvtune.")
            if not (node.module or "").startswith("kvtune."):
                return set()
        # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name`` the module ``mod``
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        return {m for m in names if m in known}
    out = set()
    for name in names:
        if name.startswith("kvtune.") and (inner := _within(name.removeprefix("kvtune."), known)):
            out.add(inner)
    return out


def import_edges(source: str, module: str, known: set[str], is_package: bool = False) -> set[str]:
    """Every known module the source of ``module`` imports, wherever the import stands (module docstring)."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= _imported(node, module, is_package, known)
    return edges - {module}


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


def _modules() -> dict[str, Path]:
    """Every module of the packages by dotted name without ``kvtune.`` (a package by its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: import_edges(path.read_text(encoding="utf-8"), name, known, path.name == "__init__.py")
        for name, path in modules.items()
    }


def _cycle_message(cycle: list[str] | None, where: str) -> str:
    return (
        f"import cycle among {where} (every import counted, in functions and under TYPE_CHECKING too): "
        + (" -> ".join(cycle or []))
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_within_a_package(package: str) -> None:
    graph = {
        name: {m for m in deps if m.split(".")[0] == package}
        for name, deps in import_graph().items()
        if name.split(".")[0] == package
    }
    cycle = find_cycle(graph)
    assert cycle is None, _cycle_message(cycle, f"the kvtune.{package} modules")


def test_no_import_cycle_across_packages() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, _cycle_message(cycle, "the kvtune modules")


def test_the_reader_sees_the_real_edges() -> None:
    """Imports at module level and inside functions (a dispatcher's import of its Triton launcher) alike."""
    graph = import_graph()
    assert {"kernels.decode_attention", "kernels.triton_decode", "kernels.gluon_decode"} <= set(graph)
    assert {"kernels.decode_ref", "kernels.decode_choice", "kernels.gluon_decode"} <= graph[
        "kernels.triton_decode"
    ]
    assert "kernels.triton_decode" in graph["kernels.decode_attention"]  # inside hybrid_decode_attention
    assert "kernels.gluon_decode" in graph["kernels.decode_choice"]  # inside decode_kernel
    assert "tuner.preflight" in graph["tuner.job"]


def test_triton_launchers_do_not_import_each_other_for_helpers() -> None:
    """Host helpers shared by the Triton launchers live in ``triton_common``, not in ``triton_decode``: only
    its dispatcher imports it."""
    importers = {name for name, deps in import_graph().items() if "kernels.triton_decode" in deps}
    assert importers <= {"kernels.decode_attention"}, sorted(importers)


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


KNOWN = {"kernels", "kernels.a", "kernels.b", "kernels.c", "kernels.d", "tuner.export", "tuner.job",
         "tuner.commands", "tuner.commands.x"}  # fmt: skip


@pytest.mark.parametrize(
    ("module", "source", "edges"),
    [
        (
            "kernels.a",
            "from kvtune.kernels.b import f\nimport kvtune.kernels.c\n",
            {"kernels.b", "kernels.c"},
        ),
        ("kernels.a", "from kvtune.kernels import b, nothing\n", {"kernels.b", "kernels"}),
        ("kernels.a", "from . import c\nfrom .d import g\n", {"kernels.c", "kernels.d"}),
        (
            "kernels.a",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtune.kernels.b import T\n",
            {"kernels.b"},
        ),
        (
            "kernels.a",
            "def f():\n    from kvtune.kernels.b import g\n    return g()\n",
            {"kernels.b"},
        ),
        ("kernels.a", "class K:\n    def m(self):\n        import kvtune.kernels.c.inner\n", {"kernels.c"}),
        (
            "kernels.a",
            "try:\n    from kvtune.kernels.b import g\nexcept ImportError:\n    g = None\n",
            {"kernels.b"},
        ),
        ("kernels.a", "from kvtune.kernels.a import f\n", set()),  # itself
        (
            "tuner.commands.x",
            "from .. import export\nfrom ..job import tune\n",
            {"tuner.export", "tuner.job"},
        ),
        ("kernels.a", "from kvtune.kernels_extra.b import f\nfrom torch import b\nimport kernels.b\n", set()),
    ],
)
def test_import_edges(module: str, source: str, edges: set[str]) -> None:
    assert import_edges(source, module, KNOWN) == edges


def test_a_package_reads_its_relative_imports_from_itself() -> None:
    assert import_edges("from . import x\n", "tuner.commands", KNOWN, is_package=True) == {"tuner.commands.x"}


def test_a_lazy_cycle_is_found() -> None:
    """A dispatcher that imports its Triton module inside a function, whose Triton module imports the
    dispatcher back at module level for the reference: the shape every kernel pair had before their
    references moved below both."""
    known = {"kernels.quest", "kernels.triton_quest"}
    graph = {
        "kernels.quest": import_edges(
            "def quest_topk(q):\n    from kvtune.kernels.triton_quest import quest_topk_triton\n"
            "    return quest_topk_triton(q)\n",
            "kernels.quest",
            known,
        ),
        "kernels.triton_quest": import_edges(
            "from kvtune.kernels.quest import quest_topk_ref\n", "kernels.triton_quest", known
        ),
    }
    assert find_cycle(graph) == ["kernels.quest", "kernels.triton_quest", "kernels.quest"]
