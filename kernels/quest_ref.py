"""Quest selection of L2 blocks: per sequence and KV head, the blocks with the highest upper bound of q·k.

The bound of a block for one query head is ``Σ_d max(q_d · min_d, q_d · max_d)`` over the block's
per-channel key min and max (:func:`kvtune.kernels.layout.key_bounds`); a KV head sums it over its group of
query heads.

This module is the PyTorch reference (the executable spec and the fallback of the Triton launcher
:mod:`kvtune.kernels.triton_quest`); :mod:`kvtune.kernels.quest` dispatches between them.
"""

from __future__ import annotations

import torch

from kvtune.kernels.layout import ColdPool, key_bounds


def quest_scores_ref(
    q: torch.Tensor, pool: ColdPool, l2_table: torch.Tensor, l2_count: torch.Tensor
) -> torch.Tensor:
    """Bounds [B, H, M2] float32 of the listed L2 blocks (``-inf`` on padding)."""
    bsz, hq, d = q.shape
    h = pool.layout.num_kv_heads
    lo, hi = key_bounds(pool, l2_table.long().clamp(min=0))  # [B, M2, H, D]
    qg = q.float().view(bsz, h, hq // h, 1, d)
    lo, hi = lo.permute(0, 2, 1, 3)[:, :, None], hi.permute(0, 2, 1, 3)[:, :, None]  # [B, H, 1, M2, D]
    score = torch.maximum(qg * lo, qg * hi).sum(dim=(2, 4))
    m2 = l2_table.shape[1]
    valid = torch.arange(m2, device=q.device)[None, :] < l2_count[:, None]
    return score.masked_fill(~valid[:, None, :], float("-inf"))


def quest_topk_ref(
    q: torch.Tensor, pool: ColdPool, l2_table: torch.Tensor, l2_count: torch.Tensor, k_blocks: int
) -> torch.Tensor:
    """Top ``k_blocks`` L2 blocks per sequence and KV head.

    q: [B, Hq, D]; l2_table: [B, M2] int32 block ids (first ``l2_count[b]`` valid, then -1); l2_count: [B]
    int32.
    Returns [B, H, k_blocks] int32 block ids in decreasing bound order, -1 where fewer than ``k_blocks``
    exist. Ties: of blocks with equal bounds the one later in ``l2_table`` comes first (and is kept where
    the ``k_blocks``-th place falls among them), as in the Triton kernels' keys.
    """
    return topk_of_scores(quest_scores_ref(q, pool, l2_table, l2_count), l2_table, k_blocks)


def topk_of_scores(scores: torch.Tensor, l2_table: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """The block ids of the ``k_blocks`` best of ``scores`` [B, H, M2] (``-inf``: padding) per sequence and
    KV head, with :func:`quest_topk_ref`'s order, ties and padding."""
    bsz, h, m2 = scores.shape
    out = torch.full((bsz, h, k_blocks), -1, dtype=torch.int32, device=scores.device)
    kk = min(k_blocks, m2)
    if kk == 0:
        return out
    # a stable descending sort of the reversed list: equal bounds keep the reversed order, later first
    values, rev = scores.flip(-1).sort(dim=-1, descending=True, stable=True)
    values, idx = values[..., :kk], m2 - 1 - rev[..., :kk]
    ids = torch.gather(l2_table[:, None, :].expand(bsz, h, -1), 2, idx)
    out[..., :kk] = torch.where(torch.isfinite(values), ids, -1).to(torch.int32)
    return out
