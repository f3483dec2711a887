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
selection's time. The cache does not keep a summary yet (its seal would write one beside the fp16 bounds).

The kernels load e4m3 tiles, which Triton compiles for sm_89 (Ada) and newer only: on an A100 or an A10G
:func:`~kvtune.kernels.sparse_table.sparse_block_table` refuses a summary (ValueError) and the selection
reads the fp16 bounds. e4m3 has 4 significant bits and no infinities: its largest finite value is 448, past
which no e4m3 value bounds a key. Keys are O(10), so :func:`summary8` refuses a pool whose key minimum or span
lies past ±448 (ValueError) instead of scaling the bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtune.kernels.layout import ColdPool, block_levels
from kvtune.kernels.quest_ref import topk_of_scores

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448: the largest finite e4m3 value


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


@dataclass(frozen=True)
class QuestSummary8:
    """One layer's Quest bounds in float8 e4m3 (see the module docstring): ``lo`` and ``span``
    [num_blocks, H, D], the pool's block ids and KV heads."""

    lo: torch.Tensor
    span: torch.Tensor

    @property
    def bytes_per_block(self) -> int:
        """Bytes Quest reads of one L2 block, every KV head: ``lo`` and ``span``, a byte each per channel."""
        return 2 * math.prod(self.lo.shape[1:])


def summary8(pool: ColdPool) -> QuestSummary8:
    """The e4m3 summary of the pool's key bounds. The maximum ``min + scale · levels`` and the span are
    computed in float64, where both are exact: ``lo + span`` bounds the true maximum, not only its float32
    rounding. ValueError where a key minimum or span lies past ±448 (no e4m3 value bounds it)."""
    k_min = pool.k_min.double()
    levels = block_levels(pool, torch.arange(pool.num_blocks, device=pool.k_min.device)).double()
    hi = k_min + pool.k_scale.double() * levels[:, None, None]
    lo = outward(k_min, E4M3, up=False)
    span = hi - lo.double()
    if not bool((k_min.abs() <= E4M3_MAX).all() and (span <= E4M3_MAX).all()):
        raise ValueError(
            "summary8: `|key min| <= 448 and key max - key min <= 448` (float8 e4m3's largest finite value) "
            f"must hold, but got |key min| up to {float(k_min.abs().max()):g} and spans up to "
            f"{float(span.max()):g}"
        )
    return QuestSummary8(lo.to(E4M3), outward(span, E4M3, up=True).to(E4M3))


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
