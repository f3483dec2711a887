"""The sparse tier's table with Quest's selection split over several programs per row (``"split"`` of
:func:`kvtune.kernels.sparse_table_choice.select_kernel`): two launches, no host synchronisation, sizes that
follow the batch and the row width only (capturable in a CUDA graph), one compiled kernel for every size.

1. ``_span_kernel``, programs ``(row, s)`` for ``row = (sequence b, KV head h)``:

   * ``s = 0`` splits the row as the single-program kernel does (:mod:`kvtune.kernels.triton_sparse_table`):
     the L1 blocks in order to the table, the counts (``num = n1 + min(k, L2 blocks)``), the -1 padding
     after the selected places, and the bytes of the L1 blocks and of Quest (by ``h == 0``);
   * ``s = 1 .. splits`` scores the L2 blocks among the row's positions ``[(s - 1) * span, s * span)``, 64
     at a time, with the single kernel's bound and keys (``_scan_chunk``), and writes the span's
     ``k`` largest keys (``-2^63`` after them) to ``keys[row, s - 1]``.

   The key of a block holds its position in the row, not in the row's list of L2 blocks: both order the
   L2 blocks alike, so keys compare as in the single kernel, and the merge reads the id from the row.
2. ``_merge_spans_kernel``, one program per row: ``tl.topk`` sorts the ``k`` largest of the row's
   ``splits x TOPK`` keys descending (keys are distinct, so a key's place is its rank); each goes to place
   ``n1 + rank`` of the table with its block's id; their bytes are added to the count.

Over an 8-bit pool that may hold demoted blocks the merge can also write the table split by bits (``parts``:
:mod:`kvtune.kernels.bits_partition_ref`), which the mixed Gluon attention reads: the row's L1 blocks (their
bits loaded), then the selected ones (their bits are in their keys), and the padding. The attention then
launches no partition of its own: one launch and its wait fewer a step. (The span kernel's program ``(row,
0)``, which loads the L1 blocks' bits already, placed them first; its vectors of 512 entries took the span
kernel from 128 to 162 registers a thread at two warps, 6 programs a multiprocessor where the plan counts 8,
and the spans at 16 x 32K took 18.5 µs against 12.4 on an H100; the merge of spans, at 32-44 registers, has
the room.)

Ties: keys order by bound, then by position (later first), in both kernels, so the tables are the same.
The bounds must be the same floats: Triton lays a ``[chunk, D]`` tile's rows over warps and its channels
over lanes, so a block's sum over channels runs in the same order at 1 warp and 16 blocks a step as at 8
and 64 (on an H100 every build of run 52a, 1 to 8 warps, gave the single kernel's tables). From a
:class:`~kvtune.kernels.quest_summary.QuestSummary8` (``SUMMARY8``) the spans score its float8 bounds, as
the single kernel does.

Why: the single kernel scores a row's L2 blocks one chunk after another in one program per row, 128
programs at 16 sequences x 8 KV heads (about one per multiprocessor, each waiting on its chunks in turn),
32 at 4 x 128K. Here a row's chunks are spread over ``splits`` programs (planned from the rows and the
multiprocessors, :func:`~kvtune.kernels.sparse_table_choice.split_plan`) of one warp each from the fp16
bounds; from the e4m3 summary one where a row has at most 8 spans, else two (``SelectOptions.warps``, 16
blocks a step): a warp that never waits on another, about a quarter fewer instructions a block than at 8
warps, 185 registers and no spills at one. The merge ranks the spans' ``splits x TOPK`` keys rounded up to
a power of two, 256 at least (:func:`~kvtune.kernels.sparse_table_choice.merge_width`: 1,024 at most from
fp16, 32 spans at top 32; 512 from the summary; those of absent spans masked), a build per width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.arch import arch_of, num_sms
from kvtune.kernels.backend import on_gpu
from kvtune.kernels.bits_partition_ref import BitsPartition, partition_width
from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_summary import QuestSummary8
from kvtune.kernels.sparse_table_choice import (
    DEFAULT_SELECT,
    SelectOptions,
    merge_width,
    select_kernel,
    split_plan,
)
from kvtune.kernels.sparse_table_ref import L1, L2, ByteCount
from kvtune.kernels.triton_common import next_pow2, replaced
from kvtune.kernels.triton_sparse_table import (
    FILL,
    NONE,
    SPLIT,
    _bounds,
    _merge_top,
    _query_sums,
    _scan_chunk,
    quest_bounds,
    sparse_block_table_triton,
    table_outputs,
)

# The merge's top-k network over 256 keys compiles for sm_90 to ~470 instructions and 11 barriers per warp at
# 8 warps (1,590 and 3 at one warp); ranking by counting the keys above each one in [256, 64] comparisons took
# ~2,860 and 33. On an H200 the split selection at 4 x 128K took 21.6 µs against 27.6 (4 or 8 warps alike).
# Over 1,024 keys the network costs ~2.3 µs more a launch than over 256 (H100, 8 spans at 16 x 32K, 52a).
MERGE_WARPS = 8
PART_PAD = 512  # -1 entries per store of the split by bits' padding
# L1 entries per step of the merge's split by bits: one a thread at 8 warps (at 512, with the fp16 bounds'
# 1,024 keys, the merge spilled 8 bytes; sm_90)
PART_STEP = 256


@triton.jit
def _part_store(part_ptr, pos_ptr, bh, W, W2, at, blk, valid, bits, n8, n4):
    """Entries ``blk`` (where ``valid``, in table order, at table places ``at``) of row bh to their half of
    the split by bits (``bits_partition_ref``: 8-bit blocks from 0, 4-bit ones from ``W2``, ``n8`` and ``n4``
    placed before them) and their places there to ``positions``. Returns the halves' new counts."""
    four = valid & (bits == 4)
    eight = valid & (bits != 4)
    f = four.to(tl.int32)
    e = eight.to(tl.int32)
    dest = tl.where(four, W2 + n4 + tl.cumsum(f, 0) - f, n8 + tl.cumsum(e, 0) - e)
    tl.store(part_ptr + bh.to(tl.int64) * 2 * W2 + dest, blk.to(tl.int32), mask=valid)
    tl.store(pos_ptr + bh.to(tl.int64) * W + at, dest, mask=valid)
    return n8 + tl.sum(e, 0), n4 + tl.sum(f, 0)


