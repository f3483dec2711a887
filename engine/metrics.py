"""Metrics of one trace replay (docs/DESIGN.md §2) and the device copy-bandwidth probe.

Per request: TTFT (arrival → first output token), TPOT (mean time per output token after the first), the
inter-token latencies (every gap between consecutive output tokens) and end-to-end latency (arrival → last
token); each summarized as P50/P90/P99. A percentile over fewer than :data:`MIN_REQUESTS_FOR_PERCENTILES`
requests is reported with a warning. Attention bandwidth is the bytes the attention pass read divided by its
measured time; utilization compares it with the copy bandwidth measured on the device at start.

Attention time is the device time of the decode attention (the ``cache.decode`` calls: hot-zone append,
table, attention kernels, access update). An eager step times every layer's call with events; a decode
step replayed as a CUDA graph cannot be timed inside, so only every ``TIMING_EVERY``-th replay (16,
:mod:`kvtune.engine.graphs`) takes a variant of its graph with timing events around each layer's attention:
``attention_ms`` and ``attention_bytes`` then cover the timed steps only (``attention_steps`` of them, the
eager and mixed iterations included), and the attention per step and bandwidth are ratios over those
steps. ``model_ms`` is the device time of the forwards of decode iterations (a graph replay whole);
bookkeeping is what a decode iteration's wall time adds to it (host work between replays, scheduling).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MIN_REQUESTS_FOR_PERCENTILES = 100
PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """P50, P90 and P99 of ``values`` (linear interpolation); NaN for an empty sequence."""
    if len(values) == 0:
        return (math.nan, math.nan, math.nan)
    p = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return (float(p[0]), float(p[1]), float(p[2]))


@dataclass(frozen=True)
class RequestTiming:
    """When one request arrived and when each of its output tokens came out (engine clock, ms)."""

    rid: int
    arrival_ms: float
    token_ms: tuple[float, ...]

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0] - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.token_ms[-1] - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        n = len(self.token_ms)
        return None if n < 2 else (self.token_ms[-1] - self.token_ms[0]) / (n - 1)

    @property
    def itl_ms(self) -> list[float]:
        return [b - a for a, b in zip(self.token_ms, self.token_ms[1:])]


@dataclass(frozen=True)
class EngineCounters:
    """Totals the engine accumulates over a replay (times in ms, bytes in bytes)."""

    duration_ms: float = 0.0
    decode_steps: int = 0
    decode_ms: float = 0.0  # whole decode steps: scheduling + cache bookkeeping + model + attention
    model_ms: float = 0.0  # model.decode calls (model math + attention)
    attention_ms: float = 0.0  # cache.decode calls, of the ``attention_steps`` timed decode iterations
    attention_bytes: int = 0
    prefill_ms: float = 0.0
    prefill_chunks: int = 0  # model prefill calls (a prompt over the per-iteration budget takes several)
    peak_kv_bytes: int = 0
    peak_running: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of every admission (recomputes included)
    prefix_hit_tokens: int = 0
    refused: int = 0
    clipped: int = 0
    copy_bandwidth_gbs: float = math.nan
    debug: dict[str, Any] = field(default_factory=dict)
    attention_steps: int = 0  # decode iterations whose attention was timed (0: all of them)
    forward_ms: float = 0.0  # device time of every forward (decode, mixed, prefill)
    graph_steps: int = 0  # decode steps run as static steps (replayed as CUDA graphs on CUDA)
    mixed_iterations: int = 0  # iterations with decode tokens and prompt chunks in one forward
    piecewise_forwards: int = 0  # forwards with prompt tokens whose dense parts ran as pieces (piecewise)
    mixed_graph_forwards: int = 0  # forwards with prompt tokens replayed as one graph (mixed_graphs)
    graph_captures: int = 0
    graph_capture_ms: float = 0.0  # left out of the replay's clock
    compiles: int = 0  # Triton compilations inside the measured replay (kvtune.engine.compiles)
    compile_ms: float = 0.0  # ... their host time inside iterations, left out of the replay's clock
    eager_forward_ms: float = 0.0  # device time of the forwards launched op by op (not graph replays)
    eager_launch_ms: float = 0.0  # host time spent launching those forwards
    gated_iterations: int = 0  # iterations started behind a gate (the gated clock)
    gate_leaks: int = 0  # ... whose gate opened before the host had enqueued all of the iteration
    gate_ms: float = 0.0  # the gates' sleep (wall time the device held still; on no clock)
    gate_stretches: int = 0  # leaks of a gate shorter than planned (its sleeps were then lengthened)
    gate_waits: int = 0  # layer boundaries where the host waited for the device (GATE_AHEAD_LAYERS)
    gate_wait_ms: float = 0.0  # ... the host's time waiting there (wall only)
    # the engine's options as this replay resolved them (max_num_seqs: the derived value when not given)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    graphs: bool = False  # static decode steps
    cuda_graphs: bool = False  # ... captured and replayed as CUDA graphs
    mixed: bool = False
    clock: str = "wall"  # what the replay's clock counted (SchedulerConfig.clock)
    # a sparse config's tier: the largest share of the in-use (layer, block) pairs in L2 at once, and the
    # migrations applied (NaN / 0 without a sparse tier)
    l2_peak_share: float = math.nan
    migrations: int = 0


@dataclass(frozen=True)
class ReplayMetrics:
    """Everything one replay reports; :meth:`to_dict` is what the tuner stores with a trial."""

    completed: int
    refused: int
    clipped: int
    preemptions: int
    prefill_chunks: int
    ttft_ms: tuple[float, float, float]
    tpot_ms: tuple[float, float, float]
    itl_ms: tuple[float, float, float]
    e2e_ms: tuple[float, float, float]
    tokens_per_s: float
    requests_per_s: float
    duration_s: float
    decode_steps: int
    step_ms: float
    attn_ms_per_step: float
    attn_bandwidth_gbs: float
    copy_bandwidth_gbs: float
    attn_utilization: float
    bookkeeping_ms_per_step: float
    bookkeeping_share: float
    peak_kv_bytes: int
    peak_running: int
    prefix_hit_rate: float
    warnings: tuple[str, ...] = ()
    debug: dict[str, Any] = field(default_factory=dict)
    prefill_share: float = math.nan  # of the forwards' device time, in iterations that carry prompt tokens
    graph_steps: int = 0
    mixed_iterations: int = 0
    piecewise_forwards: int = 0
    mixed_graph_forwards: int = 0
    graph_captures: int = 0
    graph_capture_ms: float = 0.0
    compiles: int = 0
    compile_ms: float = 0.0
    # forwards' device time / the replay's duration: the share of the replay the device works (CUDA events
    # around each forward; gaps inside a forward launched op by op count as work, see launch_ratio)
    device_busy: float = math.nan
    # host time launching the op-by-op forwards / their device time: near or above 1, they are launch-bound
    # (the device waits on the host inside them, so device_busy overstates the work)
    launch_ratio: float = math.nan
    # the gated clock: iterations started behind a gate, those whose gate opened before the host had
    # enqueued them (their time holds host gaps), and the gates' sleep in ms (wall only)
    gated_iterations: int = 0
    gate_leaks: int = 0
    gate_ms: float = 0.0
    gate_stretches: int = 0  # of those leaks, the gates that opened before their planned length
    # layer boundaries of eager forwards where the host waited for the device, and its wait (wall only)
    gate_waits: int = 0
    gate_wait_ms: float = 0.0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    graphs: bool = False
    cuda_graphs: bool = False
    mixed: bool = False
    clock: str = "wall"
    # the sparse tier's use: the largest share of in-use (layer, block) pairs in L2 at once (NaN: no sparse
    # tier; 0: the tier never held a block, so the replay timed its machinery and none of its savings)
    l2_peak_share: float = math.nan
    migrations: int = 0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for name in ("ttft", "tpot", "itl", "e2e"):
            for p, value in zip(PERCENTILES, getattr(self, f"{name}_ms")):
                d[f"{name}_p{p}_ms"] = value
        for f in dataclasses.fields(self):
            if f.name not in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "warnings", "debug"):
                d[f.name] = getattr(self, f.name)
        d["warnings"] = list(self.warnings)
        if self.debug:
            d["debug"] = dict(self.debug)
        return d


def median_spread(values: Sequence[float]) -> float:
    """How far repeats of one measurement scatter: the largest distance of a finite value from their median,
    over the median (0 for fewer than two finite values, NaN for a median that is not positive)."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return 0.0
    mid = statistics.median(finite)
    return max(abs(v - mid) for v in finite) / mid if mid > 0 else math.nan


