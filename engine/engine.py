"""The serving engine: open-loop trace replay with continuous batching over the hybrid cache.

A replay puts requests on a clock (arrival = trace arrival × ``time_scale``; 0 = all at once, the saturation
test), admits them as the KV budget allows (:mod:`kvtune.engine.scheduler`), prefills each admitted
sequence, then runs one decode step for the whole running batch, and repeats. Outputs are forced to
``output_length`` (greedy tokens, no early end). Time is measured (CUDA events on a GPU, ``perf_counter`` on
a CPU); idle gaps with nothing to run are skipped, not slept: no latency can change in them, and the engine
clock advances by the gap.

Iterations (:class:`~kvtune.engine.scheduler.SchedulerConfig`): by default each iteration is one forward
with the decode token of every running sequence whose prompt is done and prompt chunks filling the rest of
``max_num_batched_tokens`` (``mixed``); an iteration without prompt work runs the static decode step
(``graphs``, :mod:`kvtune.engine.graphs`): host bookkeeping in a few array operations, then the seals and
the forward replayed as CUDA graphs on CUDA (run directly on a CPU). ``max_num_seqs`` is derived from the
budget unless given (:meth:`Engine.settings_for`). Per-sequence outputs live in slot-indexed arrays
(:mod:`kvtune.engine.outputs`), so the host work of a decode step does not grow with the batch beyond array
operations. ``mixed=False, graphs=False`` is the engine as it was: admit, prefill each chunk in its own
forward, then one eager decode step.

Each decode iteration is split into: attention (the ``cache.decode`` calls; in graph mode timed on every
16th replay only, see :mod:`kvtune.engine.metrics`), model math (the rest of the forward) and bookkeeping
(everything else in the iteration: ``begin_step``/``end_step`` or ``prepare_step``/``finish_step``,
scheduling, preemption). A warm-up run of the first ``warmup_requests`` requests comes first on the replay's
cache (then emptied), so first compilations, graph captures and allocator growth stay out of the metrics;
a Triton compilation met inside a measured iteration all the same is left out of the clock
(:mod:`kvtune.engine.compiles`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvtune.cache_impl.chunks import upload, warm_pinned_pool
from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.engine.compiles import CompileWatch
from kvtune.engine.graphs import DecodeGraphs
from kvtune.engine.graphs import attention_ms as graphs_attention_ms
from kvtune.engine.metrics import (
    EngineCounters,
    ReplayMetrics,
    RequestTiming,
    copy_bandwidth_gbs,
    summarize,
)
from kvtune.engine.mixed_graphs import MixedGraphs
from kvtune.engine.options import CPU_BUDGET_CAP_BYTES, max_num_seqs_for
from kvtune.engine.outputs import SlotOutputs
from kvtune.engine.piecewise import PIECE_BUCKETS, PiecewiseForward
from kvtune.engine.scheduler import Scheduler, SchedulerConfig
from kvtune.engine.scheduler import Sequence as Seq
from kvtune.engine.traces import LengthCounts, LengthPolicy, Request, prompt_token_ids, read_trace

Progress = Callable[[int, int], None]
# (engine clock in ms, every sequence of the replay in arrival order) -> True to end the replay now: a
# capacity probe whose latency limits can no longer be met stops instead of serving a long queue.
Stop = Callable[[float, Sequence[Seq]], bool]
DEFAULT_BASELINE = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=0)
# the gated clock (SchedulerConfig.clock "gated"): each kind of iteration has its own gates (GateSizes), which
# hold the idle device GATE_MARGIN × the longest host time of that kind's last GATE_HISTORY gated segments
# + GATE_PAD_MS, at most GATE_MAX_MS for an iteration's first gate and GATE_LAYER_MAX_MS for one between
# layers; a kind not yet timed assumes GATE_FIRST_MS of host time
GATE_MARGIN, GATE_PAD_MS, GATE_MAX_MS, GATE_LAYER_MAX_MS, GATE_HISTORY = 1.25, 0.3, 50.0, 25.0, 64
# ... and a history of fewer than GATE_SETTLED segments GATE_YOUNG_MARGIN × its longest + GATE_YOUNG_PAD_MS:
# a process's first iterations of a kind vary the most (a fresh machine, run 46a: a gate sized from two
# segments leaked at 2.3 × the longer, one from four at 1.39 ×), and a longer sleep costs only idle wall
GATE_SETTLED, GATE_YOUNG_MARGIN, GATE_YOUNG_PAD_MS = 8, 2.0, 1.0
# an eager forward's host waits at a layer boundary where the device has not yet passed the mark of
# GATE_AHEAD_LAYERS boundaries before: the device's launch queue holds ~1,020 kernels (run 28c) and an eager
# layer launches 18-43 (benchmarks/mixed_ops.py), so past a queue's worth the host would block inside a
# launch, a wait no clock can take out, and a gate sized from that host time would grow (run 29a)
GATE_AHEAD_LAYERS = 4
# host ms assumed before a kind is timed (a captured step launches one graph; an eager forward opens a gate
# per layer, whose ops take the host 0.5-2 ms for a Llama-3.1-8B shape on an H200)
GATE_FIRST_MS = 10.0
# a host time more than GATE_CLIP × the median of its history (8 or more) counts as that much: a pause of the
# host (a garbage collection, a library's first call) would otherwise size the next GATE_HISTORY gates
GATE_CLIP = 3.0


# each model's piecewise forward (Engine._piecewise), kept while the model lives
_PIECES: weakref.WeakKeyDictionary[Any, PiecewiseForward] = weakref.WeakKeyDictionary()
# ... uncaptured, for the static buffers and piece functions of the mixed graphs (without ``piecewise``)
_PIECE_BUFFERS: weakref.WeakKeyDictionary[Any, PiecewiseForward] = weakref.WeakKeyDictionary()
MAX_PACKED = 32768  # the most packed rows of a mixed iteration replayed as a graph (MixedGraphs)
# a replay on the gated clock, and a study's probe, runs with Python's cyclic collector paused: a collection
# inside a gated segment adds host time no gate is sized for (run 46: two of four leaked first segments held
# one, at 1.39 and 1.55 × their history's longest), one inside a probe can decide its P99; reference counting
# frees what a replay drops (it leaves no cyclic garbage: tests/test_graphs.py). `0`: leave it on
GC_PAUSE_ENV = "KVTUNE_GC_PAUSE"
# the use of a mixed iteration's shape that captures its graph: a capture took about 65 ms on an H200, some
# 3.5x the iteration's host launch in pieces, and a probe meets most shapes once (RESULTS, run 40)
MIXED_CAPTURE_ON = 2


def gate_for(host_ms: float, settled: bool, first: bool) -> float:
    """The sleep, in ms, ahead of a segment that takes the host ``host_ms``: with the margins of a settled
    history or a young one, capped as an iteration's first gate (``first``) or one between layers."""
    margin, pad = (GATE_MARGIN, GATE_PAD_MS) if settled else (GATE_YOUNG_MARGIN, GATE_YOUNG_PAD_MS)
    return min(margin * host_ms + pad, GATE_MAX_MS if first else GATE_LAYER_MAX_MS)


