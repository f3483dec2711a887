"""Options of a replay and of a quality run: light values (no cache, no kernels) that the tuner's driver
builds and validates before any worker starts, and that every replay entry point shares."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, sequences_for_budget
from kvtune.engine.scheduler import SchedulerConfig

MAX_NUM_SEQS_CAP = 1024  # the most sequences a derived max_num_seqs allows
CPU_BUDGET_CAP_BYTES = 4 << 30  # a CPU worker's default KV budget at most (allocated whole, up front)
WARMUP_REQUESTS = 2  # served once on a throw-away cache before every measured replay (compilations, pools)
# On a CPU, lengths are scaled down so that a replay of a few requests takes about a minute.
CPU_LENGTH_SCALE = 1 / 32
CPU_LENGTH_CAP = 192
# kernels compiled ahead by planning processes on the host's spare cores (kvtune.engine.warm)
WARM_ENV = "KVTUNE_WARM"
WARM_PROCESSES_ENV = "KVTUNE_WARM_PROCESSES"


def length_defaults(device: torch.device) -> tuple[float, int | None]:
    """``(length scale, length cap)`` for a trace replayed on ``device``: the trace as it is on a GPU."""
    return (CPU_LENGTH_SCALE, CPU_LENGTH_CAP) if torch.device(device).type == "cpu" else (1.0, None)


def max_num_seqs_for(
    config: HybridConfig,
    shape: ModelKVShape,
    budget_bytes: int,
    mean_length: float,
    batched_tokens: int | None = None,
    *,
    given: int | None = None,
    factor: float = 1.0,
    requests: int | None = None,
) -> tuple[int, int]:
    """``(max_num_seqs, derived)``: the engine's limit on running sequences, its default and its caps decided
    here alone (the engine's replays and the search space's knob both ask).

    ``derived``, the default: how many sequences of ``mean_length`` tokens (prompt + output) the budget holds
    at once, hot zone and sealed blocks at the config's bits
    (:func:`~kvtune.cache_impl.layout.sequences_for_budget`), at most :data:`MAX_NUM_SEQS_CAP`; so a config
    that stores more tokens per byte runs bigger batches. ``max_num_seqs``: ``given`` where given
    (``--max-num-seqs``), else ``factor`` × ``derived`` (the search space's ``max_num_seqs_factor``) at most
    :data:`MAX_NUM_SEQS_CAP`; then at most ``requests`` (a replay of fewer requests runs no more; 0 counts as
    1), at most ``batched_tokens`` (``max_num_batched_tokens``: every decode token fits one iteration) and at
    least 1.
    """
    derived = min(MAX_NUM_SEQS_CAP, sequences_for_budget(config, shape, budget_bytes, mean_length))
    seqs = given if given is not None else min(round(factor * derived), MAX_NUM_SEQS_CAP)
    if requests is not None:
        seqs = min(seqs, requests or 1)
    if batched_tokens is not None:
        seqs = min(seqs, batched_tokens)
    return max(1, seqs), derived


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


def warm_enabled() -> bool:
    """Compile kernels ahead (``KVTUNE_WARM``, default on; ``0`` off)."""
    return os.environ.get(WARM_ENV, "1") != "0"


def warm_processes(configs: int, workers: int = 1) -> int:
    """The planning processes of one worker: ``KVTUNE_WARM_PROCESSES``, else half the cores this process may
    use less two, shared by ``workers``, at least one, at most one per config; ValueError naming the variable
    for a value that is not a positive int (checked before Ray starts)."""
    raw = os.environ.get(WARM_PROCESSES_ENV)
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{WARM_PROCESSES_ENV}={raw!r}: expected a positive number of processes")
    else:
        n = max(1, usable_cores() // 2 - 2) // max(1, workers)
    return max(1, min(n, configs))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
