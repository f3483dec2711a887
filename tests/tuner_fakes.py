"""Workers for the tuner tests: the real worker with a fault injected, and a model-free stand-in.

Importable by Ray worker processes as ``kvtune.tests.tuner_fakes`` (the tests folder is part of the package).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape
from kvtune.cache_impl.traces import Request
from kvtune.tuner.worker import TrialWorker, WorkerInfo, WorkerSpec, versions

CRASH_BITS = 4  # the config the crashing worker refuses


class CrashingWorker(TrialWorker):
    """The real worker, but every config with ``quantization_bits == 4`` raises (as a CUDA OOM would)."""

    def configure(self, config: dict[str, Any], workload: Any) -> None:
        if config["quantization_bits"] == CRASH_BITS:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"
            )
        super().configure(config, workload)


class BrokenWorker(TrialWorker):
    """A worker whose model never loads."""

    def __init__(self, spec: WorkerSpec) -> None:
        raise ValueError(f"model {spec.model!r}: weights are corrupt (injected by the test)")


class FakeWorker(TrialWorker):
    """No model: metrics are a deterministic function of the config; each window takes ``WINDOW_S``."""

    WINDOW_S = 0.25

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device("cpu")
        self.budget_bytes = spec.budget_bytes or 1 << 30
        self._config: HybridConfig | None = None
        self._workload: Any = None
        self._windows: list[dict[str, Any]] = []

    def info(self) -> WorkerInfo:
        shape = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, dtype=torch.float32)
        gpus = tuple(os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","))
        return WorkerInfo(
            device_name="fake", device_memory_bytes=0, hostname=socket.gethostname(), gpu_ids=gpus,
            versions=versions(), budget_bytes=self.budget_bytes, real_weights=False, max_context=4096,
            vocab_size=512, kv_shape=shape,
        )  # fmt: skip

    def calibrate(self, requests: tuple[Request, ...], load: float) -> float:
        return 1.0

    def replay(
        self, config: dict[str, Any], requests: tuple[Request, ...], time_scale: float, warmup: int
    ) -> dict[str, Any]:
        time.sleep(self.WINDOW_S)
        start = time.time()
        c = HybridConfig.from_dict(config)
        tpot = 10.0 + c.quantization_bits + c.hot_tokens / 64 + c.block_size / 128
        return {"tpot_p99_ms": tpot, "ttft_p99_ms": 5 * tpot, "e2e_p99_ms": 50 * tpot,
                "tokens_per_s": 1000.0 / tpot, "started": start, "pid": os.getpid()}  # fmt: skip

    def quality(self, config: dict[str, Any]) -> dict[str, Any]:
        bits = config["quantization_bits"]
        return {"ppl_change_pct": {0: 0.0, 8: 0.1, 4: 1.0}[bits], "mean_kl": {0: 0.0, 8: 1e-4, 4: 1e-2}[bits]}