class GateSizes:
    """What the next gate of each kind of iteration asks, from the host times of that kind's recent gated
    segments. A kind is (``step``: a captured decode step; ``decode``: an eager one; ``prefill``: one prompt
    chunk alone; ``chunks``: several; ``mixed``: decode rows and chunks, number of chunks; ``graph``: a
    forward with prompt tokens replayed as one graph, :class:`MixedGraphs`): an eager forward launches
    every op of every layer, a captured step one graph, so one history for both would size a
    forward's gate from the steps' (run 28a: 141 of 263 gates opened inside a prefill sized that way). An
    eager forward's segments (:class:`_Gate`) keep two histories: its first (the iteration's set-up and its
    first layer) and the rest (a layer each). A kind first met with another number of chunks scales the
    largest time of its kind by the ratio."""

    def __init__(self) -> None:
        self._host: dict[tuple[str, int, bool], deque[float]] = {}

    def ms(self, key: tuple[str, int], first: bool = True) -> float:
        """The gate of ``key``'s first segment (``first``) or of a later one, in ms."""
        kind, n = key
        seen = self._host.get((kind, n, first))
        if seen:
            host = max(seen)
        else:
            same = [(m, max(d)) for (k, m, f), d in self._host.items() if k == kind and f == first and d]
            host = max((h * max(1.0, n / max(m, 1)) for m, h in same), default=GATE_FIRST_MS)
        return gate_for(host, seen is not None and len(seen) >= GATE_SETTLED, first)

    def add(self, key: tuple[str, int], host_ms: float, first: bool = True) -> None:
        """A gated segment's host time (a leaked one's bounded by :meth:`Engine._gate_close`'s caller), at
        most GATE_CLIP × the median of its history."""
        seen = self._host.setdefault((*key, first), deque(maxlen=GATE_HISTORY))
        if len(seen) >= 8:
            host_ms = min(host_ms, GATE_CLIP * statistics.median(seen))
        seen.append(host_ms)


@contextlib.contextmanager
def collector_paused(paused: bool = True, collect: bool = False) -> Iterator[None]:
    """Python's cyclic collector paused for the block where ``paused`` and ``KVTUNE_GC_PAUSE`` is not ``0``
    (collected first with ``collect``); left alone where it was off already (an enclosing pause). A replay on
    the gated clock pauses it without collecting (a full collection takes a process with torch loaded about
    0.1 s, and a study replays hundreds of times), a study's probe collects first
    (:func:`kvtune.tuner.worker.gc_paused`): what was pending is collected once the collector runs again."""
    if not paused or not gc.isenabled() or os.environ.get(GC_PAUSE_ENV, "1") == "0":
        yield
        return
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def prompt_rows(requests: Sequence[Request], max_num_batched_tokens: int) -> set[int]:
    """The row counts of the requests' prompts run alone: each prompt in chunks of
    ``max_num_batched_tokens`` tokens and the rest (what :meth:`LlamaModel.warm_rows` runs ahead)."""
    rows = set()
    for r in requests:
        full, rest = divmod(r.input_length, max_num_batched_tokens)
        if full:
            rows.add(max_num_batched_tokens)
        if rest:
            rows.add(rest)
    return rows


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
        self._cycles: float | None = None

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

    def gate(self, ms: float) -> Any:
        """A mark after the device has spun for ``ms`` (a sleep kernel): what the host enqueues meanwhile
        starts behind it, back to back, so marks after this one time the device's work without the host's
        launch gaps (on a CPU, a plain mark)."""
        if not self.cuda:
            return self.mark()
        torch.cuda._sleep(max(1, int(ms * self._cycles_per_ms())))
        return self.mark()

    def wait(self, mark: Any) -> None:
        """Hold the host until the device has passed ``mark`` (on a CPU, nothing to wait for)."""
        if self.cuda:
            mark.synchronize()

    def stretch_sleeps(self, factor: float) -> None:
        """Sleeps ``factor`` times longer from now on (one ran shorter than asked)."""
        if self._cycles is not None:
            self._cycles *= factor

    def _cycles_per_ms(self) -> float:
        """Sleep cycles per ms: the fastest of a few timed sleeps (an idle GPU starts at a low clock; a
        sleep timed then would be too short later, at the boost clock)."""
        if self._cycles is None:
            cycles, best = 1 << 22, 0.0
            for _ in range(4):
                a = self.mark()
                torch.cuda._sleep(cycles)
                best = max(best, cycles / max(self.elapsed_ms(a, self.mark()), 1e-3))
            self._cycles = best
        return self._cycles


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


def model_pieces(model: Any, device: torch.device) -> PiecewiseForward:
    """``model``'s piecewise forward: one per model, shared by every engine over it, its graphs captured when
    first built (on CUDA; its ``capture_ms`` says how long that took)."""
    pieces = _PIECES.get(model)
    if pieces is None:
        pieces = PiecewiseForward(model, PIECE_BUCKETS[-1], capture=device.type == "cuda")
        pieces.capture_all()
        _PIECES[model] = pieces
    return pieces


class EngineClock:
    """Engine time in ms since the replay started; idle gaps are skipped, not slept.

    The wall clock (the default) is host time. The device clock (``device=True``) is the sum of the times of
    the iterations completed so far on the device timeline (:meth:`advance`, from :class:`DeviceTimer`
    marks): the host's time between iterations, and its jitter, do not count, so a replay repeated takes the
    same requests into the same iterations unless the device's own times differ."""

    def __init__(self, device: bool = False) -> None:
        self.device = device
        self._t0 = time.perf_counter()
        self._device_ms = 0.0
        self._skipped_ms = 0.0

    def now_ms(self) -> float:
        if self.device:
            return self._device_ms + self._skipped_ms
        return (time.perf_counter() - self._t0) * 1000.0 + self._skipped_ms

    def skip_to(self, ms: float) -> None:
        self._skipped_ms += max(0.0, ms - self.now_ms())

    def advance(self, ms: float) -> None:
        """An iteration that took ``ms`` on the device completed (moves the device clock only)."""
        if self.device:
            self._device_ms += max(0.0, ms)

    def exclude(self, ms: float) -> None:
        """Leave ``ms`` just spent (capturing a CUDA graph) out of the clock: it stood still meanwhile (the
        device clock never counted it)."""
        if not self.device:
            self._skipped_ms -= max(0.0, ms)


