"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# `python -m pytest` puts the checkout's root first on sys.path, where the top-level folder kernels/ stands in
# for Hugging Face's package of that name, which transformers imports whenever it is installed (transformers
# 5.25 with kernels 0.19: "cannot import name 'CUDAProperties' from 'kernels'"). The root moves to the end of
# the path before anything imports the tests: installed packages come first, and kvtune (`kvtune/` links the
# top-level folders) is still found there where it is not installed (a checkout on PYTHONPATH).
_ROOT = Path(__file__).resolve().parents[1]
_OFF = [p for p in sys.path if Path(p or os.curdir).resolve() == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _OFF] + _OFF[:1]
if getattr(sys.modules.get("kernels"), "__file__", None) == str(_ROOT / "kernels" / "__init__.py"):
    del sys.modules["kernels"]

import pytest  # noqa: E402
import torch  # noqa: E402

# Small CPU shapes run fastest single-threaded, and two test processes on a 2-core machine don't fight.
torch.set_num_threads(1)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """The tests that wait for the interpreter suite's child run last, so the rest of the suite runs beside it
    instead of waiting."""
    items.sort(key=lambda item: item.name == "test_interpreted_suite")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the interpreter suite will run (a CPU-only machine, the test selected), start its child pytest
    now: it runs beside the rest of the suite (tests/triton_testlib.py)."""
    from kvtune.tests.triton_testlib import HAS_CUDA, INTERPRETING, start_interpreted_suite

    if not (HAS_CUDA or INTERPRETING) and any(i.name == "test_interpreted_suite" for i in session.items):
        start_interpreted_suite()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from kvtune.tests.triton_testlib import stop_interpreted_suite

    stop_interpreted_suite()


@pytest.fixture(scope="session")
def tiny() -> Any:
    """The tiny random-weight Llama on the CPU (engine and quality tests)."""
    from kvtune.engine.model import load_model

    return load_model("random:tiny", torch.device("cpu"))


# ---- Ray: one session for the whole test run (tuner tests) ------------------------------------------------
# A fake multi-GPU node, described the way Ray describes a real one: 4 GPUs and one accelerator_type resource.
# GPU workers ask for num_gpus=1 and accelerator_type="H200" (they compute on the CPU here); CPU workers ask
# for CPUs. Started on first use, shut down at the end of the run. It is started the way kvtune starts its own
# local Ray (kvtune.tuner.local_ray: every listener on 127.0.0.1), with token authentication off for the tests
# (RAY_AUTH_MODE=disabled; tests/test_hostile_inputs.py checks the token in a Ray of its own).
FAKE_GPUS = 4
FAKE_ACCELERATOR = "H200"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray = pytest.importorskip("ray")
    from kvtune.tuner.local_ray import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=2, num_gpus=FAKE_GPUS, resources={f"accelerator_type:{FAKE_ACCELERATOR}": 1})
    yield ray
    ray.shutdown()


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt of the CLI to start or join Ray fails the test: the input must be refused before."""
    from kvtune.tuner.commands import tune as tune_command

    def refuse(address: str | None) -> Any:
        raise AssertionError("Ray was started before the input was checked")

    monkeypatch.setattr(tune_command, "init_ray", refuse)


# ---- end of the Ray block ----------------------------------------------------------------------------------
