"""Sealing (quantize + pack) and dequantization of cold blocks: the launchers (rule, reference and helpers:
:mod:`kvtune.kernels.quant_ref`; on CUDA the Triton kernels of :mod:`kvtune.kernels.triton_quant`, imported on
first use).
"""

from __future__ import annotations

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant_ref import (
    check_seal_bits,
    codes_of_rows,
    dequantize_blocks_ref,
    dequantize_gathered,
    pack_int4,
    seal_blocks_ref,
    unpack_int4,
)

__all__ = [
    "check_seal_bits",
    "codes_of_rows",
    "dequantize_blocks",
    "dequantize_blocks_ref",
    "dequantize_gathered",
    "pack_int4",
    "seal_blocks",
    "seal_blocks_ref",
    "unpack_int4",
]


def seal_blocks(
    pool: ColdPool,
    block_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Quantize + pack ``n`` blocks into the pool (see :func:`seal_blocks_ref`); Triton on CUDA tensors."""
    if use_triton(k):
        from kvtune.kernels.triton_quant import seal_blocks_triton

        return seal_blocks_triton(pool, block_ids, k, v, bits, rows)
    seal_blocks_ref(pool, block_ids, k, v, bits, rows)


def dequantize_blocks(pool: ColdPool, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`dequantize_blocks_ref`."""
    return dequantize_blocks_ref(pool, block_ids)
