"""Quest's key bounds in float8: the sparse tier's selection reading half the bytes, still an upper bound.

The selection (:mod:`kvtune.kernels.sparse_table_ref`) bounds ``q·k`` over an L2 block for a KV head by
``Σ_d lo_d·S_d + range_d·P_d``, with the block's key minimum ``lo`` and range ``range = k_scale · levels`` per
channel, ``S = Σ_g q_g`` and ``P = Σ_g max(q_g, 0)`` over the head's query group. The pool holds ``lo`` and
the scale in fp16: 4 bytes a channel, 29.4 MB a layer at 16 sequences × 32K tokens, whose reading alone
takes 11.4 µs of the selection's 17-19 µs on an H200. :class:`QuestSummary8` holds the same bounds in float8
e4m3, 2 bytes a channel (14.7 MB there):

* ``lo``: the key minimum rounded down (towards -inf) to e4m3;
* ``span``: the key maximum minus that rounded minimum, levels folded in, rounded up (towards +inf).

So ``lo ≤ min`` and ``lo + span ≥ max`` channel by channel: the bound stays an upper bound of every ``q·k``
in the block, looser by the rounding, and a kernel reads ``span`` as the range (no levels to apply). On real
keys (SmolLM2-135M, ``lab/scripts/quest_fp8.py``) the e4m3 bounds keep 95-97.5 % of the blocks the fp16
bounds select. On an H200 (``benchmarks/decode_attention.py --quest``: CUDA graph replays of the selection
with its byte counter's set-up, random pools, where the summary keeps 92-94 % of the fp16 selection) the
single kernel took 20.6 µs from the summary against 22.5 µs from fp16 at 16 × 32K, and the split one 22.1
against 26.6 µs at 4 × 128K: half the bytes took 8-17 % off, so the bytes are not the whole of the
selection's time.

A cache whose config has the sparse tier keeps a summary on a GPU of sm_89 or newer
(:func:`kvtune.cache_impl.layout.keeps_summary`: ``KVTUNE_QUEST_SUMMARY`` auto, the default; 1 on every
device, 0 never): the layout allocates it beside the fp16 bounds and counts its bytes, the seal and both
demotion kernels write it (:func:`summary_codes`, rounded by integer operations on the float32 bits:
:func:`outward_codes`), and the selection reads it on sm_89 and newer.

The kernels load e4m3 tiles, which Triton compiles for sm_89 (Ada) and newer only: on an A100 or an A10G
:func:`~kvtune.kernels.sparse_table.sparse_block_table` refuses a summary (ValueError) and the selection
reads the fp16 bounds. e4m3 has 4 significant bits and no infinities: its largest finite value is 448, past
which no e4m3 value bounds a key. Keys are O(10), so :func:`summary8` refuses a pool whose key minimum or span
lies past ±448 (ValueError) instead of scaling the bounds; the cache's writes cannot refuse (no host
synchronization) and saturate at ±448, where the bound no longer holds for that channel (the largest |key|
of SmolLM2-135M on real text was 25.7).
"""

from __future__ import annotations

import torch

from kvtune.kernels.layout import E4M3, E4M3_MAX, ColdPool, QuestSummary8, block_levels
from kvtune.kernels.quest_ref import topk_of_scores


