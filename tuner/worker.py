"""The trial worker: one long-lived process per device that loads the model once and replays configs.

It answers the calls of the trial protocol (:mod:`kvtune.tuner.protocol`, which says their order and what
crosses) and replays through the one replay wiring, :class:`kvtune.engine.replay.Replayer`. The engine and the
model are imported when a worker starts, never in the driver process.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import ReplayOptions
from kvtune.engine.traces import Request
from kvtune.studies.records import versions
from kvtune.tuner.protocol import TrialResult, WorkerInfo, WorkerSpec, Workload, mean_metrics


class TrialWorker:
    """Loads the model once; runs trials one call at a time (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        from kvtune.engine.model import load_model
        from kvtune.engine.replay import Replayer

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but this worker sees no CUDA device")
        self.loaded = load_model(spec.model, self.device, getattr(torch, spec.dtype))
        options = ReplayOptions(spec.budget_bytes, scheduler=spec.scheduler)
        self.replayer = Replayer(self.loaded, self.device, options)
        self.budget_bytes = self.replayer.budget_bytes
        self._quality_model: Any = None
        self._config: HybridConfig | None = None
        self._workload: Workload | None = None
        self._windows: list[dict[str, Any]] = []

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
        return self.replayer.calibrate(requests, load)

    # ---- one trial -----------------------------------------------------------------------------------
    def configure(self, config: HybridConfig, workload: Workload) -> None:
        """Start a trial (``config`` was validated by the driver); free what the last trial left."""
        self._config, self._workload, self._windows = None, None, []
        self._free()
        self._config, self._workload = config, workload

    def run_window(self, index: int) -> dict[str, Any]:
        """Replay window ``index`` of the workload with the configured config; that window's metrics."""
        assert self._config is not None and self._workload is not None, "configure() first"
        assert index == len(self._windows), (
            f"windows run in order: expected {len(self._windows)}, got {index}"
        )
        w = self._workload
        metrics = self.replay(self._config, w.windows[index], w.time_scale, w.warmup_requests)
        self._windows.append(metrics)
        return metrics

    def finish(self) -> TrialResult:
        assert self._config is not None and self._windows, "configure() and run_window() first"
        windows = tuple(self._windows)
        return TrialResult(self._config, windows, mean_metrics(windows))

    # ---- stateless calls -----------------------------------------------------------------------------
    def replay(
        self, config: HybridConfig, requests: tuple[Request, ...], time_scale: float, warmup: int
    ) -> dict[str, Any]:
        """One replay of ``requests`` under ``config`` (also used by validation): its metrics."""
        return dict(self.replayer.replay(config, requests, time_scale, warmup=warmup).to_dict())

    def quality(self, config: HybridConfig) -> dict[str, Any]:
        """Quality of ``config`` (teacher-forced over the text, against the unquantized cache)."""
        from kvtune.engine.quality import measure_quality

        q = self.spec.quality
        text = Path(q.text_path).read_text(encoding="utf-8")
        result = measure_quality(
            self._quality_loaded(),
            config,
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
            from kvtune.engine.model import load_model

            self._quality_model = load_model(q.model, self.device, getattr(torch, q.dtype))
        return self._quality_model

    def _free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def ping(self) -> bool:
        return True
