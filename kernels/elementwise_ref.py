"""PyTorch references of :mod:`kvtune.kernels.elementwise` (the executable spec and the CPU path), and the
checks of the outputs a caller may give, shared by the dispatcher and the Triton launchers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden], weight [hidden] → ``weight · (x / sqrt(mean(x²) + eps))`` (float32 inside, x.dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, sum_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``s = x + delta`` (x itself when delta is None) and ``rms_norm(s)``; x, delta [N, hidden];
    ``sum_out``: where ``s`` is written (x itself may be given: in place; needs delta)."""
    check_sum_out(x, delta, sum_out)
    s = x if delta is None else x + delta
    if sum_out is not None:
        s = sum_out.copy_(s)
    return s, rms_norm_ref(s, weight, eps)


def check_sum_out(x: torch.Tensor, delta: torch.Tensor | None, sum_out: torch.Tensor | None) -> None:
    if sum_out is not None and (delta is None or sum_out.shape != x.shape or sum_out.dtype != x.dtype):
        raise ValueError(
            "add_rms_norm: `sum_out is given with delta and matches x (shape, dtype)` must hold, but got "
            f"x {tuple(x.shape)} {x.dtype}, sum_out {tuple(sum_out.shape)} {sum_out.dtype}, delta "
            f"{'None' if delta is None else tuple(delta.shape)}"
        )


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rope_qkv_ref(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, out: QKV | None = None
) -> QKV:
    """qkv [N, (Hq + 2H)·D], cos/sin [N, D] float32 → q [N, Hq, D], k, v [N, H, D] (contiguous, qkv.dtype);
    ``out``: written into these three (contiguous, of those shapes and qkv's dtype) and returned."""
    n, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.view(n, num_heads + 2 * num_kv_heads, d).split([num_heads, num_kv_heads, num_kv_heads], 1)
    got = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()
    if out is None:
        return got
    check_qkv_out(out, qkv, num_heads, num_kv_heads, d)
    for dst, src in zip(out, got):
        dst.copy_(src)
    return out


def check_qkv_out(out: QKV, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, d: int) -> None:
    """``rope_qkv``'s ``out``: contiguous q [N, Hq, D], k, v [N, H, D] of qkv's dtype, else a ValueError."""
    n = qkv.shape[0]
    shapes = [(n, num_heads, d), (n, num_kv_heads, d), (n, num_kv_heads, d)]
    if [tuple(t.shape) for t in out] != shapes or any(
        t.dtype != qkv.dtype or not t.is_contiguous() for t in out
    ):
        raise ValueError(
            f"rope_qkv: `out is contiguous q {shapes[0]}, k, v {shapes[1]} of {qkv.dtype}` must hold, but "
            f"got {[(tuple(t.shape), t.dtype, t.is_contiguous()) for t in out]}"
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] by cos/sin [N, D]: ``x cos + rotate_half(x) sin`` (in x.dtype)."""
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2F] → ``silu(gate) · up`` [N, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