def summarize(timings: Sequence[RequestTiming], c: EngineCounters) -> ReplayMetrics:
    """Fold per-request timings and the engine's counters into :class:`ReplayMetrics`."""
    tpots = [t.tpot_ms for t in timings if t.tpot_ms is not None]
    itls = [gap for t in timings for gap in t.itl_ms]
    tokens = sum(len(t.token_ms) for t in timings)
    seconds = c.duration_ms / 1000.0
    steps = max(c.decode_steps, 1)
    attn_steps = max(c.attention_steps or c.decode_steps, 1)
    attn_s = c.attention_ms / 1000.0
    bandwidth = c.attention_bytes / attn_s / 1e9 if attn_s > 0 else math.nan
    bookkeeping = max(c.decode_ms - c.model_ms, 0.0) / steps
    step_ms = c.decode_ms / steps
    return ReplayMetrics(
        completed=len(timings),
        refused=c.refused,
        clipped=c.clipped,
        preemptions=c.preemptions,
        prefill_chunks=c.prefill_chunks,
        ttft_ms=percentiles([t.ttft_ms for t in timings]),
        tpot_ms=percentiles(tpots),
        itl_ms=percentiles(itls),
        e2e_ms=percentiles([t.e2e_ms for t in timings]),
        tokens_per_s=tokens / seconds if seconds > 0 else math.nan,
        requests_per_s=len(timings) / seconds if seconds > 0 else math.nan,
        duration_s=seconds,
        decode_steps=c.decode_steps,
        step_ms=step_ms,
        attn_ms_per_step=c.attention_ms / attn_steps,
        attn_bandwidth_gbs=bandwidth,
        copy_bandwidth_gbs=c.copy_bandwidth_gbs,
        attn_utilization=bandwidth / c.copy_bandwidth_gbs if c.copy_bandwidth_gbs > 0 else math.nan,
        bookkeeping_ms_per_step=bookkeeping,
        bookkeeping_share=bookkeeping / step_ms if step_ms > 0 else math.nan,
        peak_kv_bytes=c.peak_kv_bytes,
        peak_running=c.peak_running,
        prefix_hit_rate=c.prefix_hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        warnings=_warnings(len(timings), c),
        debug=dict(c.debug),
        prefill_share=c.prefill_ms / c.forward_ms if c.forward_ms > 0 else math.nan,
        graph_steps=c.graph_steps,
        mixed_iterations=c.mixed_iterations,
        piecewise_forwards=c.piecewise_forwards,
        mixed_graph_forwards=c.mixed_graph_forwards,
        graph_captures=c.graph_captures,
        graph_capture_ms=c.graph_capture_ms,
        compiles=c.compiles,
        compile_ms=c.compile_ms,
        device_busy=c.forward_ms / c.duration_ms if c.duration_ms > 0 else math.nan,
        launch_ratio=c.eager_launch_ms / c.eager_forward_ms if c.eager_forward_ms > 0 else math.nan,
        gated_iterations=c.gated_iterations,
        gate_leaks=c.gate_leaks,
        gate_ms=c.gate_ms,
        gate_stretches=c.gate_stretches,
        gate_waits=c.gate_waits,
        gate_wait_ms=c.gate_wait_ms,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        graphs=c.graphs,
        cuda_graphs=c.cuda_graphs,
        mixed=c.mixed,
        clock=c.clock,
        l2_peak_share=c.l2_peak_share,
        migrations=c.migrations,
    )


