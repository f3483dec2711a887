"""Workers for the tuner tests: the real worker with a fault injected.

Importable by Ray worker processes as ``kvtune.tests.tuner_fakes`` (the tests folder is part of the package).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.tuner.protocol import WorkerSpec
from kvtune.tuner.worker import TrialWorker

CRASH_BITS = 4  # the config the crashing worker refuses


class CrashingWorker(TrialWorker):
    """The real worker, but every config with ``quantization_bits == 4`` raises (as a CUDA OOM would)."""

    def configure(self, config: HybridConfig, workload: Any, knobs: Any = None) -> None:
        if config.quantization_bits == CRASH_BITS:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"
            )
        super().configure(config, workload, knobs)


class BrokenWorker(TrialWorker):
    """A worker whose model never loads."""

    def __init__(self, spec: WorkerSpec) -> None:
        raise ValueError(f"model {spec.model!r}: weights are corrupt (injected by the test)")
