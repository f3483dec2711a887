"""The serving engine: open-loop trace replay with continuous batching over the hybrid cache.

A replay puts requests on a clock (arrival = trace arrival × ``time_scale``; 0 = all at once, the saturation
test), admits them as the KV budget allows (:mod:`kvtune.engine.scheduler`), prefills each admitted
sequence, then runs one decode step for the whole running batch, and repeats. Outputs are forced to
``output_length`` (greedy tokens, no early end). Time is measured (CUDA events on a GPU, ``perf_counter`` on
a CPU); idle gaps with nothing to run are skipped, not slept: no latency can change in them, and the engine
clock advances by the gap.

Each decode step is split into: attention (the ``cache.decode`` calls, timed one by one), model math (the
rest of ``model.decode``) and bookkeeping (everything else in the step: ``begin_step``/``end_step``,
scheduling, preemption). A warm-up run of the first ``warmup_requests`` requests on a throw-away cache comes
first, so first compilations and allocator growth stay out of the metrics.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.engine.metrics import (
    EngineCounters,
    ReplayMetrics,
    RequestTiming,
    copy_bandwidth_gbs,
    summarize,
)
from kvtune.engine.scheduler import Scheduler, SchedulerConfig
from kvtune.engine.scheduler import Sequence as Seq
from kvtune.engine.traces import LengthCounts, LengthPolicy, Request, prompt_token_ids, read_trace

Progress = Callable[[int, int], None]
CPU_BUDGET_CAP_BYTES = 4 << 30
DEFAULT_BASELINE = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=0)


class ReplayTimeoutError(RuntimeError):
    """A replay ran past its :class:`Deadline` (a trial's time limit): the config is infeasible here."""


@dataclass(frozen=True)
class Deadline:
    """A bound on a replay's wall-clock time: ``at`` is a ``time.monotonic()`` reading, ``reason`` what the
    error says (the limit and where it comes from). Checked once per engine iteration, so a replay ends
    within one prefill chunk or decode step of it."""

    at: float
    reason: str

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise ReplayTimeoutError(self.reason)


# ------------------------------------------------------------------------------------------------ timing


class DeviceTimer:
    """Marks on the device timeline: CUDA events on a GPU, ``perf_counter`` readings on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (on CUDA, waits for the end mark)."""
        if not self.cuda:
            return (end - start) * 1000.0
        end.synchronize()
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class TimedCache:
    """The cache as the model sees it: every ``decode`` call is timed (attention); the rest passes through."""

    def __init__(self, cache: Any, timer: DeviceTimer) -> None:
        self._cache = cache
        self._timer = timer
        self._marks: list[tuple[Any, Any]] = []

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        start = self._timer.mark()
        out = self._cache.decode(*args, **kwargs)
        self._marks.append((start, self._timer.mark()))
        return out

    def take_attention_ms(self) -> float:
        """Attention time since the last call (the marks must have completed)."""
        total = sum(self._timer.elapsed_ms(a, b) for a, b in self._marks)
        self._marks.clear()
        return total

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class EngineClock:
    """Engine time in ms since the replay started; idle gaps are skipped, not slept."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._skipped_ms = 0.0

    def now_ms(self) -> float:
        return (time.perf_counter() - self._t0) * 1000.0 + self._skipped_ms

    def skip_to(self, ms: float) -> None:
        self._skipped_ms += max(0.0, ms - self.now_ms())


# ------------------------------------------------------------------------------------------------ a run


@dataclass
class _Run:
    """Mutable state of one replay (one cache, one scheduler, the counters so far)."""

    cache: Any
    timed: TimedCache
    scheduler: Scheduler
    clock: EngineClock
    total: int
    timings: list[RequestTiming] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + value

    def peak(self, key: str, value: float) -> None:
        self.counters[key] = max(self.counters.get(key, 0.0), value)


class Engine:
    """Replays requests on one model and one cache configuration under a KV budget (bytes)."""

    def __init__(
        self,
        loaded: Any,
        config: HybridConfig,
        budget_bytes: int,
        device: torch.device,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"`budget_bytes > 0` must hold, but got budget_bytes={budget_bytes}")
        self.loaded = loaded
        self.model = loaded.model
        self.spec = loaded.spec
        self.config = config
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self.scheduler_config = scheduler or SchedulerConfig()
        self.timer = DeviceTimer(self.device)
        self.copy_bandwidth_gbs = copy_bandwidth_gbs(self.device)

    # -------------------------------------------------------------------------------------------- public

    def replay(
        self,
        requests: Sequence[Request],
        time_scale: float,
        warmup_requests: int = 4,
        progress: Progress | None = None,
        clipped: int = 0,
        deadline: Deadline | None = None,
    ) -> ReplayMetrics:
        """Replay ``requests`` open-loop (arrivals × ``time_scale``) and measure them.

        Requests longer than the model's context are clipped to it; ``clipped`` in the result counts the
        requests a length policy shortened (here, or before: :class:`~kvtune.engine.traces.Request`'s
        ``shortened``) plus the ``clipped`` given. ``deadline`` ends a replay that runs too long
        (:class:`ReplayTimeoutError`). The
        first ``warmup_requests`` requests are first run once, all at once, on a throw-away cache that
        first launches the kernels they may not reach (:meth:`HybridCache.compile_kernels`), so that no
        compilation falls inside the measured replay; that replay then serves every request.
        """
        if not (math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"`time_scale >= 0` must hold, but got time_scale={time_scale}")
        if not requests:
            raise ValueError("no request to replay")
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("request ids (rid) must be unique within a replay")
        fitted, counts = LengthPolicy(self.spec.max_context).apply(requests)
        if warmup_requests > 0:
            self._run(fitted[:warmup_requests], 0.0, None, compile_kernels=True, deadline=deadline)
        run = self._run(fitted, time_scale, progress, deadline=deadline)
        return summarize(run.timings, self._counters(run, clipped=clipped + counts.shortened))

    def with_config(self, config: HybridConfig) -> Engine:
        """The same engine (model, budget, device, copy-bandwidth probe) with another cache configuration."""
        clone = object.__new__(Engine)
        clone.__dict__.update(self.__dict__)
        clone.config = config
        return clone

    def new_cache(self, max_seqs: int | None = None) -> HybridCache:
        """A fresh cache over the budget with ``max_seqs`` hot-zone slots (default ``max_batch``)."""
        slots = self.scheduler_config.max_batch if max_seqs is None else max_seqs
        return HybridCache(self.config, self.model.kv_shape, self.budget_bytes, self.device, max_seqs=slots)

    # -------------------------------------------------------------------------------------------- loop

    def _run(
        self,
        requests: Sequence[Request],
        time_scale: float,
        progress: Progress | None,
        compile_kernels: bool = False,
        deadline: Deadline | None = None,
    ) -> _Run:
        cache = self.new_cache(min(self.scheduler_config.max_batch, len(requests)))
        if compile_kernels:  # the warm-up: kernels its requests may not reach compile now, not when timed
            cache.compile_kernels()
        arrivals = deque(self._sequences(requests, time_scale))
        scheduler = Scheduler(cache, self.scheduler_config)
        self.timer.synchronize()
        run = _Run(cache, TimedCache(cache, self.timer), scheduler, EngineClock(), total=len(requests))
        with torch.inference_mode():
            while arrivals or run.scheduler.has_work():
                if deadline is not None:
                    deadline.check()
                self._take_arrivals(run, arrivals)
                if not run.scheduler.has_work():
                    run.clock.skip_to(arrivals[0].arrival_ms)
                    continue
                self._prefill_admitted(run, progress)
                self._decode_step(run, progress)
        run.add("duration_ms", run.clock.now_ms())
        return run

    def _sequences(self, requests: Sequence[Request], time_scale: float) -> list[Seq]:
        t0 = min(r.arrival_ms for r in requests)
        vocab = self.spec.vocab_size
        seqs = [Seq(r, prompt_token_ids(r, vocab), (r.arrival_ms - t0) * time_scale) for r in requests]
        return sorted(seqs, key=lambda s: (s.arrival_ms, s.seq_id))

    def _take_arrivals(self, run: _Run, arrivals: deque[Seq]) -> None:
        now = run.clock.now_ms()
        while arrivals and arrivals[0].arrival_ms <= now:
            run.scheduler.add(arrivals.popleft())

    def _prefill_admitted(self, run: _Run, progress: Progress | None) -> None:
        """Admit what fits, then this iteration's prefill chunks; a finished prompt emits its first token."""
        refused_before = len(run.scheduler.refused)
        run.scheduler.admit(run.clock.now_ms())
        for seq, n in run.scheduler.prefill_chunks():
            start = self.timer.mark()
            chunk = seq.tokens[seq.prefilled : seq.prefilled + n]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            logits = self.model.prefill(run.cache, seq.seq_id, ids, seq.prefilled, last_only=True)
            seq.prefilled += n
            token = None if seq.prefilling else int(logits[-1].argmax())
            run.add("prefill_ms", self.timer.elapsed_ms(start, self.timer.mark()))
            run.add("prefill_chunks", 1)
            if token is not None:
                self._emit(run, seq, token, progress)
        if len(run.scheduler.refused) > refused_before and progress is not None:
            progress(len(run.timings) + len(run.scheduler.refused), run.total)
        self._track_memory(run)

    def _decode_step(self, run: _Run, progress: Progress | None) -> None:
        start = self.timer.mark()
        batch = run.scheduler.schedule_decode()
        if not batch:
            return
        ids = [s.seq_id for s in batch]
        plan = run.cache.begin_step(ids, run.clock.now_ms())
        tokens = torch.tensor([s.output[-1] for s in batch], dtype=torch.long, device=self.device)
        positions = torch.tensor([s.next_position for s in batch], dtype=torch.long, device=self.device)
        model_start = self.timer.mark()
        logits = self.model.decode(run.timed, plan, tokens, positions)
        model_end = self.timer.mark()
        next_tokens = logits.argmax(dim=-1)
        run.cache.end_step(plan)
        end = self.timer.mark()
        next_list = next_tokens.tolist()  # synchronizes
        self.timer.synchronize()
        run.add("decode_steps", 1)
        run.add("decode_ms", self.timer.elapsed_ms(start, end))
        run.add("model_ms", self.timer.elapsed_ms(model_start, model_end))
        run.add("attention_ms", run.timed.take_attention_ms())
        run.peak("peak_running", len(batch))
        self._track_memory(run)
        for seq, token in zip(batch, next_list):
            self._emit(run, seq, int(token), progress)

    def _emit(self, run: _Run, seq: Seq, token: int, progress: Progress | None) -> None:
        seq.output.append(token)
        seq.token_ms.append(run.clock.now_ms())
        if not seq.done:
            return
        run.scheduler.finish(seq)
        run.timings.append(RequestTiming(seq.seq_id, seq.arrival_ms, tuple(seq.token_ms)))
        if progress is not None:
            progress(len(run.timings) + len(run.scheduler.refused), run.total)

    def _track_memory(self, run: _Run) -> None:
        run.peak("peak_kv_bytes", float(kv_bytes_in_use(run.cache)))

    def _counters(self, run: _Run, clipped: int) -> EngineCounters:
        c, s = run.counters, run.scheduler
        debug = dict(run.cache.debug_stats()) if self.config.kv_cache_debug else {}
        return EngineCounters(
            duration_ms=c.get("duration_ms", 0.0),
            decode_steps=int(c.get("decode_steps", 0)),
            decode_ms=c.get("decode_ms", 0.0),
            model_ms=c.get("model_ms", 0.0),
            attention_ms=c.get("attention_ms", 0.0),
            attention_bytes=int(run.cache.attention_bytes_read),  # decode attention only
            prefill_ms=c.get("prefill_ms", 0.0),
            prefill_chunks=int(c.get("prefill_chunks", 0)),
            peak_kv_bytes=int(c.get("peak_kv_bytes", 0)),
            peak_running=int(c.get("peak_running", 0)),
            preemptions=s.preemptions,
            prompt_tokens=s.prompt_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            refused=len(s.refused),
            clipped=clipped,
            copy_bandwidth_gbs=self.copy_bandwidth_gbs,
            debug=debug,
        )


def kv_bytes_in_use(cache: Any) -> int:
    """Bytes of the budget the cache holds for live data (hot zones of running sequences + used blocks)."""
    return int(cache.stats()["kv_bytes_in_use"])


# ------------------------------------------------------------------------------------------------ setup


def load_workload(
    path: str,
    max_context: int,
    requests: int | None = None,
    seed: int = 0,
    length_scale: float = 1.0,
    length_cap: int | None = None,
) -> tuple[list[Request], LengthCounts, dict[str, Any]]:
    """A trace sample fitted to a model: ``requests`` contiguous requests (seeded start), lengths scaled by
    ``length_scale``, capped at ``length_cap`` tokens and clipped to ``max_context``.

    Returns the requests, what the length policy changed, and a provenance record of the sample.
    """
    trace = read_trace(path).sample(n=requests, seed=seed)
    policy = LengthPolicy(max_context, "clip", length_scale, length_cap)
    fitted, counts = policy.apply(trace.requests)
    info = trace.sample_info.to_dict() if trace.sample_info is not None else {}
    record = {
        "path": str(path),
        "format": trace.format,
        "sample": info,
        "length_policy": policy.to_dict(),
        "length_counts": counts.to_dict(),
    }
    return fitted, counts, record


def resolve_device(name: str | None = None) -> torch.device:
    """``name`` as a device; None: the first CUDA device when there is one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested, but no CUDA device is available")
    return device


# -------------------------------------------------------------------------------------------- budget + load


def default_budget_bytes(loaded: Any, device: torch.device, fraction: float = 0.9) -> int:
    """The KV budget: ``fraction`` of the device memory free now (after the model is loaded).

    On a CPU: ``fraction`` of the available RAM, capped at :data:`CPU_BUDGET_CAP_BYTES` (4 GiB), because a CPU
    replay runs scaled-down lengths and the machine is shared.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"`0 < fraction <= 1` must hold, but got fraction={fraction}")
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(available * fraction, CPU_BUDGET_CAP_BYTES))