GATE_LEAK_SHARE = 0.05  # more gated iterations leaking than this share: a warning


def _warnings(completed: int, c: EngineCounters) -> tuple[str, ...]:
    out = []
    if completed < MIN_REQUESTS_FOR_PERCENTILES:
        out.append(
            f"percentiles over {completed} requests (< {MIN_REQUESTS_FOR_PERCENTILES}): P99 is noisy, "
            "replay more requests"
        )
    if c.refused:
        out.append(f"{c.refused} request(s) refused: they can never fit in the KV budget")
    if c.clipped:
        total = completed + c.refused
        most = ""
        if 2 * c.clipped > total:
            most = " (most of the replay: it measures shorter requests than the trace's)"
        out.append(f"{c.clipped} request(s) clipped to a length cap or the model's context{most}")
    if c.l2_peak_share == 0.0:
        out.append(
            "the sparse tier held no block: attention mass stayed above each block's even share (random "
            "weights spread it so), so this replay timed the tier's selection and none of its savings"
        )
    if c.gate_leaks > GATE_LEAK_SHARE * c.gated_iterations:
        out.append(
            f"{c.gate_leaks} of {c.gated_iterations} gated iterations started on the device before the host "
            "had enqueued them: their times hold host gaps (a synchronization inside the iteration?)"
        )
    return tuple(out)


# ------------------------------------------------------------------------------------------ copy bandwidth


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Achieved device-memory bandwidth of a plain tensor copy, in GB/s (best of ``repeats``).

    Counts the bytes read plus the bytes written (``2 * nbytes`` per copy), the usual convention for a copy
    benchmark. CUDA copies are timed with device events; CPU copies with ``perf_counter`` (on CPU ``nbytes``
    is capped at 64 MiB so the probe stays quick).
    """
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch, allocator
    best = min(_timed_copy_s(src, dst) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def _timed_copy_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    if src.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None and tuples by lists (strict JSON for ``json.dumps``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