@triton.jit
def _l1_row(blocks_ptr, tier_ptr, bits_ptr, cost_ptr, table_ptr, num_ptr, n1_ptr, bytes_ptr, bh, M, W, K,
            quest_cost, H: tl.constexpr, SPLIT: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
            POOL_BITS: tl.constexpr, MIXED: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """Row bh's L1 blocks in order to its table, -1 after the selected places, the counts, and the bytes
    of the L1 blocks and of Quest (Quest's by h == 0), as the single-program kernel's steps 1 and 3."""
    b = bh // H
    row = b.to(tl.int64) * M
    out = table_ptr + bh.to(tl.int64) * W
    c1 = tl.zeros([], tl.int32)
    c2 = tl.zeros([], tl.int32)
    read = tl.zeros([SPLIT], tl.int64)
    js = tl.arange(0, SPLIT)
    blk = tl.load(blocks_ptr + row + js, mask=js < M, other=-1)
    for j0 in range(0, M, SPLIT):  # the next step's ids load while a step's tiers (and bits) do
        blk_n = tl.load(blocks_ptr + row + j0 + SPLIT + js, mask=j0 + SPLIT + js < M, other=-1)
        at = tl.where(blk >= 0, blk, 0)
        t = tl.load(tier_ptr + at, mask=blk >= 0, other=0)
        if MIXED:  # every listed block's bits, loaded beside its tier
            bits = tl.load(bits_ptr + at, mask=blk >= 0, other=0).to(tl.int32)
        is1 = (blk >= 0) & (t == T1)
        tl.store(out + c1 + tl.cumsum(is1.to(tl.int32), 0) - 1, blk.to(tl.int32), mask=is1)
        if MIXED:
            read += tl.load(cost_ptr + bits, mask=is1, other=0)
        c1 += tl.sum(is1.to(tl.int32), 0)
        c2 += tl.sum(((blk >= 0) & (t == T2)).to(tl.int32), 0)
        blk = blk_n
    ns = tl.minimum(c2, K)
    for p0 in range(c1 + ns, W, FILL):
        pad = p0 + tl.arange(0, FILL)
        tl.store(out + pad, tl.full([FILL], -1, tl.int32), mask=pad < W)
    tl.store(num_ptr + bh, c1 + ns)
    tl.store(n1_ptr + bh, c1)
    total = tl.where(bh % H == 0, c2.to(tl.int64) * quest_cost, 0)
    if MIXED:
        total += tl.sum(read, 0)
    else:
        total += c1.to(tl.int64) * tl.load(cost_ptr + POOL_BITS)
    tl.atomic_add(bytes_ptr, total)


@triton.jit
def _score_span(q_ptr, kmin_ptr, kscale_ptr, bits_ptr, blocks_ptr, tier_ptr, keys_ptr, scratch_ptr, bh, s, M,
                K, SPAN, P, s_qb, s_qh, s_kn, s_kh, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                MB: tl.constexpr, TOPK: tl.constexpr, T2: tl.constexpr, POOL_BITS: tl.constexpr,
                MIXED: tl.constexpr, SUMMARY8: tl.constexpr):  # fmt: skip
    """The K largest keys of the L2 blocks at row positions [s * SPAN, (s + 1) * SPAN) of row bh (descending,
    NONE after) to keys[bh, s]; candidates and merges as in the single kernel's step 2 (SUMMARY8: kmin_ptr
    and kscale_ptr are a summary's lo and span)."""
    b = bh // H
    h = bh % H
    row = blocks_ptr + b.to(tl.int64) * M
    qs, qp = _query_sums(q_ptr, b, h, s_qb, s_qh, G, D, POOL_BITS, MIXED, SUMMARY8)
    slot = bh.to(tl.int64) * P + s
    cands = scratch_ptr + slot * (SPAN + TOPK)  # keys above the K-th best when they were scored
    best_buf = cands + SPAN
    kmin_h = kmin_ptr + h * s_kh
    kscale_h = kscale_ptr + h * s_kh
    jj = tl.arange(0, MB)
    best = tl.full([TOPK], NONE, tl.int64)
    floor = tl.full([], NONE, tl.int64)
    wp = tl.zeros([], tl.int32)
    rp = tl.zeros([], tl.int32)
    start = s * SPAN
    end = tl.minimum(start + SPAN, M)
    blk = tl.load(row + start + jj, mask=start + jj < end, other=-1)
    t = tl.load(tier_ptr + tl.where(blk >= 0, blk, 0), mask=blk >= 0, other=0)
    for c0 in range(start, end, MB):
        blk = tl.where((blk >= 0) & (t == T2), blk, -1)  # the L2 blocks of the chunk
        lo, sc, bits = _bounds(kmin_h, kscale_h, bits_ptr, blk, s_kn, D, POOL_BITS, MIXED)
        p = c0 + MB + jj  # the next chunk's ids and tiers load while this one is scored
        blk_n = tl.load(row + p, mask=p < end, other=-1)
        t = tl.load(tier_ptr + tl.where(blk_n >= 0, blk_n, 0), mask=blk_n >= 0, other=0)
        best, floor, wp, rp = _scan_chunk(lo, sc, bits, blk, c0, qs, qp, best, floor, wp, rp, cands, best_buf,
                                          K, TOPK, MB, MIXED, SUMMARY8)  # fmt: skip
        blk = blk_n
    if wp > rp:  # the last candidates
        tl.debug_barrier()
        last = tl.load(cands + rp + jj, mask=rp + jj < wp, other=NONE)
        best = _merge_top(best, last, K, best_buf, TOPK)
    tl.store(keys_ptr + slot * TOPK + tl.arange(0, TOPK), best)


@triton.jit(do_not_specialize=["M", "W", "K", "SPAN", "P"])  # sizes follow the batch and lengths
def _span_kernel(
    q_ptr, kmin_ptr, kscale_ptr, bits_ptr, blocks_ptr, tier_ptr, cost_ptr, table_ptr, num_ptr, n1_ptr,
    bytes_ptr, keys_ptr, scratch_ptr, M, W, K, SPAN, P, quest_cost, s_qb, s_qh, s_kn, s_kh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, MB: tl.constexpr, SPLIT: tl.constexpr,
    TOPK: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, POOL_BITS: tl.constexpr, MIXED: tl.constexpr,
    SUMMARY8: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Program (row, 0): the row's L1 blocks, counts, padding and bytes; (row, s > 0): span s - 1's top-K."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    if s == 0:
        _l1_row(blocks_ptr, tier_ptr, bits_ptr, cost_ptr, table_ptr, num_ptr, n1_ptr, bytes_ptr, bh, M, W, K,
                quest_cost, H, SPLIT, T1, T2, POOL_BITS, MIXED, FILL)  # fmt: skip
    else:
        _score_span(q_ptr, kmin_ptr, kscale_ptr, bits_ptr, blocks_ptr, tier_ptr, keys_ptr, scratch_ptr, bh,
                    s - 1, M, K, SPAN, P, s_qb, s_qh, s_kn, s_kh, H, G, D, MB, TOPK, T2, POOL_BITS, MIXED,
                    SUMMARY8)  # fmt: skip


@triton.jit(do_not_specialize=["M", "W", "K", "P", "W2", "R"])
def _merge_spans_kernel(keys_ptr, blocks_ptr, cost_ptr, table_ptr, n1_ptr, bytes_ptr, bits_ptr, part_ptr,
                        pos_ptr, pcount_ptr, M, W, K, P, W2, R, H: tl.constexpr, TOPK: tl.constexpr,
                        NK: tl.constexpr, PART: tl.constexpr, PB: tl.constexpr, ZB: tl.constexpr,
                        AHEAD: tl.constexpr = False, TRIGGER: tl.constexpr = False):  # fmt: skip
    """Row bh's top-K of its spans' keys to table places n1 + rank, with their bytes (``cost[bits]``, the
    bits in the key). ``tl.topk`` (a bitonic network) sorts the TOPK largest of the NK keys descending, so a
    key's rank is its place (keys are distinct). PART: the row split by bits too, its L1 blocks (listed by
    ``_l1_row``, ``PB`` at a time, their bits loaded) then the selected ones (their bits in their keys), the
    halves' counts, -1 after each half and after the row's count in ``positions``. AHEAD: the first ``PB``
    L1 ids and their bits are loaded before the network (``SelectOptions.merge_l1_ahead``). TRIGGER (sm_90):
    a launch that follows as a programmatic dependent may start now (the mixed attention's builds with
    ``gluon_after_select``, which wait for this launch's end before reading its outputs)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    n = P * TOPK
    e = tl.arange(0, NK)
    key = tl.load(keys_ptr + bh.to(tl.int64) * n + e, mask=e < n, other=NONE)
    c1 = tl.load(n1_ptr + bh)
    out = table_ptr + bh.to(tl.int64) * W
    jp = tl.arange(0, PB)
    if PART and AHEAD:  # converted only where used, so that no wait for the bits comes before the network
        blk0 = tl.load(out + jp, mask=jp < c1, other=0)
        bits0 = tl.load(bits_ptr + blk0, mask=jp < c1, other=8)
    if TOPK == 1:  # (tl.topk reduces to a scalar at k 1)
        top = tl.full([1], 0, tl.int64) + tl.max(key, 0)
    else:
        top = tl.topk(key, TOPK)
    i = tl.arange(0, TOPK)
    sel = (top != NONE) & (i < K)
    ids = tl.load(blocks_ptr + (bh // H).to(tl.int64) * M + ((top >> 4) & 0xFFFFFFF), mask=sel, other=-1)
    tl.store(out + c1 + i, ids.to(tl.int32), mask=sel)
    tl.atomic_add(bytes_ptr, tl.sum(tl.load(cost_ptr + (top & 15), mask=sel, other=0), 0))
    if PART:  # the L1 blocks (in the table since the spans' launch), then the selected ones after them
        n8 = c1 * 0
        n4 = c1 * 0
        if AHEAD:
            n8, n4 = _part_store(part_ptr, pos_ptr, bh, W, W2, jp, blk0, jp < c1, bits0.to(tl.int32), n8, n4)
        for j0 in range(PB if AHEAD else 0, c1, PB):
            j = j0 + jp
            blk = tl.load(out + j, mask=j < c1, other=0)
            bits = tl.load(bits_ptr + blk, mask=j < c1, other=8).to(tl.int32)
            n8, n4 = _part_store(part_ptr, pos_ptr, bh, W, W2, j, blk, j < c1, bits, n8, n4)
        n8, n4 = _part_store(part_ptr, pos_ptr, bh, W, W2, c1 + i, ids, sel, (top & 15).to(tl.int32), n8, n4)
        tl.store(pcount_ptr + bh, n8)
        tl.store(pcount_ptr + R + bh, n4)
        half = part_ptr + bh.to(tl.int64) * 2 * W2
        pad = tl.full([ZB], -1, tl.int32)
        for p0 in range(n8, W2, ZB):
            p = p0 + tl.arange(0, ZB)
            tl.store(half + p, pad, mask=p < W2)
        for p0 in range(n4, W2, ZB):
            p = p0 + tl.arange(0, ZB)
            tl.store(half + W2 + p, pad, mask=p < W2)
        for p0 in range(n8 + n4, W, ZB):
            p = p0 + tl.arange(0, ZB)
            tl.store(pos_ptr + bh.to(tl.int64) * W + p, pad, mask=p < W)


def sparse_block_table_split_triton(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    options: SelectOptions | None = None,
    summary: QuestSummary8 | None = None,
    parts: BitsPartition | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~kvtune.kernels.triton_sparse_table.sparse_block_table_triton`'s contract and results (the same
    table, counts and bytes) in two launches, planned with ``options`` (None: the defaults;
    ``options.split`` is not read); ``summary``: the bounds from its e4m3 lo and span. With nothing to
    select (``k_blocks`` 0) or a head dim the kernels do not tile, the single-program launcher's path.

    ``parts`` (an :func:`~kvtune.kernels.bits_partition_ref.empty_partition` for the table's shape): over an
    8-bit pool that may hold demoted blocks, the merge also writes the table split by bits that the mixed
    Gluon attention reads (``partition_by_bits_ref``'s result), so that the attention launches no
    partition of its own; written only there and on this path (the single-program one leaves it as it is:
    :func:`~kvtune.kernels.sparse_table.sparse_block_table_parts` knows which runs)."""
    opts = DEFAULT_SELECT if options is None else options
    fp8 = summary is not None
    if select_kernel(k_blocks, q.shape[2], replaced(opts, split=True), summary=fp8) != "split":
        return sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summary)
    table, num, n1 = table_outputs(q, pool, blocks, tier, k_blocks, count, summary)
    B, M = blocks.shape
    if B == 0:
        return table, num, n1
    if q.stride(2) != 1:
        q = q.contiguous()
    H = pool.layout.num_kv_heads
    W, dev = M + k_blocks, q.device
    plan = split_plan(B * H, M, k_blocks, num_sms(dev), opts, fp8)
    topk = next_pow2(k_blocks)
    keys = torch.empty((B * H, plan.splits, topk), dtype=torch.int64, device=dev)
    scratch = torch.empty((B * H, plan.splits, plan.span + topk), dtype=torch.int64, device=dev)
    cap = {"maxnreg": opts.maxnreg} if opts.maxnreg else {}
    k_lo, k_span, quest_cost = quest_bounds(pool, count, summary)
    mixed = pool.bits == 8 and pool.may_demote
    part = mixed and parts is not None
    if parts is not None and part:
        w2 = partition_width(W)
        if parts.table.shape != (B, H, 2 * w2) or parts.positions.shape != (B, H, W):
            raise ValueError(
                f"parts: a split of [{B}, {H}, {W}] tables must be empty_partition({B}, {H}, {W})'s shapes"
            )
        split_out = (parts.table, parts.positions, parts.counts, w2, parts.counts.stride(0))
    else:  # not written: any int32 tensors
        split_out = (table, table, num, 1, 1)
    launch(_span_kernel, (B * H, plan.splits + 1),
        q, k_lo, k_span, pool.block_bits, blocks, tier, count.cost, table, num, n1, count.total, keys,
        scratch, M, W, k_blocks, plan.span, plan.splits, quest_cost, q.stride(0), q.stride(1), k_lo.stride(0),
        k_lo.stride(1), H=H, G=q.shape[1] // H, D=q.shape[2], MB=opts.chunk, SPLIT=SPLIT, TOPK=topk, T1=L1,
        T2=L2, POOL_BITS=pool.bits, MIXED=mixed, SUMMARY8=fp8, FILL=FILL,
        num_warps=opts.span_warps(fp8, plan.splits), num_stages=1, **cap,
    )  # fmt: skip
    launch(_merge_spans_kernel, (B * H,),
        keys, blocks, count.cost, table, n1, count.total, pool.block_bits, *split_out[:3], M, W, k_blocks,
        plan.splits, *split_out[3:], H=H, TOPK=topk, NK=merge_width(k_blocks, plan.splits), PART=part,
        PB=PART_STEP, ZB=PART_PAD, AHEAD=part and opts.merge_l1_ahead,
        TRIGGER=part and on_gpu(q) and arch_of(dev).pdl, num_warps=MERGE_WARPS,
    )  # fmt: skip
    return table, num, n1
