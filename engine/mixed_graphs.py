"""Mixed iterations (decode rows beside prompt chunks) as one CUDA graph each, per shape bucket.

A mixed iteration in pieces (:mod:`kvtune.engine.piecewise`) replays its dense parts as graphs but launches
every layer's attention and cache work from the host: about eight launches a layer, each with its Python
around it. On an H100's host that was 20-35 ms for 16 decode rows and a chunk of 256 tokens (Llama-3.1-8B
shape), more than the GPU needs for it. Here the whole iteration is captured, as the static decode step is
(:mod:`kvtune.engine.graphs`), over fixed shapes:

- the rows: the decode rows first, padded to a rows bucket ``R`` and staged as a static decode step stages
  them (:meth:`HybridCache.prepare_step`: their seals run before the iteration, in the decode graphs' seal
  graph), then the chunks' tokens, then padding up to the pieces' token bucket ``N`` (``N >= R + T``);
- the chunks' plan padded to fixed sizes in fixed storage (:class:`~kvtune.cache_impl.chunks.ChunkPad`,
  :class:`~kvtune.cache_impl.chunks.ChunkStaging`): query rows ``N - R``, packed rows a power of two, chunk
  entries a power of two, seal entries none or a power of two (at most what the tokens can seal), hot
  writes one zone per chunk entry; FlashAttention is given the pads as its longest lengths;
- the logits of every decode row (padding included) and of each chunk entry's last row.

One graph per (``N``, ``R``, table width, packed rows, chunk entries, seal entries), captured on the
shape's ``capture_on``-th use (:meth:`wants`; before it the caller runs the iteration op by op, so a shape a
replay meets once is never captured: a capture took about 3.5x an iteration's host time in pieces), after one
uncaptured run on a side stream (what that run wrote is put back: the decode rows' hot positions and access
statistics, the chunks' hot zones, the tokens the decode rows leave on the device; the warm-up plans the
tiers but migrates nothing, as the decode step's). A sparse config's tier planning and migrations
run inside the graph after the layers, as in the static decode step. Without capture (a CPU) the same
function runs directly over the same padded buffers: what the CPU tests compare with the eager mixed
forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvtune.cache_impl.chunks import ChunkPad, ChunkPlan, ChunkStaging
from kvtune.cache_impl.layout import hot_capacity
from kvtune.cache_impl.plan import StagedCopy, StepInfo
from kvtune.kernels.elementwise import add_rms_norm

MIN_PACKED = 256  # the smallest packed-rows bucket


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class MixedInfo:
    """One staged mixed iteration: the decode rows' static step (None: none), the chunks and their padded
    plan, the graph's key, and the logits' rows (``R`` decode rows, then one per chunk entry)."""

    step: StepInfo | None
    chunks: tuple[tuple[int, int], ...]
    plan: ChunkPlan
    key: tuple[int, ...]
    decode_rows: int
    logit_rows: int


class MixedGraphs:
    """Mixed iterations of one model over one cache (module docstring). ``decode``: the cache's
    :class:`~kvtune.engine.graphs.DecodeGraphs` (its step buffers, shapes and seal graphs);
    ``pieces``: the model's :class:`~kvtune.engine.piecewise.PiecewiseForward`; ``max_chunks``: the most
    chunks in an iteration; ``max_packed``: the most packed rows (beyond it an iteration does not fit);
    ``capture``: replay CUDA graphs; ``keep_logits``: keep each iteration's logits (tests); ``capture_on``:
    the use of a shape that captures it (:meth:`wants`)."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        decode: Any,
        pieces: Any,
        max_chunks: int,
        max_packed: int,
        capture: bool,
        keep_logits: bool = False,
        capture_on: int = 1,
    ) -> None:
        if capture and cache.device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs a CUDA cache")
        self.model, self.cache, self.decode, self.pieces, self.capture = model, cache, decode, pieces, capture
        self.capture_on = capture_on
        self._uses: dict[tuple[int, ...], int] = {}
        tokens = pieces.max_tokens
        self.max_chunks = _pow2(max_chunks)
        self.max_packed = _pow2(max_packed, MIN_PACKED)
        self._hot = hot_capacity(cache.config)
        self.staging = ChunkStaging(
            ChunkPad(tokens, self.max_packed, self.max_chunks, self._seals(tokens, self.max_chunks),
                     self.max_chunks * self._hot),
            cache.device,
        )  # fmt: skip
        dev, rows = cache.device, decode.buffers.rows + self.max_chunks
        self._inputs = torch.zeros(3, max(tokens, rows), dtype=torch.int64, pin_memory=capture)
        self._inputs_dev = torch.zeros_like(self._inputs, device=dev)
        self._copy = StagedCopy()
        self.tokens_out = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(rows, model.spec.vocab_size, device=dev) if keep_logits else None
        self._row_ids = torch.arange(decode.buffers.rows, device=dev)
        self._plan: ChunkPlan | None = None
        self._graphs: dict[tuple[int, ...], Any] = {}
        self.captures = 0

    def _seals(self, query_rows: int, chunks: int) -> int:
        """The most blocks ``chunks`` chunks of ``query_rows`` tokens in all can seal (hot zones full)."""
        bs = self.cache.config.block_size
        return -(-(query_rows + chunks * self._hot) // bs)

    # ---- an iteration ------------------------------------------------------------------------------------
    def fits(self, decode_rows: int, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether an iteration of ``decode_rows`` rows and ``chunks`` fits the captured shapes (else
        :meth:`prepare` refuses it, before anything is staged)."""
        if not (0 < len(chunks) <= self.max_chunks and decode_rows <= self.decode.buffers.rows):
            return False
        rows = self.decode.rows_for(decode_rows) if decode_rows else 0
        tokens = rows + sum(t for _, t in chunks)
        return self.pieces.fits(tokens) and self.cache.chunk_sizes(chunks).rows <= self.max_packed

    def wants(self, slots: np.ndarray, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether an iteration that :meth:`fits` runs as a graph: its shape's graph exists, or this is the
        shape's ``capture_on``-th use (counted here; the caller runs the others op by op). The shape is
        predicted before anything is staged, as :meth:`prepare` will key it."""
        if self.capture_on <= 1:
            return True
        key = self.key_for(slots, chunks)
        if key in self._graphs:
            return True
        self._uses[key] = uses = self._uses.get(key, 0) + 1
        return uses >= self.capture_on

    def key_for(self, slots: np.ndarray, chunks: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """The graph's key an iteration of the decode rows ``slots`` and ``chunks`` will have."""
        r, n, pad = self._shape(len(slots), chunks)
        width = self.decode.width_for(self.cache.step_blocks(slots)) if len(slots) else 0
        return (n, r, width, pad.rows, pad.chunks, pad.seals)

    def prepare(
        self,
        slots: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        chunks: Sequence[tuple[int, int]],
        chunk_ids: np.ndarray,
        chunk_positions: np.ndarray,
        now_ms: float,
    ) -> MixedInfo:
        """The host's part: the decode rows ``slots`` (feeding ``tokens`` at ``positions``) staged as a
        static step, the chunks planned, padded and staged, the inputs staged; on CUDA the graph this shape
        needs captured (before anything of the iteration runs). A ``ValueError`` where the chunks' packed
        rows exceed ``max_packed`` (nothing changed: checked before the decode rows are staged)."""
        cache, b = self.cache, len(slots)
        r, n, pad = self._shape(b, chunks)  # refused here, before anything is staged
        step = cache.prepare_step(slots, tokens, now_ms, self.decode.buffers, self.decode) if b else None
        width = step.width if step is not None else 0
        plan = cache.plan_chunks(chunks, pad, self.staging)
        self._plan = plan
        cb = plan.cu_q.numel() - 1
        self._copy.wait()  # the previous inputs' copy has left the host buffer
        host = self._inputs.numpy()
        host[:2, :n] = 0
        host[0, :b], host[1, :b] = tokens, positions
        host[0, r : r + len(chunk_ids)], host[1, r : r + len(chunk_ids)] = chunk_ids, chunk_positions
        ends = r + np.array([e for _, e in plan.bounds]) - 1
        host[2, :r] = np.arange(r)
        host[2, r : r + cb] = np.resize(ends, cb)  # padding chunk entries: a real chunk's last row
        self._copy.copy(self._inputs_dev, self._inputs)  # one copy, from pinned memory on CUDA
        key = (n, r, width, plan.max_k, cb, plan.seal_blocks.numel())
        info = MixedInfo(step, tuple(chunks), plan, key, r, r + cb)
        if self.capture:
            if step is not None:
                self.decode.ensure_seal_graph(step)
            if key not in self._graphs:
                self._graphs[key] = self._capture_forward(info)
        return info

    def run(self, info: MixedInfo) -> torch.Tensor:
        """The decode rows' seals, then the iteration (a replay on CUDA); its tokens (argmax) on the device,
        the decode rows' first then each chunk's. Then :meth:`finish`."""
        if info.step is not None:
            self.decode.seal(info.step)
        if self.capture:
            self._graphs[info.key].replay()
        else:
            self._forward(info)
        b = info.step.batch if info.step is not None else 0
        out = self.tokens_out
        return torch.cat([out[:b], out[info.decode_rows : info.decode_rows + len(info.chunks)]])

    def finish(self, info: MixedInfo) -> None:
        """The host's bookkeeping after the iteration is enqueued (the decode rows' and the chunks')."""
        if info.step is not None:
            self.cache.finish_step(info.step)
        self.cache.finish_chunks(info.plan, info.chunks)

    # ---- shapes ------------------------------------------------------------------------------------------
    def _shape(self, decode_rows: int, chunks: Sequence[tuple[int, int]]) -> tuple[int, int, ChunkPad]:
        """An iteration's rows bucket ``R``, token bucket ``N`` and chunk plan's padded sizes."""
        r = self.decode.rows_for(decode_rows) if decode_rows else 0
        n = self.pieces.bucket(r + sum(t for _, t in chunks))
        return r, n, self._pad(self.cache.chunk_sizes(chunks), n - r)

    def _pad(self, real: ChunkPad, query_rows: int) -> ChunkPad:
        chunks = _pow2(real.chunks)
        if real.rows > self.max_packed or chunks > self.max_chunks:
            raise ValueError(
                f"mixed graphs: {real.rows} packed rows and {real.chunks} chunks do not fit "
                f"{self.max_packed} and {self.max_chunks}"
            )
        seals = min(_pow2(real.seals), self._seals(query_rows, chunks)) if real.seals else 0
        return ChunkPad(query_rows, _pow2(real.rows, MIN_PACKED), chunks, seals, chunks * self._hot)

    # ---- the iteration's function ------------------------------------------------------------------------
    def _forward(self, info: MixedInfo) -> None:
        n, r, width = info.key[0], info.decode_rows, info.key[2]
        cache, pieces, plan = self.cache, self.pieces, self._plan
        assert plan is not None
        inputs = self._inputs_dev
        pieces.stage_inputs(inputs[0, :n], inputs[1, :n], n)
        dplan = self.decode.buffers.plan(r, width, cache.shape.num_kv_heads) if r else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = cache.chunks_layer(i, plan, q[r:], k[r:], v[r:])
            if dplan is None:
                return out
            return torch.cat([cache.decode(i, dplan, q[:r], k[:r], v[:r]), out])

        x, delta = pieces.forward_rows(n, attend)
        if r:  # the tier planning and migrations of the decode rows' step, as the static step runs them
            cache.migrate_static(self.decode.buffers)
        rows = inputs[2, : info.logit_rows]
        m = self.model
        logits = F.linear(add_rms_norm(x[rows], delta[rows], m.norm, m.spec.rms_eps)[1], m.lm_head).float()
        out = logits.argmax(-1)
        self.tokens_out[: info.logit_rows].copy_(out)
        if self.logits is not None:
            self.logits[: info.logit_rows].copy_(logits)
        if r:  # the decode rows' tokens where a later static step reads them (padding rows: the spare entry)
            buf, dg = self.decode.buffers, self.decode
            slots = buf.view("slots", r)
            real = self._row_ids[:r] < buf.batch_tensor()
            dg.slot_tokens[torch.where(real, slots, dg.spare_rows(r))] = out[:r]

    # ---- capture -----------------------------------------------------------------------------------------
    def _capture_forward(self, info: MixedInfo) -> Any:
        cache = self.cache
        r = info.decode_rows
        if r:
            buf = self.decode.buffers
            saved = cache.save_step_effects(buf.view("slots", r), buf.view("write_pos", r))
        slots = torch.as_tensor([s.slot for s in info.plan.specs], device=cache.device)
        zones = cache.hot_kv[:, :, slots].clone()
        tokens = self.decode.slot_tokens.clone()

        def restore() -> None:  # what the warm-up wrote, which the replay writes again from the same state
            if r:
                cache.restore_step_effects(saved)
            cache.hot_kv[:, :, slots] = zones
            self.decode.slot_tokens.copy_(tokens)

        self.captures += 1
        # its time counts in the decode graphs' capture_ms
        return self.decode.capture_graph(lambda: self._forward(info), restore)
