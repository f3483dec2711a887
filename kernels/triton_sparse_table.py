"""Triton kernels of :mod:`kvtune.kernels.sparse_table`: split blocks by tier, merge L1 + selected L2.

``_split_kernel``: one program per sequence walks its blocks in chunks and scatters each L1 (L2) block to the
next free position of its output row (a running count + ``tl.cumsum`` within the chunk), so order is kept.
``_merge_kernel``: one program per (sequence, KV head) writes position ``j`` of the table as ``l1[j]`` for
``j < n1``, else the ``(j - n1)``-th best L2 block of the head (``torch.topk``'s sorted output, finite scores
first), else -1; and adds the bytes attention will read to the step's counter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.sparse_table import L1, L2, ByteCount, sparse_block_table_ref
from kvtune.kernels.triton_common import cdiv, tileable_head_dim
from kvtune.kernels.triton_quest import quest_scores_triton

CHUNK = 64


@triton.jit(do_not_specialize=["M"])  # sizes follow the batch and lengths: one compiled kernel
def _split_kernel(blocks_ptr, tier_ptr, l1_ptr, l2_ptr, n1_ptr, n2_ptr, bytes_ptr, M, quest_cost,
                  T1: tl.constexpr, T2: tl.constexpr, MB: tl.constexpr):  # fmt: skip
    """Row b: L1 and L2 blocks in order to l1[b], l2[b] (pre-filled with -1); counts; Quest's bytes."""
    b = tl.program_id(0)
    row = b.to(tl.int64) * M
    c1 = tl.zeros([], tl.int32)
    c2 = tl.zeros([], tl.int32)
    for j0 in range(0, M, MB):
        j = j0 + tl.arange(0, MB)
        blk = tl.load(blocks_ptr + row + j, mask=j < M, other=-1)
        valid = blk >= 0
        t = tl.load(tier_ptr + tl.where(valid, blk, 0), mask=valid, other=0)
        is1 = valid & (t == T1)
        is2 = valid & (t == T2)
        tl.store(l1_ptr + row + c1 + tl.cumsum(is1.to(tl.int32), 0) - 1, blk.to(tl.int32), mask=is1)
        tl.store(l2_ptr + row + c2 + tl.cumsum(is2.to(tl.int32), 0) - 1, blk.to(tl.int32), mask=is2)
        c1 += tl.sum(is1.to(tl.int32), 0)
        c2 += tl.sum(is2.to(tl.int32), 0)
    tl.store(n1_ptr + b, c1)
    tl.store(n2_ptr + b, c2)
    tl.atomic_add(bytes_ptr, c2.to(tl.int64) * quest_cost)


@triton.jit(do_not_specialize=["M", "K", "W"])
def _merge_kernel(l1_ptr, n1_ptr, l2_ptr, val_ptr, idx_ptr, bits_ptr, cost_ptr, table_ptr, num_ptr, bytes_ptr,
                  M, K, W, H: tl.constexpr, MB: tl.constexpr):  # fmt: skip
    """Row (b, h): table = l1[:n1] ++ the finite top-K L2 blocks, -1 after; its count and byte cost."""
    bh = tl.program_id(0)
    b = bh // H
    n1 = tl.load(n1_ptr + b)
    l1_row = b.to(tl.int64) * M
    sel_row = bh.to(tl.int64) * K
    count = tl.zeros([MB], tl.int32)
    read = tl.zeros([MB], tl.int64)
    for j0 in range(0, W, MB):
        j = j0 + tl.arange(0, MB)
        from_l1 = j < n1
        e1 = tl.load(l1_ptr + l1_row + j, mask=from_l1, other=-1)
        s = j - n1
        in_sel = (s >= 0) & (s < K)
        v = tl.load(val_ptr + sel_row + s, mask=in_sel, other=float("-inf"))
        picked = in_sel & (v > float("-inf"))
        i = tl.load(idx_ptr + sel_row + s, mask=picked, other=0)
        e2 = tl.load(l2_ptr + l1_row + i, mask=picked, other=-1)
        e = tl.where(from_l1, e1, tl.where(picked, e2, -1))
        tl.store(table_ptr + bh.to(tl.int64) * W + j, e, mask=j < W)
        ok = e >= 0
        bits = tl.load(bits_ptr + tl.where(ok, e, 0), mask=ok, other=0)
        read += tl.where(ok, tl.load(cost_ptr + bits.to(tl.int32), mask=ok, other=0), 0)
        count += ok.to(tl.int32)
    tl.store(num_ptr + bh, tl.sum(count, 0))
    tl.atomic_add(bytes_ptr, tl.sum(read, 0))


def _pair(shape: tuple[int, ...], device: torch.device, fill: int | None = None) -> tuple[torch.Tensor, ...]:
    """Two int32 tensors of ``shape`` in one allocation, each 16-byte aligned (an unaligned second half
    would be another specialization of the kernels, compiled again whenever the batch changes)."""
    n = math.prod(shape)
    stride = cdiv(n, 4) * 4
    buf = torch.empty(2 * stride, dtype=torch.int32, device=device)
    if fill is not None:
        buf.fill_(fill)
    return buf[:n].view(shape), buf[stride : stride + n].view(shape)


def sparse_block_table_triton(
    q: torch.Tensor, pool: ColdPool, blocks: torch.Tensor, tier: torch.Tensor, k_blocks: int, count: ByteCount
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of :func:`kvtune.kernels.sparse_table.sparse_block_table_ref`."""
    if not tileable_head_dim(q.shape[2]):
        return sparse_block_table_ref(q, pool, blocks, tier, k_blocks, count)
    B, M = blocks.shape
    H = pool.layout.num_kv_heads
    rules = {
        "blocks int64 [B, M] contiguous": blocks.dtype == torch.int64 and blocks.is_contiguous(),
        "tier int8 [N] contiguous": tier.dtype == torch.int8 and tier.is_contiguous(),
        "count: cost int64 [9], total int64 scalar": count.cost.dtype == count.total.dtype == torch.int64
        and count.cost.shape == (9,),
        "q is [B, Hq, D]": q.dim() == 3 and q.shape[0] == B,
    }
    broken = [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"sparse_block_table: `{broken[0]}` must hold (blocks {tuple(blocks.shape)})")
    dev = q.device
    split = _pair((B, M), dev, fill=-1)
    counts = _pair((B,), dev)
    table = torch.empty((B, H, M + k_blocks), dtype=torch.int32, device=dev)
    num = torch.empty((B, H), dtype=torch.int32, device=dev)
    if B == 0:
        return table, num, num
    _split_kernel[(B,)](blocks, tier, split[0], split[1], counts[0], counts[1], count.total, M,
                        count.quest_cost, T1=L1, T2=L2, MB=CHUNK, num_warps=2)  # fmt: skip
    k = min(k_blocks, M)
    if k:
        vals, idx = torch.topk(quest_scores_triton(q, pool, split[1], counts[1]), k, dim=-1)
    else:
        vals = torch.empty((B, H, 0), dtype=torch.float32, device=dev)
        idx = torch.empty((B, H, 0), dtype=torch.int64, device=dev)
    _merge_kernel[(B * H,)](split[0], counts[0], split[1], vals, idx, pool.block_bits, count.cost, table, num,
                            count.total, M, k, M + k_blocks, H=H, MB=CHUNK, num_warps=2)  # fmt: skip
    return table, num, counts[0][:, None].expand(B, H)
