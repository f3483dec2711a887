"""Quest selection of L2 blocks: the launcher (rule and reference: :mod:`kvtune.kernels.quest_ref`; on CUDA
the Triton kernel of :mod:`kvtune.kernels.triton_quest`, imported on first use).
"""

from __future__ import annotations

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_ref import quest_scores_ref, quest_topk_ref

__all__ = ["quest_scores_ref", "quest_topk", "quest_topk_ref"]


def quest_topk(
    q: torch.Tensor, pool: ColdPool, l2_table: torch.Tensor, l2_count: torch.Tensor, k_blocks: int
) -> torch.Tensor:
    """See :func:`quest_topk_ref`; the Triton bound kernel + ``torch.topk`` on CUDA tensors."""
    if use_triton(q):
        from kvtune.kernels.triton_quest import quest_topk_triton

        return quest_topk_triton(q, pool, l2_table, l2_count, k_blocks)
    return quest_topk_ref(q, pool, l2_table, l2_count, k_blocks)