def calibrate_time_scale(
    loaded: Any,
    requests: Sequence[Request],
    budget_bytes: int,
    device: torch.device,
    load: float = 0.75,
    config: HybridConfig | None = None,
    warmup_requests: int = 4,
    scheduler: SchedulerConfig | None = None,
    deadline: Deadline | None = None,
) -> float:
    """The factor on trace inter-arrival times that runs the unquantized baseline at ``load`` of saturation.

    Saturation = requests/s of the baseline (``config.unquantized()``, default hot_tokens 32, block_size 64)
    serving all ``requests`` at once. The trace's own rate is ``(n - 1) / span``; the returned factor
    stretches (> 1) or compresses (< 1) arrivals so the rate becomes ``load × saturation``. Requests that all
    arrive at once get 1 (no time scale changes them).
    """
    if not 0 < load <= 1.5:
        raise ValueError(f"`0 < load <= 1.5` must hold, but got load={load}")
    if len(requests) < 2:
        raise ValueError(f"calibration needs at least 2 requests, got {len(requests)}")
    span_ms = max(r.arrival_ms for r in requests) - min(r.arrival_ms for r in requests)
    if span_ms <= 0:
        return 1.0  # every request arrives at once: a time scale changes nothing
    baseline = (config or DEFAULT_BASELINE).unquantized()
    engine = Engine(loaded, baseline, budget_bytes, device, scheduler)
    saturation_rps = engine.replay(
        requests, time_scale=0.0, warmup_requests=warmup_requests, deadline=deadline
    ).requests_per_s
    trace_rps = (len(requests) - 1) / (span_ms / 1000.0)
    return trace_rps / (load * saturation_rps)
