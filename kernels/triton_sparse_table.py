"""Triton kernel of :mod:`kvtune.kernels.sparse_table`: a layer's attention table in one launch.

One program per (sequence ``b``, KV head ``h``), 8 warps, in three steps; no host synchronisation, no size
that depends on the data, one compiled kernel for every batch and table width:

1. split: row ``b`` of ``blocks``, ``SPLIT`` ids at a time, with their tiers: the L1 blocks go to the next
   free positions of the table row (a running count + ``tl.cumsum``, so in order), the L2 blocks to the
   program's list in a scratch row, in order. The tiers of the next step and the ids of the one after are
   in flight while a step is split.
2. select: the L2 list, ``CHUNK`` = 64 blocks at a time: ``[64, D]`` tiles of ``k_min`` and ``k_scale`` of
   head ``h`` (fp16, 32 KB at ``D`` 128), the Quest bound of each block, and its key. Two chunks (a, b) live
   in registers: while one is scored the other's bounds load (~32 KB per program in flight; at 16 sequences
   x 8 KV heads, 128 programs, one per SM).
3. the selected blocks (best first) after the L1 ones, -1 after them, the counts, and the bytes attention
   and Quest read added to the step's counter (one atomic per program; Quest's bytes by ``h == 0``).

The bound. With ``s = scale · levels`` (``hi = lo + s``; ``scale >= 0`` in every pool, see
:func:`kvtune.kernels.quant.min_scale`), ``max(q·lo, q·hi) = q·lo + max(q, 0)·s``, so a KV head's bound is
``Σ_d S_d·lo_d + P_d·s_d`` with ``S = Σ_g q_g`` and ``P = Σ_g max(q_g, 0)`` summed once per program: two FMAs
per key channel instead of ``G`` times that, which keeps the scoring under the loads' time. It equals
:func:`kvtune.kernels.quest.quest_scores_ref` up to float rounding (the same sums in another order).

From a :class:`~kvtune.kernels.quest_summary.QuestSummary8` (``SUMMARY8``) the tiles are its float8 ``lo``
and ``span`` instead (16 KB a chunk at ``D`` 128, half the bytes): ``span`` is the range with the levels
folded in, so the bound is ``Σ_d S_d·lo_d + P_d·span_d`` with no levels applied; each block's bits are
still loaded where its key packs them (an 8-bit pool that may hold demoted blocks), for the bytes of the
selected ones. It equals :func:`kvtune.kernels.quest_summary.summary_scores_ref` up to float rounding.

The top-k. A block's key is an int64: its bound's float bits made order-preserving as a signed int in the
high half, its position in the list and its bits in the low half (-2^63: no block). Keys are distinct, so a
key's rank in a set is the number of keys above it. ``best`` holds the ``k_blocks`` largest keys merged so
far, descending; a chunk's keys above the ``k_blocks``-th best ("candidates") are appended to a scratch
buffer (``tl.cumsum`` again) and merged 64 at a time: each key's rank in ``best`` + the 64 comes from
``[TOPK, 64]`` and ``[64, 64]`` comparisons, and each key of rank below ``k_blocks`` is stored at that rank in
scratch and read back after a barrier. Why this and not the alternatives, from the sm_90 SASS of each:
``tl.sort``/``tl.topk`` of every chunk's keys into ``best`` (bitonic) spread their compare-swap rounds over
the 8 warps (~45 barriers and ~900 instructions per warp per chunk, more than the scoring); selecting from
all the scores at the end needs them in one register tensor (a static size: a recompilation per table
width) or serial rounds of cross-warp reductions (radix select, ``k_blocks`` arg-maxes) after the last load.
With random bounds ``~k·ln(n/k)`` of ``n`` keys are candidates: 3 merges of ~300 instructions per warp at
448 L2 blocks and ``k_blocks`` 32 instead of 7.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_summary import E4M3, QuestSummary8
from kvtune.kernels.sparse_table_ref import L1, L2, ByteCount, sparse_block_table_ref
from kvtune.kernels.triton_common import cdiv, next_pow2, require, tileable_head_dim

SPLIT = 512  # blocks per step of the split (2 ids and tiers per thread)
CHUNK = 64  # L2 blocks per step of the selection: [64, D] tiles of key mins and scales (32 KB at D 128)
FILL = 256  # -1 entries written per store of the table's padding
NUM_WARPS = 8  # 256 threads: 32 fp16 per thread per tile; 2 chunks of 2 tiles in registers (~210 in all)
NONE = tl.constexpr(-(2**63))  # the key of a position that is not an L2 block


@triton.jit
def _bounds(kmin_ptr, kscale_ptr, bits_ptr, blk, s_kn, D: tl.constexpr, POOL_BITS: tl.constexpr,
            MIXED: tl.constexpr):  # fmt: skip
    """Key min and scale tiles [MB, D] (fp16 as stored, or a summary's float8 lo and span: the pointers'
    type; pointers at the program's head) of blocks blk (undefined where blk < 0), and the blocks' bits (the
    pool's unless MIXED)."""
    valid = blk >= 0
    blk = blk.to(tl.int32)  # 32-bit offsets: the launcher checks the bounds' size
    offs = blk[:, None] * s_kn + tl.arange(0, D)[None, :]
    lo = tl.load(kmin_ptr + offs, mask=valid[:, None])
    sc = tl.load(kscale_ptr + offs, mask=valid[:, None])
    if MIXED:
        bits = tl.load(bits_ptr + blk, mask=valid, other=POOL_BITS).to(tl.int32)
    else:
        bits = tl.full(blk.shape, POOL_BITS, tl.int32)
    return lo, sc, bits


@triton.jit
def _merge_top(best, keys, K, best_buf, TOPK: tl.constexpr):
    """The K largest of ``best`` (descending, NONE after) and ``keys``, descending, NONE after.

    Keys are distinct, so a key's rank in the union is the number of keys above it: a best key's is its
    index plus the new keys above it, a new key's the new keys above it plus the best keys above it. Ranks
    below TOPK are a permutation (NONE keys of ``best`` included, those of ``keys`` rank past TOPK): each key
    of rank r < K is stored to ``best_buf[r]``, read back after a barrier."""
    i = tl.arange(0, TOPK)
    above = keys[None, :] > best[:, None]  # [TOPK, MB]: new key j above best key i
    rank_best = i + tl.sum(above.to(tl.int32), 1)
    rank_keys = tl.sum((keys[:, None] > keys[None, :]).to(tl.int32), 0) + TOPK - tl.sum(above.to(tl.int32), 0)
    tl.store(best_buf + rank_best, best, mask=rank_best < K)
    tl.store(best_buf + rank_keys, keys, mask=rank_keys < K)
    tl.debug_barrier()
    return tl.load(best_buf + i, mask=i < K, other=NONE)


@triton.jit
def _scan_chunk(lo, sc, bits, blk, c0, qs, qp, best, floor, wp, rp, cands, best_buf, K, TOPK: tl.constexpr,
                MB: tl.constexpr, MIXED: tl.constexpr, SUMMARY8: tl.constexpr):  # fmt: skip
    """Quest's bound of the blocks ``blk`` at positions c0... of the L2 list; their keys above ``floor`` (the
    K-th best so far) appended to ``cands[wp:]``, merged into ``best`` MB at a time (``cands[rp:rp + MB]``).
    Returns (best, floor, wp, rp). SUMMARY8: ``sc`` is a summary's span, the levels in it."""
    jj = tl.arange(0, MB)
    s = sc.to(tl.float32)
    if MIXED and not SUMMARY8:
        s = s * tl.where(bits > 0, (1 << bits) - 1, 1).to(tl.float32)[:, None]
    score = tl.sum(lo.to(tl.float32) * qs[None, :] + s * qp[None, :], 1)
    score = score.to(tl.int32, bitcast=True)
    score = score ^ ((score >> 31) & 0x7FFFFFFF)  # the float's order as a signed int
    keys = tl.where(blk >= 0, (score.to(tl.int64) << 32) | ((c0 + jj).to(tl.int64) << 4) | bits, NONE)
    up = keys > floor
    tl.store(cands + wp + tl.cumsum(up.to(tl.int32), 0) - 1, keys, mask=up)
    wp += tl.sum(up.to(tl.int32), 0)
    if wp - rp >= MB:
        tl.debug_barrier()  # the candidates are written by every thread of the program
        best = _merge_top(best, tl.load(cands + rp + jj), K, best_buf, TOPK)
        rp += MB
        floor = tl.load(best_buf + K - 1)
    return best, floor, wp, rp


@triton.jit
def _query_sums(q_ptr, b, h, s_qb, s_qh, G: tl.constexpr, D: tl.constexpr, POOL_BITS: tl.constexpr,
                MIXED: tl.constexpr, SUMMARY8: tl.constexpr):  # fmt: skip
    """S = sum_g q_g and P = sum_g max(q_g, 0) over KV head h's query group (P times the levels unless
    MIXED or SUMMARY8: a summary's spans hold them)."""
    d = tl.arange(0, D)
    q_row = q_ptr + b.to(tl.int64) * s_qb + (h * G) * s_qh + d
    qs = tl.zeros([D], tl.float32)
    qp = tl.zeros([D], tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_row + g * s_qh).to(tl.float32)
        qs += qg
        qp += tl.maximum(qg, 0.0)
    if not MIXED and not SUMMARY8:  # every block has the pool's levels: fold them into P
        qp = qp * (1.0 if POOL_BITS == 0 else (1 << POOL_BITS) - 1.0)
    return qs, qp


@triton.jit(do_not_specialize=["M", "W", "K"])  # sizes follow the batch and lengths: one compiled kernel
def _sparse_table_kernel(
    q_ptr, kmin_ptr, kscale_ptr, bits_ptr, blocks_ptr, tier_ptr, cost_ptr, table_ptr, num_ptr, n1_ptr,
    bytes_ptr, scratch_ptr, M, W, K, quest_cost, s_qb, s_qh, s_kn, s_kh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, MB: tl.constexpr, SPLIT: tl.constexpr,
    TOPK: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, POOL_BITS: tl.constexpr, MIXED: tl.constexpr,
    SUMMARY8: tl.constexpr, SELECT: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Row (b, h): table = its L1 blocks in order ++ its K best L2 blocks for head h, -1 after; the count,
    the L1 count, and the bytes attention and Quest read (Quest's once per sequence, by h == 0). SUMMARY8:
    ``kmin_ptr``/``kscale_ptr`` are a summary's lo and span."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    row = b.to(tl.int64) * M
    out = table_ptr + bh.to(tl.int64) * W
    l2_list = scratch_ptr + bh.to(tl.int64) * (2 * M + TOPK)  # the row's L2 blocks, in order
    cands = l2_list + M  # keys above the K-th best when they were scored, merged or not yet
    best_buf = cands + M  # the best keys after the last merge, descending
    if SELECT:  # the group's query sums, loaded while the split runs
        qs, qp = _query_sums(q_ptr, b, h, s_qb, s_qh, G, D, POOL_BITS, MIXED, SUMMARY8)

    # 1. split: L1 blocks in order to the table, L2 blocks in order to the list (the tiers of the next chunk
    # and the ids of the one after in flight while a chunk is split)
    c1 = tl.zeros([], tl.int32)
    c2 = tl.zeros([], tl.int32)
    read = tl.zeros([SPLIT], tl.int64)
    pending = tl.full([SPLIT], 255, tl.int32)  # bits of the previous chunk's L1 blocks, costed a chunk late
    js = tl.arange(0, SPLIT)
    blk_a = tl.load(blocks_ptr + row + js, mask=js < M, other=-1)
    blk_b = tl.load(blocks_ptr + row + SPLIT + js, mask=SPLIT + js < M, other=-1)
    t_a = tl.load(tier_ptr + tl.where(blk_a >= 0, blk_a, 0), mask=blk_a >= 0, other=0)
    for j0 in range(0, M, SPLIT):
        t_b = tl.load(tier_ptr + tl.where(blk_b >= 0, blk_b, 0), mask=blk_b >= 0, other=0)
        j = j0 + 2 * SPLIT + js
        blk_c = tl.load(blocks_ptr + row + j, mask=j < M, other=-1)
        valid = blk_a >= 0
        is1 = valid & (t_a == T1)
        is2 = valid & (t_a == T2)
        tl.store(out + c1 + tl.cumsum(is1.to(tl.int32), 0) - 1, blk_a.to(tl.int32), mask=is1)
        if SELECT:
            tl.store(l2_list + c2 + tl.cumsum(is2.to(tl.int32), 0) - 1, blk_a, mask=is2)
        if MIXED:
            read += tl.load(cost_ptr + pending, mask=pending != 255, other=0)
            pending = tl.load(bits_ptr + tl.where(is1, blk_a, 0), mask=is1, other=255).to(tl.int32)
        c1 += tl.sum(is1.to(tl.int32), 0)
        c2 += tl.sum(is2.to(tl.int32), 0)
        blk_a, t_a, blk_b = blk_b, t_b, blk_c

    # 2. select: Quest's bound of the L2 blocks, MB at a time; candidates merged MB at a time
    ns = tl.zeros([], tl.int32)
    total = tl.where(h == 0, c2.to(tl.int64) * quest_cost, 0)
    if SELECT:
        tl.debug_barrier()  # the list is written by every thread of the program
        jj = tl.arange(0, MB)
        best = tl.full([TOPK], NONE, tl.int64)
        floor = tl.full([], NONE, tl.int64)  # the K-th best key merged so far
        wp = tl.zeros([], tl.int32)  # candidates written
        rp = tl.zeros([], tl.int32)  # candidates merged
        kmin_h = kmin_ptr + h * s_kh
        kscale_h = kscale_ptr + h * s_kh
        blk_a = tl.load(l2_list + jj, mask=jj < c2, other=-1)
        blk_b = tl.load(l2_list + MB + jj, mask=MB + jj < c2, other=-1)
        lo_a, sc_a, bits_a = _bounds(kmin_h, kscale_h, bits_ptr, blk_a, s_kn, D, POOL_BITS, MIXED)
        for c0 in range(0, c2, 2 * MB):  # chunks a and b of a step each load while the other is scored
            lo_b, sc_b, bits_b = _bounds(kmin_h, kscale_h, bits_ptr, blk_b, s_kn, D, POOL_BITS, MIXED)
            p = c0 + 2 * MB + jj
            blk_n = tl.load(l2_list + p, mask=p < c2, other=-1)
            best, floor, wp, rp = _scan_chunk(lo_a, sc_a, bits_a, blk_a, c0, qs, qp, best, floor, wp, rp,
                                              cands, best_buf, K, TOPK, MB, MIXED, SUMMARY8)  # fmt: skip
            lo_a, sc_a, bits_a = _bounds(kmin_h, kscale_h, bits_ptr, blk_n, s_kn, D, POOL_BITS, MIXED)
            blk_a = blk_n
            p = c0 + 3 * MB + jj
            blk_n = tl.load(l2_list + p, mask=p < c2, other=-1)
            if c0 + MB < c2:
                best, floor, wp, rp = _scan_chunk(lo_b, sc_b, bits_b, blk_b, c0 + MB, qs, qp, best, floor, wp,
                                                  rp, cands, best_buf, K, TOPK, MB, MIXED,
                                                  SUMMARY8)  # fmt: skip
            blk_b = blk_n
        if wp > rp:  # the last candidates
            tl.debug_barrier()
            last = tl.load(cands + rp + jj, mask=rp + jj < wp, other=NONE)
            best = _merge_top(best, last, K, best_buf, TOPK)
        i = tl.arange(0, TOPK)
        keep = best != NONE  # best first; NONE past the K-th and past the L2 blocks
        ids = tl.load(l2_list + ((best >> 4) & 0xFFFFFFF), mask=keep, other=-1).to(tl.int32)
        tl.store(out + c1 + i, ids, mask=i < K)
        ns = tl.sum(keep.to(tl.int32), 0)
        total += tl.sum(tl.load(cost_ptr + (best & 15), mask=keep, other=0), 0)

    # 3. counts, padding and bytes
    for p0 in range(c1 + K, W, FILL):
        pad = p0 + tl.arange(0, FILL)
        tl.store(out + pad, tl.full([FILL], -1, tl.int32), mask=pad < W)
    tl.store(num_ptr + bh, c1 + ns)
    tl.store(n1_ptr + bh, c1)
    if MIXED:
        read += tl.load(cost_ptr + pending, mask=pending != 255, other=0)
        total += tl.sum(read, 0)
    else:
        total += c1.to(tl.int64) * tl.load(cost_ptr + POOL_BITS)
    tl.atomic_add(bytes_ptr, total)


def _pair(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Two int32 tensors of ``shape`` in one allocation, each 16-byte aligned (an unaligned second half
    would be another specialization of the kernel, compiled again whenever the batch changes)."""
    n = math.prod(shape)
    stride = cdiv(n, 4) * 4
    buf = torch.empty(2 * stride, dtype=torch.int32, device=device)
    return buf[:n].view(shape), buf[stride : stride + n].view(shape)


def quest_bounds(
    pool: ColdPool, count: ByteCount, summary: QuestSummary8 | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the selection's bound reads, the kernels' ``kmin_ptr`` and ``kscale_ptr`` (the pool's fp16 key
    mins and scales, or the summary's e4m3 lo and span), and Quest's bytes per L2 block (``count.quest_cost``,
    or the summary's: :class:`~kvtune.kernels.sparse_table_ref.ByteCount`)."""
    if summary is None:
        return pool.k_min, pool.k_scale, count.quest_cost
    return summary.lo, summary.span, summary.bytes_per_block


def table_outputs(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    summary: QuestSummary8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A table launch's checks (ValueError naming the rule that does not hold) and its outputs, unwritten:
    table [B, H, M + k_blocks], num_cold and num_l1 [B, H], int32."""
    B, M = blocks.shape
    H = pool.layout.num_kv_heads
    lo, span, _ = quest_bounds(pool, count, summary)
    extent = sum((n - 1) * st for n, st in zip(lo.shape, lo.stride(), strict=True)) + 1
    rules = {
        "blocks int64 [B, M] contiguous": blocks.dtype == torch.int64 and blocks.is_contiguous(),
        "tier int8 [N] contiguous": tier.dtype == torch.int8 and tier.is_contiguous(),
        "count: cost int64 [9], total int64 scalar": count.cost.dtype == count.total.dtype == torch.int64
        and count.cost.shape == (9,),
        "q is [B, Hq, D]": q.dim() == 3 and q.shape[0] == B and q.shape[1] % H == 0,
        "k_blocks >= 0": k_blocks >= 0,
        "blocks per row < 2^28 (a key holds the position)": M < 1 << 28,
        "key bounds span < 2^31 elements (32-bit offsets)": extent < 1 << 31,
        "summary: lo and span e4m3 [N, H, D] of one layout, channels contiguous": summary is None
        or (
            lo.dtype == span.dtype == E4M3
            and lo.shape == span.shape == pool.k_min.shape
            and lo.stride() == span.stride()
            and lo.stride(2) == 1
        ),
    }
    require("sparse_block_table", rules, lambda: f"blocks {tuple(blocks.shape)}")
    table = torch.empty((B, H, M + k_blocks), dtype=torch.int32, device=q.device)
    num, n1 = _pair((B, H), q.device)
    return table, num, n1


def sparse_block_table_triton(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    summary: QuestSummary8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of :func:`kvtune.kernels.sparse_table_ref.sparse_block_table_ref`, in one launch.

    The selected L2 blocks of a (sequence, KV head) are the reference's top-k, best first, equal bounds in
    the reference's order (later in the row first); bounds within float rounding of each other may be
    ordered differently. In an 8-bit pool that may hold demoted blocks each block's own bits give its levels
    and byte cost; in any other pool every block has the pool's bits (:mod:`kvtune.kernels.layout`), which
    the kernel uses without reading ``block_bits``. ``summary``: the bounds from its e4m3 lo and span (the
    same kernel built with ``SUMMARY8``).
    """
    if not tileable_head_dim(q.shape[2]):
        return sparse_block_table_ref(q, pool, blocks, tier, k_blocks, count, summary)
    table, num, n1 = table_outputs(q, pool, blocks, tier, k_blocks, count, summary)
    B, M = blocks.shape
    H = pool.layout.num_kv_heads
    dev = q.device
    W = M + k_blocks
    if B == 0:
        return table, num, n1
    if q.stride(2) != 1:
        q = q.contiguous()
    topk = next_pow2(k_blocks)
    scratch = torch.empty((B * H, 2 * M + topk if k_blocks else 0), dtype=torch.int64, device=dev)
    k_lo, k_span, quest_cost = quest_bounds(pool, count, summary)
    launch(_sparse_table_kernel, (B * H,),
        q, k_lo, k_span, pool.block_bits, blocks, tier, count.cost, table, num, n1, count.total, scratch, M,
        W, k_blocks, quest_cost, q.stride(0), q.stride(1), k_lo.stride(0), k_lo.stride(1), H=H,
        G=q.shape[1] // H, D=q.shape[2], MB=CHUNK, SPLIT=SPLIT, TOPK=topk, T1=L1, T2=L2, POOL_BITS=pool.bits,
        MIXED=pool.bits == 8 and pool.may_demote, SUMMARY8=summary is not None, SELECT=k_blocks > 0,
        FILL=FILL, num_warps=NUM_WARPS, num_stages=1,
    )  # fmt: skip
    return table, num, n1
