"""Hybrid decode attention: one query token per sequence over its hot zone and its listed cold blocks.

The launcher: the kernel :func:`~kvtune.kernels.decode_choice.decode_kernel` picks computes it, the
PyTorch reference (:mod:`kvtune.kernels.decode_ref`, the contract) or the fused Triton kernels
(:mod:`kvtune.kernels.triton_decode`, imported on first use). Those import only modules below this one, so
no kernel module imports another one back.
"""

from __future__ import annotations

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.bits_partition_ref import BitsPartition
from kvtune.kernels.decode_choice import DecodeKernel, decode_kernel
from kvtune.kernels.decode_ref import hybrid_decode_attention_ref
from kvtune.kernels.layout import ColdPool

__all__ = ["DecodeKernel", "decode_kernel", "hybrid_decode_attention", "hybrid_decode_attention_ref"]


def hybrid_decode_attention(
    q: torch.Tensor,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    hot_slot: torch.Tensor,
    hot_len: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    sm_scale: float,
    partition: BitsPartition | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`hybrid_decode_attention_ref`; computed by the kernel :func:`decode_kernel` picks (the fused
    Triton kernels on CUDA tensors). ``partition``: the table split by bits where the selection wrote it
    (:func:`~kvtune.kernels.sparse_table.sparse_block_table_parts`), which the mixed Gluon path then reads."""
    kernel = decode_kernel(q, pool, block_table, triton=use_triton(q))
    if kernel == "reference":
        return hybrid_decode_attention_ref(
            q, hot_k, hot_v, hot_slot, hot_len, pool, block_table, num_cold, sm_scale
        )
    from kvtune.kernels.triton_decode import hybrid_decode_attention_triton

    return hybrid_decode_attention_triton(
        q, hot_k, hot_v, hot_slot, hot_len, pool, block_table, num_cold, sm_scale, kernel=kernel,
        partition=partition,
    )  # fmt: skip
