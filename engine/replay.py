"""The one replay wiring: ``kvtune replay``, the tuner's workers and the benchmarks all replay through here.

A :class:`Replayer` holds one loaded model on one device, the KV budget and the engine's options; it builds
the :class:`~kvtune.engine.engine.Engine` once (that probes the device's copy bandwidth) and replays any
config on it; the last replay's cache and CUDA graphs stay for the next replay of the same config and
options (a repeat, a capacity probe at another rate) until another config or :meth:`Replayer.release`
frees them. Its options and the CPU length defaults are :mod:`kvtune.engine.options`, so every entry point
scales a trace and warms up the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import (
    Deadline,
    Engine,
    Progress,
    Stop,
    calibrate_time_scale,
    default_budget_bytes,
)
from kvtune.engine.metrics import ReplayMetrics, RequestTiming
from kvtune.engine.options import ReplayOptions
from kvtune.engine.traces import Request


class Replayer:
    """One model on one device replaying configs under one budget (see the module docstring)."""

    def __init__(self, loaded: Any, device: torch.device, options: ReplayOptions | None = None) -> None:
        self.loaded = loaded
        self.device = torch.device(device)
        self.options = options or ReplayOptions()
        self.budget_bytes = self.options.budget_bytes or int(default_budget_bytes(loaded, self.device))
        self._engine: Engine | None = None

    def engine(self, config: HybridConfig) -> Engine:
        """The engine with ``config`` (built on first use; later configs share its bandwidth probe)."""
        if self._engine is None:
            options = self.options
            self._engine = Engine(self.loaded, config, self.budget_bytes, self.device, options.scheduler)
        return self._engine.with_config(config)

    def keeps_cache_for(self, config: HybridConfig, requests: Sequence[Request]) -> bool:
        """Whether a replay of ``requests`` under ``config`` would reuse the kept cache
        (:meth:`Engine.keeps_cache_for`)."""
        return self._engine is not None and self.engine(config).keeps_cache_for(requests)

    def release(self) -> None:
        """Free the cache and graphs the last replay kept (:meth:`Engine.replay` keeps them for a repeat)."""
        if self._engine is not None:
            self._engine.release()

    def replay(
        self,
        config: HybridConfig,
        requests: Sequence[Request],
        time_scale: float,
        progress: Progress | None = None,
        clipped: int = 0,
        warmup: int | None = None,
        stop: Stop | None = None,
        deadline: Deadline | None = None,
        timings: list[RequestTiming] | None = None,
        settings_from: Sequence[Request] | None = None,
    ) -> ReplayMetrics:
        """Replay ``requests`` under ``config`` (arrivals × ``time_scale``; 0 = all at once), after ``warmup``
        requests (default: the options') served on a throw-away cache; ``stop`` may end it early,
        ``timings`` receives the per-request times and ``settings_from`` gives the requests the cache is
        built for (:meth:`Engine.replay`)."""
        engine = self.engine(config)
        warmup = self.options.warmup_requests if warmup is None else warmup
        try:
            return engine.replay(
                list(requests), time_scale, warmup, progress, clipped, stop=stop, deadline=deadline,
                timings=timings, settings_from=settings_from,
            )  # fmt: skip
        finally:
            del engine
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def calibrate(
        self,
        requests: Sequence[Request],
        load: float,
        config: HybridConfig | None = None,
        deadline: Deadline | None = None,
    ) -> float:
        """The time scale at which the unquantized baseline of ``config`` runs at ``load`` of saturation."""
        self.release()  # the calibration builds its own cache over the whole budget
        return float(
            calibrate_time_scale(
                self.loaded,
                list(requests),
                self.budget_bytes,
                self.device,
                load,
                config,
                self.options.warmup_requests,
                self.options.scheduler,
                deadline=deadline,
            )
        )
