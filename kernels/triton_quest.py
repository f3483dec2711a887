"""Quest selection of L2 blocks in Triton: the bound per block, then the top-k per (sequence, KV head).

``score[b, h, j] = sum_{g in group(h)} sum_d max(q_gd * min_d, q_gd * max_d)`` for the key bounds of block
``l2_table[b, j]`` (``max = min + scale * (2^bits - 1)`` for quantized blocks, with the block's own bits in an
8-bit pool). The scores of all L2 blocks are one pass over their key bounds; ``torch.topk`` over ``[B, H,
M2]`` floats (on the device, no host sync) picks the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_ref import quest_topk_ref
from kvtune.kernels.triton_common import cdiv, tileable_head_dim

QUEST_TILE = 64  # L2 blocks per program, whatever the table width (one compiled kernel)


@triton.jit(do_not_specialize=["M2"])  # one compiled kernel for every table width
def _quest_score_kernel(
    q_ptr, kmin_ptr, kscale_ptr, bits_ptr, table_ptr, count_ptr, score_ptr,
    M2, s_qb, s_qh, s_kn, s_kh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, MB: tl.constexpr, POOL_BITS: tl.constexpr,
    MIXED: tl.constexpr,
):  # fmt: skip
    """Scores of MB L2 blocks of one (sequence, KV head); -inf past l2_count (max = min + scale * levels)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    j = tl.program_id(0) * MB + tl.arange(0, MB)
    d = tl.arange(0, D)
    valid = j < tl.load(count_ptr + b)
    bid = tl.load(table_ptr + b.to(tl.int64) * M2 + j, mask=valid, other=0).to(tl.int64)
    offs = bid[:, None] * s_kn + h * s_kh + d[None, :]
    kmin = tl.load(kmin_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    second = tl.load(kscale_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    if MIXED:
        bits = tl.load(bits_ptr + bid, mask=valid, other=POOL_BITS).to(tl.int32)
        levels = ((1 << bits) - 1).to(tl.float32)[:, None]
    else:
        levels = 1.0 if POOL_BITS == 0 else (1 << POOL_BITS) - 1.0
    kmax = kmin + second * levels
    score = tl.zeros([MB], tl.float32)
    for gg in tl.static_range(G):
        qg = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * G + gg) * s_qh + d).to(tl.float32)
        score += tl.sum(tl.maximum(qg[None, :] * kmin, qg[None, :] * kmax), 1)
    tl.store(score_ptr + bh.to(tl.int64) * M2 + j, tl.where(valid, score, float("-inf")), mask=j < M2)


def quest_scores_triton(
    q: torch.Tensor, pool: ColdPool, l2_table: torch.Tensor, l2_count: torch.Tensor
) -> torch.Tensor:
    """Quest bound of every listed L2 block: float32 [B, H, M2] (-inf past ``l2_count``).

    q [B, Hq, D] (unit stride on D); l2_table int32 [B, M2] (padded -1); l2_count int32 [B].
    """
    B, Hq, D = q.shape
    H = pool.k_min.shape[1]
    l2_table = l2_table.to(torch.int32).contiguous()
    M2 = l2_table.shape[1]
    scores = torch.empty((B, H, M2), dtype=torch.float32, device=q.device)
    if M2 == 0:
        return scores
    mb = QUEST_TILE
    launch(_quest_score_kernel, (cdiv(M2, mb), B * H),
        q, pool.k_min, pool.k_scale, pool.block_bits, l2_table, l2_count.to(torch.int32), scores,
        M2, q.stride(0), q.stride(1), pool.k_min.stride(0), pool.k_min.stride(1),
        H=H, G=Hq // H, D=D, MB=mb, POOL_BITS=pool.bits, MIXED=pool.bits == 8,
    )  # fmt: skip
    return scores


def topk_blocks(scores: torch.Tensor, l2_table: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """Block ids of the k_blocks best scores per (sequence, KV head): int32 [B, H, k_blocks], -1 if none."""
    B, H, M2 = scores.shape
    out = torch.full((B, H, k_blocks), -1, dtype=torch.int32, device=scores.device)
    k = min(k_blocks, M2)
    if k == 0:
        return out
    vals, idx = torch.topk(scores, k, dim=-1)
    ids = torch.gather(l2_table.to(torch.int32)[:, None, :].expand(B, H, M2), 2, idx)
    out[:, :, :k] = torch.where(torch.isfinite(vals), ids, torch.full_like(ids, -1))
    return out


def quest_topk_triton(
    q: torch.Tensor, pool: ColdPool, l2_table: torch.Tensor, l2_count: torch.Tensor, k_blocks: int
) -> torch.Tensor:
    """Same contract as ``quest_topk_ref``: int32 [B, H, k_blocks] block ids, -1 where fewer than k exist."""
    if not tileable_head_dim(q.shape[2]):
        return quest_topk_ref(q, pool, l2_table, l2_count, k_blocks)
    return topk_blocks(quest_scores_triton(q, pool, l2_table, l2_count), l2_table, k_blocks)
