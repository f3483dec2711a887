"""A decode table of an 8-bit pool with demoted blocks, split by block bits: the reference and its shapes.

The Gluon cold kernel reads one code width per build. An 8-bit pool whose blocks may be demoted to 4 bits
(the sparse tier's L2 blocks) lists both widths in one table row; the mixed Gluon path
(``DecodeKernelOptions.gluon_mixed``) first splits each (sequence, KV head) row by bits into one row of twice
the padded width ``W = partition_width(M)``::

    table2[b, h, 0 : W]      the row's 8-bit blocks, in table order, -1 after them
    table2[b, h, W : 2 W]    its 4-bit blocks, in table order, -1 after them
    counts[0, b, h], counts[1, b, h]   how many of each (int32)
    positions[b, h, j]       where entry j of the row went in table2's row (-1 past num_cold)

so the 8-bit and the 4-bit Gluon builds each walk their half, and the merge finds each entry's block lse
(and so its attention mass) at ``positions``. ``W`` is a multiple of 4 and ``counts`` rows are padded to 4
entries, so every half and every count row starts 16-byte aligned (a pointer's alignment is part of a
Triton build's key: it must not change with the batch or the width). This module is the PyTorch reference;
:mod:`kvtune.kernels.triton_bits_partition` is the kernel (one launch, no host synchronisation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvtune.kernels.triton_common import cdiv


class BitsPartition(NamedTuple):
    """A table split by block bits (module docstring)."""

    table: torch.Tensor  # int32 [B, H, 2 W]
    counts: torch.Tensor  # int32 [2, B, H] (a view of rows padded to a multiple of 4 entries)
    positions: torch.Tensor  # int32 [B, H, M]


def partition_width(m: int) -> int:
    """``W``: the width of each half, ``m`` rounded up to a multiple of 4 (at least 4)."""
    return max(4, 4 * cdiv(m, 4))


def count_rows(rows: int) -> int:
    """Entries per row of the counts' storage: ``rows`` (= B * H) rounded up to a multiple of 4."""
    return 4 * cdiv(max(rows, 1), 4)


def empty_partition(b: int, h: int, m: int, device: torch.device) -> BitsPartition:
    """Uninitialised outputs of the right shapes (the kernel writes every entry)."""
    w = partition_width(m)
    counts = torch.empty((2, count_rows(b * h)), dtype=torch.int32, device=device)
    return BitsPartition(
        torch.empty((b, h, 2 * w), dtype=torch.int32, device=device),
        counts[:, : b * h].view(2, b, h),
        torch.empty((b, h, m), dtype=torch.int32, device=device),
    )


def partition_by_bits_ref(
    block_table: torch.Tensor, num_cold: torch.Tensor, block_bits: torch.Tensor
) -> BitsPartition:
    """block_table int32 [B, H, M] (ids, -1 padded), num_cold [B, H], block_bits uint8 [N] (a 4 marks a
    demoted block; every other value reads as 8 bits). Returns the split (module docstring)."""
    b, h, m = block_table.shape
    w = partition_width(m)
    out = empty_partition(b, h, m, block_table.device)
    out.table.fill_(-1)
    out.counts.zero_()
    out.positions.fill_(-1)
    for i in range(b):
        for k in range(h):
            n = int(num_cold[i, k])
            ids = block_table[i, k, :n]
            four = block_bits[ids.long()] == 4
            eight, nibble = ids[~four], ids[four]
            out.table[i, k, : len(eight)] = eight
            out.table[i, k, w : w + len(nibble)] = nibble
            pos = torch.empty(n, dtype=torch.int32, device=ids.device)
            pos[~four] = torch.arange(len(eight), dtype=torch.int32, device=ids.device)
            pos[four] = w + torch.arange(len(nibble), dtype=torch.int32, device=ids.device)
            out.positions[i, k, :n] = pos
            out.counts[0, i, k], out.counts[1, i, k] = len(eight), len(nibble)
    return out
