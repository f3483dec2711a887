"""What the Triton kernel tests share: where the kernels can run here, and the kernel modules loaded for it.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the interpreted tests run in a child process
started with it (``test_triton_kernels.test_interpreted_suite``); the compiled ones need a CUDA GPU.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
TESTS = Path(__file__).resolve().parent
# the interpreted tests of these files run in the child pytest (``-k interpreted``)
INTERPRETED_FILES = (
    "test_triton_kernels.py", "test_triton_step.py", "test_quest_summary.py", "test_chunk_kv.py",
    "test_gluon_mixed.py",
)  # fmt: skip
_suite: list[tuple[subprocess.Popen, Any]] = []  # the child started for this run, and its output file


def start_interpreted_suite() -> None:
    """Start the child pytest of the interpreted tests (TRITON_INTERPRET=1), once per run. The test session
    starts it when collection ends, so on a 2-core machine it runs beside the rest of the suite;
    :func:`interpreted_suite_result` waits for it."""
    if _suite:
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    files = [str(TESTS / f) for f in INTERPRETED_FILES]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-m", "not gpu", "-k", "interpreted", "-p",
           "no:cacheprovider"]  # fmt: skip
    out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open until the child is waited for)
    proc = subprocess.Popen(cmd, env=env, cwd=TESTS.parent, stdout=out, stderr=subprocess.STDOUT, text=True)
    _suite.append((proc, out))


def interpreted_suite_result(timeout_s: float = 900.0) -> tuple[int, str]:
    """The child's exit status and output (started now if the session did not start it)."""
    start_interpreted_suite()
    proc, out = _suite[0]
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out.seek(0)
    return code, out.read()


def assert_interpreted_suite_passed() -> None:
    """Wait for the child (:func:`interpreted_suite_result`): exit status 0, tests passed, none failed."""
    code, out = interpreted_suite_result()
    assert code == 0, out[-8000:]
    assert " passed" in out and " failed" not in out, out[-2000:]


def stop_interpreted_suite() -> None:
    """End a child nobody waited for (the session stopped early)."""
    for proc, out in _suite:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    _suite.clear()


def load(names: Sequence[str]) -> SimpleNamespace:
    """``kvtune.kernels.<name>`` for each name, as attributes of one namespace."""
    return SimpleNamespace(**{n: importlib.import_module(f"kvtune.kernels.{n}") for n in names})


def interpreted(names: Sequence[str]) -> SimpleNamespace:
    """The modules under the interpreter (only inside the TRITON_INTERPRET=1 child process)."""
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of test_interpreted_suite")
    return load(names)


def compiled(names: Sequence[str]) -> SimpleNamespace:
    """The modules compiled for the GPU; freed cache memory is NaN first, so unwritten outputs show."""
    if not HAS_CUDA or INTERPRETING:
        pytest.skip("needs a CUDA GPU (and no TRITON_INTERPRET)")
    torch.full((1 << 26,), float("nan"), device="cuda")
    return load(names)


def fixtures(names: Sequence[str]) -> tuple[Any, Any]:
    """Module-scoped ``kernels`` (interpreted) and ``gpu_kernels`` (compiled) fixtures over these modules:
    ``kernels, gpu_kernels = fixtures(MODULES)`` in a test file."""

    @pytest.fixture(scope="module")
    def kernels() -> SimpleNamespace:
        return interpreted(names)

    @pytest.fixture(scope="module")
    def gpu_kernels() -> SimpleNamespace:
        return compiled(names)

    return kernels, gpu_kernels
