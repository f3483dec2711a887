"""Triton kernel of :mod:`kvtune.kernels.bits_partition_ref`: a decode table split by block bits.

One program per (sequence, KV head) row, ``MB`` of its listed entries at a time: each entry's bits, then its
rank among the row's entries of its width so far (a running count + ``tl.cumsum``, so table order is kept)
gives its place in the 8-bit or the 4-bit half; then the padding (-1) of the positions and of the halves,
stores only, and the counts. A sparse row lists a fraction of its table's width (at 128K tokens, L1 1/8 and
top 2,048: 288 of 2,079 entries), so the work follows the listed entries. Sizes that follow the batch
and the table's width are not specialized: one compiled kernel for every step of a replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.bits_partition_ref import BitsPartition, empty_partition, partition_width
from kvtune.kernels.launch import launch

PARTITION_TILE = 128  # table entries per step of a program
PAD_TILE = 512  # padding entries per store (the padding is written without loads)
NUM_WARPS = 4


@triton.jit(do_not_specialize=["M", "W", "R"])
def _partition_kernel(table_ptr, ncold_ptr, bits_ptr, out_ptr, count_ptr, pos_ptr, M, W, R,
                      MB: tl.constexpr, ZB: tl.constexpr):  # fmt: skip
    """Row ``bh`` of ``table`` [B * H, M] split into ``out`` [B * H, 2 W] (8-bit | 4-bit), ``pos`` [B * H, M]
    and ``count`` [2, R]."""
    bh = tl.program_id(0)
    nc = tl.load(ncold_ptr + bh)
    row = bh.to(tl.int64) * M
    orow = bh.to(tl.int64) * 2 * W
    n8 = nc * 0
    n4 = nc * 0
    for j0 in range(0, nc, MB):  # the listed entries; the padding after them below, without loads
        j = j0 + tl.arange(0, MB)
        valid = j < nc
        bid = tl.load(table_ptr + row + j, mask=valid, other=0)
        four = (tl.load(bits_ptr + bid, mask=valid, other=8) == 4) & valid
        eight = (~four) & valid
        f = four.to(tl.int32)
        e = eight.to(tl.int32)
        dest = tl.where(four, W + n4 + tl.cumsum(f, 0) - f, n8 + tl.cumsum(e, 0) - e)
        tl.store(out_ptr + orow + dest, bid, mask=valid)
        tl.store(pos_ptr + row + j, tl.where(valid, dest, -1), mask=j < M)
        n8 += tl.sum(e, 0)
        n4 += tl.sum(f, 0)
    pad = tl.full([ZB], -1, tl.int32)
    for z0 in range((nc + MB - 1) // MB * MB, M, ZB):
        z = z0 + tl.arange(0, ZB)
        tl.store(pos_ptr + row + z, pad, mask=z < M)
    for p0 in range(n8, W, ZB):
        p = p0 + tl.arange(0, ZB)
        tl.store(out_ptr + orow + p, pad, mask=p < W)
    for p0 in range(n4, W, ZB):
        p = p0 + tl.arange(0, ZB)
        tl.store(out_ptr + orow + W + p, pad, mask=p < W)
    tl.store(count_ptr + bh, n8)
    tl.store(count_ptr + R + bh, n4)


def partition_by_bits_triton(
    block_table: torch.Tensor, num_cold: torch.Tensor, block_bits: torch.Tensor
) -> BitsPartition:
    """See :func:`~kvtune.kernels.bits_partition_ref.partition_by_bits_ref`; one launch."""
    b, h, m = block_table.shape
    out = empty_partition(b, h, m, block_table.device)
    if b * h == 0:
        return out
    launch(_partition_kernel, (b * h,),
        block_table.to(torch.int32).contiguous(), num_cold.to(torch.int32).contiguous(), block_bits,
        out.table, out.counts, out.positions, m, partition_width(m), out.counts.stride(0),
        MB=PARTITION_TILE, ZB=PAD_TILE, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
