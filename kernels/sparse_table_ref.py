"""A layer's attention table when some of its blocks are in L2: its L1 blocks, then the Quest-selected L2.

Per sequence ``b`` with sealed blocks ``blocks[b]`` (oldest first, -1 padded) and the layer's tiers:

1. split: the L1 and the L2 blocks of the row, each in order, -1 padded (``l1``, ``n1``, ``l2``, ``n2``);
2. select: per KV head the ``k_blocks`` L2 blocks with the highest Quest bound (:mod:`kvtune.kernels.quest`);
3. merge: per (sequence, KV head) ``table = l1[:n1] ++ selected`` (-1 padded to ``M + k_blocks``).

It also adds what attention and Quest will read to a :class:`ByteCount` on the device: per table entry
``cost[block_bits[entry]]``, per L2 block ``quest_cost`` (its key mins and scales, every KV head).

With a :class:`~kvtune.kernels.quest_summary.QuestSummary8` step 2 bounds the blocks from its float8 key
bounds instead of the pool's fp16 ones (half the bytes, a looser bound), and Quest's bytes per L2 block are
the summary's (:attr:`~kvtune.kernels.quest_summary.QuestSummary8.bytes_per_block`) instead of
``quest_cost``.

This module is the PyTorch reference (the executable spec) and the vocabulary both implementations share
(the tier codes, :class:`ByteCount`). On CUDA the launcher
:func:`kvtune.kernels.sparse_table.sparse_block_table` takes one Triton kernel
(:mod:`kvtune.kernels.triton_sparse_table`) instead of ~60 PyTorch operations per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_ref import quest_topk_ref
from kvtune.kernels.quest_summary import QuestSummary8, summary_topk_ref

L1, L2 = 1, 2  # tier codes of a block (int8)


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of ``x`` where ``mask`` moved to the front of the last dim (order kept), -1 after; and
    counts."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    count = mask.sum(-1)
    out = torch.gather(x, -1, order)
    keep = torch.arange(x.shape[-1], device=x.device) < count[..., None]
    return torch.where(keep, out, -1), count


@dataclass(frozen=True)
class ByteCount:
    """What attention and Quest read, counted on the device: ``cost[bits]`` bytes per table entry of a block
    with those bits (int64 [9]), ``quest_cost`` bytes per L2 block Quest scores (its key mins and scales, all
    KV heads), summed into ``total`` (int64 scalar, added to in place). A selection from a
    :class:`~kvtune.kernels.quest_summary.QuestSummary8` reads the summary instead, and counts its bytes per
    L2 block (``bytes_per_block``: one byte of ``lo`` and one of ``span`` per channel and KV head, half the
    fp16 mins and scales) in place of ``quest_cost``."""

    cost: torch.Tensor
    quest_cost: int
    total: torch.Tensor


def sparse_block_table_ref(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    summary: QuestSummary8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D]; blocks [B, M] int64 (-1 padded); tier [N] int8 (the layer's); ``summary``: the pool's
    float8 key bounds to select from (None: its fp16 key mins and scales).

    Returns table [B, H, M + k_blocks] int32 (L1 blocks, then the selected L2 blocks, -1 padded), num_cold
    [B, H] int32 and num_l1 [B, H] int32; adds the bytes they read to ``count``.
    """
    b, h = blocks.shape[0], pool.layout.num_kv_heads
    t = tier[blocks.clamp(min=0)]
    l1, n1 = compact(blocks, (blocks >= 0) & (t == L1))
    l2, n2 = compact(blocks, (blocks >= 0) & (t == L2))
    if summary is None:
        sel = quest_topk_ref(q, pool, l2.to(torch.int32), n2.to(torch.int32), k_blocks)
        quest_cost = count.quest_cost
    else:
        sel = summary_topk_ref(q, summary, l2.to(torch.int32), n2.to(torch.int32), k_blocks)
        quest_cost = summary.bytes_per_block
    both = torch.cat([l1[:, None].expand(b, h, -1), sel.long()], dim=-1)
    table, num = compact(both, both >= 0)
    bits = pool.block_bits[table.clamp(min=0)].long()
    count.total.add_(torch.where(table >= 0, count.cost[bits], 0).sum() + n2.sum() * quest_cost)
    return table.to(torch.int32), num.to(torch.int32), n1.to(torch.int32)[:, None].expand(b, h)
