"""The trial worker: one long-lived process per device that loads the model once and replays configs.

The driver wraps :class:`TrialWorker` in a Ray actor (one per matching GPU, or CPU actors for ``--gpu cpu``)
and
drives each trial as a sequence of calls::

    configure(config, workload)          -> None       (validates, frees what the last trial left)
    run_window(i)  for i in windows      -> dict       (that window's ReplayMetrics.to_dict())
    finish()                             -> TrialResult (frozen: the per-window metrics and their mean)
    quality(config)                      -> dict       (QualityResult.to_dict(); memoized by the driver)

Workers never open the study; every result is a value. An exception raised by a call is the config's fault
(the
driver records a violated constraint); a worker process that dies is not (the driver re-runs the trial once).
"""

from __future__ import annotations

import math
import os
import platform
import socket
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import kvtune
from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.quality import check_quality_args
from kvtune.cache_impl.traces import Request

WARMUP_REQUESTS = 2
VERSION_PACKAGES = ("torch", "triton", "ray", "optuna")


@dataclass(frozen=True)
class QualitySettings:
    """How quality is measured (DESIGN §2; the CPU defaults are a stated, reduced size)."""

    model: str
    text_path: str
    windows: int = 8
    prefill_tokens: int = 2048
    decode_tokens: int = 512
    step_ms: float = 50.0
    passkey: bool = True
    dtype: str = "float32"  # whatever the replay's dtype (see TrialWorker._quality_loaded)

    def __post_init__(self) -> None:
        check_quality_args(self.windows, self.prefill_tokens, self.decode_tokens, self.step_ms)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of ['float32', 'bfloat16', 'float16'], but got {self.dtype!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be one of ['cpu', 'cuda'], but got device={self.device!r}")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError(f"`budget_bytes >= 1` must hold, but got budget_bytes={self.budget_bytes}")


@dataclass(frozen=True)
class Workload:
    """The replay windows of a study (identical for every trial, so windows compare) and the time scale."""

    windows: tuple[tuple[Request, ...], ...]
    time_scale: float
    warmup_requests: int = WARMUP_REQUESTS


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


@dataclass(frozen=True)
class TrialResult:
    """The final, frozen result of one trial: every window's metrics and their mean (numeric keys only)."""

    config: dict[str, Any]
    windows: tuple[dict[str, Any], ...]
    mean: dict[str, float] = field(default_factory=dict)


def versions() -> dict[str, str]:
    """kvtune and the versions of the packages a result depends on ("absent" when one is not installed)."""
    found = {"kvtune": kvtune.__version__, "python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def mean_metrics(windows: tuple[dict[str, Any], ...]) -> dict[str, float]:
    """Mean over windows of every finite numeric metric (percentiles stay per window in ``windows``)."""
    keys = [k for k, v in windows[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    out: dict[str, float] = {}
    for key in keys:
        values = [float(w[key]) for w in windows if isinstance(w.get(key), int | float)]
        finite = [v for v in values if math.isfinite(v)]
        out[key] = sum(finite) / len(finite) if finite else math.nan
    return out


class TrialWorker:
    """Loads the model once; runs trials one call at a time (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        from kvtune.cache_impl.model import load_model

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but this worker sees no CUDA device")
        self.loaded = load_model(spec.model, self.device, getattr(torch, spec.dtype))
        self.budget_bytes = spec.budget_bytes or self._default_budget()
        self._engine: Any = None
        self._quality_model: Any = None
        self._config: HybridConfig | None = None
        self._workload: Workload | None = None
        self._windows: list[dict[str, Any]] = []

    def _default_budget(self) -> int:
        from kvtune.cache_impl.engine import default_budget_bytes

        return int(default_budget_bytes(self.loaded, self.device))

    # ---- facts ---------------------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        spec = self.loaded.spec
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            name, memory = props.name, int(props.total_memory)
        else:
            name, memory = f"cpu ({platform.processor() or platform.machine()})", 0
        return WorkerInfo(
            device_name=name,
            device_memory_bytes=memory,
            hostname=socket.gethostname(),
            gpu_ids=tuple(g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g),
            versions=versions(),
            budget_bytes=self.budget_bytes,
            real_weights=bool(self.loaded.real_weights),
            max_context=int(spec.max_context),
            vocab_size=int(spec.vocab_size),
            kv_shape=self.loaded.model.kv_shape,
        )

    def calibrate(self, requests: tuple[Request, ...], load: float) -> float:
        """The time scale at which the unquantized baseline runs at ``load`` of its saturation throughput."""
        from kvtune.cache_impl.engine import calibrate_time_scale

        return float(
            calibrate_time_scale(self.loaded, list(requests), self.budget_bytes, self.device, load=load)
        )

    # ---- one trial -----------------------------------------------------------------------------------
    def configure(self, config: dict[str, Any], workload: Workload) -> None:
        """Start a trial: validate ``config`` and free whatever the previous trial left on the device."""
        self._config, self._workload, self._windows = None, None, []
        self._free()
        self._config = HybridConfig.from_dict(config)
        self._workload = workload

    def run_window(self, index: int) -> dict[str, Any]:
        """Replay window ``index`` of the workload with the configured config; that window's metrics."""
        assert self._config is not None and self._workload is not None, "configure() first"
        assert index == len(self._windows), (
            f"windows run in order: expected {len(self._windows)}, got {index}"
        )
        w = self._workload
        metrics = self.replay(self._config.to_dict(), w.windows[index], w.time_scale, w.warmup_requests)
        self._windows.append(metrics)
        return metrics

    def finish(self) -> TrialResult:
        assert self._config is not None and self._windows, "configure() and run_window() first"
        windows = tuple(self._windows)
        return TrialResult(self._config.to_dict(), windows, mean_metrics(windows))

    # ---- stateless calls -----------------------------------------------------------------------------
    def replay(
        self, config: dict[str, Any], requests: tuple[Request, ...], time_scale: float, warmup: int
    ) -> dict[str, Any]:
        """One replay of ``requests`` under ``config`` on a fresh engine (also used by validation)."""
        from kvtune.cache_impl.engine import Engine

        cfg = HybridConfig.from_dict(config)
        if self._engine is None:  # built once: it probes the device's copy bandwidth
            self._engine = Engine(self.loaded, cfg, self.budget_bytes, self.device)
        engine = self._engine.with_config(cfg)
        try:
            metrics = engine.replay(list(requests), time_scale, warmup_requests=warmup)
            return dict(metrics.to_dict())
        finally:
            del engine
            self._free()

    def quality(self, config: dict[str, Any]) -> dict[str, Any]:
        """Quality of ``config`` (teacher-forced over the text, against the unquantized cache)."""
        from kvtune.cache_impl.quality import measure_quality

        q = self.spec.quality
        text = Path(q.text_path).read_text(encoding="utf-8")
        result = measure_quality(
            self._quality_loaded(),
            HybridConfig.from_dict(config),
            text,
            windows=q.windows,
            prefill_tokens=q.prefill_tokens,
            decode_tokens=q.decode_tokens,
            step_ms=q.step_ms,
            passkey=q.passkey,
        )
        return dict(result.to_dict())

    def _quality_loaded(self) -> Any:
        """The quality model, always in float32: in bfloat16 any change to the cache flips roundings that
        compound over the layers, and that noise floor (a mean KL near 1e-3 on SmolLM2, 50x the INT8
        error measured in float32) would be charged to the config."""
        q = self.spec.quality
        if q.model == self.spec.model and q.dtype == self.spec.dtype:
            return self.loaded
        if self._quality_model is None:
            from kvtune.cache_impl.model import load_model

            self._quality_model = load_model(q.model, self.device, getattr(torch, q.dtype))
        return self._quality_model

    def _free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def ping(self) -> bool:
        return True
