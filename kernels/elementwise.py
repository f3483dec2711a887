"""The decoder's per-token operations around attention, each one kernel on CUDA.

A decode step runs these once per layer on ``[batch, hidden]`` activations; as separate PyTorch operations
they are ~40 kernel launches per layer, which on a GPU costs more than the layer's arithmetic. Here:

* ``add_rms_norm(x, delta, w)`` → ``(s, w · rms(s))`` with ``s = x + delta`` (the residual add and the next
  RMSNorm in one pass; ``delta=None`` is a plain RMSNorm). ``rms(s) = s / sqrt(mean(s²) + eps)`` in float32,
  rounded to the model dtype before the weight, as Hugging Face's ``LlamaRMSNorm`` does.
* ``rope_qkv(qkv, cos, sin)`` → ``q, k, v``: split the fused projection ``[N, (Hq + 2H)·D]`` into heads and
  rotate q and k (rotate-half layout: ``x cos + rotate_half(x) sin``); v is copied.
* ``silu_mul(gate_up)`` → ``silu(gate) · up`` for ``gate_up = [gate | up]`` ``[N, 2F]``.

The references are the executable spec (and the CPU path); the Triton kernels compute in float32 and round
once, so on bf16/fp16 they differ from the references by rounding only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtune.kernels.backend import use_triton
from kvtune.kernels.elementwise_ref import (
    QKV,
    add_rms_norm_ref,
    apply_rope,
    rms_norm_ref,
    rope_qkv_ref,
    silu_mul_ref,
)

__all__ = [
    "QKV",
    "add_rms_norm",
    "add_rms_norm_ref",
    "apply_rope",
    "rms_norm",
    "rms_norm_ref",
    "rope_qkv",
    "rope_qkv_ref",
    "silu_mul",
    "silu_mul_ref",
]


def add_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, sum_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """See :func:`add_rms_norm_ref`; one Triton kernel on CUDA."""
    if use_triton(x):
        from kvtune.kernels.triton_elementwise import add_rms_norm_triton

        return add_rms_norm_triton(x, delta, weight, eps, sum_out)
    return add_rms_norm_ref(x, delta, weight, eps, sum_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`rms_norm_ref`; one Triton kernel on CUDA."""
    return add_rms_norm(x, None, weight, eps)[1]


def rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, out: QKV | None = None
) -> QKV:
    """See :func:`rope_qkv_ref`; one Triton kernel on CUDA."""
    if use_triton(qkv):
        from kvtune.kernels.triton_elementwise import rope_qkv_triton

        return rope_qkv_triton(qkv, cos, sin, num_heads, num_kv_heads, out)
    return rope_qkv_ref(qkv, cos, sin, num_heads, num_kv_heads, out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`silu_mul_ref`; one Triton kernel on CUDA."""
    if use_triton(gate_up):
        from kvtune.kernels.triton_elementwise import silu_mul_triton

        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
