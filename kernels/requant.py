"""Demotion of 8-bit blocks to 4 bits, in place: the launcher (rule and reference:
:mod:`kvtune.kernels.requant_ref`; on CUDA the Triton kernel of :mod:`kvtune.kernels.triton_quant`, imported
on first use).
"""

from __future__ import annotations

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.requant_ref import requantize_int4_ref

__all__ = ["requantize_int4", "requantize_int4_ref"]


def requantize_int4(pool: ColdPool, block_ids: torch.Tensor) -> None:
    """See :func:`requantize_int4_ref`; Triton on CUDA tensors."""
    if use_triton(pool.k):
        from kvtune.kernels.triton_quant import requantize_int4_triton

        return requantize_int4_triton(pool, block_ids)
    requantize_int4_ref(pool, block_ids)