def outward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` rounded to the 1-byte float ``dtype`` towards +inf (``up``) or -inf, back in float32 (exact).

    The cast rounds to nearest: where that went the wrong way the value steps one code further, away from
    zero where the sign agrees with the direction, towards it otherwise (the codes of one sign are ordered
    by magnitude). Values past the format's largest finite one are the caller's to refuse."""
    y = x.to(dtype).float()
    wrong = y < x if up else y > x
    if not wrong.any():
        return y
    bits = x.to(dtype).view(torch.uint8).to(torch.int16)
    away = (x > 0) if up else (x < 0)
    step = torch.where(away, 1, -1).to(torch.int16)
    nudged = (bits + step).to(torch.uint8).view(dtype).float()
    return torch.where(wrong, nudged, y)


def outward_codes(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded to e4m3 towards +inf (``up``) or -inf, as uint8 codes, by integer operations
    on the float32 bits (the Triton kernels' ``_outward_e4m3`` does the same; a cast would need sm_89, and
    Triton 3.6's interpreter rounds it wrongly where the rounding carries into the exponent): the truncated
    code from the exponent and the top 3 mantissa bits, or from ``|x| · 2^9`` below e4m3's normals, then one
    code further where the value was inexact and the direction points away from zero. Past ±448 (no finite
    e4m3 value bounds it) the code saturates at ±448. Equals :func:`outward` wherever both are defined."""
    a = x.float().abs()
    b = a.view(torch.int32)
    e = (b >> 23) - 127
    normal = e >= -6  # e4m3's smallest normal is 2^-6
    s = a * 512.0  # below it, |x| in units of the smallest subnormal (2^-9), exact
    sub = s.to(torch.int32)
    code = torch.where(normal, ((e + 7) << 3) | ((b >> 20) & 7), sub)
    inexact = torch.where(normal, (b & 0xFFFFF) != 0, s != sub.float())
    away = (x > 0) if up else (x < 0)
    code = torch.clamp(code + (inexact & away).to(torch.int32), max=0x7E)
    code = code | torch.where(x < 0, 0x80, 0)
    return code.to(torch.uint8)


def summary_codes(
    k_min: torch.Tensor, k_scale: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 codes (uint8) of ``lo`` and ``span`` from fp16 key minima and scales of the same shape and
    ``levels`` broadcast to it, in float32 as the seal kernels compute them: ``lo`` = the minimum rounded
    down; ``span`` = ``(min − lo) + scale · levels`` (each term exact in float32, the sum rounded once and
    moved one float32 step up where it fell below the exact sum), then rounded up. So ``lo + span`` bounds
    ``min + scale · levels``, and equals it where that is representable."""
    lo16 = k_min.float()
    lo = outward_codes(lo16, up=False)
    a, b = lo16 - lo.view(E4M3).float(), k_scale.float() * levels
    d = a + b
    below = (a - (d - (d - a))) + (b - (d - a)) > 0  # the exact sum above its rounding (TwoSum's error)
    d = torch.where(below, (d.view(torch.int32) + 1).view(torch.float32), d)
    return lo, outward_codes(d, up=True)


def write_summary(pool: ColdPool, block_ids: torch.Tensor) -> None:
    """Refresh the pool's summary (where it keeps one) for ``block_ids`` from their fp16 bounds: the
    reference of what the seal and demotion kernels write. No host synchronization."""
    if pool.summary is None or block_ids.numel() == 0:
        return
    levels = block_levels(pool, block_ids)[..., None, None]
    lo, span = summary_codes(pool.k_min[block_ids], pool.k_scale[block_ids], levels)
    pool.summary.lo.view(torch.uint8)[block_ids] = lo
    pool.summary.span.view(torch.uint8)[block_ids] = span


def summary8(pool: ColdPool) -> QuestSummary8:
    """The e4m3 summary of the pool's key bounds (what the cache's seal writes, :func:`summary_codes`), new
    tensors. ValueError where a key minimum or span lies past ±448 (no e4m3 value bounds it)."""
    levels = block_levels(pool, torch.arange(pool.num_blocks, device=pool.k_min.device))[:, None, None]
    k_min = pool.k_min.float()
    span = k_min + pool.k_scale.float() * levels - outward(k_min, E4M3, up=False)
    if not bool((k_min.abs() <= E4M3_MAX).all() and (span <= E4M3_MAX).all()):
        raise ValueError(
            "summary8: `|key min| <= 448 and key max - key min <= 448` (float8 e4m3's largest finite value) "
            f"must hold, but got |key min| up to {float(k_min.abs().max()):g} and spans up to "
            f"{float(span.max()):g}"
        )
    lo, sp = summary_codes(pool.k_min, pool.k_scale, levels)
    return QuestSummary8(lo.view(E4M3), sp.view(E4M3))


def summary_scores_ref(
    q: torch.Tensor, summary: QuestSummary8, l2_table: torch.Tensor, l2_count: torch.Tensor
) -> torch.Tensor:
    """Bounds [B, H, M2] float32 of the listed L2 blocks from the summary, ``Σ_d lo_d·S_d + span_d·P_d``
    (``-inf`` on padding); the arguments as :func:`kvtune.kernels.quest_ref.quest_scores_ref`'s."""
    bsz, hq, d = q.shape
    h = summary.lo.shape[1]
    qg = q.float().view(bsz, h, hq // h, d)
    s, p = qg.sum(2)[:, None], qg.clamp(min=0).sum(2)[:, None]  # [B, 1, H, D]
    ids = l2_table.long().clamp(min=0)
    score = (summary.lo[ids].float() * s + summary.span[ids].float() * p).sum(-1).transpose(1, 2)
    valid = torch.arange(l2_table.shape[1], device=q.device)[None, :] < l2_count[:, None]
    return score.masked_fill(~valid[:, None, :], float("-inf"))


def summary_topk_ref(
    q: torch.Tensor, summary: QuestSummary8, l2_table: torch.Tensor, l2_count: torch.Tensor, k_blocks: int
) -> torch.Tensor:
    """:func:`kvtune.kernels.quest_ref.quest_topk_ref`'s contract and tie rule (of equal bounds the block
    later in ``l2_table`` first) with the summary's bounds: [B, H, k_blocks] int32 ids, best first, -1
    padded."""
    return topk_of_scores(summary_scores_ref(q, summary, l2_table, l2_count), l2_table, k_blocks)