# ------------------------------------------------------------------------------------------------ a run


@dataclass(frozen=True)
class EngineSettings:
    """The engine's options as one replay resolves them (:class:`SchedulerConfig`; recorded in its result).

    max_num_seqs: hot-zone slots of the cache = most sequences running; max_model_len: the longest request
    (prompt + output), which bounds a sequence's block table; graphs: decode-only iterations run the static
    step; cuda_graphs: ... replayed as CUDA graphs (CUDA only)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    graphs: bool
    cuda_graphs: bool
    mixed: bool
    max_model_len: int
    max_output: int


@dataclass
class _Gate:
    """An iteration's open gates (the gated clock). An eager forward launches every op of every layer, more
    than the device's launch queue holds behind a sleep (run 28c: 1,021 launches, then the host blocked):
    with one gate the host waited on a full queue until the gate opened (run 28b: 216 of 237 eager
    iterations leaked, their host time the gate's length). So between layers it marks the device's place
    (``probes``) and sleeps again where the sleeps still ahead of the device (after the newest mark it has
    passed) are shorter than the host takes to launch a layer: the device stays behind the host by about a
    layer's gate or two, never by a queue's worth. Each sleep between layers is timed by its own marks
    (``sleeps``), and its time leaves the iteration's."""

    key: tuple[str, int]  # the iteration's kind (GateSizes)
    t0: float  # the host's time when the current segment began
    last: Any  # the last mark enqueued before the current segment (the device idles once it passes it)
    planned: float  # the iteration's first sleep, ms
    probes: list[Any] = field(default_factory=list)  # a mark at each layer boundary
    slept: list[float] = field(default_factory=list)  # the ms slept right after each probe (0: none)
    passed: int = -1  # the newest probe the device has passed
    sleeps: list[tuple[Any, Any]] = field(default_factory=list)  # the later sleeps' marks (before, after)
    host: list[float] = field(default_factory=list)  # the finished segments' host ms
    leaked_at: int = -1  # the first segment that leaked (0: the iteration's first; -1: none)
    short: bool = False  # the first sleep ended before the host's time reached its planned length

    @property
    def leaked(self) -> bool:
        """The device passed ``last`` before the host had enqueued a segment."""
        return self.leaked_at >= 0


@dataclass
class _InFlight:
    """A static decode step launched whose tokens have not reached the host yet (at most one: the engine
    stages and launches the next step while the GPU runs this one, then lands this one)."""

    slots: np.ndarray
    done: np.ndarray  # the slots this step completes (they no longer decode)
    tokens: torch.Tensor  # the host copy of the step's tokens (arriving)
    ready: Any  # a CUDA event after that copy (None: already there)
    marks: tuple[Any, Any, Any, Any]  # iteration start, forward start, forward end, iteration end
    captured_ms: float
    attention: list[tuple[Any, Any]] | None  # the attention marks of a timed step
    bytes_before: int


@dataclass(frozen=True)
class _Kept:
    """A cache and its decode graphs kept between replays of one config with one set of options."""

    key: tuple[Any, ...]
    cache: HybridCache
    graphs: DecodeGraphs | None


@dataclass
class _Run:
    """Mutable state of one replay (one cache, one scheduler, the counters so far)."""

    cache: Any
    timed: TimedCache
    scheduler: Scheduler
    clock: EngineClock
    total: int
    settings: EngineSettings
    outputs: SlotOutputs
    graphs: DecodeGraphs | None = None
    seqs: list[Seq] = field(default_factory=list)  # every sequence of the replay, in arrival order
    in_flight: _InFlight | None = None
    captures_before: int = 0  # graphs captured by earlier replays on the same cache
    timings: list[RequestTiming] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    compiles: CompileWatch = field(default_factory=CompileWatch)  # Triton compilations inside the replay
    compile_mark: float = 0.0  # their milliseconds when the current iteration started
    gate: _Gate | None = None  # the open gates of this iteration (the gated clock)
    # each op-by-op forward with prompt tokens: its decode rows, prompt tokens and chunks, its device time
    # (its events, the sleeps between layers out) and the host's time launching it, ms
    forwards: list[dict[str, float]] = field(default_factory=list)

    def stall_ms(self) -> float:
        """Milliseconds of compilation since the current iteration started (then marked again)."""
        ms, self.compile_mark = self.compiles.ms - self.compile_mark, self.compiles.ms
        return ms

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
        self._gates = GateSizes()  # host ms of recent gated iterations, by kind
        # the cache and graphs of the last replay, shared with every with_config() copy: one at a time
        self._kept: list[_Kept | None] = [None]

    # -------------------------------------------------------------------------------------------- public

    def replay(
        self,
        requests: Sequence[Request],
        time_scale: float,
        warmup_requests: int = 4,
        progress: Progress | None = None,
        clipped: int = 0,
        deadline: Deadline | None = None,
        stop: Stop | None = None,
        timings: list[RequestTiming] | None = None,
        settings_from: Sequence[Request] | None = None,
        forwards: list[dict[str, float]] | None = None,
    ) -> ReplayMetrics:
        """Replay ``requests`` open-loop (arrivals × ``time_scale``) and measure them; ``timings``, when
        given, receives every finished request's arrival and token times (what the metrics summarize).
        ``settings_from``: resolve the options (:meth:`settings_for`) from these requests instead, so that
        a short replay builds the cache a replay of them will reuse (a priming replay with outputs cut).
        ``forwards``, when given, receives a record of each op-by-op forward with prompt tokens (decode rows,
        prompt tokens, chunks, device and host launch ms): where a repeat's prompt time went.

        Requests longer than the model's context are clipped to it; ``clipped`` in the result counts the
        requests a length policy shortened (here, or before: :class:`~kvtune.engine.traces.Request`'s
        ``shortened``) plus the ``clipped`` given. ``deadline`` ends a replay that runs too long
        (:class:`ReplayTimeoutError`). ``stop``, asked once per engine iteration, ends the measured replay
        early when it returns True (the result then covers the requests finished so far). The
        first ``warmup_requests`` requests are first run once, all at once, on the replay's cache, which
        first launches the kernels they may not reach (:meth:`HybridCache.compile_kernels`) and captures the
        CUDA graphs they use, so that no compilation falls inside the measured replay; the cache is then
        emptied (:meth:`HybridCache.reset`, its tensors and the graphs over them kept) and serves every
        request. A graph first needed by the measured replay is captured then, outside its clock.

        The cache and its graphs outlive the replay: the next replay with the same config and the same
        resolved options (a repeat, another arrival rate of a capacity search) empties and reuses them,
        with no warm-up and no capture of a shape already seen; another config frees them first.
        """
        if not (math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"`time_scale >= 0` must hold, but got time_scale={time_scale}")
        if not requests:
            raise ValueError("no request to replay")
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("request ids (rid) must be unique within a replay")
        policy = LengthPolicy(self.spec.max_context)
        fitted, counts = policy.apply(requests)
        settings = self.settings_for(fitted if settings_from is None else policy.apply(settings_from)[0])
        self._piecewise()  # built and captured once per model, before anything is timed
        if self.device.type == "cuda":  # each prompt's row count met once before any clock runs
            self.model.warm_rows(prompt_rows(fitted, settings.max_num_batched_tokens), logits=[1])
        if self._gated():
            warm_pinned_pool(self.device)  # no gated segment waits for the pinned pool to grow
        cache, graphs, fresh = self._cache_for(settings)
        settings = replace(settings, max_num_seqs=cache.layout.num_slots)  # the layout may give fewer
        with collector_paused(self._gated()):  # no collection inside a gated segment
            try:
                if warmup_requests > 0 and fresh:
                    self._run(
                        fitted[:warmup_requests], 0.0, None, compile_kernels=True, deadline=deadline,
                        cache=cache, graphs=graphs, settings=settings,
                    )  # fmt: skip
                cache.reset()
                if graphs is not None:
                    graphs.restart()
                run = self._run(
                    fitted, time_scale, progress, deadline=deadline, stop=stop, cache=cache, graphs=graphs,
                    settings=settings,
                )  # fmt: skip
            except BaseException:
                self.release()  # a replay cut short leaves no state behind
                raise
        if timings is not None:
            timings.extend(run.timings)
        if forwards is not None:
            forwards.extend(run.forwards)
        return summarize(run.timings, self._counters(run, clipped=clipped + counts.shortened))

    def with_config(self, config: HybridConfig) -> Engine:
        """The same engine (model, budget, device, copy-bandwidth probe) with another cache configuration."""
        clone = object.__new__(Engine)
        clone.__dict__.update(self.__dict__)
        clone.config = config
        return clone

    def with_clock(self, clock: str) -> Engine:
        """The same engine on another clock (:class:`SchedulerConfig`'s ``clock``); it shares the kept cache
        and graphs, which do not depend on the clock, so a replay on one clock after one on the other
        captures nothing."""
        clone = self.with_config(self.config)
        clone.scheduler_config = replace(self.scheduler_config, clock=clock)
        return clone

    def settings_for(self, requests: Sequence[Request]) -> EngineSettings:
        """The options of a replay of ``requests`` (already fitted to the context): ``max_num_seqs`` given, or
        derived from the budget and the layout at the requests' mean prompt + output length, within the
        caps of :func:`~kvtune.engine.options.max_num_seqs_for`."""
        opts = self.scheduler_config
        lengths = [r.input_length + r.output_length for r in requests] or [1]
        seqs, _ = max_num_seqs_for(
            self.config, self.model.kv_shape, self.budget_bytes, sum(lengths) / len(lengths),
            opts.max_num_batched_tokens, given=opts.max_num_seqs, requests=len(requests),
        )  # fmt: skip
        graphs = opts.graphs and not self.config.kv_cache_debug
        return EngineSettings(
            max_num_seqs=seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            graphs=graphs,
            cuda_graphs=graphs and self.device.type == "cuda",
            mixed=opts.mixed,
            max_model_len=max(lengths),
            max_output=max((r.output_length for r in requests), default=1),
        )

    def new_cache(self, max_seqs: int | None = None) -> HybridCache:
        """A fresh cache over the budget with ``max_seqs`` hot-zone slots (default: the options'
        ``max_num_seqs``, else :data:`~kvtune.cache_impl.layout.DEFAULT_MAX_SEQS`)."""
        slots = self.scheduler_config.max_num_seqs if max_seqs is None else max_seqs
        return HybridCache(self.config, self.model.kv_shape, self.budget_bytes, self.device, max_seqs=slots)

    def keeps_cache_for(self, requests: Sequence[Request]) -> bool:
        """Whether a replay of ``requests`` would reuse the cache and graphs kept from the last replay (a
        repeat, another rate of the same window and config) rather than build new ones."""
        fitted, _ = LengthPolicy(self.spec.max_context).apply(requests)
        kept = self._kept[0]
        return kept is not None and kept.key == self._cache_key(self.settings_for(fitted))

    def _cache_key(self, settings: EngineSettings) -> tuple[Any, ...]:
        return (self.config.to_json(None), self.budget_bytes, self.device, settings)

    def _cache_for(self, settings: EngineSettings) -> tuple[HybridCache, DecodeGraphs | None, bool]:
        """The cache (and graphs) of a replay with ``settings``: the kept ones when config, budget and
        settings match, else new ones (the kept ones freed first). The flag says whether they are new."""
        key = self._cache_key(settings)
        kept = self._kept[0]
        if kept is not None and kept.key == key:
            return kept.cache, kept.graphs, False
        self.release()
        cache = self.new_cache(settings.max_num_seqs)
        graphs = self._decode_graphs(cache, replace(settings, max_num_seqs=cache.layout.num_slots))
        self._kept[0] = _Kept(key, cache, graphs)
        return cache, graphs, True

    def release(self) -> None:
        """Free the cache and graphs kept from the last replay (of this engine and its copies)."""
        if self._kept[0] is None:
            return
        self._kept[0] = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _piecewise(self) -> PiecewiseForward | None:
        """The model's piecewise forward (:func:`model_pieces`) where the options ask for it."""
        return model_pieces(self.model, self.device) if self.scheduler_config.piecewise else None

    def _decode_graphs(self, cache: HybridCache, settings: EngineSettings) -> DecodeGraphs | None:
        """The cache's decode graphs (None: ``graphs`` off), with its mixed iterations' graphs where the
        options ask for them (``mixed_graphs``)."""
        if not settings.graphs:
            return None
        max_blocks = min(cache.layout.num_blocks, cache.layout.blocks_for(settings.max_model_len))
        graphs = DecodeGraphs(
            self.model, cache, settings.max_num_seqs, max(1, max_blocks), settings.cuda_graphs
        )
        if self.scheduler_config.mixed_graphs:
            pieces = _PIECES.get(self.model) or _PIECE_BUFFERS.get(self.model)
            if pieces is None:  # its static buffers and piece functions (the graphs capture them whole)
                pieces = PiecewiseForward(self.model, PIECE_BUCKETS[-1], capture=False)
                _PIECE_BUFFERS[self.model] = pieces
            packed = settings.max_num_batched_tokens + 2 * settings.max_model_len
            graphs.mixed = MixedGraphs(
                self.model, cache, graphs, pieces, settings.max_num_seqs, min(packed, MAX_PACKED),
                settings.cuda_graphs, capture_on=MIXED_CAPTURE_ON,
            )  # fmt: skip
        return graphs

    # -------------------------------------------------------------------------------------------- loop

    def _run(
        self,
        requests: Sequence[Request],
        time_scale: float,
        progress: Progress | None,
        compile_kernels: bool = False,
        deadline: Deadline | None = None,
        stop: Stop | None = None,
        cache: HybridCache | None = None,
        graphs: DecodeGraphs | None = None,
        settings: EngineSettings | None = None,
    ) -> _Run:
        if settings is None:
            settings = self.settings_for(requests)
        if cache is None:
            cache = self.new_cache(settings.max_num_seqs)
            settings = replace(settings, max_num_seqs=cache.layout.num_slots)
            graphs = self._decode_graphs(cache, settings)
        if compile_kernels:  # the warm-up: kernels its requests may not reach compile now, not when timed
            cache.compile_kernels()
        seqs = self._sequences(requests, time_scale)
        arrivals = deque(seqs)
        config = replace(
            self.scheduler_config, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        )  # fmt: skip
        scheduler = Scheduler(cache, config)
        outputs = SlotOutputs(cache.layout.num_slots, settings.max_output)
        self.timer.synchronize()
        run = _Run(
            cache,
            TimedCache(cache, self.timer),
            scheduler,
            EngineClock(device=self.scheduler_config.clock != "wall"),
            len(requests),
            settings,
            outputs,
            graphs,
            seqs,
            captures_before=graphs.captures if graphs is not None else 0,
        )
        scheduler.on_preempt = outputs.detach
        with torch.inference_mode(), run.compiles:
            while arrivals or run.scheduler.has_work():
                if deadline is not None:
                    deadline.check()
                if stop is not None and stop(run.clock.now_ms(), seqs):
                    break
                self._take_arrivals(run, arrivals)
                if not run.scheduler.has_work():
                    run.clock.skip_to(arrivals[0].arrival_ms)
                    continue
                if settings.mixed:
                    self._mixed_iteration(run, progress)
                else:
                    self._separate_iteration(run, progress)
            self._land(run, progress)
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

    # ---- iterations --------------------------------------------------------------------------------------

    def _mixed_iteration(self, run: _Run, progress: Progress | None) -> None:
        """The decode token of every running sequence whose prompt is done, then prompt chunks filling the
        rest of ``max_num_batched_tokens``: one forward (a static/graph step when there is no chunk)."""
        start = self._start(run)
        slots = self._decode_slots(run, progress)
        reserved = run.cache.blocks_needed_for_slots(slots) if slots.size else 0
        budget = run.scheduler.config.max_num_batched_tokens - len(slots)
        self._admit(run, progress, budget=budget, reserved_blocks=reserved, partial=True)
        chunks = run.scheduler.prefill_chunks(budget)
        if chunks:
            self._forward(run, slots, chunks, start, progress)
        elif slots.size:
            self._decode(run, slots, start, progress)
        else:
            self._land(run, progress)
        self._track_memory(run)

    def _separate_iteration(self, run: _Run, progress: Progress | None) -> None:
        """The engine before mixed iterations: admit, prefill each chunk in its own forward, then one decode
        step of every running sequence whose prompt is done."""
        self._admit(run, progress)
        for seq, n in run.scheduler.prefill_chunks():
            self._forward(run, np.zeros(0, dtype=np.int64), [(seq, n)], self._start(run), progress)
        self._track_memory(run)
        start = self._start(run)
        slots = self._decode_slots(run, progress)
        if slots.size:
            self._decode(run, slots, start, progress)
            self._track_memory(run)
        else:
            self._land(run, progress)

    def _start(self, run: _Run) -> Any:
        """An iteration's first mark; the compilations inside it are counted from here."""
        run.stall_ms()
        run.gate = None
        return self.timer.mark()

    def _gated(self) -> bool:
        return self.scheduler_config.clock == "gated" and self.timer.cuda

    def _gate(self, run: _Run, key: tuple[str, int]) -> Any:
        """Hold the idle device while the host enqueues this iteration: a sleep a little longer than the host
        took for recent iterations of its kind (``key``, :class:`GateSizes`), then the iteration's new start
        mark, so its time from that mark is the device's alone (the host's scheduling before it, on an idle
        device, is no device time either). Placed after the iteration's last read from the device. An eager
        forward gates again between layers (:meth:`_layer_gates`); :meth:`_gate_close` checks them when
        the last work is queued."""
        ms = self._gates.ms(key)
        mark = self.timer.gate(ms)
        run.gate = _Gate(key, time.perf_counter(), mark, ms)
        run.add("gate_ms", ms)
        run.add("gated_iterations", 1)
        return mark

    def _segment_done(self, gate: _Gate) -> None:
        host_ms = (time.perf_counter() - gate.t0) * 1000.0
        if gate.last.query():  # the device ran out of queued work while the host still enqueued the segment
            gate.short |= not gate.host and host_ms < gate.planned  # the first sleep ran short of its plan
            if not gate.leaked:
                gate.leaked_at = len(gate.host)
            # at most twice the first gate: had the host waited for the device, it would have waited a
            # sleep's length, and the bound keeps such a wait from ratcheting the gates up
            host_ms = min(host_ms, 2.0 * gate.planned)
        gate.host.append(host_ms)

    def _layer_gates(self, run: _Run) -> Callable[[], None] | None:
        """The model's hook between two layers of a gated eager forward (None: nothing gated). The segment
        before it is enqueued; a mark notes the device's place. Unless the sleeps queued after the newest
        mark the device has passed add up to a layer's gate (the host's time for a layer, with margin), the
        next segment starts behind a new sleep of that length. (Counting the layers the device is behind
        instead let a simulated device run dry: a layer's kernels take it far less than their launches take
        the host.) Where the device has not passed the mark GATE_AHEAD_LAYERS boundaries back (a first gate
        longer than the host needed), the host waits for it there, outside any segment's time. A layer that
        took the host longer than the history's gate allows for sizes the next sleep from its own time (a
        host slowed mid-forward, run 46a: layers at 3.6 ms against a history of 1.9 ms, until the device
        ran dry at the 25th)."""
        if run.gate is None:
            return None
        sized = self._gates.ms(run.gate.key, first=False)  # the history changes when the iteration closes

        def between_layers() -> None:
            gate = run.gate
            if gate is None:
                return
            self._segment_done(gate)
            ms = sized
            if len(gate.host) > 1:  # a layer just took the host longer than the history's sleep allows for
                ms = max(ms, gate_for(gate.host[-1], settled=True, first=False))
            probe = self.timer.mark()
            gate.probes.append(probe)
            while gate.passed + 1 < len(gate.probes) and gate.probes[gate.passed + 1].query():
                gate.passed += 1
            behind = len(gate.probes) - 1 - GATE_AHEAD_LAYERS
            if gate.passed < behind:  # GATE_AHEAD_LAYERS ahead of a device still asleep: wait here
                t = time.perf_counter()
                self.timer.wait(gate.probes[behind])
                gate.passed = behind
                run.add("gate_wait_ms", (time.perf_counter() - t) * 1000.0)
                run.add("gate_waits", 1)
            if sum(gate.slept[gate.passed + 1 :]) >= ms:  # the device has that much sleep ahead of it
                gate.slept.append(0.0)
                gate.last = probe
            else:
                gate.last = self.timer.gate(ms)
                gate.slept.append(ms)
                gate.sleeps.append((probe, gate.last))
                run.add("gate_ms", ms)
            gate.t0 = time.perf_counter()

        return between_layers

    def _gate_close(self, run: _Run, excused: bool = False) -> list[tuple[Any, Any]]:
        """The iteration's last work is enqueued. Had the device run out of queued work before, it ran part
        of the iteration while the host still enqueued (its time holds host gaps): a leak, counted once per
        iteration. The host times of its segments size the next gates of its kind. ``excused``: a graph
        capture or a Triton compilation inside, no measure of the host's usual time. Returns the marks of the
        sleeps between layers (:meth:`_slept_ms`: the caller takes their time out of the iteration's)."""
        gate, run.gate = run.gate, None
        if gate is None:
            return []
        self._segment_done(gate)
        if excused or run.compiles.ms > run.compile_mark:
            return gate.sleeps
        for i, host_ms in enumerate(gate.host):
            self._gates.add(gate.key, host_ms, first=i == 0)
        if gate.leaked:
            run.add("gate_leaks", 1)
            if gate.short:  # open before its planned length: the SM clock rose since the calibration
                self.timer.stretch_sleeps(GATE_MARGIN)
                run.add("gate_stretches", 1)
        return gate.sleeps

    def _slept_ms(self, sleeps: list[tuple[Any, Any]]) -> float:
        """The device time of the sleeps between an iteration's layers (their marks completed)."""
        return sum(self.timer.elapsed_ms(a, b) for a, b in sleeps)

    def _stalled(self, run: _Run) -> float:
        """The milliseconds of Triton compilation inside the iteration so far: left out of the wall clock
        here and, by the caller, out of the iteration's device time (:mod:`kvtune.engine.compiles`)."""
        ms = run.stall_ms()
        if ms > 0:
            run.clock.exclude(ms)
            run.add("compile_ms", ms)
        return ms

    def _admit(self, run: _Run, progress: Progress | None, **kwargs: Any) -> None:
        refused_before = len(run.scheduler.refused)
        for admission in run.scheduler.admit(run.clock.now_ms(), **kwargs):
            seq = admission.seq
            run.outputs.attach(seq, run.cache.slot_of(seq.seq_id))
        if len(run.scheduler.refused) > refused_before and progress is not None:
            progress(len(run.timings) + len(run.scheduler.refused), run.total)

    def _decode_slots(self, run: _Run, progress: Progress | None) -> np.ndarray:
        """Slots of the sequences that decode this iteration, after preempting the newest running ones until
        the blocks their step seals are free."""
        slots = run.outputs.decoding_slots()
        while slots.size and run.cache.blocks_needed_for_slots(slots) > run.cache.blocks_free():
            if run.in_flight is not None:  # what the step in flight finishes frees blocks; then preempt
                self._land(run, progress)
            else:
                run.scheduler.preempt_newest()  # saves the victim's outputs (on_preempt) before freeing it
            slots = run.outputs.decoding_slots()
        return slots

    def _decode(self, run: _Run, slots: np.ndarray, start: Any, progress: Progress | None) -> None:
        """One decode-only iteration: the static step (graph replay on CUDA) or the eager one."""
        if run.graphs is not None:
            self._static_decode(run, run.graphs, slots, start, progress)
            return
        if self._gated():
            start = self._gate(run, ("decode", 0))
        cache, now = run.cache, run.clock.now_ms()
        tokens = run.outputs.last_tokens(slots)
        positions = cache.lengths(slots)
        plan = cache.begin_step_slots(slots, now)
        inputs = upload(torch.from_numpy(np.stack([tokens, positions])), self.device)
        model_start, launch_t0 = self.timer.mark(), time.perf_counter()
        logits = self.model.decode(run.timed, plan, inputs[0], inputs[1], self._layer_gates(run))
        model_end = self.timer.mark()
        launch_ms = (time.perf_counter() - launch_t0) * 1000.0
        next_tokens = logits.argmax(dim=-1)
        cache.end_step(plan)
        end = self.timer.mark()
        sleeps = self._gate_close(run)
        next_np = next_tokens.cpu().numpy()  # synchronizes
        self.timer.synchronize()
        slept = self._slept_ms(sleeps)  # the sleeps between layers: no time of the step's
        marks = (start, model_start, model_end, end)
        run.clock.advance(self._count_step(run, marks, self._stalled(run) + slept))
        run.add("eager_forward_ms", self.timer.elapsed_ms(model_start, model_end) - slept)
        run.add("eager_launch_ms", launch_ms)
        self._add_attention(run, run.timed.take_attention_ms(), 0)
        run.peak("peak_running", len(slots))
        self._emit(run, slots, next_np, progress)

    def _static_decode(
        self, run: _Run, graphs: DecodeGraphs, slots: np.ndarray, start: Any, progress: Progress | None
    ) -> None:
        """The static step, kept in flight: stage it (a row whose last token is still on the device feeds
        it from there), launch it, then land the step launched before it, so the host's bookkeeping of this
        step ran while the GPU worked on that one. A step whose attention is timed runs alone (the step
        before it lands first, it lands at once): the byte count read around it must be its own."""
        cache = run.cache
        timed = graphs.timing_next()
        if timed:
            self._land(run, progress)
        bytes_before = self._attention_bytes(run, timed=timed)  # reads the device: before any gate
        if self._gated() and run.in_flight is None:  # the device idles from here
            start = self._gate(run, ("step", 0))
        info = graphs.prepare(slots, run.outputs.last_tokens(slots), run.clock.now_ms())
        captured_ms = self._captures(run, graphs)  # left out of the clock and of this step's time
        model_start = self.timer.mark()
        timed = graphs.run(info)
        model_end = self.timer.mark()
        cache.finish_step(info)
        end = self.timer.mark()
        self._gate_close(run, excused=captured_ms > 0)
        tokens, ready = graphs.tokens_to_host(info)
        flight = _InFlight(
            slots, run.outputs.launch(slots), tokens, ready, (start, model_start, model_end, end),
            captured_ms + self._stalled(run), graphs.attention_marks() if timed else None, bytes_before,
        )  # fmt: skip
        run.peak("peak_running", len(slots))
        self._land(run, progress)
        run.in_flight = flight
        if timed:
            self._land(run, progress)

    def _captures(self, run: _Run, graphs: DecodeGraphs) -> float:
        """The milliseconds ``graphs`` spent capturing since last asked: left out of the clock (the
        compilations inside them counted with them), returned for the iteration to leave out too."""
        captured_ms = graphs.take_capture_ms()
        if captured_ms:
            run.stall_ms()  # compilations during a capture are part of its time
        run.clock.exclude(captured_ms)
        run.add("graph_capture_ms", captured_ms)
        return captured_ms

    def _land(self, run: _Run, progress: Progress | None) -> None:
        """The step in flight, if any, completes: its tokens and their time (now, once they are on the
        host), its counters, and the sequences it finished leave."""
        flight, run.in_flight = run.in_flight, None
        if flight is None:
            return
        if flight.ready is not None:
            flight.ready.synchronize()
        run.clock.advance(self._count_step(run, flight.marks, flight.captured_ms))
        run.outputs.fill(flight.slots, flight.tokens.numpy()[: len(flight.slots)], run.clock.now_ms())
        run.add("graph_steps", 1)
        if flight.attention is not None:
            self._add_attention(run, graphs_attention_ms(flight.attention), flight.bytes_before)
        self._finish(run, flight.done, progress)

    def _count_step(self, run: _Run, marks: tuple[Any, Any, Any, Any], captured_ms: float = 0.0) -> float:
        """A decode step's counters from its marks (iteration start, forward start and end, iteration end;
        completed), less the capture and compilation time spent inside it; returns the step's time."""
        start, model_start, model_end, end = marks
        model_ms = self.timer.elapsed_ms(model_start, model_end)
        step_ms = max(0.0, self.timer.elapsed_ms(start, end) - captured_ms)
        model_ms = min(model_ms, step_ms)
        run.add("decode_steps", 1)
        run.add("decode_ms", step_ms)
        run.add("model_ms", model_ms)
        run.add("forward_ms", model_ms)
        return step_ms

    def _forward(
        self,
        run: _Run,
        slots: np.ndarray,
        chunks: list[tuple[Seq, int]],
        start: Any,
        progress: Progress | None,
    ) -> None:
        """One forward of the decode rows ``slots`` (may be none) and prompt ``chunks``: eager (op by op or
        in pieces), or replayed as one graph where the mixed graphs take its shapes
        (:meth:`_graph_forward`)."""
        self._land(run, progress)  # the forward feeds tokens from the host
        cache, b = run.cache, len(slots)
        segments = [(seq.seq_id, n) for seq, n in chunks]
        mixed = run.graphs.mixed if run.graphs is not None else None
        graph = mixed is not None and mixed.fits(b, segments) and mixed.wants(slots, segments)
        # reads the device: before the gate
        bytes_before = self._attention_bytes(run, timed=b > 0 and not graph)
        rows = b + sum(n for _, n in chunks)
        pieces = self._piecewise()
        in_pieces = pieces is not None and pieces.fits(rows)
        if self._gated():
            if not graph and not in_pieces:  # a row count first met here: set up before the gate
                self.model.warm_rows([rows], logits=[b + len(chunks)])
            # the device idles from here
            kind = "graph" if graph else "mixed" if b else "prefill" if len(chunks) == 1 else "chunks"
            start = self._gate(run, (kind, 0 if graph else len(chunks)))
        ids, positions = [run.outputs.last_tokens(slots)], [cache.lengths(slots)]
        for seq, n in chunks:
            ids.append(np.asarray(seq.tokens[seq.prefilled : seq.prefilled + n], dtype=np.int64))
            positions.append(np.arange(seq.prefilled, seq.prefilled + n, dtype=np.int64))
        if graph:
            assert mixed is not None
            next_np, iteration_ms, model_ms, launch_ms = self._graph_forward(
                run, mixed, slots, segments, ids, positions, start
            )
        else:
            plan = cache.begin_step_slots(slots, run.clock.now_ms()) if b else None
            packed = np.stack([np.concatenate(ids), np.concatenate(positions)])
            inputs = upload(torch.from_numpy(packed), self.device)
            if in_pieces:
                run.add("piecewise_forwards", 1)
            model_start, launch_t0 = self.timer.mark(), time.perf_counter()
            between = self._layer_gates(run)
            logits = self.model.forward_mixed(
                run.timed, plan, inputs[0], inputs[1], b, segments, between, pieces
            )
            model_end = self.timer.mark()
            launch_ms = (time.perf_counter() - launch_t0) * 1000.0
            next_tokens = logits.argmax(dim=-1)
            if plan is not None:
                cache.end_step(plan)
            end = self.timer.mark()
            sleeps = self._gate_close(run)
            next_np = next_tokens.cpu().numpy()  # synchronizes
            slept = self._slept_ms(sleeps)  # the sleeps between layers: no time of the iteration's
            iteration_ms = max(0.0, self.timer.elapsed_ms(start, end) - slept - self._stalled(run))
            model_ms = min(self.timer.elapsed_ms(model_start, model_end) - slept, iteration_ms)
            run.add("eager_forward_ms", model_ms)
            run.add("eager_launch_ms", launch_ms)
        run.clock.advance(iteration_ms)
        run.add("prefill_ms", model_ms)
        run.add("forward_ms", model_ms)
        run.add("prefill_chunks", len(chunks))
        prompt = sum(n for _, n in chunks)
        run.forwards.append({"decode_rows": b, "prompt_tokens": prompt, "chunks": len(chunks),
                             "device_ms": model_ms, "launch_ms": launch_ms})  # fmt: skip
        if b:
            run.add("decode_steps", 1)
            run.add("mixed_iterations", 1)
            run.add("decode_ms", iteration_ms)
            run.add("model_ms", model_ms)
            if not graph:  # a graph's attention is not timed inside it
                self._add_attention(run, run.timed.take_attention_ms(), bytes_before)
            run.peak("peak_running", b)
            self._emit(run, slots, next_np[:b], progress)
        done = [(j, seq) for j, (seq, n) in enumerate(chunks) if seq.prefilled + n == seq.prefill_target]
        for seq, n in chunks:
            seq.prefilled += n
        if done:  # a finished prompt emits its first token and decodes from the next iteration on
            first = np.asarray([seq.slot for _, seq in done], dtype=np.int64)
            self._emit(run, first, next_np[[b + j for j, _ in done]], progress, start_decoding=True)

    def _graph_forward(
        self,
        run: _Run,
        mixed: MixedGraphs,
        slots: np.ndarray,
        segments: list[tuple[int, int]],
        ids: list[np.ndarray],
        positions: list[np.ndarray],
        start: Any,
    ) -> tuple[np.ndarray, float, float, float]:
        """:meth:`_forward` as one graph replay (:class:`MixedGraphs`): the decode rows staged as a static
        step, the chunks' padded plan staged, the graph captured on first use (its time left out of the
        clock, as a decode step's), replayed, the host's bookkeeping done. Returns the tokens (decode rows',
        then each chunk's), the iteration's and the forward's device ms and the host's launch ms."""
        info = mixed.prepare(
            slots, ids[0], positions[0], segments, np.concatenate(ids[1:]), np.concatenate(positions[1:]),
            run.clock.now_ms(),
        )  # fmt: skip
        captured_ms = self._captures(run, mixed.decode)  # they capture through the decode graphs
        model_start, launch_t0 = self.timer.mark(), time.perf_counter()
        tokens = mixed.run(info)
        model_end = self.timer.mark()
        launch_ms = (time.perf_counter() - launch_t0) * 1000.0
        mixed.finish(info)
        end = self.timer.mark()
        self._gate_close(run, excused=captured_ms > 0)
        next_np = tokens.cpu().numpy()  # synchronizes
        iteration_ms = max(0.0, self.timer.elapsed_ms(start, end) - captured_ms - self._stalled(run))
        model_ms = min(self.timer.elapsed_ms(model_start, model_end), iteration_ms)
        run.add("mixed_graph_forwards", 1)
        return next_np, iteration_ms, model_ms, launch_ms

    def _emit(
        self, run: _Run, slots: np.ndarray, tokens: np.ndarray, progress: Progress | None,
        start_decoding: bool = False,
    ) -> None:  # fmt: skip
        """One output token for each slot, all at the clock's now; finished sequences leave."""
        outputs = run.outputs
        finished = outputs.record(slots, tokens, run.clock.now_ms())
        if start_decoding:
            outputs.decoding[slots] = True
        self._finish(run, finished, progress)

    def _finish(self, run: _Run, finished: np.ndarray, progress: Progress | None) -> None:
        """The sequences in slots ``finished`` produced their last token: they leave."""
        outputs = run.outputs
        for slot in finished.tolist():
            seq = outputs.seqs[slot]
            assert seq is not None
            outputs.detach(seq)
            run.scheduler.finish(seq)
            run.timings.append(RequestTiming(seq.seq_id, seq.arrival_ms, tuple(seq.token_ms)))
            if progress is not None:
                progress(len(run.timings) + len(run.scheduler.refused), run.total)

    def _attention_bytes(self, run: _Run, timed: bool) -> int:
        """The cache's attention byte count now, where attention is timed on some steps only (graphs); an
        engine that times every decode step reads the total once at the end."""
        if run.graphs is None or not timed:
            return 0
        return int(run.cache.attention_bytes_read)

    def _add_attention(self, run: _Run, ms: float, bytes_before: int) -> None:
        run.add("attention_ms", ms)
        run.add("attention_steps", 1)
        if run.graphs is not None:
            run.add("attention_bytes", int(run.cache.attention_bytes_read) - bytes_before)

    def _track_memory(self, run: _Run) -> None:
        run.peak("peak_kv_bytes", float(kv_bytes_in_use(run.cache)))

    def _counters(self, run: _Run, clipped: int) -> EngineCounters:
        c, s, st = run.counters, run.scheduler, run.settings
        debug = dict(run.cache.debug_stats()) if self.config.kv_cache_debug else {}
        graphs = run.graphs
        sparse = self.config.sparse_top_k > 0
        attention_bytes = (
            c.get("attention_bytes", 0.0) if graphs is not None else run.cache.attention_bytes_read
        )
        return EngineCounters(
            duration_ms=c.get("duration_ms", 0.0),
            decode_steps=int(c.get("decode_steps", 0)),
            decode_ms=c.get("decode_ms", 0.0),
            model_ms=c.get("model_ms", 0.0),
            attention_ms=c.get("attention_ms", 0.0),
            attention_bytes=int(attention_bytes),  # decode attention only (of the timed steps)
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
            attention_steps=int(c.get("attention_steps", 0)),
            forward_ms=c.get("forward_ms", 0.0),
            graph_steps=int(c.get("graph_steps", 0)),
            mixed_iterations=int(c.get("mixed_iterations", 0)),
            piecewise_forwards=int(c.get("piecewise_forwards", 0)),
            mixed_graph_forwards=int(c.get("mixed_graph_forwards", 0)),
            graph_captures=graphs.captures - run.captures_before if graphs is not None else 0,
            graph_capture_ms=c.get("graph_capture_ms", 0.0),
            compiles=run.compiles.count,
            compile_ms=c.get("compile_ms", 0.0),
            eager_forward_ms=c.get("eager_forward_ms", 0.0),
            eager_launch_ms=c.get("eager_launch_ms", 0.0),
            gated_iterations=int(c.get("gated_iterations", 0)),
            gate_leaks=int(c.get("gate_leaks", 0)),
            gate_ms=c.get("gate_ms", 0.0),
            gate_stretches=int(c.get("gate_stretches", 0)),
            gate_waits=int(c.get("gate_waits", 0)),
            gate_wait_ms=c.get("gate_wait_ms", 0.0),
            max_num_seqs=st.max_num_seqs,
            max_num_batched_tokens=s.config.max_num_batched_tokens,
            graphs=st.graphs,
            cuda_graphs=st.cuda_graphs,
            mixed=st.mixed,
            clock=self.scheduler_config.clock,
            l2_peak_share=l2_peak_share(run.cache) if sparse else math.nan,
            migrations=migrations_done(run.cache) if sparse else 0,
        )


def migrations_done(cache: Any) -> int:
    """Tier migrations the cache applied since it was last emptied (0 for a cache without tiers; reads the
    device's count)."""
    return int(getattr(cache, "migrations_done", 0))


def l2_peak_share(cache: Any) -> float:
    """The largest share of in-use (layer, block) pairs in L2 after any step since the cache was emptied,
    kept on the device by the tier queue (0.0 for a cache without it)."""
    share = getattr(cache, "l2_peak_share", None)
    return 0.0 if share is None else float(share)


def l2_share(cache: Any) -> float | None:
    """The share of the in-use (layer, block) pairs that sit in L2 now (reads the tiers back; None for a
    cache without tiers)."""
    share = getattr(cache, "l2_share", None)
    return share() if callable(share) else None


def kv_bytes_in_use(cache: Any) -> int:
    """Bytes of the budget the cache holds for live data (hot zones of running sequences + used blocks)."""
    if hasattr(cache, "kv_bytes_in_use"):
        return int(cache.kv_bytes_in_use())
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
