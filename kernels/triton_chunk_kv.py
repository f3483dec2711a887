"""Triton kernels of :mod:`kvtune.kernels.chunk_kv`: a chunk layer's packed keys and values, hot-zone writes.

``_pack_kernel``: one program per (tile of ``ROWS`` packed rows, KV head) reads each row's kind and source
and loads the row from the cold pool (dequantizing it as :func:`kvtune.kernels.quant_ref.dequantize_gathered`
does: ``min + code · scale`` in float32, no fused multiply-add, so the CPU interpreter gives the reference's
values), from the hot zones or from the new keys and values, and stores it once rounded. The channel tile is
the two halves ``[0, D/2)`` and ``[D/2, D)``, as the seal's: an INT4 byte ``c`` packs channel ``c`` with
``c + D/2``.

``_hot_write_kernel``: one program per (tile of ``ROWS`` rows, KV head) copies K and V rows into their hot
zones' (slot, position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvtune.kernels.chunk_kv_ref import HOT, NEW, PREFIX, hot_write_ref, pack_kv_ref
from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.triton_common import cdiv, require, tileable_head_dim

ROWS = 16  # rows a program of either kernel handles (one KV head each)
# the rows' kinds as the kernels see them (a kernel reads globals only as compile-time values)
_PREFIX, _HOT, _NEW = tl.constexpr(PREFIX), tl.constexpr(HOT), tl.constexpr(NEW)


@triton.jit
def _halves(ptr, at, m, DH: tl.constexpr):
    """Float32 [ROWS, DH] loads at ``ptr + at`` and ``ptr + at + DH`` (``at`` [ROWS, DH]), rows ``m``."""
    lo = tl.load(ptr + at, mask=m[:, None], other=0.0).to(tl.float32)
    return lo, tl.load(ptr + at + DH, mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _codes(ptr, at, m, cold4, POOL_BITS: tl.constexpr, DH: tl.constexpr):
    """Float32 codes of channels c and c + DH of the code rows at ``ptr + at`` (4 bits: packed in one byte;
    an 8-bit pool's rows of blocks at 4 bits (``cold4``) likewise, in their first DH bytes)."""
    lo = tl.load(ptr + at, mask=m[:, None], other=0).to(tl.int32)
    if POOL_BITS == 4:
        return (lo & 15).to(tl.float32), (lo >> 4).to(tl.float32)
    else:
        hi = tl.load(ptr + at + DH, mask=m[:, None] & ~cold4[:, None], other=0).to(tl.int32)
        demoted = cold4[:, None]
        return tl.where(demoted, lo & 15, lo).to(tl.float32), tl.where(demoted, lo >> 4, hi).to(tl.float32)


@triton.jit
def _pick(m, a_lo, a_hi, b_lo, b_hi):
    """(a_lo, a_hi) on the rows where m [ROWS], else (b_lo, b_hi)."""
    return tl.where(m[:, None], a_lo, b_lo), tl.where(m[:, None], a_hi, b_hi)


@triton.jit(do_not_specialize=["n_rows", "s_ow"])  # the rows follow the chunks: one build for all
def _pack_kernel(
    kind_ptr, src_ptr, out_ptr, k_ptr, v_ptr, hot_ptr,
    pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, bits_ptr,
    n_rows, s_ow, s_or, s_oh, s_nr, s_nh, s_hw, s_hs, s_hh, s_hc, s_pn, s_ph, s_pt, s_kn, s_kh, s_vn, s_vh,
    BS: tl.constexpr, CAP: tl.constexpr, D: tl.constexpr, POOL_BITS: tl.constexpr, ROWS: tl.constexpr,
    HAS_POOL: tl.constexpr,
):  # fmt: skip
    """Packed rows [tile · ROWS, +ROWS) of KV head h, K and V planes (module docstring)."""
    DH: tl.constexpr = D // 2
    h = tl.program_id(1)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, DH)[None, :]
    live = r < n_rows
    kind = tl.load(kind_ptr + r, mask=live, other=-1)
    src = tl.load(src_ptr + r, mask=live, other=0)
    is_new, is_hot, is_cold = live & (kind == _NEW), live & (kind == _HOT), live & (kind == _PREFIX)
    # new rows: row src of k, v
    at = (src * s_nr + h * s_nh)[:, None] + c
    k_lo, k_hi = _halves(k_ptr, at, is_new, DH)
    v_lo, v_hi = _halves(v_ptr, at, is_new, DH)
    # hot rows: slot src // CAP, position src % CAP
    at = ((src // CAP) * s_hs + h * s_hh + (src % CAP) * s_hc)[:, None] + c
    hk_lo, hk_hi = _halves(hot_ptr, at, is_hot, DH)
    hv_lo, hv_hi = _halves(hot_ptr + s_hw, at, is_hot, DH)
    k_lo, k_hi = _pick(is_hot, hk_lo, hk_hi, k_lo, k_hi)
    v_lo, v_hi = _pick(is_hot, hv_lo, hv_hi, v_lo, v_hi)
    if HAS_POOL:  # cold rows: token src % BS of block src // BS
        blk, t = src // BS, src % BS
        at = (blk * s_pn + h * s_ph + t * s_pt)[:, None] + c
        if POOL_BITS == 0:
            ck_lo, ck_hi = _halves(pk_ptr, at, is_cold, DH)
            cv_lo, cv_hi = _halves(pv_ptr, at, is_cold, DH)
        else:
            cold4 = is_cold & (tl.load(bits_ptr + blk, mask=is_cold, other=0) == 4)
            kc_lo, kc_hi = _codes(pk_ptr, at, is_cold, cold4, POOL_BITS, DH)
            vc_lo, vc_hi = _codes(pv_ptr, at, is_cold, cold4, POOL_BITS, DH)
            kq = (blk * s_kn + h * s_kh)[:, None] + c
            kmin_lo, kmin_hi = _halves(kmin_ptr, kq, is_cold, DH)
            ksc_lo, ksc_hi = _halves(ksc_ptr, kq, is_cold, DH)
            vq = blk * s_vn + h * s_vh + t
            vmin = tl.load(vmin_ptr + vq, mask=is_cold, other=0.0).to(tl.float32)[:, None]
            vsc = tl.load(vsc_ptr + vq, mask=is_cold, other=0.0).to(tl.float32)[:, None]
            ck_lo, ck_hi = kmin_lo + kc_lo * ksc_lo, kmin_hi + kc_hi * ksc_hi
            cv_lo, cv_hi = vmin + vc_lo * vsc, vmin + vc_hi * vsc
        k_lo, k_hi = _pick(is_cold, ck_lo, ck_hi, k_lo, k_hi)
        v_lo, v_hi = _pick(is_cold, cv_lo, cv_hi, v_lo, v_hi)
    dst = (r * s_or + h * s_oh)[:, None] + c
    ty = out_ptr.dtype.element_ty
    m = live[:, None]
    tl.store(out_ptr + dst, k_lo.to(ty), mask=m)
    tl.store(out_ptr + dst + DH, k_hi.to(ty), mask=m)
    tl.store(out_ptr + s_ow + dst, v_lo.to(ty), mask=m)
    tl.store(out_ptr + s_ow + dst + DH, v_hi.to(ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])  # one build whatever the number of rows
def _hot_write_kernel(
    k_ptr, v_ptr, rows_ptr, slots_ptr, pos_ptr, hot_ptr, n_rows,
    s_kr, s_kh, s_vr, s_vh, s_hw, s_hs, s_hh, s_hc,
    D: tl.constexpr, ROWS: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """Rows [tile · ROWS, +ROWS) of K and V, KV head h, into their hot zones."""
    h = tl.program_id(1)
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, D)
    live = i < n_rows
    r = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64) if HAS_ROWS else i
    slot = tl.load(slots_ptr + i, mask=live, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + i, mask=live, other=0).to(tl.int64)
    dst = (slot * s_hs + h * s_hh + pos * s_hc)[:, None] + c[None, :]
    ty = hot_ptr.dtype.element_ty
    k = tl.load(k_ptr + (r * s_kr + h * s_kh)[:, None] + c[None, :], mask=live[:, None])
    tl.store(hot_ptr + dst, k.to(ty), mask=live[:, None])
    v = tl.load(v_ptr + (r * s_vr + h * s_vh)[:, None] + c[None, :], mask=live[:, None])
    tl.store(hot_ptr + s_hw + dst, v.to(ty), mask=live[:, None])


def pack_kv_triton(
    pool: ColdPool, hot: Tensor, k: Tensor, v: Tensor, kind: Tensor, src: Tensor, dtype: torch.dtype
) -> Tensor:
    """The contract of :func:`~kvtune.kernels.chunk_kv_ref.pack_kv_ref`, one launch."""
    rows, h, d = kind.shape[0], k.shape[1], k.shape[2]
    if not tileable_head_dim(d):
        return pack_kv_ref(pool, hot, k, v, kind, src, dtype)
    _check(k, v, hot, pool)
    out = torch.empty((2, rows, h, d), dtype=dtype, device=k.device)
    if rows == 0:
        return out
    launch(_pack_kernel, (cdiv(rows, ROWS), h),
        kind, src, out, k, v, hot, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale,
        pool.block_bits, rows, out.stride(0), out.stride(1), out.stride(2), k.stride(0), k.stride(1),
        hot.stride(0), hot.stride(1), hot.stride(2), hot.stride(3), pool.k.stride(0), pool.k.stride(1),
        pool.k.stride(2), pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0),
        pool.v_min.stride(1),
        BS=pool.k.shape[2], CAP=hot.shape[3], D=d, POOL_BITS=pool.bits, ROWS=ROWS,
        HAS_POOL=pool.k.shape[0] > 0, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def hot_write_triton(
    hot: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor, rows: Tensor | None = None
) -> None:
    """The contract of :func:`~kvtune.kernels.chunk_kv_ref.hot_write_ref`, one launch."""
    n, h, d = slots.shape[0], k.shape[1], k.shape[2]
    if d & (d - 1) or d < 16:
        hot_write_ref(hot, k, v, slots, positions, rows)
        return
    unit = k.stride(2) == 1 and v.stride(2) == 1 and hot.stride(4) == 1
    require("hot_write", {"unit stride on D (k, v, hot)": unit}, lambda: f"k {tuple(k.stride())}")
    if n == 0:
        return
    launch(_hot_write_kernel, (cdiv(n, ROWS), h),
        k, v, slots if rows is None else rows, slots, positions, hot, n,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), hot.stride(0), hot.stride(1), hot.stride(2),
        hot.stride(3), D=d, ROWS=ROWS, HAS_ROWS=rows is not None,
    )  # fmt: skip


def _check(k: torch.Tensor, v: torch.Tensor, hot: torch.Tensor, pool: ColdPool) -> None:
    rules = {
        "k, v [N, H, D] alike with unit stride on D": k.shape == v.shape and k.stride() == v.stride()
        and k.stride(2) == 1,
        "hot [2, S, H, C, D] with unit stride on D": hot.dim() == 5 and hot.stride(4) == 1
        and tuple(hot.shape[2::2]) == tuple(k.shape[1:]),
        "pool rows contiguous, K and V alike": pool.k.stride() == pool.v.stride() and pool.k.stride(3) == 1
        and pool.k_min.stride(2) == 1 and pool.v_min.stride(2) == 1,
    }  # fmt: skip
    require(
        "pack_kv", rules, lambda: f"k {tuple(k.shape)}, hot {tuple(hot.shape)}, pool {tuple(pool.k.shape)}"
    )
