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
import torch.nn.functional as F

from kvtune.kernels.backend import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden], weight [hidden] → ``weight · (x / sqrt(mean(x²) + eps))`` (float32 inside, x.dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` (x itself when delta is None) and ``rms_norm(s)``; x, delta [N, hidden]."""
    s = x if delta is None else x + delta
    return s, rms_norm_ref(s, weight, eps)


def rope_qkv_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (Hq + 2H)·D], cos/sin [N, D] float32 → q [N, Hq, D], k, v [N, H, D] (contiguous, qkv.dtype)."""
    n, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.view(n, num_heads + 2 * num_kv_heads, d).split([num_heads, num_kv_heads, num_kv_heads], 1)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] by cos/sin [N, D]: ``x cos + rotate_half(x) sin`` (in x.dtype)."""
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2F] → ``silu(gate) · up`` [N, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`add_rms_norm_ref`; one Triton kernel on CUDA."""
    if use_triton(x):
        from kvtune.kernels.triton_elementwise import add_rms_norm_triton

        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_ref(x, delta, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`rms_norm_ref`; one Triton kernel on CUDA."""
    return add_rms_norm(x, None, weight, eps)[1]


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`rope_qkv_ref`; one Triton kernel on CUDA."""
    if use_triton(qkv):
        from kvtune.kernels.triton_elementwise import rope_qkv_triton

        return rope_qkv_triton(qkv, cos, sin, num_heads, num_kv_heads)
    return rope_qkv_ref(qkv, cos, sin, num_heads, num_kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`silu_mul_ref`; one Triton kernel on CUDA."""
    if use_triton(gate_up):
        from kvtune.kernels.triton_elementwise import silu_mul_triton

        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
