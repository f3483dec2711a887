"""The trial worker: one long-lived process per device that loads the model once and replays configs.

It answers the calls of the trial protocol (:mod:`kvtune.tuner.protocol`, which says their order and what
crosses) and replays through the one replay wiring, :class:`kvtune.engine.replay.Replayer`. The engine and the
model are imported when a worker starts, never in the driver process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import ReplayOptions
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.engine.traces import Request
from kvtune.studies.records import versions
from kvtune.tuner.capacity import (
    ProbeStop,
    Slo,
    capacity_metrics,
    decision_margin,
    probe_passes,
    probe_record,
    requests_pass,
    windows_margin,
)
from kvtune.tuner.protocol import (
    BASELINE,
    EngineKnobs,
    QualitySettings,
    TrialResult,
    WorkerInfo,
    WorkerSpec,
    Workload,
    mean_metrics,
)
from kvtune.tuner.quality_host import QualityHost

if TYPE_CHECKING:
    from kvtune.engine.engine import Deadline, Stop
    from kvtune.engine.metrics import RequestTiming

# The unloaded replay: the trace's arrivals slowed this much (requests that arrive together in the trace, a
# burst, still do: no rate spreads them; all others are served alone; idle gaps are skipped, not slept), and
# outputs cut to this many tokens (its median TPOT is one decode step).
UNLOADED_TIME_SCALE = 1000.0
UNLOADED_OUTPUT_TOKENS = 8
UNLOADED_REPEATS = 3  # measured after one unmeasured replay; the median P99 TTFT's replay is kept
# ... one on a GPU's gated clock, where the three read within 0.12 % of each other in five H200 studies
# (runs 31d-33c: 24.32-24.71 ms, each study's three within 0.02-0.12 %), the unmeasured one 2.4-6.6 % above
UNLOADED_REPEATS_GATED = 1
# A new cache's priming replay cuts outputs to this many tokens: every prompt's shapes and the largest batch,
# at a third to a half of a whole replay's wall (H200, 96 requests: 2.6-3.8 s against 4.8-8.4 s).
PRIME_OUTPUT_TOKENS = 16
# what is measured on the CPU beside the probes by default: a quality model of at most 1 B parameters
# (SmolLM2-135M is 0.13 B), windows of at most 8,192 tokens in all, no passkey, no aggregation probe. On a
# 2-core CPU (2 threads) SmolLM2 took 5.1-6.5 s at 2 × (1,024 + 64), 19.2 s at 2 × (2,048 + 128), and the
# passkey check alone at 2,048 tokens 110 s: that one stays on the GPU
QUALITY_BESIDE_MAX_PARAMS = 1_000_000_000
QUALITY_BESIDE_MAX_TOKENS = 8192


def outputs_cut(requests: Sequence[Request], tokens: int) -> tuple[Request, ...]:
    """``requests`` with their outputs cut to at most ``tokens`` tokens."""
    return tuple(dataclasses.replace(r, output_length=min(r.output_length, tokens)) for r in requests)


def trial_deadline(limit_s: float | None, what: str) -> Deadline | None:
    """The deadline ``limit_s`` seconds from now (None: no limit); past it a replay raises
    :class:`~kvtune.engine.engine.ReplayTimeoutError`, which the driver records as an infeasible trial."""
    if limit_s is None:
        return None
    from kvtune.engine.engine import Deadline

    reason = f"{what} ran past its time limit of {limit_s:g} s (--trial-timeout): infeasible here"
    return Deadline(time.monotonic() + limit_s, reason)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect, then keep Python's garbage collector off for the block: no collection pause inside a probe
    (one stall can decide a P99 over ~100 requests); ``KVTUNE_GC_PAUSE=0`` leaves it on
    (:func:`kvtune.engine.engine.collector_paused`)."""
    from kvtune.engine.engine import collector_paused

    with collector_paused(collect=True):
        yield


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
        self._warmers: list[Any] = []  # kernels compiled ahead on the host's spare cores (engine/warm.py)
        self._warm_baseline(spec)  # while the model loads
        self.loaded = load_model(spec.model, self.device, getattr(torch, spec.dtype))
        options = ReplayOptions(spec.budget_bytes, scheduler=spec.scheduler)
        self.replayer = Replayer(self.loaded, self.device, options)
        self.budget_bytes = self.replayer.budget_bytes
        self._quality_model: Any = None
        self._quality_host: QualityHost | None = None  # quality beside the probes (quality_host.py)
        if quality_beside(spec.quality, self.device.type):
            self._quality_host = QualityHost(spec.quality)
        self._config: HybridConfig | None = None
        self._workload: Workload | None = None
        self._windows: list[dict[str, Any]] = []
        self._knobs: EngineKnobs | None = None
        self._probes: list[dict[str, Any]] = []
        self._replayers: dict[Any, Any] = {}  # scheduler config -> Replayer (the engine knobs of a trial)
        self._deadline: Deadline | None = None  # the trial's time limit (Workload.time_limit_s)
        self._pieces_s = 0.0
        if spec.scheduler.piecewise:  # the model's pieces captured once, before anything is timed
            from kvtune.engine.engine import model_pieces

            self._pieces_s = model_pieces(self.loaded.model, self.device).capture_ms / 1000.0

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
            pieces_capture_s=self._pieces_s,
        )

    def calibrate(
        self, requests: tuple[Request, ...], load: float, time_limit_s: float | None = None
    ) -> float:
        """The time scale at which the unquantized baseline runs at ``load`` of its saturation throughput
        (ended by :class:`~kvtune.engine.engine.ReplayTimeoutError` past ``time_limit_s``)."""
        return self.replayer.calibrate(
            requests, load, deadline=trial_deadline(time_limit_s, "the calibration")
        )

    # ---- one trial -----------------------------------------------------------------------------------
    def configure(
        self,
        config: HybridConfig,
        workload: Workload,
        knobs: EngineKnobs | None = None,
        quality: bool = False,
    ) -> None:
        """Start a trial (``config`` was validated by the driver; ``knobs``: its engine options, None for the
        worker's own); free what the last trial left. ``quality``: the trial will ask for its config's
        quality, which a worker that measures it beside the probes starts measuring now."""
        self._config, self._workload, self._windows, self._probes = None, None, [], []
        if quality and self._quality_host is not None:
            self._quality_host.submit(config.to_dict())
        self.release()
        self._config, self._workload, self._knobs = config, workload, knobs
        self._deadline = trial_deadline(workload.time_limit_s, "the trial")

    def run_window(self, index: int) -> dict[str, Any]:
        """Replay window ``index`` of the workload with the configured config; that window's metrics."""
        assert self._config is not None and self._workload is not None, "configure() first"
        assert index == len(self._windows), (
            f"windows run in order: expected {len(self._windows)}, got {index}"
        )
        w = self._workload
        metrics = self.replay(
            self._config, w.windows[index], w.time_scale, w.warmup_requests, self._knobs, self._deadline
        )
        self._windows.append(metrics)
        return metrics

    def probe(self, rate: float) -> dict[str, Any]:
        """Replay the workload's windows at ``rate`` × the trace's own arrival rate under the study's limits
        (the capacity objective): :meth:`probe_config`'s record."""
        assert self._config is not None and self._workload is not None, "configure() first"
        w = self._workload
        assert w.slo is not None, "a probe needs the study's latency limits"
        record = self.probe_config(
            self._config, self._knobs, w.windows, rate, w.slo, w.warmup_requests, self._deadline
        )
        self._probes.append(record)
        return record

    def finish(self, capacity: float | None = None) -> TrialResult:
        """The trial's result; ``capacity``: its search's (the driver's), which the capacity objective
        reports, with the windows of the highest passing probe at or below it."""
        assert self._config is not None and (self._windows or self._probes), "configure() and run first"
        if self._probes:  # the capacity objective: the windows at the highest passing rate
            at, mean = capacity_metrics(self._probes, capacity)
            return TrialResult(self._config, tuple(at), mean)
        windows = tuple(self._windows)
        return TrialResult(self._config, windows, mean_metrics(windows))

    # ---- stateless calls -----------------------------------------------------------------------------
    def replay(
        self,
        config: HybridConfig,
        requests: tuple[Request, ...],
        time_scale: float,
        warmup: int,
        knobs: EngineKnobs | None = None,
        deadline: Deadline | None = None,
        timings: list[RequestTiming] | None = None,
        stop: Stop | None = None,
    ) -> dict[str, Any]:
        """One replay of ``requests`` under ``config`` (also used by validation): its metrics; ``timings``
        receives the per-request times; ``stop`` may end it early (:meth:`Engine.replay`)."""
        replayer = self._replayer(knobs)
        self._prime(replayer, config, requests, warmup, deadline)
        metrics = replayer.replay(
            config, requests, time_scale, warmup=warmup, deadline=deadline, timings=timings, stop=stop
        )
        return dict(metrics.to_dict())

    def _prime(
        self, replayer: Any, config: HybridConfig, requests: tuple[Request, ...], warmup: int,
        deadline: Deadline | None,
    ) -> None:  # fmt: skip
        """Before a measured replay on a new cache (a new config, or a window of other lengths): serve
        ``requests`` all at once, unmeasured, their outputs cut to ``PRIME_OUTPUT_TOKENS``, on the cache
        the measured replay will reuse. The first replay on a cache pays what no later one does (kernels
        compiled, the allocator growing to the prefill's shapes, first launches at each prompt length):
        measured on an H200, the first of four identical replays ran 23 % slower, and near capacity the
        first replay of a new window collapsed (P90 TTFT 847 ms, every slot full) where three repeats
        passed with P90 TTFT 113-119 ms. Every prompt runs whole; decode graphs the short outputs do not
        reach are captured in the measured replay, outside its clock (on an H200 the first whole replay
        on a new cache after a short prime read the clock of a repeat within 1.6 %)."""
        if not replayer.keeps_cache_for(config, requests):
            short = outputs_cut(requests, PRIME_OUTPUT_TOKENS)
            replayer.replay(config, short, 0.0, warmup=warmup, deadline=deadline, settings_from=requests)

    def probe_config(
        self,
        config: HybridConfig,
        knobs: EngineKnobs | None,
        windows: tuple[tuple[Request, ...], ...],
        rate: float,
        slo: Slo,
        warmup: int,
        deadline: Deadline | None = None,
    ) -> dict[str, Any]:
        """One capacity probe (stateless; also used for the baseline and validation): replay each window
        at ``rate`` × its own arrival rate (time scale ``1 / rate``) until one fails the limits; a window
        stops as soon as its P99 is certain to fail (:class:`~kvtune.tuner.capacity.ProbeStop`,
        ``probe_aborted`` in its metrics). Under a pooled ``slo`` the windows are judged together, on their
        requests' times (:func:`~kvtune.tuner.capacity.requests_pass`), and one stop counts over all of
        them."""
        if not rate > 0:
            raise ValueError(f"`rate > 0` must hold, but got rate={rate}")
        started = time.perf_counter()
        replayer, runs, passed, aborted = self._replayer(knobs), [], True, False
        pooled: list[RequestTiming] = []
        shared = ProbeStop(slo, sum(len(w) for w in windows)) if slo.pooled else None
        margins = []
        from kvtune.engine.compiles import CompileWatch  # the driver's process imports no engine

        prime_s = 0.0
        compiles = CompileWatch()
        for requests in windows:
            primed = time.perf_counter()
            with compiles:
                self._prime(replayer, config, requests, warmup, deadline)
            prime_s += time.perf_counter() - primed
            stop = shared or ProbeStop(slo, len(requests))
            timings: list[RequestTiming] = []
            stop.next_window()
            with gc_paused():
                replay = replayer.replay(
                    config, requests, 1.0 / rate, warmup=warmup, stop=stop, deadline=deadline,
                    timings=timings if slo.needs_requests else None,
                )  # fmt: skip
            metrics = dict(replay.to_dict())
            metrics["probe_aborted"] = stop.fired
            runs.append(metrics)
            pooled.extend(timings)
            if not (stop.fired or slo.pooled):
                margins.append(_window_margin(metrics, timings, slo))
            if stop.fired or (not slo.pooled and not _window_passes(metrics, timings, slo, len(requests))):
                passed, aborted = False, stop.fired
                break
        if slo.pooled and not aborted:
            margins.append(decision_margin(pooled, slo))
            passed = requests_pass(pooled, slo, sum(len(w) for w in windows)) and not _refused(runs)
        margin = None if aborted else min(margins, default=None)
        record = probe_record(rate, passed, aborted, runs, mean_metrics(tuple(runs)), margin)
        # the probe's host seconds, and of them the new cache's set-up (a config or window met anew): what
        # the time budget plans a search of another config with (kvtune.tuner.budget); of the set-up, Triton's
        # compilations (or loads from its disk cache: ``compile_loads`` of the ``compiles``)
        wall = time.perf_counter() - started
        return record | {
            "wall_s": wall, "prime_s": prime_s, "compile_s": compiles.ms / 1e3, "compiles": compiles.count,
            "compile_loads": compiles.loaded,
        }  # fmt: skip

    def unloaded(self, config: HybridConfig, requests: tuple[Request, ...], warmup: int) -> dict[str, Any]:
        """``requests`` at 1/1000 of their rate (outputs cut to ``UNLOADED_OUTPUT_TOKENS``): one at a time
        except the trace's own bursts of simultaneous arrivals, which no rate spreads. The unloaded
        latencies that the default capacity limits are derived from.

        One unmeasured replay primes the cache, then :func:`unloaded_repeats` are measured and the one with
        the median P99 TTFT is returned (``ttft_p99_repeats``: all of them; ``unprimed_ttft_p99_ms``: the
        priming replay's). The priming of a new cache serves the requests all at once, which leaves the
        shapes of requests served alone to the first unloaded replay. On the wall and device clocks even a
        primed P99 TTFT moves between replays: on an H200 (96 requests) single replays read 30.7-57.0 ms
        primed and 34.9-61.6 ms unprimed, the median of three 31.8-53.5 ms, since a prompt served alone runs
        op by op and is launch-bound (host launch time over device time 0.99-1.00): the host's speed moves
        it. The gated clock leaves the host's launch time out, and there one measured replay is enough."""
        short = outputs_cut(requests, UNLOADED_OUTPUT_TOKENS)
        first = self.replay(config, short, UNLOADED_TIME_SCALE, warmup)
        repeats = unloaded_repeats(self.spec.scheduler.clock, self.device.type)
        runs = [self.replay(config, short, UNLOADED_TIME_SCALE, warmup) for _ in range(repeats)]
        p99 = [r.get("ttft_p99_ms") for r in runs]
        ranked = sorted(range(len(runs)), key=lambda i: (p99[i] is None, p99[i] or 0.0))
        median = runs[ranked[(len(runs) - 1) // 2]]
        return median | {"ttft_p99_repeats": p99, "unprimed_ttft_p99_ms": first.get("ttft_p99_ms")}

    def _replayer(self, knobs: EngineKnobs | None) -> Any:
        """The replayer of ``knobs``' scheduler (the worker's own for None); built once per distinct one. The
        others free what they kept: one cache over the budget lives at a time."""
        chosen = self.replayer
        scheduler = knobs.scheduler(self.spec.scheduler) if knobs is not None else self.spec.scheduler
        if scheduler != self.spec.scheduler:
            if scheduler not in self._replayers:
                from kvtune.engine.replay import Replayer

                options = dataclasses.replace(self.replayer.options, budget_bytes=self.budget_bytes,
                                              scheduler=scheduler)  # fmt: skip
                self._replayers[scheduler] = Replayer(self.loaded, self.device, options)
            chosen = self._replayers[scheduler]
        for replayer in (self.replayer, *self._replayers.values()):
            if replayer is not chosen:
                replayer.release()
        return chosen

    def quality(self, config: HybridConfig) -> dict[str, Any]:
        """Quality of ``config`` (teacher-forced over the text, against the unquantized cache), with the
        call's seconds: ``wall_s``, and of them ``load_s`` the quality model's load (0 once loaded) and
        ``compile_s`` Triton's compilations (or loads from its disk cache) for the quality model's shapes.
        Measured beside the probes (:mod:`kvtune.tuner.quality_host`): ``wall_s`` is the call's wait for
        the answer, ``measure_s`` the CPU process's time on it and ``load_s`` its load of the model (in the
        first answer), both beside the probes."""
        from kvtune.engine.compiles import CompileWatch
        from kvtune.engine.quality import measure_quality

        started = time.perf_counter()
        if self._quality_host is not None:
            deadline = self._deadline  # the trial's time limit bounds the wait
            timeout = None if deadline is None else max(0.0, deadline.at - time.monotonic())
            try:
                answer = self._quality_host.result(config.to_dict(), timeout=timeout)
            except TimeoutError:
                from kvtune.engine.engine import ReplayTimeoutError  # as a replay past the limit

                assert deadline is not None
                raise ReplayTimeoutError(deadline.reason) from None
            return answer | {"wall_s": time.perf_counter() - started}
        self.release()  # the quality run builds its own caches
        q = self.spec.quality
        text = Path(q.text_path).read_text(encoding="utf-8")
        loading = time.perf_counter()
        loaded = self._quality_loaded()
        load_s = time.perf_counter() - loading
        with CompileWatch() as compiles:
            result = measure_quality(
                loaded,
                config,
                text,
                windows=q.windows,
                prefill_tokens=q.prefill_tokens,
                decode_tokens=q.decode_tokens,
                step_ms=q.step_ms,
                passkey=q.passkey,
                aggregation=q.aggregation,
            )
        times = {"wall_s": time.perf_counter() - started, "load_s": load_s, "compile_s": compiles.ms / 1e3}
        return dict(result.to_dict()) | times

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

    def release(self) -> None:
        """Free what the last trial kept (its replayers' caches and graphs, the allocator's spare blocks)."""
        for replayer in (self.replayer, *self._replayers.values()):
            replayer.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def ping(self) -> bool:
        return True

    # ---- kernels compiled ahead ------------------------------------------------------------------------
    def warm_kernels(self, configs: Sequence[dict[str, Any]], workers: int = 1) -> bool:
        """Start compiling the kernels of ``configs`` (dicts, in the order wanted) on the host's spare cores
        while this worker measures (:mod:`kvtune.engine.warm`), with a ``workers``-th of the processes the
        host's cores allow (the study's workers share them). Only a GPU worker whose launches take the Triton
        kernels does it (not with ``KVTUNE_WARM=0``); returns whether it started."""
        from kvtune.engine.options import warm_processes

        return self._warm(self.loaded.spec, configs, warm_processes(len(configs), workers))

    def _warm_baseline(self, spec: WorkerSpec) -> None:
        """The baseline's kernels and the model's, compiled ahead while the model loads (the calibration,
        the first replay, then finds them on disk)."""
        from kvtune.engine.model import model_spec

        model = model_spec(spec.model)
        if model is not None:
            self._warm(model, [BASELINE.to_dict()], 1)

    def _warm(self, model: Any, configs: Sequence[dict[str, Any]], processes: int) -> bool:
        from kvtune.engine import warm
        from kvtune.engine.options import warm_enabled
        from kvtune.kernels.backend import use_triton

        if not (configs and use_triton(self.device) and warm_enabled()):
            return False
        spec = warm.spec_for(self.device, model, self.spec.dtype, self.spec.scheduler, configs)
        self._warmers.append(warm.KernelWarmer(spec, processes))
        return True

    def warm_report(self) -> dict[str, Any] | None:
        """How far the last :meth:`warm_kernels` got (``KernelWarmer.report``); None where none started."""
        return self._warmers[-1].report() if self._warmers else None

    def __del__(self) -> None:
        for warmer in getattr(self, "_warmers", ()):
            warmer.stop()


def unloaded_repeats(clock: str, device: str) -> int:
    """The unloaded replays measured after the priming one: :data:`UNLOADED_REPEATS_GATED` on a GPU's gated
    clock (their P99 TTFT is the device's and does not move), :data:`UNLOADED_REPEATS` otherwise (on the
    wall or device clock the host's launch time moved it ±25 %; on a CPU the gated clock is the wall's)."""
    return UNLOADED_REPEATS_GATED if clock == "gated" and device == "cuda" else UNLOADED_REPEATS


def quality_beside(quality: QualitySettings, device: str) -> bool:
    """Whether a worker on ``device`` measures quality on the CPU beside its probes: asked for (``cpu``), or
    on a GPU worker by default (``auto``) where the measurement is light enough for the CPU to finish it
    while the probes run (:data:`QUALITY_BESIDE_MAX_PARAMS`, :data:`QUALITY_BESIDE_MAX_TOKENS`, no passkey
    and no aggregation probe)."""
    from kvtune.engine.model import model_parameters

    if quality.device != "auto":
        return quality.device == "cpu"
    if device != "cuda":
        return False
    tokens = quality.windows * (quality.prefill_tokens + quality.decode_tokens)
    if quality.passkey or quality.aggregation or tokens > QUALITY_BESIDE_MAX_TOKENS:
        return False
    params = model_parameters(quality.model)
    return params is not None and params <= QUALITY_BESIDE_MAX_PARAMS


def _window_passes(metrics: dict[str, Any], timings: list[Any], slo: Slo, requests: int) -> bool:
    """One window's verdict: on its percentiles, or on its requests' times for another statistic."""
    if slo.statistic == "percentile":
        return probe_passes(metrics, slo)
    return requests_pass(timings, slo, requests) and not _refused([metrics])


def _window_margin(metrics: dict[str, Any], timings: list[Any], slo: Slo) -> float:
    return windows_margin([metrics], slo) if slo.statistic == "percentile" else decision_margin(timings, slo)


def _refused(runs: list[dict[str, Any]]) -> bool:
    return any(m.get("refused", 0) for m in runs)


def local_worker(
    model: str,
    device: torch.device,
    text_path: str,
    dtype: str | None = None,
    budget_bytes: int | None = None,
    scheduler: SchedulerConfig | None = None,
) -> TrialWorker:
    """A worker in this process, without Ray: how a benchmark probes and replays as a study's worker does.
    ``dtype`` None is bfloat16 on a GPU and float32 on a CPU; its quality settings are the smallest (one
    window of 192 + 16 tokens of ``text_path``), since a benchmark measures no quality."""
    quality = QualitySettings("smollm2", text_path, windows=1, prefill_tokens=192, decode_tokens=16)
    spec = WorkerSpec(
        model, device.type, quality, dtype=dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        budget_bytes=budget_bytes, scheduler=scheduler or SchedulerConfig(),
    )  # fmt: skip
    return TrialWorker(spec)
