"""Decode steps as CUDA graphs: one per (batch bucket, table-width bucket), replayed over static buffers.

A static decode step (:meth:`HybridCache.prepare_step`, :mod:`kvtune.cache_impl.plan`) splits into:

(a) host bookkeeping: which hot zones fill, fresh blocks, lengths, the block table rows, byte accounting:
    numpy over slot-indexed arrays, staged into :class:`~kvtune.cache_impl.plan.StepBuffers` and uploaded
    in one copy;
(b) the seals of the zones that would fill (``HybridCache.seal_static``: every layer's seal, one shift of all
    zones, the fresh blocks' statistics): its own graph per seal-count bucket;
(c) the forward: the input tokens (staged, or where the previous step left them on the device) →
    embeddings → layers (RMSNorm, QKV, RoPE, hot-zone append at the staged slots, decode attention over the
    staged block table with per-row lengths, o-proj, MLP) → logits → argmax into a static output and into
    :attr:`DecodeGraphs.slot_tokens`: one graph per (rows, width) bucket;
(d) after the replay, ``HybridCache.finish_step`` (prefix registration, tier planning, migrations: they
    change tensors in place, so no graph is captured again).

Tokens on the device: every step writes its argmax into ``slot_tokens[slot]`` (padding rows into a spare
entry), and a row staged with token -1 reads its input there. So the engine can stage step t + 1 and replay
it before step t's tokens reach the host (:class:`~kvtune.engine.engine.Engine` keeps one step in flight):
the host's bookkeeping of one step overlaps the GPU's work on the one before.

Buckets: rows 1, 2, 4, 8, then multiples of 16 up to the most sequences (as vLLM and nano-vllm); table widths
multiples of 16 about 25 % apart up to the longest sequence's blocks, the attention planning its splits for
the bucket's width and masking each row at its own block count; seal entries 1, 2, 4, ... Padding rows
read one token of slot 0 and write where no hot zone holds data; padding seal entries repeat a real one.
Every graph is captured on first use after one uncaptured run of the same function on a side stream (which
compiles and loads every kernel and fixes its launch plan at these shapes; what that run changed is put
back), into one memory pool shared by all graphs of the runner. :attr:`capture_ms` says how long captures
took, so a replay can leave them out of its clock.

Without capture (a CPU, or ``capture=False``) the same functions run directly on exactly sized buffers: that
is the path the CPU tests compare with the eager one. Attention time: every ``timing_every``-th step is timed
and only those steps count in the attention time (so that the steps between run in flight, on a CPU as on a
GPU). An uncaptured step times each layer's ``cache.decode`` (``perf_counter`` on a CPU, events on a GPU); a
captured step cannot time inside itself, so it replays a variant of its graph with external timing events
around each layer's attention (``torch.cuda.Event(external=True)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtune.cache_impl.plan import StepBuffers, StepInfo
from kvtune.kernels.backend import ahead

if TYPE_CHECKING:
    from kvtune.engine.mixed_graphs import MixedGraphs

TIMING_EVERY = 16


def row_buckets(max_rows: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then multiples of 16, the last one >= ``max_rows``."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return small + list(range(16, max_rows + 16, 16)) if max_rows > 8 else [*small, max_rows]


def width_buckets(max_blocks: int) -> list[int]:
    """Captured table widths: multiples of 16, each at most ~25 % above the one before (16, 32, 48, 64, 80,
    112, 144, 192, ...), the last one ``max_blocks`` rounded up to a multiple of 16. A step's attention plans
    its splits for its bucket's width, so a bucket wider than the longest row costs idle splits."""
    top = max(16, -(-max_blocks // 16) * 16)
    out, w = [], 16
    while w < top:
        out.append(w)
        w = max(w + 16, -(-(w * 5 // 4) // 16) * 16)
    return [*out, top]


def seal_buckets(max_rows: int) -> list[int]:
    out, n = [], 1
    while n < max_rows:
        out.append(n)
        n *= 2
    return [*out, max_rows]


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class _Marked:
    """The cache as the captured forward sees it: marks around each ``decode`` call (attention)."""

    def __init__(self, cache: Any, marks: list[tuple[Any, Any]], mark: Callable[[int], Any]) -> None:
        self._cache, self._marks, self._mark, self._layer = cache, marks, mark, 0

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        start = self._mark(2 * self._layer)
        out = self._cache.decode(*args, **kwargs)
        self._marks.append((start, self._mark(2 * self._layer + 1)))
        self._layer += 1
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


@dataclass
class _Graph:
    graph: Any
    events: list[Any]  # external timing events, two per layer (empty: untimed variant)


class DecodeGraphs:
    """Static decode steps of one model over one cache (see the module docstring).

    ``max_rows``: the most sequences in a step; ``max_blocks``: the most sealed blocks of one sequence (the
    table's width). ``capture``: replay CUDA graphs (needs a CUDA device); otherwise run the same step
    functions directly. ``padded`` (default: ``capture``, or planning ahead for a GPU): round rows, widths
    and seal entries up to the buckets (an uncaptured run with it does what a replay does, padding included:
    tests, and the processes that compile ahead).
    ``keep_logits``: also copy each step's logits to :attr:`logits` (tests).
    """

    def __init__(
        self,
        model: Any,
        cache: Any,
        max_rows: int,
        max_blocks: int,
        capture: bool,
        timing_every: int = TIMING_EVERY,
        keep_logits: bool = False,
        padded: bool | None = None,
    ) -> None:
        if capture and cache.device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs a CUDA cache")
        self.model, self.cache, self.capture = model, cache, capture
        # a process compiling ahead for a GPU (kernels.backend.plan_ahead) pads as that GPU's replays would
        self.padded = (capture or ahead() is not None) if padded is None else padded
        self.timing_every = max(1, timing_every)
        if self.padded:
            self._rows, self._widths = row_buckets(max_rows), width_buckets(max_blocks)
            self._seals = seal_buckets(self._rows[-1])
            rows, width = self._rows[-1], self._widths[-1]
        else:
            rows, width = max_rows, max(1, max_blocks)
        self.buffers = StepBuffers(rows, width, cache.device, pinned=capture)
        self._marks: list[tuple[Any, Any]] = []
        self._graph: _Graph | None = None
        vocab = model.spec.vocab_size
        self.logits = (
            torch.zeros((rows, vocab), dtype=torch.float32, device=cache.device) if keep_logits else None
        )
        slots = cache.layout.num_slots
        self.slot_tokens = torch.zeros(slots + 1, dtype=torch.int64, device=cache.device)
        self._spare = torch.full((rows,), slots, dtype=torch.int64, device=cache.device)
        self._row_ids = torch.arange(rows, device=cache.device)
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=capture) for _ in range(2)]
        self._flip = 0
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}
        self._seal_graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._replays = 0
        self.timing_supported = True
        self.capture_ms = 0.0  # host time spent capturing since the last take_capture_ms()
        self.captures = 0
        # the mixed iterations over these buffers, where the engine's options ask for them (Engine)
        self.mixed: MixedGraphs | None = None

    # ---- StepShape ---------------------------------------------------------------------------------------
    def rows_for(self, batch: int) -> int:
        return _bucket(self._rows, batch) if self.padded else batch

    def width_for(self, blocks: int) -> int:
        return _bucket(self._widths, blocks) if self.padded else max(1, blocks)

    def seals_for(self, seals: int) -> int:
        return _bucket(self._seals, seals) if self.padded else seals

    # ---- a step ------------------------------------------------------------------------------------------
    def prepare(self, slots: np.ndarray, tokens: np.ndarray, now_ms: float) -> StepInfo:
        """(a): the host bookkeeping, staged and uploaded; on CUDA also captures the graphs this shape needs
        (before anything of the step runs, so a caller can time the step after this)."""
        info = self.cache.prepare_step(slots, tokens, now_ms, self.buffers, self)
        if self.capture:
            self.ensure_seal_graph(info)
            timed = self._timed_now()
            if (info.rows, info.width, timed) not in self._graphs:
                self._capture_forward(info, timed)
        return info

    def run(self, info: StepInfo) -> bool:
        """(b) + (c): the seals, then the forward (replays on CUDA). Returns whether attention is timed."""
        self.seal(info)
        timed = self._timed_now()  # uncaptured steps too, so a CPU runs the same steps in flight
        if not self.capture:
            self._marks = []
            self._forward(info.rows, info.width, self._marks if timed else None, self._mark_direct)
        else:
            timed = timed and (info.rows, info.width, True) in self._graphs
            self._graph = self._graphs[(info.rows, info.width, timed)]
            self._graph.graph.replay()
        self._replays += 1
        return timed

    def ensure_seal_graph(self, info: StepInfo) -> None:
        """Capture the seal graph a staged step with seals needs, if not yet (on CUDA)."""
        if self.capture and info.num_seals and info.seal_rows not in self._seal_graphs:
            self._seal_graphs[info.seal_rows] = self._capture_seal(info)

    def seal(self, info: StepInfo) -> None:
        """(b): the staged step's seals, if any (a replay on CUDA)."""
        if not info.num_seals:
            return
        if self.capture:
            self._seal_graphs[info.seal_rows].replay()
        else:
            self.cache.seal_static(self.buffers, info.seal_rows)

    def spare_rows(self, rows: int) -> torch.Tensor:
        """``rows`` entries of :attr:`slot_tokens`' spare index (where padding rows write their token)."""
        return self._spare[:rows]

    def capture_graph(self, fn: Callable[[], None], restore: Callable[[], None]) -> Any:
        """A CUDA graph of ``fn`` in this runner's pool, after one uncaptured run of it and ``restore()``
        (:attr:`capture_ms` counts its time: :class:`~kvtune.engine.mixed_graphs.MixedGraphs` captures
        through here)."""
        return self._capture(fn, restore)

    def attention_marks(self) -> list[tuple[Any, Any]]:
        """The (start, end) marks around each layer's attention in the last step run with timing: read them
        with :func:`attention_ms` once the step has completed (a captured graph records them again only at
        its next replay)."""
        if not self.capture:
            return list(self._marks)
        assert self._graph is not None
        ev = self._graph.events
        return [(ev[i], ev[i + 1]) for i in range(0, len(ev), 2)]

    def attention_ms(self) -> float:
        """Attention time of the last step run with timing (its end must have completed)."""
        return attention_ms(self.attention_marks())

    def tokens_to_host(self, info: StepInfo) -> tuple[torch.Tensor, Any]:
        """Start copying the step's tokens to the host: (host tensor, CUDA event after the copy; None on a
        CPU, where they are there already). Two pinned buffers take turns, so the copy of the next step
        never overwrites tokens the host has not read yet (one step is in flight at most)."""
        out = self.buffers.tokens_out[: info.batch]
        if not self.capture:
            return out.clone(), None
        self._flip ^= 1
        host = self._host_tokens[self._flip][: info.batch]
        host.copy_(out, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def restart(self) -> None:
        """A new replay on these graphs: its steps count from 0, so the same steps of every replay are timed.
        A timed step runs alone (it lands at once, :meth:`Engine._static_decode`), which frees what it
        finished an iteration earlier than a step kept in flight: counted on from the replay before, the
        timed steps fell elsewhere in each repeat and moved admissions and preemptions between repeats."""
        self._replays = 0

    def timing_next(self) -> bool:
        """Whether the next step's attention will be timed (every ``timing_every``-th step)."""
        return self._timed_now()

    def take_capture_ms(self) -> float:
        ms, self.capture_ms = self.capture_ms, 0.0
        return ms

    # ---- the step functions ------------------------------------------------------------------------------
    def _forward(self, rows: int, width: int, marks: list[tuple[Any, Any]] | None, mark: Any) -> None:
        buf = self.buffers
        plan = buf.plan(rows, width, self.cache.shape.num_kv_heads)
        cache = self.cache if marks is None else _Marked(self.cache, marks, mark)
        slots, staged = buf.view("slots", rows), buf.view("tokens", rows)
        tokens = torch.where(staged >= 0, staged, self.slot_tokens[slots])
        logits = self.model.decode(cache, plan, tokens, buf.view("positions", rows))
        self.cache.migrate_static(buf)  # the tier planning and migrations, in the same graph
        out = logits.argmax(-1)
        buf.tokens_out[:rows].copy_(out)
        real = self._row_ids[:rows] < buf.batch_tensor()
        self.slot_tokens[torch.where(real, slots, self._spare[:rows])] = out
        if self.logits is not None:
            self.logits[:rows].copy_(logits)

    def _mark_direct(self, _: int) -> Any:
        if self.cache.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timed_now(self) -> bool:
        return self.timing_supported and self._replays % self.timing_every == 0

    # ---- capture -----------------------------------------------------------------------------------------
    def _capture_forward(self, info: StepInfo, timed: bool) -> None:
        """Capture the forward of this shape, with timing events (``timed``) or without; each variant is
        captured the first time a step needs it."""
        rows, width = info.rows, info.width
        if timed:
            layers = len(self.model.layers)
            try:
                events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(2 * layers)]
                self._graphs[(rows, width, True)] = _Graph(self._capture_fn(rows, width, events), events)
                return
            except Exception:  # external timing events are missing or refused: time nothing inside graphs
                self.timing_supported = False
                torch.cuda.synchronize()
        if (rows, width, False) not in self._graphs:
            self._graphs[(rows, width, False)] = _Graph(self._capture_fn(rows, width, []), [])

    def _capture_fn(self, rows: int, width: int, events: list[Any]) -> Any:
        def fn() -> None:
            if events:
                marks: list[tuple[Any, Any]] = []
                self._forward(rows, width, marks, lambda i: events[i].record() or events[i])
            else:
                self._forward(rows, width, None, None)

        buf = self.buffers
        saved = self.cache.save_step_effects(buf.view("slots", rows), buf.view("write_pos", rows))
        tokens = self.slot_tokens.clone()

        def restore() -> None:
            # the warm-up run appended to the hot zones (before this step's seals ran), updated the access
            # statistics and byte counts and overwrote the tokens it reads: the replay does it all again
            self.cache.restore_step_effects(saved)
            self.slot_tokens.copy_(tokens)

        return self._capture(fn, restore)

    def _capture_seal(self, info: StepInfo) -> Any:
        n = info.seal_rows
        slots = torch.as_tensor(np.unique(info.sealed_slots), device=self.cache.device)
        zone = self.cache.hot_kv
        saved = zone[:, :, slots].clone()

        def restore() -> None:  # the warm-up run shifted the zones: the replay will seal them again
            zone[:, :, slots] = saved

        return self._capture(lambda: self.cache.seal_static(self.buffers, n), restore)

    def _capture(self, fn: Callable[[], None], restore: Callable[[], None]) -> Any:
        t0 = time.perf_counter()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.inference_mode():
            fn()  # warm-up: compiles and loads every kernel, fixes launch plans (split counts) at this shape
        current.wait_stream(side)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            fn()
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize()
        self.capture_ms += (time.perf_counter() - t0) * 1000.0
        self.captures += 1
        return graph


def attention_ms(marks: list[tuple[Any, Any]]) -> float:
    """Milliseconds between each (start, end) pair of :meth:`DecodeGraphs.attention_marks`, summed (the
    step they time must have completed)."""
    return sum(_elapsed_ms(a, b) for a, b in marks)


def _elapsed_ms(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1000.0
    return float(start.elapsed_time(end))
