"""What the Triton kernel tests share: where the kernels can run here, and the kernel modules loaded for it.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the interpreted tests run in a child process
started with it (``test_triton_kernels.test_interpreted_suite``); the compiled ones need a CUDA GPU.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
