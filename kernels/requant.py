"""Demotion of 8-bit blocks to 4 bits, in place: the launcher (rule and reference:
:mod:`kvtune.kernels.requant_ref`; on CUDA the Triton kernel of :mod:`kvtune.kernels.triton_quant`, imported
on first use).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.requant_ref import requantize_int4_ref

__all__ = ["requantize_int4", "requantize_int4_masked", "requantize_int4_ref"]


def requantize_int4(pool: ColdPool, block_ids: torch.Tensor) -> None:
    """See :func:`requantize_int4_ref`; Triton on CUDA tensors."""
    if use_triton(pool.k):
        from kvtune.kernels.triton_quant import requantize_int4_triton

        return requantize_int4_triton(pool, block_ids)
    requantize_int4_ref(pool, block_ids)


def requantize_int4_masked(pools: Sequence[ColdPool], mask: torch.Tensor) -> None:
    """Re-quantize the 8-bit blocks where ``mask`` (bool ``[layers, blocks]``) is set, in every layer's
    8-bit pool. On CUDA (Triton) without reading anything back: the listed blocks are compacted on the
    device and one kernel walks the list to its device-side length (capturable in a CUDA graph); the PyTorch
    reference lists them with ``nonzero``."""
    if not pools or mask.numel() == 0:
        return
    if use_triton(pools[0].k):
        from kvtune.kernels.triton_quant import requantize_int4_masked_triton

        return requantize_int4_masked_triton(pools, mask)
    for layer, pool in enumerate(pools):
        ids = mask[layer].nonzero().flatten()
        if ids.numel():
            requantize_int4_ref(pool, ids)
