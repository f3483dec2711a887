"""The trial protocol between the driver and a worker: the calls, their order, and the values that cross.

The driver wraps :class:`kvtune.tuner.worker.TrialWorker` in a Ray actor (one per matching GPU, or CPU
actors for ``--gpu cpu``) and drives each trial as this sequence of calls (:class:`Call`, ordered by
:func:`next_call`)::

    configure(config, workload, knobs) -> None    validates nothing more: the config arrived validated
    run_window(i), i = 0..W-1     -> dict         that window's ReplayMetrics.to_dict()
      or, for the capacity objective,
    probe(rate), as the search asks -> dict       every window at ``rate`` x the trace's own arrival rate
    finish(capacity=None)         -> TrialResult  frozen: the per-window metrics and their mean
    quality(config)               -> dict         QualityResult.to_dict(); skipped when the driver knows it

The capacity objective replaces the windows by probes: :class:`~kvtune.tuner.capacity.CapacitySearch`
says which rate comes next and when the search is done; each probe replays the trial's windows at one rate
and says whether they met the study's latency limits (:mod:`kvtune.tuner.capacity`). The engine knobs
(:class:`EngineKnobs`) travel beside the config, never inside it: the hybrid_v2 contract is fixed.

A config crosses as a :class:`~kvtune.cache_impl.config.HybridConfig`, built and validated once by the
driver; the study stores ``config.to_dict()``. Workers never open the study; every result is a value. An
exception raised by a call is the config's fault (the driver records a violated constraint); a worker
process that dies is not (the driver re-runs the trial once).

This module and everything it imports are light: the driver process never imports the cache, the kernels or
the engine's model runner.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import WARMUP_REQUESTS, check_quality_args
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.engine.traces import Request
from kvtune.tuner.capacity import CapacitySearch, Slo

# The unquantized baseline every study measures its limits, noise and gains against (and calibrates on)
BASELINE = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=0)


class Call(enum.Enum):
    """One call of the protocol; the value is the worker method's name."""

    CONFIGURE = "configure"
    WINDOW = "run_window"
    FINISH = "finish"
    QUALITY = "quality"
    PROBE = "probe"


def next_call(
    done: Call, window: int, windows: int, quality_known: bool, search: CapacitySearch | None = None
) -> tuple[Call, int] | None:
    """What follows ``done`` (with ``window`` the index of the window or probe just run): the next call and
    the window or probe index it takes (-1 when none); None when the trial has everything (its quality
    already known). With a capacity ``search`` (its state after the last probe) probes replace windows, as
    many as the search asks for (:meth:`CapacitySearch.next_rate`)."""
    if done is Call.CONFIGURE:
        return (Call.WINDOW, 0) if search is None else (Call.PROBE, 0)
    if done is Call.PROBE:
        assert search is not None, "a probe without a capacity search"
        return (Call.PROBE, window + 1) if search.next_rate() is not None else (Call.FINISH, -1)
    if done is Call.WINDOW:
        return (Call.WINDOW, window + 1) if window + 1 < windows else (Call.FINISH, -1)
    if done is Call.FINISH and not quality_known:
        return Call.QUALITY, -1
    return None


QUALITY_DEVICES = ("auto", "cpu", "worker")


@dataclass(frozen=True)
class QualitySettings:
    """How quality is measured (docs/DESIGN.md §2; the CPU defaults are a stated, reduced size)."""

    model: str
    text_path: str
    windows: int = 8
    prefill_tokens: int = 2048
    decode_tokens: int = 512
    step_ms: float = 50.0
    passkey: bool = True
    dtype: str = "float32"  # whatever the replay's dtype (see TrialWorker._quality_loaded)
    aggregation: bool = False  # the aggregation probe (engine/aggregation.py), on where a bound needs it
    # where: "cpu" in a process of its own beside the probes (tuner/quality_host.py), "worker" on the
    # worker's device after them, "auto" the first on a GPU worker for a light measurement
    # (tuner.worker.quality_beside), else the second
    device: str = "auto"

    def __post_init__(self) -> None:
        check_quality_args(self.windows, self.prefill_tokens, self.decode_tokens, self.step_ms)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of ['float32', 'bfloat16', 'float16'], but got {self.dtype!r}"
            )
        if self.device not in QUALITY_DEVICES:
            raise ValueError(
                f"quality device must be one of {list(QUALITY_DEVICES)}, but got {self.device!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """As stored with a study; ``aggregation`` only where on and ``device`` only where not "auto" (a
        study made before either compares equal)."""
        d = dict(self.__dict__)
        if not d["aggregation"]:
            del d["aggregation"]
        if d["device"] == "auto":
            del d["device"]
        return d


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a study loads: the model, where it runs, its KV budget and the quality
    settings."""

    model: str
    device: str  # "cpu" or "cuda" (a Ray GPU actor sees its one GPU as cuda:0)
    quality: QualitySettings
    dtype: str = "float32"
    budget_bytes: int | None = None  # None: the engine's default for the device
    threads: int | None = None  # torch CPU threads (None: torch's default)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # the engine's batching limits

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be one of ['cpu', 'cuda'], but got device={self.device!r}")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError(f"`budget_bytes >= 1` must hold, but got budget_bytes={self.budget_bytes}")


@dataclass(frozen=True)
class Workload:
    """The replay windows of a study (identical for every trial, so windows compare) and the time scale;
    ``slo``: the latency limits of the capacity objective (None for the fixed-rate objectives)."""

    windows: tuple[tuple[Request, ...], ...]
    time_scale: float
    warmup_requests: int = WARMUP_REQUESTS
    slo: Slo | None = None
    time_limit_s: float | None = None  # a trial running longer (from configure on) fails, infeasible


@dataclass(frozen=True)
class EngineKnobs:
    """The engine options a trial tunes beside its config, under vLLM's names: the tokens one engine
    iteration may batch and the sequences it may run at once."""

    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name} >= 1` must hold, but got {name}={value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "`max_num_batched_tokens >= max_num_seqs` must hold (vLLM's rule), but got "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs}"
            )

    def scheduler(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` (the worker's engine options) with these two limits."""
        return dataclasses.replace(
            base, max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs
        )

    def to_dict(self) -> dict[str, int]:
        return {"max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineKnobs:
        return cls(int(d["max_num_batched_tokens"]), int(d["max_num_seqs"]))


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker runs and with what (stored on every trial it runs)."""

    device_name: str
    device_memory_bytes: int
    hostname: str
    gpu_ids: tuple[str, ...]
    versions: dict[str, str]
    budget_bytes: int
    real_weights: bool
    max_context: int
    vocab_size: int
    kv_shape: Any  # ModelKVShape of the model
    pieces_capture_s: float = 0.0  # capturing the model's pieces at start (``piecewise`` on a GPU; else 0)


@dataclass(frozen=True)
class TrialResult:
    """The final, frozen result of one trial: every window's metrics and their mean (numeric keys only)."""

    config: HybridConfig
    windows: tuple[dict[str, Any], ...]
    mean: dict[str, float] = field(default_factory=dict)


def mean_metrics(windows: tuple[dict[str, Any], ...]) -> dict[str, float]:
    """Mean over windows of every finite numeric metric (percentiles stay per window in ``windows``)."""
    keys = [k for k, v in windows[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    out: dict[str, float] = {}
    for key in keys:
        values = [float(w[key]) for w in windows if isinstance(w.get(key), int | float)]
        finite = [v for v in values if math.isfinite(v)]
        out[key] = sum(finite) / len(finite) if finite else math.nan
    return out
