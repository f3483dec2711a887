"""The prompt chunks of one engine iteration, planned once for every layer (``HybridCache.prefill_chunks``).

Per layer, what ``HybridCache.prefill`` does chunk by chunk (attend over the cached prefix and the chunk;
seal the blocks the chunk fills; put the rest in the hot zone) runs here with the writes of all chunks
fused: each chunk's hot tokens and new tokens form one *stream* ``[S, 2, H, D]`` (K and V stacked), the
sealed blocks are one gather of its rows and one ``seal_blocks`` call, the new hot zones one gather and one
scatter. Only attention stays per chunk. The indices are the same in every layer: the host computes them at
layer 0 into one array, uploaded in one copy (pinned, without waiting for the device on CUDA).

Stream layout, per chunk in order: its ``hot_len`` hot tokens (a later chunk of a prompt), then its ``T``
new tokens. Rows ``[0, n_seal · bs)`` of a chunk's segment seal into its fresh blocks; the rest becomes its
hot zone, from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk as the host sees it at layer 0: the sequence's slot, tokens in the hot zone and sealed
    blocks before the chunk, the chunk's tokens, the blocks it seals and its block ids (``sealed`` then
    ``n_seal``)."""

    slot: int
    hot_len: int
    sealed: int
    tokens: int
    n_seal: int
    blocks: np.ndarray


@dataclass(frozen=True)
class ChunkPlan:
    """Device indices of an iteration's chunks (views of one uploaded int64 buffer).

    bounds: per chunk (q start, q end, stream start), host ints · prefix [p]: every chunk's sealed blocks
    before it, chunk after chunk (dequantized in one call per layer) · prefix_bounds: per chunk its
    (start, end) in ``prefix``, host ints · seal_blocks [n]: the fresh blocks, chunk by chunk · seal_rows
    [n · bs]: their stream rows · hot_rows, hot_slots, hot_pos [m]: the stream rows that become hot tokens,
    their slot and position · has_hot: whether any chunk starts with hot tokens (else the stream is just
    the chunks' K and V).
    """

    specs: tuple[ChunkSpec, ...]
    bounds: tuple[tuple[int, int, int], ...]
    prefix: torch.Tensor
    prefix_bounds: tuple[tuple[int, int], ...]
    seal_blocks: torch.Tensor
    seal_rows: torch.Tensor
    hot_rows: torch.Tensor
    hot_slots: torch.Tensor
    hot_pos: torch.Tensor
    has_hot: bool


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA the copy leaves from pinned memory without waiting for the device:
    a plain copy from pageable memory synchronizes the stream, so the host would stall behind every kernel
    queued before it (and a gated iteration, :class:`kvtune.engine.engine.EngineClock`, would open early)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_chunk_plan(specs: list[ChunkSpec], block_size: int, device: torch.device) -> ChunkPlan:
    """The indices of ``specs`` (in the order their tokens come), packed on the host and uploaded once."""
    bounds, prefix_bounds, q0, s0, p0 = [], [], 0, 0, 0
    prefix, seal_ids, seal_rows, hot_rows, hot_slots, hot_pos = [], [], [], [], [], []
    for s in specs:
        bounds.append((q0, q0 + s.tokens, s0))
        prefix.append(s.blocks[: s.sealed])
        prefix_bounds.append((p0, p0 + s.sealed))
        p0 += s.sealed
        seal_ids.append(s.blocks[s.sealed : s.sealed + s.n_seal])
        seal_rows.append(s0 + np.arange(s.n_seal * block_size))
        segment = s.hot_len + s.tokens
        tail = np.arange(s.n_seal * block_size, segment)
        hot_rows.append(s0 + tail)
        hot_slots.append(np.full(len(tail), s.slot))
        hot_pos.append(tail - s.n_seal * block_size)
        q0, s0 = q0 + s.tokens, s0 + segment
    fields = [np.concatenate(x) for x in (prefix, seal_ids, seal_rows, hot_rows, hot_slots, hot_pos)]
    sizes = [len(f) for f in fields]
    dev = upload(torch.from_numpy(np.concatenate(fields).astype(np.int64)), device)
    views, at = [], 0
    for n in sizes:
        views.append(dev[at : at + n])
        at += n
    return ChunkPlan(
        specs=tuple(specs),
        bounds=tuple(bounds),
        prefix=views[0],
        prefix_bounds=tuple(prefix_bounds),
        seal_blocks=views[1],
        seal_rows=views[2],
        hot_rows=views[3],
        hot_slots=views[4],
        hot_pos=views[5],
        has_hot=any(s.hot_len for s in specs),
    )
