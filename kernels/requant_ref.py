"""Demotion of 8-bit blocks to 4 bits, in place (layout: :mod:`kvtune.kernels.layout`).

The block's INT8 values are dequantized and quantized again at 4 bits (keys per channel, values per token,
as at sealing); the packed codes fill the first ``D/2`` bytes of each row of the block's 8-bit slot (the
rest is zeroed), min/scale are replaced and ``block_bits`` becomes 4. The error adds up: ``|x − deq4| ≤
scale8 / 2 + scale4 / 2``.

This module is the PyTorch reference (the executable spec and the fallback of the Triton launcher in
:mod:`kvtune.kernels.triton_quant`); :mod:`kvtune.kernels.requant` dispatches between them.
"""

from __future__ import annotations

import torch

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant_ref import dequantize_blocks_ref, seal_blocks_ref
from kvtune.kernels.quest_summary import write_summary


def requantize_int4_ref(pool: ColdPool, block_ids: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Re-quantize 8-bit blocks ``block_ids`` ``[n]`` int64 of an 8-bit pool to 4 bits in place; with
    ``where`` (bool ``[n]``) only the listed blocks where it is set.

    Blocks already at 4 bits are left as they are (no host synchronization: selected with ``torch.where``).
    """
    if pool.bits != 8:
        raise ValueError(f"requantize_int4 needs an 8-bit pool, got a {pool.bits}-bit one")
    if block_ids.numel() == 0:
        return
    old: tuple[torch.Tensor, ...] = (
        pool.k[block_ids].clone(),
        pool.v[block_ids].clone(),
        pool.k_min[block_ids].clone(),
        pool.k_scale[block_ids].clone(),
        pool.v_min[block_ids].clone(),
        pool.v_scale[block_ids].clone(),
    )
    keep = pool.block_bits[block_ids] == 4
    if where is not None:
        keep = keep | ~where
        old = (*old, pool.block_bits[block_ids].clone())
    k, v = dequantize_blocks_ref(pool, block_ids)
    seal_blocks_ref(pool, block_ids, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), bits=4)
    fields = ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits")
    for name, before in zip(fields, old):
        now = getattr(pool, name)[block_ids]
        mask = keep.view(-1, *([1] * (now.dim() - 1)))
        getattr(pool, name)[block_ids] = torch.where(mask, before, now)
    write_summary(pool, block_ids)  # from the bounds each block ends with
