"""The prompt chunks of one engine iteration, planned once for every layer (``HybridCache.prefill_chunks``).

Per layer, what ``HybridCache.prefill`` does chunk by chunk (attend over the cached prefix and the chunk;
seal the blocks the chunk fills; put the rest in the hot zone) runs here for all chunks at once, in a fixed
number of launches whatever the number of chunks: the chunks' keys and values are *packed* ``[2, K, H,
D]`` (a K plane and a V plane, each contiguous for the attention), each chunk's segment its cached prefix
(sealed blocks, dequantized), its hot tokens and its new tokens, which is what its queries attend to
(causally, the queries at the segment's end). Per layer: one kernel packs the rows, each from its own
source (:func:`kvtune.kernels.chunk_kv.pack_kv`: a cold block's token, a hot-zone entry or a new row); one
attention call covers every chunk (FlashAttention's variable-length form on a GPU, one call per chunk
elsewhere: :func:`kvtune.cache_impl.hybrid_cache.chunks_attention`); one seal quantizes the sealed blocks
straight from the packed rows (each block a window of ``bs`` rows from its start); one kernel writes the new
hot zones (:func:`kvtune.kernels.chunk_kv.hot_write`). The indices are the same in every layer: the host
computes them at layer 0 into one array, uploaded in one copy (pinned, without waiting for the device on
CUDA).

Packed layout, per chunk in order: its ``sealed × bs`` prefix tokens, its ``hot_len`` hot tokens, then its
``T`` new tokens. Of the chunk's *stream* (hot then new tokens), rows ``[0, n_seal · bs)`` seal into its
fresh blocks; the rest becomes its hot zone, from position 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtune.cache_impl.plan import StagedCopy
from kvtune.kernels.chunk_kv import HOT, NEW, PREFIX


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
    """Device indices of an iteration's chunks (views of one uploaded int64 buffer, and the two int32
    offsets FlashAttention takes).

    bounds: per chunk (q start, q end), host ints · key_bounds: per chunk its (start, end) in the packed
    rows, host ints · done: per chunk the tokens cached before it, host ints · pack_kind, pack_src [K]: each
    packed row's source (:mod:`kvtune.kernels.chunk_kv`: ``PREFIX`` block · bs + token, ``HOT`` slot · C +
    position, ``NEW`` row of the chunks' new keys) · seal_blocks [n]: the fresh blocks, chunk by chunk ·
    seal_starts [n]: each one's first packed row · hot_rows, hot_slots, hot_pos [m]: the packed rows that
    become hot tokens, their slot and position · cu_q, cu_k [C + 1] int32: the chunks' query and key
    offsets · max_q, max_k: the longest.
    """

    specs: tuple[ChunkSpec, ...]
    bounds: tuple[tuple[int, int], ...]
    key_bounds: tuple[tuple[int, int], ...]
    done: tuple[int, ...]
    pack_kind: torch.Tensor
    pack_src: torch.Tensor
    seal_blocks: torch.Tensor
    seal_starts: torch.Tensor
    hot_rows: torch.Tensor
    hot_slots: torch.Tensor
    hot_pos: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


# PyTorch's pinned host pool, filled before a gated replay (warm_pinned_pool): blocks per power-of-two size
PINNED_WARM_ENV = "KVTUNE_PINNED_WARM"
PINNED_POOL = ((range(0, 13), 16), (range(13, 21), 8))  # 1 B-4 KiB: 16 each; 8 KiB-1 MiB: 8 each (16 MiB)


def warm_pinned_pool(device: torch.device) -> int:
    """Leave PyTorch's pinned host pool holding free blocks before a replay on the gated clock; the number of
    blocks asked (0 off CUDA or with ``KVTUNE_PINNED_WARM=0``).

    :func:`upload` pins each copy's source, and the pool hands out a block of the request's power-of-two size
    once the device has run the copies that used it. Behind a gate every copy of the iteration stays queued
    until the gate opens, so a gated iteration holds more blocks of a size at once than the ungated replays
    before it needed, and a block the pool lacks is a call to the driver (``cudaHostAlloc``) inside the gated
    segment. Asking for all the blocks at once and freeing them leaves at least that many free (no copy used
    them): 16 of each size up to 4 KiB and 8 of each up to 1 MiB (a gated mixed iteration uploads about five
    arrays, its inputs, rows, chunk plan, decode plan and new blocks), 16 MiB of pinned memory a process,
    grown only the first time. Done before every gated replay: blocks that earlier replays' tensors still
    hold are not free (run 46a: filled once a process, a later test's gates grew the pool). Such calls to
    the driver were not what leaked the gates seen so far (run 46a: the leaked gates held none), but they
    add host time a gate is not sized for."""
    if device.type != "cuda" or os.environ.get(PINNED_WARM_ENV, "1") == "0":
        return 0
    blocks = [
        torch.empty(1 << k, dtype=torch.uint8, pin_memory=True)
        for sizes, count in PINNED_POOL
        for k in sizes
        for _ in range(count)
    ]
    return len(blocks)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA the copy leaves from pinned memory without waiting for the device:
    a plain copy from pageable memory synchronizes the stream, so the host would stall behind every kernel
    queued before it (and a gated iteration, :class:`kvtune.engine.engine.EngineClock`, would open early)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def upload_aligned(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int64 host arrays on ``device`` in one copy (:func:`upload`), each a view starting 16-byte aligned (an
    even number of int64s before it): a kernel argument's alignment is part of what Triton specializes on, so
    a kernel given any of them is one build whatever the lengths before it."""
    padded = [np.concatenate([a, np.zeros(len(a) % 2, dtype=a.dtype)]) if len(a) % 2 else a for a in parts]
    dev = upload(torch.from_numpy(np.concatenate(padded).astype(np.int64)), device)
    views, at = [], 0
    for a in parts:
        views.append(dev[at : at + len(a)])
        at += len(a) + len(a) % 2
    return views


@dataclass(frozen=True)
class ChunkPad:
    """The sizes a chunk plan is padded to, so that an iteration of these sizes has fixed shapes whatever its
    chunks (a captured mixed iteration): ``tokens`` query rows given to the attention, ``rows`` packed rows,
    ``chunks`` entries of the offsets (less one), ``seals`` seal entries (0 exactly when nothing seals),
    ``hot`` hot-zone writes. Padding packed rows read new row 0 and no chunk attends to them; padding chunks
    are empty; padding seal and hot-write entries repeat real ones (writing the same values again)."""

    tokens: int
    rows: int
    chunks: int
    seals: int
    hot: int


class ChunkStaging:
    """Fixed device storage for chunk plans of at most ``capacity`` (a :class:`ChunkPad`), with a host
    staging buffer (pinned on CUDA): a plan staged here is views at the same addresses for every plan of the
    same :class:`ChunkPad`, which is what a captured iteration reads. One copy a plan, after the previous
    plan's copy has left the staging buffer."""

    def __init__(self, capacity: ChunkPad, device: torch.device) -> None:
        c = capacity
        self.capacity, self.device = c, device
        self.sizes = (c.rows, c.rows, c.seals, c.seals, c.hot, c.hot, c.hot, 2 * (c.chunks + 1))
        self.offsets = np.cumsum([0, *(n + n % 2 for n in self.sizes)])  # each part 16-byte aligned
        total = int(self.offsets[-1])
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(total, dtype=torch.int64, device=device)
        self.cu32 = torch.zeros(2, c.chunks + 1, dtype=torch.int32, device=device)
        self._copy = StagedCopy()

    def fits(self, pad: ChunkPad) -> bool:
        c = self.capacity
        return (
            pad.tokens <= c.tokens and pad.rows <= c.rows and pad.chunks <= c.chunks and pad.seals <= c.seals
            and pad.hot <= c.hot
        )  # fmt: skip

    def stage(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy ``parts`` (the plan's eight fields, each at most its capacity) to the device; their views."""
        self._copy.wait()  # the previous plan's copy has read the host buffer
        host = self.host.numpy()
        for a, at in zip(parts, self.offsets):
            host[at : at + len(a)] = a
        self._copy.copy(self.dev, self.host)
        return [self.dev[at : at + len(a)] for a, at in zip(parts, self.offsets)]


def build_chunk_plan(
    specs: list[ChunkSpec],
    block_size: int,
    hot_capacity: int,
    device: torch.device,
    pad: ChunkPad | Callable[[ChunkPad], ChunkPad] | None = None,
    staging: ChunkStaging | None = None,
) -> ChunkPlan:
    """The indices of ``specs`` (in the order their tokens come), packed on the host and uploaded once;
    ``hot_capacity``: the hot zones' positions per slot (``C``). ``pad``: padded to those sizes (a
    ``ValueError`` where the chunks do not fit them), or to the sizes it returns for the plan's own (a
    function), in ``staging``'s fixed storage where given."""
    bs = block_size
    bounds, key_bounds, done = [], [], []
    kinds, srcs, seal_ids, seal_starts, hot_rows, hot_slots, hot_pos = [], [], [], [], [], [], []
    q0 = k0 = 0
    for s in specs:
        cached = s.sealed * bs
        segment = cached + s.hot_len + s.tokens
        bounds.append((q0, q0 + s.tokens))
        key_bounds.append((k0, k0 + segment))
        done.append(cached + s.hot_len)
        kinds.append(np.repeat(np.array([PREFIX, HOT, NEW]), [cached, s.hot_len, s.tokens]))
        token = np.arange(cached)
        srcs.append(s.blocks[token // bs] * bs + token % bs)
        srcs.append(s.slot * hot_capacity + np.arange(s.hot_len))
        srcs.append(np.arange(q0, q0 + s.tokens))
        stream = k0 + cached  # the chunk's hot then new tokens in the packed rows
        seal_ids.append(s.blocks[s.sealed : s.sealed + s.n_seal])
        seal_starts.append(stream + bs * np.arange(s.n_seal))
        tail = np.arange(s.n_seal * bs, s.hot_len + s.tokens)
        hot_rows.append(stream + tail)
        hot_slots.append(np.full(len(tail), s.slot))
        hot_pos.append(tail - s.n_seal * bs)
        q0, k0 = q0 + s.tokens, k0 + segment
    fields = [
        np.concatenate(x).astype(np.int64)
        for x in (kinds, srcs, seal_ids, seal_starts, hot_rows, hot_slots, hot_pos)
    ]
    cu = np.zeros((2, len(specs) + 1), dtype=np.int64)
    cu[0, 1:] = np.cumsum([b - a for a, b in bounds])
    cu[1, 1:] = np.cumsum([b - a for a, b in key_bounds])
    max_q, max_k = max(b - a for a, b in bounds), max(b - a for a, b in key_bounds)
    if callable(pad):
        pad = pad(ChunkPad(q0, len(fields[0]), len(specs), len(fields[2]), len(fields[4])))
    if pad is not None:
        fields, cu = _padded(fields, cu, q0, pad)
        max_q, max_k = pad.tokens, pad.rows
    if staging is not None:
        if pad is None or not staging.fits(pad):
            raise ValueError(f"build_chunk_plan: staging of {staging.capacity} takes plans padded within it")
        *views, cu_dev = staging.stage([*fields, cu.ravel()])
        offsets = staging.cu32[:, : cu.shape[1]]
        offsets.copy_(cu_dev.view(2, -1))
    else:
        # every field 16-byte aligned: the kernels are one build whatever the chunks' lengths
        *views, cu_dev = upload_aligned([*fields, cu.ravel()], device)
        offsets = cu_dev.view(2, -1).to(torch.int32)
    return ChunkPlan(
        specs=tuple(specs),
        bounds=tuple(bounds),
        key_bounds=tuple(key_bounds),
        done=tuple(done),
        pack_kind=views[0],
        pack_src=views[1],
        seal_blocks=views[2],
        seal_starts=views[3],
        hot_rows=views[4],
        hot_slots=views[5],
        hot_pos=views[6],
        cu_q=offsets[0],
        cu_k=offsets[1],
        max_q=max_q,
        max_k=max_k,
    )


def _padded(
    fields: list[np.ndarray], cu: np.ndarray, tokens: int, pad: ChunkPad
) -> tuple[list[np.ndarray], np.ndarray]:
    """The plan's fields and offsets at ``pad``'s sizes (:class:`ChunkPad`)."""
    kind, src, seal_ids, seal_starts, hot_rows, hot_slots, hot_pos = fields
    n_rows, n_seals, n_chunks = len(kind), len(seal_ids), cu.shape[1] - 1
    if not (
        tokens <= pad.tokens and n_rows <= pad.rows and n_chunks <= pad.chunks and len(hot_rows) <= pad.hot
        and (n_seals <= pad.seals if n_seals else pad.seals == 0)
    ):  # fmt: skip
        raise ValueError(
            f"build_chunk_plan: {tokens} tokens, {n_rows} packed rows, {n_chunks} chunks, {n_seals} seals, "
            f"{len(hot_rows)} hot writes do not fit {pad} (seals 0 exactly when nothing seals)"
        )
    rows = pad.rows - n_rows
    kind = np.concatenate([kind, np.full(rows, NEW, dtype=np.int64)])
    src = np.concatenate([src, np.zeros(rows, dtype=np.int64)])
    seals = [np.resize(x, pad.seals) for x in (seal_ids, seal_starts)]  # repeats of real entries
    hot = [np.resize(x, pad.hot) for x in (hot_rows, hot_slots, hot_pos)]
    cu = np.concatenate([cu, np.repeat(cu[:, -1:], pad.chunks - n_chunks, axis=1)], axis=1)
    return [kind, src, *seals, *hot], cu
