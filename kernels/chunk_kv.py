"""A prompt chunk's packed keys and values and the hot-zone writes: the launchers (rule and reference:
:mod:`kvtune.kernels.chunk_kv_ref`; on CUDA the Triton kernels of :mod:`kvtune.kernels.triton_chunk_kv`,
imported on first use).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtune.kernels.backend import use_triton
from kvtune.kernels.chunk_kv_ref import HOT, NEW, PREFIX, hot_write_ref, pack_kv_ref
from kvtune.kernels.layout import ColdPool

__all__ = ["HOT", "NEW", "PREFIX", "hot_write", "hot_write_ref", "pack_kv", "pack_kv_ref"]


def pack_kv(
    pool: ColdPool, hot: Tensor, k: Tensor, v: Tensor, kind: Tensor, src: Tensor, dtype: torch.dtype
) -> Tensor:
    """Packed keys and values ``[2, K, H, D]`` (:func:`~kvtune.kernels.chunk_kv_ref.pack_kv_ref`)."""
    if use_triton(k):
        from kvtune.kernels.triton_chunk_kv import pack_kv_triton

        return pack_kv_triton(pool, hot, k, v, kind, src, dtype)
    return pack_kv_ref(pool, hot, k, v, kind, src, dtype)


def hot_write(
    hot: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor, rows: Tensor | None = None
) -> None:
    """K and V rows into hot zones (:func:`~kvtune.kernels.chunk_kv_ref.hot_write_ref`)."""
    if use_triton(k):
        from kvtune.kernels.triton_chunk_kv import hot_write_triton

        hot_write_triton(hot, k, v, slots, positions, rows)
        return
    hot_write_ref(hot, k, v, slots, positions, rows)
