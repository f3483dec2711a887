"""Options of a replay and of a quality run: light values (no cache, no kernels) that the tuner's driver
builds and validates before any worker starts, and that every replay entry point shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtune.engine.scheduler import SchedulerConfig

CPU_BUDGET_CAP_BYTES = 4 << 30  # a CPU worker's default KV budget at most (allocated whole, up front)
WARMUP_REQUESTS = 2  # served once on a throw-away cache before every measured replay (compilations, pools)
# On a CPU, lengths are scaled down so that a replay of a few requests takes about a minute.
CPU_LENGTH_SCALE = 1 / 32
CPU_LENGTH_CAP = 192


def length_defaults(device: torch.device) -> tuple[float, int | None]:
    """``(length scale, length cap)`` for a trace replayed on ``device``: the trace as it is on a GPU."""
    return (CPU_LENGTH_SCALE, CPU_LENGTH_CAP) if torch.device(device).type == "cpu" else (1.0, None)


@dataclass(frozen=True)
class ReplayOptions:
    """How every replay of a session runs: KV budget (None: the device's default), warm-up, scheduling."""

    budget_bytes: int | None = None
    warmup_requests: int = WARMUP_REQUESTS
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError(f"`budget_bytes >= 1` must hold, but got budget_bytes={self.budget_bytes}")
        if self.warmup_requests < 0:
            raise ValueError(
                f"`warmup_requests >= 0` must hold, but got warmup_requests={self.warmup_requests}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "warmup_requests": self.warmup_requests,
            "scheduler": dict(self.scheduler.__dict__),
        }


def check_quality_args(windows: int, prefill_tokens: int, decode_tokens: int, step_ms: float) -> None:
    for name, value in (
        ("windows", windows),
        ("prefill_tokens", prefill_tokens),
        ("decode_tokens", decode_tokens),
    ):
        if value < 1:
            raise ValueError(f"`{name} >= 1` must hold, but got {name}={value}")
    if not (math.isfinite(step_ms) and step_ms > 0):
        raise ValueError(f"`step_ms > 0` must hold, but got step_ms={step_ms}")


# model precisions by the names the command line and the study use
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
