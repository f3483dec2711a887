"""Triton kernels of :mod:`kvtune.kernels.elementwise`: add + RMSNorm, RoPE of the fused qkv, SiLU·up.

One program per token row (RMSNorm), per (token, head) (RoPE) or per (token, column tile) (SiLU·up); float32
inside, one rounding to the model dtype at the end (the residual sum is rounded first, as ``x + delta`` is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvtune.kernels.elementwise_ref import QKV, check_qkv_out, check_sum_out
from kvtune.kernels.launch import launch
from kvtune.kernels.triton_common import cdiv, next_pow2, require


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, s_x, s_d, s_s, s_o,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r: s = x + delta (model dtype) → sum; w · (s / sqrt(mean(s²) + eps)) → out."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    x = tl.load(x_ptr + r * s_x + c, mask=m, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + r * s_d + c, mask=m, other=0.0).to(tl.float32)).to(
            sum_ptr.dtype.element_ty
        )
        tl.store(sum_ptr + r * s_s + c, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * s_o + c, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm_triton(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, sum_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """x, delta [N, hidden] (unit stride on hidden), weight [hidden] → (x + delta, rms_norm(x + delta));
    ``sum_out`` (with delta): where x + delta goes (x itself may be given: a row is read before written)."""
    _check_rows("add_rms_norm", x, delta, weight)
    check_sum_out(x, delta, sum_out)
    if sum_out is not None and sum_out.stride(1) != 1:
        raise ValueError(f"add_rms_norm: `sum_out has unit stride on hidden` must hold: {sum_out.stride()}")
    n, hidden = x.shape
    out = torch.empty_like(x)
    s = x if delta is None else torch.empty_like(x) if sum_out is None else sum_out
    d = x if delta is None else delta
    block = next_pow2(hidden)
    launch(_add_rms_norm_kernel, (n,),
        x, d, weight, s, out, hidden, eps, x.stride(0), d.stride(0), s.stride(0), out.stride(0),
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return s, out


def _check_rows(name: str, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> None:
    rules = {
        "x is [N, hidden] with unit stride on hidden": x.dim() == 2 and x.stride(1) == 1,
        "delta matches x (shape, dtype, unit stride)": delta is None
        or (delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(1) == 1),
        "weight is contiguous [hidden]": weight.shape == x.shape[1:] and weight.is_contiguous(),
    }
    require(name, rules, lambda: f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, s_n, s_cn,
    HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Token n, head j of the fused projection: rotate (q and k heads) or copy (v heads) its D channels."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.arange(0, HALF)
    m = c < D // 2
    src = qkv_ptr + n * s_n + j * D + c
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + D // 2, mask=m, other=0.0).to(tl.float32)
    if j < HQ + H:
        cos = tl.load(cos_ptr + n * s_cn + c, mask=m, other=0.0)
        sin = tl.load(sin_ptr + n * s_cn + c, mask=m, other=0.0)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if j < HQ:
            dst = q_ptr + (n * HQ + j) * D + c
        else:
            dst = k_ptr + (n * H + j - HQ) * D + c
    else:
        dst = v_ptr + (n * H + j - HQ - H) * D + c
    tl.store(dst, x1.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(dst + D // 2, x2.to(q_ptr.dtype.element_ty), mask=m)


def rope_qkv_triton(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, out: QKV | None = None
) -> QKV:
    """qkv [N, (Hq + 2H)·D] (unit column stride), cos/sin [N, D] float32 → q [N, Hq, D], k, v [N, H, D]
    (``out``: written into these, contiguous)."""
    n, d = qkv.shape[0], cos.shape[-1]
    heads = num_heads + 2 * num_kv_heads
    rules = {
        "qkv is [N, (Hq + 2H)·D] with unit column stride": qkv.dim() == 2
        and qkv.shape[1] == heads * d
        and qkv.stride(1) == 1,
        "cos, sin are float32 [N, D] with equal strides": cos.shape == sin.shape == (n, d)
        and cos.dtype == sin.dtype == torch.float32
        and cos.stride() == sin.stride()
        and cos.stride(1) == 1,
        "D is even": d % 2 == 0,
    }
    require("rope_qkv", rules, lambda: f"qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}")
    if out is not None:
        check_qkv_out(out, qkv, num_heads, num_kv_heads, d)
        q, k, v = out
    else:
        q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((n, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
    if n:
        launch(_rope_qkv_kernel, (n, heads),
            qkv, cos, sin, q, k, v, qkv.stride(0), cos.stride(0),
            HQ=num_heads, H=num_kv_heads, D=d, HALF=next_pow2(d // 2), num_warps=1,
        )  # fmt: skip
    return (q, k, v) if out is None else out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, s_g, s_o, BLOCK: tl.constexpr):
    """Row n, columns tile: silu(gate) · up in float32."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_cols
    g = tl.load(gu_ptr + n * s_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + n * s_g + n_cols + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_o + c, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2F] (unit column stride) → silu(gate) · up [N, F]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"silu_mul: `gate_up is [N, 2F] with unit column stride` must hold, got {tuple(gate_up.shape)}"
        )
    n, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, f), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(f))
    if n:
        grid, strides = (n, cdiv(f, block)), (gate_up.stride(0), out.stride(0))
        launch(_silu_mul_kernel, grid, gate_up, out, f, *strides, BLOCK=block, num_warps=4)
    return out
