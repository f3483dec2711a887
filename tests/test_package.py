"""Packaging: the folders map into one ``kvtune`` namespace, and imports point one way (docs/DESIGN.md §4)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtune

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "cache_impl", "engine", "search_spaces", "studies", "tuner")
# what each package may import from kvtune (besides itself and the root package)
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "cache_impl": {"kernels"},
    "engine": {"kernels", "cache_impl"},
    "search_spaces": {"kernels", "cache_impl", "engine"},
    "studies": {"kernels", "cache_impl", "engine", "search_spaces"},
    "tuner": {"kernels", "cache_impl", "engine", "search_spaces", "studies"},
}
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "kernels": {"optuna", "ray"},
    "cache_impl": {"optuna", "ray"},
    "engine": {"optuna", "ray"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _edges() -> list[tuple[str, Path, str]]:
    return [
        (package, path, name)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package: str) -> None:
    wrong = []
    for owner, path, name in _edges():
        if owner != package:
            continue
        parts = name.split(".")
        inner = parts[1] if parts[0] == "kvtune" and len(parts) > 1 else None
        if inner in PACKAGES and inner != package and inner not in ALLOWED[package]:
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
        if parts[0] in FORBIDDEN_THIRD_PARTY.get(package, set()):
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
        if parts[0] in PACKAGES:
            wrong.append(
                f"{path.relative_to(ROOT)} imports the bare top-level name {name}; use kvtune.{name}"
            )
    assert not wrong, "\n".join(wrong)


def test_installed_kernels_is_the_projects_own(tmp_path: Path) -> None:
    """Hugging Face ships a top-level ``kernels`` package; ours must stay ``kvtune.kernels``."""
    pytest.importorskip("kernels", reason="Hugging Face's `kernels` package is not installed")
    code = (
        "import kernels, kvtune.kernels, kvtune.kernels.layout as lay, pathlib;"
        "print(pathlib.Path(kernels.__file__).resolve());"
        "print(pathlib.Path(kvtune.kernels.__file__).resolve());"
        "print(lay.ColdLayout.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    hf_file, ours, layout_module = out.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py" or "site-packages" in ours
    assert Path(hf_file).parent != Path(ours).parent, (hf_file, ours)
    assert layout_module == "kvtune.kernels.layout"


def test_version_is_exposed() -> None:
    assert kvtune.__version__.count(".") == 2


def test_console_command_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtune", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("kvtune ")


@pytest.mark.parametrize(("value", "ok"), [("torch", True), ("triton", True), ("cuda", False), ("", False)])
def test_kernels_variable_is_checked(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, value: str, ok: bool
) -> None:
    from kvtune.kernels.backend import kernel_choice, use_triton

    monkeypatch.setenv("KVTUNE_KERNELS", value)
    kernel_choice.cache_clear()  # the variable is read once per process; the test re-reads it
    request.addfinalizer(kernel_choice.cache_clear)
    if ok:
        assert use_triton(torch.zeros(1)) is False  # a CPU tensor never takes Triton
    else:
        with pytest.raises(ValueError, match=r"KVTUNE_KERNELS=.*expected one of \['triton', 'torch'\]"):
            use_triton(torch.zeros(1))


# The driver's process reads configs, traces and card facts; the cache, the kernels and the model runner are
# the workers'. Only these light modules (values and byte arithmetic, no kernels) may load in the driver
# (``kernels.arch``: the architectures' limits, which the card catalog's block sizes follow).
DRIVER_MAY_IMPORT = {
    "kvtune.cache_impl.config",
    "kvtune.cache_impl.layout",
    "kvtune.kernels.arch",
    "kvtune.kernels.backend",
    "kvtune.kernels.layout",
    "kvtune.engine.options",
    "kvtune.engine.scheduler",
    "kvtune.engine.traces",
}


def test_driver_process_does_not_import_the_cache_or_kernels(tmp_path: Path) -> None:
    code = (
        "import sys, kvtune.tuner.cli, kvtune.tuner.commands.tune, kvtune.tuner.job, kvtune.tuner.driver;"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvtune.') or m == 'triton')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    heavy = {
        m
        for m in out.stdout.split()
        if m == "triton" or (m.split(".")[1] in ("cache_impl", "kernels", "engine") and m.count(".") > 1)
    }
    assert heavy <= DRIVER_MAY_IMPORT, sorted(heavy - DRIVER_MAY_IMPORT)
