"""Sealing (quantize + pack) and INT8 -> INT4 demotion in Triton; layout in :mod:`kvtune.kernels.layout`.

One program per (block, KV head) holds the block's ``[block_size, D]`` keys and values in registers as two
channel halves ``[0, D/2)`` and ``[D/2, D)`` (an INT4 byte ``c`` packs channel ``c`` with ``c + D/2``).
The arithmetic repeats :mod:`kvtune.kernels.quant_ref` operation by operation, in float32 with IEEE
division, no fused multiply-add (``enable_fp_fusion=False``) and round-half-even through ``(y + 2^23) -
2^23``, so codes, mins and scales equal the reference's on the CPU (interpreter tests). On the GPU the tests
check the layout's error bound instead: the reference run by PyTorch on CUDA divides by a Python scalar
through its reciprocal and can land one fp16 step away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant_ref import check_seal_bits, seal_blocks_ref
from kvtune.kernels.requant_ref import requantize_int4_ref
from kvtune.kernels.triton_common import next_pow2, tileable_head_dim


@triton.jit
def _round_f16(x, UP: tl.constexpr):
    """fp16 value (as float32) >= x (UP) or <= x, at most one ulp from the nearest rounding."""
    y = x.to(tl.float16).to(tl.float32)
    if UP:
        bumped = ((y + tl.abs(y) * 0.0009765625) + 5.960464477539063e-08).to(tl.float16).to(tl.float32)
        return tl.where(y < x, bumped, y)
    else:
        bumped = ((y - tl.abs(y) * 0.0009765625) - 5.960464477539063e-08).to(tl.float16).to(tl.float32)
        return tl.where(y > x, bumped, y)


@triton.jit
def _min_scale(lo, hi, LEVELS: tl.constexpr):
    """fp16-exact (min, scale) with min <= lo and min + LEVELS * scale >= hi."""
    lo16 = _round_f16(lo, False)
    return lo16, _round_f16(tl.div_rn(tl.maximum(hi - lo16, 0.0), LEVELS * 1.0), True)


@triton.jit
def _quantize(x, lo16, scale16, LEVELS: tl.constexpr):
    """uint8 codes round((x - min) / scale) clamped to [0, LEVELS] (round half to even)."""
    safe = tl.where(scale16 > 0, scale16, 1.0)
    y = tl.minimum(tl.maximum(tl.div_rn(x - lo16, safe), 0.0), LEVELS * 1.0)
    return ((y + 8388608.0) - 8388608.0).to(tl.uint8)


@triton.jit
def _store_codes(ptr, t, c, tmask, c_lo, c_hi, BITS: tl.constexpr, POOL_BITS: tl.constexpr, DH: tl.constexpr):
    """Code halves [T, DH] -> block rows: 8 bits as is; 4 bits packed (+ zeroed tail in an 8-bit slot)."""
    offs = t[:, None] * (DH * POOL_BITS // 4) + c[None, :]
    if BITS == 8:
        tl.store(ptr + offs, c_lo, mask=tmask[:, None])
        tl.store(ptr + offs + DH, c_hi, mask=tmask[:, None])
    else:
        tl.store(ptr + offs, c_lo | (c_hi << 4), mask=tmask[:, None])
        if POOL_BITS == 8:
            tl.store(ptr + offs + DH, tl.zeros_like(c_lo), mask=tmask[:, None])


@triton.jit
def _outward_e4m3(x, UP: tl.constexpr):
    """``x`` (float32) rounded to e4m3 towards +inf (UP) or -inf: (uint8 code, its value as float32), by
    integer operations on the bits (no float8 type: compiles for every architecture), saturating at ±448;
    :func:`kvtune.kernels.quest_summary.outward_codes` is the reference."""
    a = tl.abs(x)
    b = a.to(tl.int32, bitcast=True)
    e = (b >> 23) - 127
    normal = e >= -6  # e4m3's smallest normal is 2^-6
    s = a * 512.0  # below it, |x| in units of the smallest subnormal (2^-9), exact
    sub = s.to(tl.int32)
    inexact = tl.where(normal, (b & 0xFFFFF) != 0, s != sub.to(tl.float32))
    away = (x > 0) if UP else (x < 0)  # rounding away from zero: the next code (carries into the exponent)
    inc = (inexact & away).to(tl.int32)
    code = tl.minimum(tl.where(normal, ((e + 7) << 3) | ((b >> 20) & 7), sub) + inc, 0x7E)
    step = ((tl.maximum(e, -6) + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): one code at exponent e
    trunc = (b & -1048576).to(tl.float32, bitcast=True)  # the top 3 mantissa bits kept
    value = tl.where(normal, trunc + inc.to(tl.float32) * step, (sub + inc).to(tl.float32) / 512.0)
    value = tl.minimum(value, 448.0)
    return (code | tl.where(x < 0, 0x80, 0)).to(tl.uint8), tl.where(x < 0, -value, value)


@triton.jit
def _summary(lo, sc, slo_ptr, ssp_ptr, c, LEVELS: tl.constexpr):
    """Store the e4m3 summary of fp16-exact (min, scale) channels ``c``: lo = min rounded down, span = (min −
    lo) + scale · LEVELS rounded up (:func:`kvtune.kernels.quest_summary.summary_codes`, the same floats;
    the kernels that call it compile without FMA contraction)."""
    code, lo8 = _outward_e4m3(lo, False)
    a = lo - lo8
    b = sc * LEVELS
    d = a + b
    below = (a - (d - (d - a))) + (b - (d - a)) > 0  # the exact sum above its rounding (TwoSum's error)
    d = tl.where(below, (d.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), d)
    span, _ = _outward_e4m3(d, True)
    tl.store(slo_ptr + c, code)
    tl.store(ssp_ptr + c, span)


@triton.jit
def _key_bounds(x_lo, x_hi, tmask, kmin_ptr, ksc_ptr, c, LEVELS: tl.constexpr, DH: tl.constexpr,
                slo_ptr, ssp_ptr, SUMMARY: tl.constexpr):  # fmt: skip
    """Per-channel (min, scale) of one head's keys in a block, both halves, stored (and their e4m3 summary
    where SUMMARY); returned as (min, scale) of the low half, then of the high half."""
    big = float("inf")
    lo_lo, sc_lo = _min_scale(tl.min(tl.where(tmask[:, None], x_lo, big), 0),
                              tl.max(tl.where(tmask[:, None], x_lo, -big), 0), LEVELS)  # fmt: skip
    lo_hi, sc_hi = _min_scale(tl.min(tl.where(tmask[:, None], x_hi, big), 0),
                              tl.max(tl.where(tmask[:, None], x_hi, -big), 0), LEVELS)  # fmt: skip
    tl.store(kmin_ptr + c, lo_lo.to(tl.float16))
    tl.store(kmin_ptr + DH + c, lo_hi.to(tl.float16))
    tl.store(ksc_ptr + c, sc_lo.to(tl.float16))
    tl.store(ksc_ptr + DH + c, sc_hi.to(tl.float16))
    if SUMMARY:
        _summary(lo_lo, sc_lo, slo_ptr, ssp_ptr, c, LEVELS)
        _summary(lo_hi, sc_hi, slo_ptr + DH, ssp_ptr + DH, c, LEVELS)
    return lo_lo, sc_lo, lo_hi, sc_hi


@triton.jit
def _seal_tile(
    x_lo,
    x_hi,
    tmask,
    code_ptr,
    kmin_ptr,
    ksc_ptr,
    t,
    c,
    IS_KEY: tl.constexpr,
    BITS: tl.constexpr,
    POOL_BITS: tl.constexpr,
    DH: tl.constexpr,
    slo_ptr=None,
    ssp_ptr=None,
    SUMMARY: tl.constexpr = False,
):
    """Quantize one head's keys (per channel) or values (per token) of a block; store codes + min/scale.
    Bits 0: store the block as it is, in the pool's precision, and the keys' min and ``max − min`` per
    channel (the reference's bounds, one level)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    if BITS == 0:
        if IS_KEY:
            _key_bounds(x_lo, x_hi, tmask, kmin_ptr, ksc_ptr, c, 1, DH, slo_ptr, ssp_ptr, SUMMARY)
        offs = t[:, None] * (2 * DH) + c[None, :]
        tl.store(code_ptr + offs, x_lo.to(code_ptr.dtype.element_ty), mask=tmask[:, None])
        tl.store(code_ptr + offs + DH, x_hi.to(code_ptr.dtype.element_ty), mask=tmask[:, None])
    elif IS_KEY:
        lo_lo, sc_lo, lo_hi, sc_hi = _key_bounds(x_lo, x_hi, tmask, kmin_ptr, ksc_ptr, c, LEVELS, DH, slo_ptr,
                                                 ssp_ptr, SUMMARY)  # fmt: skip
        c_lo = _quantize(x_lo, lo_lo[None, :], sc_lo[None, :], LEVELS)
        c_hi = _quantize(x_hi, lo_hi[None, :], sc_hi[None, :], LEVELS)
        _store_codes(code_ptr, t, c, tmask, c_lo, c_hi, BITS, POOL_BITS, DH)
    else:
        lo, sc = _min_scale(tl.minimum(tl.min(x_lo, 1), tl.min(x_hi, 1)),
                            tl.maximum(tl.max(x_lo, 1), tl.max(x_hi, 1)), LEVELS)  # fmt: skip
        c_lo = _quantize(x_lo, lo[:, None], sc[:, None], LEVELS)
        c_hi = _quantize(x_hi, lo[:, None], sc[:, None], LEVELS)
        tl.store(kmin_ptr + t, lo.to(tl.float16), mask=tmask)
        tl.store(ksc_ptr + t, sc.to(tl.float16), mask=tmask)
        _store_codes(code_ptr, t, c, tmask, c_lo, c_hi, BITS, POOL_BITS, DH)


@triton.jit
def _seal_kernel(
    k_ptr, v_ptr, ids_ptr, rows_ptr, pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr,
    s_in, s_it, s_ih, s_pn, s_ph, s_kn, s_kh, s_vn, s_vh,
    BS: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, POOL_BITS: tl.constexpr,
    HAS_ROWS: tl.constexpr, SUMMARY: tl.constexpr,
):  # fmt: skip
    """Seal block i (k, v [N, bs, H, D] at row rows[i], or i) for KV head h into pool row ids[i]; with
    SUMMARY the keys' e4m3 bounds too (``slo_ptr``/``ssp_ptr``, laid out as the key mins)."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    DH: tl.constexpr = D // 2
    bid = tl.load(ids_ptr + i).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i
    t = tl.arange(0, T)
    c = tl.arange(0, DH)
    tmask = t < BS
    src = r * s_in + t[:, None] * s_it + h * s_ih + c[None, :]
    dst = bid * s_pn + h * s_ph
    kq = bid * s_kn + h * s_kh
    for which in tl.static_range(2):
        x_ptr = k_ptr if which == 0 else v_ptr
        x_lo = tl.load(x_ptr + src, mask=tmask[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + src + DH, mask=tmask[:, None], other=0.0).to(tl.float32)
        if which == 0:
            _seal_tile(x_lo, x_hi, tmask, pk_ptr + dst, kmin_ptr + kq, ksc_ptr + kq, t, c, True, BITS,
                       POOL_BITS, DH, slo_ptr + kq, ssp_ptr + kq, SUMMARY)  # fmt: skip
        else:
            vq = bid * s_vn + h * s_vh
            _seal_tile(x_lo, x_hi, tmask, pv_ptr + dst, vmin_ptr + vq, vsc_ptr + vq, t, c, False, BITS,
                       POOL_BITS,
                       DH)  # fmt: skip


@triton.jit
def _requant_block(
    pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr, dst, kq, vq, t, c, tmask,
    D: tl.constexpr, DH: tl.constexpr, SUMMARY: tl.constexpr,
):  # fmt: skip
    """Dequantize one 8-bit (block, head) tile (codes at ``dst``, key min/scale at ``kq``, value min/scale at
    ``vq``) and seal it again at 4 bits in place."""
    row = dst + t[:, None] * D + c[None, :]
    # keys: x = min_c + code * scale_c; values: x = min_t + code * scale_t (all loads before any store)
    k_lo = (
        tl.load(kmin_ptr + kq + c).to(tl.float32)[None, :]
        + tl.load(pk_ptr + row, mask=tmask[:, None], other=0).to(tl.float32)
        * tl.load(ksc_ptr + kq + c).to(tl.float32)[None, :]
    )
    k_hi = (
        tl.load(kmin_ptr + kq + DH + c).to(tl.float32)[None, :]
        + tl.load(pk_ptr + row + DH, mask=tmask[:, None], other=0).to(tl.float32)
        * tl.load(ksc_ptr + kq + DH + c).to(tl.float32)[None, :]
    )
    vmin = tl.load(vmin_ptr + vq + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    vsc = tl.load(vsc_ptr + vq + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    v_lo = vmin + tl.load(pv_ptr + row, mask=tmask[:, None], other=0).to(tl.float32) * vsc
    v_hi = vmin + tl.load(pv_ptr + row + DH, mask=tmask[:, None], other=0).to(tl.float32) * vsc
    _seal_tile(k_lo, k_hi, tmask, pk_ptr + dst, kmin_ptr + kq, ksc_ptr + kq, t, c, True, 4, 8, DH,
               slo_ptr + kq, ssp_ptr + kq, SUMMARY)  # fmt: skip
    _seal_tile(v_lo, v_hi, tmask, pv_ptr + dst, vmin_ptr + vq, vsc_ptr + vq, t, c, False, 4, 8, DH)


@triton.jit
def _requant_kernel(
    ids_ptr, keep_ptr, pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr,
    s_pn, s_ph, s_kn, s_kh, s_vn, s_vh,
    BS: tl.constexpr, T: tl.constexpr, D: tl.constexpr, SUMMARY: tl.constexpr,
):  # fmt: skip
    """Dequantize 8-bit block ids[i] (head h) and seal it again at 4 bits in place; skip if keep[i]."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    if tl.load(keep_ptr + i) == 0:
        bid = tl.load(ids_ptr + i).to(tl.int64)
        t = tl.arange(0, T)
        c = tl.arange(0, D // 2)
        _requant_block(
            pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr, bid * s_pn + h * s_ph,
            bid * s_kn + h * s_kh, bid * s_vn + h * s_vh, t, c, t < BS, D, D // 2, SUMMARY,
        )  # fmt: skip


@triton.jit
def _requant_list_kernel(
    ids_ptr, count_ptr, pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr,
    num_blocks, l_p, l_k, l_v,
    s_pn, s_ph, s_kn, s_kh, s_vn, s_vh,
    BS: tl.constexpr, T: tl.constexpr, D: tl.constexpr, SUMMARY: tl.constexpr,
):  # fmt: skip
    """``_requant_kernel`` over a device-side list: entries ``ids[i] = layer · num_blocks + block`` for
    ``i < count`` (read here), head ``program_id(1)``, programs striding the list; layer ``l``'s pool
    starts ``l · l_p`` (codes), ``l · l_k`` (key min/scale), ``l · l_v`` (value min/scale) elements after
    layer 0's (the summary's as the key mins)."""
    h = tl.program_id(1)
    n = tl.load(count_ptr)
    t = tl.arange(0, T)
    c = tl.arange(0, D // 2)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        flat = tl.load(ids_ptr + i).to(tl.int64)
        layer = flat // num_blocks
        bid = flat - layer * num_blocks
        _requant_block(
            pk_ptr, pv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, slo_ptr, ssp_ptr,
            layer * l_p + bid * s_pn + h * s_ph, layer * l_k + bid * s_kn + h * s_kh,
            layer * l_v + bid * s_vn + h * s_vh, t, c, t < BS, D, D // 2, SUMMARY,
        )  # fmt: skip


def _check_pool_rows(pool: ColdPool) -> None:
    for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale"):
        x = getattr(pool, name)
        if x.stride(-1) != 1 or (x.dim() == 4 and x.stride(2) != x.shape[3]):
            raise ValueError(f"pool.{name} must have contiguous rows (strides {x.stride()})")
    if pool.summary is not None:
        for name in ("lo", "span"):
            x = getattr(pool.summary, name)
            if x.stride() != pool.k_min.stride():
                raise ValueError(
                    f"pool.summary.{name} must have the key mins' strides {pool.k_min.stride()}, "
                    f"but has {x.stride()}"
                )


def _summary_args(pool: ColdPool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The summary's lo and span as uint8 (the kernels write codes), or the key mins twice (unused)."""
    if pool.summary is None:
        return pool.k_min, pool.k_min, False
    return pool.summary.lo.view(torch.uint8), pool.summary.span.view(torch.uint8), True


def seal_blocks_triton(
    pool: ColdPool,
    block_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Same contract as ``seal_blocks_ref``: blocks ``k[rows[i]]``, ``v[rows[i]]`` (``[bs, H, D]``, any
    strides but a unit one on D; ``k[i]`` without ``rows``) -> pool rows ``block_ids[i]``."""
    check_seal_bits(pool, bits)
    n = int(block_ids.numel())
    if n == 0:
        return
    if not tileable_head_dim(k.shape[3]):
        seal_blocks_ref(pool, block_ids, k, v, bits, rows)
        return
    _check_pool_rows(pool)
    if k.stride() != v.stride() or k.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()
    bs, H, D = k.shape[1], k.shape[2], k.shape[3]
    ids = block_ids.to(torch.int64).contiguous()
    row_ids = ids if rows is None else rows.to(torch.int64).contiguous()
    slo, ssp, summary = _summary_args(pool)
    launch(_seal_kernel, (n, H),
        k, v, ids, row_ids, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min,
        pool.v_scale, slo, ssp, k.stride(0), k.stride(1), k.stride(2), pool.k.stride(0), pool.k.stride(1),
        pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1),
        BS=bs, T=next_pow2(bs), D=D, BITS=bits, POOL_BITS=pool.bits, HAS_ROWS=rows is not None,
        SUMMARY=summary, enable_fp_fusion=False,
    )  # fmt: skip
    pool.block_bits.index_fill_(0, block_ids.long(), bits)  # capture-safe: no host tensor


def requantize_int4_triton(pool: ColdPool, block_ids: torch.Tensor) -> None:
    """Same contract as ``requantize_int4_ref``: 8-bit blocks -> 4 bits in place; 4-bit blocks stay."""
    if pool.bits != 8:
        raise ValueError(f"requantize_int4 needs an 8-bit pool, got a {pool.bits}-bit one")
    n = int(block_ids.numel())
    if n == 0:
        return
    if not tileable_head_dim(pool.k.shape[3]):
        requantize_int4_ref(pool, block_ids)
        return
    _check_pool_rows(pool)
    ids = block_ids.to(torch.int64).contiguous()
    keep = (pool.block_bits[ids] == 4).to(torch.int8)
    bs, H, D = pool.k.shape[2], pool.k.shape[1], pool.k.shape[3]
    slo, ssp, summary = _summary_args(pool)
    launch(_requant_kernel, (n, H),
        ids, keep, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale, slo, ssp,
        pool.k.stride(0), pool.k.stride(1), pool.k_min.stride(0), pool.k_min.stride(1),
        pool.v_min.stride(0), pool.v_min.stride(1),
        BS=bs, T=next_pow2(bs), D=D, SUMMARY=summary, enable_fp_fusion=False,
    )  # fmt: skip
    pool.block_bits.index_fill_(0, ids.long(), 4)


LIST_PROGRAMS = 64  # programs striding the compacted list (per KV head); one under the interpreter


def _layer_stride(pools: Sequence[ColdPool], name: str) -> int | None:
    """Elements between consecutive layers' ``name`` tensors when every layer's is a slice of one allocation
    at a constant stride (:meth:`~kvtune.kernels.layout.ColdLayout.allocate_layers`), else None."""
    return _stride_of([getattr(pool, name) for pool in pools])


def _stride_of(xs: Sequence[torch.Tensor]) -> int | None:
    """:func:`_layer_stride` of the tensors ``xs``, one per layer."""
    first = xs[0]
    if len(xs) == 1:
        return 0
    step = xs[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    for i, x in enumerate(xs):
        if x.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if x.data_ptr() != first.data_ptr() + i * step or x.stride() != first.stride():
            return None
    return step // size if step % size == 0 else None


def _summary_stride(pools: Sequence[ColdPool], name: str) -> int | None:
    """:func:`_layer_stride` of the summaries' ``name`` (lo or span), every pool keeping one."""
    xs = [getattr(p.summary, name) for p in pools if p.summary is not None]
    return _stride_of(xs) if len(xs) == len(pools) else None


def requantize_int4_masked_triton(pools: Sequence[ColdPool], mask: torch.Tensor) -> None:
    """Same contract as ``requantize_int4_masked``: one launch over every layer (pools of one allocation),
    else one per layer; no host read of the mask."""
    if pools[0].bits != 8:
        raise ValueError(f"requantize_int4 needs 8-bit pools, got a {pools[0].bits}-bit one")
    if not tileable_head_dim(pools[0].k.shape[3]):  # the reference over every block, masked: no host read
        for layer, pool in enumerate(pools):
            ids = torch.arange(pool.num_blocks, device=mask.device)
            requantize_int4_ref(pool, ids, where=mask[layer])
        return
    strides = [_layer_stride(pools, name) for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale")]
    bits_stride = _layer_stride(pools, "block_bits")
    same = strides[0] == strides[1] and strides[2] == strides[3] and strides[4] == strides[5]
    if pools[0].summary is not None:  # the summary's layers at the key mins' stride
        same = same and all(_summary_stride(pools, name) == strides[2] for name in ("lo", "span"))
    if any(x is None for x in (*strides, bits_stride)) or not same:
        for layer, pool in enumerate(pools):
            requantize_int4_masked_triton([pool], mask[layer : layer + 1])
        return
    pool = pools[0]
    for p in pools:
        _check_pool_rows(p)
    layers, n = mask.shape
    bits = torch.as_strided(pool.block_bits, (layers, n), (int(bits_stride or 0), 1))
    todo = (mask & (bits == 8)).flatten()  # a 4-bit block stays as it is
    pos = todo.cumsum(0) - 1
    count = todo.sum()
    ids = torch.empty(layers * n + 1, dtype=torch.int64, device=mask.device)
    ids.index_copy_(0, torch.where(todo, pos, layers * n), torch.arange(layers * n, device=mask.device))
    bs, H, D = pool.k.shape[2], pool.k.shape[1], pool.k.shape[3]
    programs = LIST_PROGRAMS if mask.is_cuda else 1  # the interpreter runs every program in Python
    slo, ssp, summary = _summary_args(pool)
    launch(_requant_list_kernel, (programs, H),
        ids, count, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale, slo, ssp,
        n, strides[0], strides[2], strides[4],
        pool.k.stride(0), pool.k.stride(1), pool.k_min.stride(0), pool.k_min.stride(1),
        pool.v_min.stride(0), pool.v_min.stride(1),
        BS=bs, T=next_pow2(bs), D=D, SUMMARY=summary, enable_fp_fusion=False,
    )  # fmt: skip
    bits.masked_fill_(todo.view(layers, n), 4)
