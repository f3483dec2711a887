"""Fused hybrid decode attention in Triton: one split-K pass, then a merge.

One program of ``_split_kernel`` owns one (sequence ``b``, KV head ``h``, split ``s``) and all ``G`` query
heads of that KV head's group (padded to ``GP >= 16`` rows for ``tl.dot``). It walks its share of the cold
blocks listed in ``block_table[b, h, :num_cold[b, h]]`` -- the row's own count split evenly over the splits,
not the table's width, so the short rows of a sparse table (``M + k`` columns, ``n1 + k`` listed) keep every
split busy (the last split also walks the hot zone) -- with an online softmax in base 2. The Gluon builds
(below) go further: a row keeps one split busy per ``gluon_busy_blocks`` of its listed blocks, the others
write no partial and the merge reads none for them (``_busy_splits``). Quantized blocks are
never dequantized element by element (``x = min + code * scale``):

* keys, per channel: ``q . k = sum_d (q_d scale_d) code_d + sum_d q_d min_d`` -- the scale and min fold into
  ``q`` once per block, and the matrix unit multiplies ``q * scale`` (fp16) by the raw codes (fp16, exact);
* values, per token: ``p . v = sum_t (p_t scale_t) code_t + sum_t p_t min_t`` -- the scales fold into ``p``.

The head dimension is processed as two halves ``[0, D/2)`` and ``[D/2, D)``: an INT4 byte ``c`` holds channel
``c`` (low nibble) and ``c + D/2`` (high nibble), so both halves come from one byte tile with a mask and a
shift. An 8-bit pool whose block was demoted to 4 bits (``block_bits == 4``) takes the same path with
per-block shift, mask and column offset, without a branch. The codes become fp16 by the magic-number trick
(``0x6400 | c`` is ``1024 + c`` in fp16) -- as pure ``tl`` bit operations, or as PTX ``prmt`` on four codes at
once (GPU only, ``cvt=2``).

``_merge_kernel`` combines the splits (log-sum-exp), writes the output, the per-block attention mass
``exp2(lse_block - lse_total)`` averaged over the group, and the hot zone's mass. Where the Gluon kernel
(``gluon_decode``) reads the cold blocks of a pure 8-bit or 4-bit pool, the merge attends the hot zone
itself before it merges, launched as a programmatic dependent so that it does so while the cold blocks
stream; the hot zone's products need 16 query rows, and the rest of the merge runs at the group's own rows
(``MERGE_GROUP_ROWS``), 8 partials in flight (``MERGE_TILE``). An 8-bit pool with demoted blocks takes the
Gluon kernel where ``gluon_mixed`` asks: its table split by bits (``triton_bits_partition``), the 8-bit and
the 4-bit builds over their halves, and the merge finds each block's lse through the split's positions
(``MAPPED``).

Which of these kernels takes a launch is decided by :func:`kvtune.kernels.decode_choice.decode_kernel`, with
the options of :class:`~kvtune.kernels.decode_choice.DecodeKernelOptions`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kvtune.kernels import gluon_decode
from kvtune.kernels.arch import HOPPER, Arch, arch_of, num_sms
from kvtune.kernels.bits_partition_ref import BitsPartition, partition_width
from kvtune.kernels.decode_choice import PURE_INT8 as PURE_INT8
from kvtune.kernels.decode_choice import DecodeKernel, decode_kernel, options_for
from kvtune.kernels.decode_choice import DecodeKernelOptions as DecodeKernelOptions
from kvtune.kernels.decode_choice import default_options as default_options
from kvtune.kernels.decode_ref import hybrid_decode_attention_ref
from kvtune.kernels.launch import launch
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.triton_bits_partition import partition_by_bits_triton
from kvtune.kernels.triton_common import cdiv, next_pow2, replaced, require

LOG2E = 1.4426950408889634
# Splits' partials the merge loads before it merges them (``_merge_kernel``'s ``SB``: 1, 4, 8 or 16; 8 was
# within 1 % of 4 on an H200, run 24b, and with ``MERGE_GROUP_ROWS`` took sparse INT4 at 4 x 128K from 0.0576
# to 0.0427 ms on an H100, run 57b, where 16 gained no more); listed blocks per step of the merge's per-block
# mass (``MB``), and whether the first step's loads go out with the first partials (``AHEAD``): on the H200
# (graphs, run 24b) AHEAD took sparse INT4 at 4 x 128K from 0.0530 to 0.0504 ms and 128 blocks a step to
# 0.0498 (dense INT4 at 4 x 128K: 0.2052, 0.2016, 0.1940).
MERGE_TILE = 8
# Where the Gluon kernel takes the cold blocks, the merge handles the partials, the output and the mass at the
# group's rows (``GM``), not at the 16 its hot zone's products pad them to: a quarter of the registers a
# partial at G 4, so ``MERGE_TILE`` 8 or 16 of them in flight at once.
MERGE_GROUP_ROWS = True
MASS_TILE = 128
MASS_AHEAD = True
# The merge's software-pipelining stages where the Gluon kernel takes the cold blocks (None: Triton's default,
# which gives its loops cp.async rings of ~70 KB of shared memory on sm_90; 1: plain loads, ~22 KB). The merge
# alone is no faster at 1, but its programs, launched early, leave the cold kernel more shared memory: the
# sparse steps 1-4 % faster on an H200 (run 24g).
MERGE_STAGES: int | None = 1
# Programs a multiprocessor the wave model leaves out of a Gluon build's slots (its occupancy less this), so
# that the merge, a programmatic dependent, finds room beside the cold programs. 0: every slot. Leaving one
# out was slower on an H200 (run 28a, graphs, split-major): sparse INT4 at 4 x 128K 0.0681 ms against 0.0464
# (the plan took 57 splits), dense INT4 at 16 x 32K 0.173 against 0.161 (``lab/scripts/busy_order.py``).
WAVE_FREE = 0
# The split kernel's launch order: split-major (every row's split 0 first, as ``gluon_decode.SPLIT_MAJOR``) or
# a row's splits one after another (False). On an H200 (run 28a, graphs, two rounds) split-major was never
# slower: unquantized at 4 x 128K 0.536 ms against 0.545 dense and 0.0839 against 0.0887 sparse (L1 1/8 + top
# 2,048), 64 x 8K and 16 x 32K within 0.1 %.
SPLIT_MAJOR = True


def _prmt_asm(sel0: str, sel1: str) -> tl.constexpr:
    """PTX making two fp16x2 registers ($0, $1) of the bytes of one 32-bit register ($2) picked by two
    ``prmt`` selectors: ``0x64cc`` is ``1024 + c`` in fp16, minus 1024."""
    return tl.constexpr(
        "{\n.reg .b32 t0, t1, bias;\nmov.b32 bias, 0x64006400;\n"
        f"prmt.b32 t0, $2, 0x64646464, {sel0};\nprmt.b32 t1, $2, 0x64646464, {sel1};\n"
        "sub.f16x2 $0, t0, bias;\nsub.f16x2 $1, t1, bias;\n}\n"
    )


# Four codes of a register in channel order (bytes 0, 1 | 2, 3), or the even and the odd channel of two 16-bit
# code pairs (bytes 0, 2 | 1, 3).
_CODES = _prmt_asm("0x4140", "0x4342")
_PAIRS = _prmt_asm("0x4240", "0x4341")


@triton.jit
def _prmt_f16(x, ASM: tl.constexpr, PAIRS: tl.constexpr):
    """fp16 codes by the PTX ``ASM`` (GPU only): from uint8 codes, four per register (one output), or from
    uint16 code pairs, two per register (two outputs: the even and the odd channel)."""
    if PAIRS:
        return tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    else:
        return tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4
        )


@triton.jit
def _codes_to(x, CDT: tl.constexpr, CVT: tl.constexpr):
    """uint8 codes [.., n] -> CDT, exact (codes <= 255)."""
    if CVT == 2:
        return _prmt_f16(x, _CODES, False)
    elif CVT == 1:
        return (x.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return x.to(CDT)


@triton.jit
def _pair_to(x, CDT: tl.constexpr, CVT: tl.constexpr):
    """uint16 pairs of 8-bit codes (low byte: even channel) -> (even, odd) codes in CDT, exact."""
    if CVT == 2:  # one prmt (+ one sub.f16x2) per output register
        return _prmt_f16(x, _PAIRS, True)
    lo = x & 255
    hi = x >> 8
    if CVT == 0:
        return lo.to(CDT), hi.to(CDT)
    else:  # magic number: 0x6400 | c is 1024 + c in fp16
        even = (lo | 0x6400).to(tl.float16, bitcast=True)
        odd = (hi | 0x6400).to(tl.float16, bitcast=True)
        return even - 1024.0, odd - 1024.0


@triton.jit
def _value_pairs(ptr, s_t, T: tl.constexpr, DH: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr,
                 CVT: tl.constexpr):  # fmt: skip
    """The value codes of one 8-bit block as (even, odd) channel tiles [T, DH] in CDT (``v_pairs``)."""
    t = tl.arange(0, T)
    j = tl.arange(0, DH)
    offs = t[:, None].to(tl.int64) * (s_t // 2) + j[None, :]
    raw = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=(t < BS)[:, None], other=0)
    return _pair_to(raw, CDT, CVT)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax (base 2) over scores s [GP, T]: probabilities, rescale, new state, tile lse."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_tile = tl.sum(p, 1)
    return p, alpha, m_new, l_i * alpha + l_tile, m_new + tl.log2(l_tile)


@triton.jit
def _dense_tile(
    k_ptr,
    v_ptr,
    s_t,
    n_valid,
    q_lo,
    q_hi,
    qk_scale,
    m_i,
    l_i,
    acc_lo,
    acc_hi,
    DH: tl.constexpr,
    T: tl.constexpr,
    PREC: tl.constexpr,
    VPAIR: tl.constexpr = False,
):
    """T tokens in model precision (hot zone or an unquantized block); rows t >= n_valid masked. VPAIR: the
    output's two halves are the even and the odd channels (``v_pairs``), not the low and the high half."""
    t = tl.arange(0, T)
    c = tl.arange(0, DH)
    valid = t < n_valid
    offs = t[:, None].to(tl.int64) * s_t + c[None, :]
    k_lo = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
    k_hi = tl.load(k_ptr + offs + DH, mask=valid[:, None], other=0.0)
    s = tl.dot(q_lo, tl.trans(k_lo), input_precision=PREC) + tl.dot(
        q_hi, tl.trans(k_hi), input_precision=PREC
    )
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    p, alpha, m_i, l_i, lse = _softmax_step(s, m_i, l_i)
    if VPAIR:
        v_offs = t[:, None].to(tl.int64) * s_t + 2 * c[None, :]
        v_lo = tl.load(v_ptr + v_offs, mask=valid[:, None], other=0.0)
        v_hi = tl.load(v_ptr + v_offs + 1, mask=valid[:, None], other=0.0)
    else:
        v_lo = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        v_hi = tl.load(v_ptr + offs + DH, mask=valid[:, None], other=0.0)
    pv = p.to(v_lo.dtype)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(pv, v_lo, input_precision=PREC)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(pv, v_hi, input_precision=PREC)
    return m_i, l_i, acc_lo, acc_hi, lse


@triton.jit
def _hot_zone(k_ptr, v_ptr, s_t, n_hot, q_lo, q_hi, qk_scale, m_i, l_i, acc_lo, acc_hi, DH: tl.constexpr,
              HOT_T: tl.constexpr, PREC: tl.constexpr, VPAIR: tl.constexpr = False):  # fmt: skip
    """The hot zone's ``n_hot`` tokens (model precision) folded into the running state, ``HOT_T`` at a time;
    also returns the hot zone's own lse (-inf where it is empty)."""
    for t0 in range(0, n_hot, HOT_T):
        m_i, l_i, acc_lo, acc_hi, _ = _dense_tile(
            k_ptr + t0 * s_t, v_ptr + t0 * s_t, s_t, n_hot - t0, q_lo, q_hi, qk_scale, m_i, l_i, acc_lo,
            acc_hi, DH, HOT_T, PREC, VPAIR)  # fmt: skip
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    return m_i, l_i, acc_lo, acc_hi, lse


@triton.jit
def _code_halves(
    ptr,
    s_t,
    hi_off,
    shift,
    mask,
    T: tl.constexpr,
    DH: tl.constexpr,
    BS: tl.constexpr,
    KIND: tl.constexpr,
    MIXED: tl.constexpr,
    TRANS: tl.constexpr,
):
    """Codes of channels [0, D/2) and [D/2, D) of one block: two uint8 tiles [T, DH] ([DH, T] if TRANS)."""
    t = tl.arange(0, T)
    c = tl.arange(0, DH)
    if TRANS:
        offs = t[None, :].to(tl.int64) * s_t + c[:, None]
        tmask = (t < BS)[None, :]
    else:
        offs = t[:, None].to(tl.int64) * s_t + c[None, :]
        tmask = (t < BS)[:, None]
    raw_lo = tl.load(ptr + offs, mask=tmask, other=0)
    if KIND == 4:
        return raw_lo & 15, raw_lo >> 4
    elif MIXED:
        raw_hi = tl.load(ptr + offs + hi_off, mask=tmask, other=0)
        return raw_lo & mask, raw_hi >> shift
    else:
        return raw_lo, tl.load(ptr + offs + DH, mask=tmask, other=0)


@triton.jit
def _quant_tile(
    k_ptr,
    v_ptr,
    s_t,
    kmin_ptr,
    ksc_ptr,
    vmin_ptr,
    vsc_ptr,
    bits,
    q_lo,
    q_hi,
    m_i,
    l_i,
    acc_lo,
    acc_hi,
    DH: tl.constexpr,
    T: tl.constexpr,
    BS: tl.constexpr,
    KIND: tl.constexpr,
    MIXED: tl.constexpr,
    CDT: tl.constexpr,
    CVT: tl.constexpr,
    PREC: tl.constexpr,
    KT: tl.constexpr,
    VPAIR: tl.constexpr = False,
):
    """One quantized cold block; every pointer is already at this (block, head). KT: load keys as [DH, T];
    VPAIR: values as even/odd channel tiles (:func:`_value_pairs`)."""
    four = bits == 4
    hi_off = tl.where(four, 0, DH)
    shift = tl.where(four, 4, 0).to(tl.uint8)
    mask = tl.where(four, 15, 255).to(tl.uint8)
    c = tl.arange(0, DH)
    t = tl.arange(0, T)
    kmin_lo = tl.load(kmin_ptr + c).to(tl.float32)
    kmin_hi = tl.load(kmin_ptr + DH + c).to(tl.float32)
    ksc_lo = tl.load(ksc_ptr + c).to(tl.float32)
    ksc_hi = tl.load(ksc_ptr + DH + c).to(tl.float32)
    k_lo, k_hi = _code_halves(k_ptr, s_t, hi_off, shift, mask, T, DH, BS, KIND, MIXED, KT)
    if KT:
        k_lo = _codes_to(k_lo, CDT, CVT)
        k_hi = _codes_to(k_hi, CDT, CVT)
    else:
        k_lo = tl.trans(_codes_to(k_lo, CDT, CVT))
        k_hi = tl.trans(_codes_to(k_hi, CDT, CVT))
    qs_lo = (q_lo * ksc_lo[None, :]).to(CDT)
    qs_hi = (q_hi * ksc_hi[None, :]).to(CDT)
    qm = tl.sum(q_lo * kmin_lo[None, :], 1) + tl.sum(q_hi * kmin_hi[None, :], 1)
    s = tl.dot(qs_lo, k_lo, input_precision=PREC)
    s += tl.dot(qs_hi, k_hi, input_precision=PREC)
    s = tl.where((t < BS)[None, :], s + qm[:, None], float("-inf"))
    p, alpha, m_i, l_i, lse = _softmax_step(s, m_i, l_i)
    vmin = tl.load(vmin_ptr + t, mask=t < BS, other=0.0).to(tl.float32)
    vsc = tl.load(vsc_ptr + t, mask=t < BS, other=0.0).to(tl.float32)
    ps = (p * vsc[None, :]).to(CDT)
    pm = tl.sum(p * vmin[None, :], 1)
    if VPAIR:
        v_lo, v_hi = _value_pairs(v_ptr, s_t, T, DH, BS, CDT, CVT)
    else:
        v_lo, v_hi = _code_halves(v_ptr, s_t, hi_off, shift, mask, T, DH, BS, KIND, MIXED, False)
        v_lo = _codes_to(v_lo, CDT, CVT)
        v_hi = _codes_to(v_hi, CDT, CVT)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(ps, v_lo, input_precision=PREC) + pm[:, None]
    acc_hi = acc_hi * alpha[:, None] + tl.dot(ps, v_hi, input_precision=PREC) + pm[:, None]
    return m_i, l_i, acc_lo, acc_hi, lse


# Sizes that follow the batch and the sequence lengths are not specialized (an int equal to 1 or divisible by
# 16 would otherwise compile the kernel again, seconds each, in the middle of a replay).
@triton.jit
def _busy_splits(nc, num_splits, busy_blocks):
    """Splits of a row of ``nc`` listed blocks that take blocks: one per ``busy_blocks`` of them (rounded up),
    at least 1 and at most ``num_splits``; the row's blocks are shared evenly among them."""
    return tl.maximum(tl.minimum((nc + busy_blocks - 1) // busy_blocks, num_splits), 1)


@triton.jit(do_not_specialize=["busy_blocks", "num_splits", "M"])
def _split_kernel(
    q_ptr, hot_k_ptr, hot_v_ptr, hot_slot_ptr, hot_len_ptr,
    ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, bits_ptr, table_ptr, num_cold_ptr,
    part_acc_ptr, part_ml_ptr, blk_lse_ptr, hot_lse_ptr,
    qk_scale, busy_blocks, num_splits, M,
    s_qb, s_qh, s_hs, s_hh, s_ht, s_cn, s_ch, s_ct, s_kn, s_kh, s_vn, s_vh,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, T: tl.constexpr, BS: tl.constexpr,
    HOT_T: tl.constexpr, KIND: tl.constexpr, MIXED: tl.constexpr, CDT: tl.constexpr, CVT: tl.constexpr,
    PREC: tl.constexpr, KT: tl.constexpr = False, VPAIR: tl.constexpr = False, BUSY: tl.constexpr = False,
    SPLIT_MAJOR: tl.constexpr = False,
):  # fmt: skip
    """Partial attention of one (split, sequence * KV head): partial (m, l, acc), per-block and hot lse.
    ``BUSY``: a row's blocks are shared over ``_busy_splits`` of its splits (as the Gluon kernel does),
    else over all of them (``busy_blocks`` unused). ``SPLIT_MAJOR``: the grid is (B * H, splits)."""
    pid_s = tl.program_id(1 if SPLIT_MAJOR else 0)
    bh = tl.program_id(0 if SPLIT_MAJOR else 1)
    b = bh // H
    h = bh % H
    DH: tl.constexpr = D // 2
    g = tl.arange(0, GP)
    c = tl.arange(0, DH)
    gmask = g < G
    q_off = b.to(tl.int64) * s_qb + (h * G + g)[:, None] * s_qh + c[None, :]
    q_lo = tl.load(q_ptr + q_off, mask=gmask[:, None], other=0.0)
    q_hi = tl.load(q_ptr + q_off + DH, mask=gmask[:, None], other=0.0)
    qf_lo = q_lo.to(tl.float32) * qk_scale
    qf_hi = q_hi.to(tl.float32) * qk_scale
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, DH], tl.float32)
    acc_hi = tl.zeros([GP, DH], tl.float32)
    # The hot zone (model precision, newest tokens) belongs to the last split.
    is_last = pid_s == num_splits - 1
    n_hot = tl.where(is_last, tl.load(hot_len_ptr + b), 0)
    hot_off = tl.load(hot_slot_ptr + b).to(tl.int64) * s_hs + h * s_hh
    m_i, l_i, acc_lo, acc_hi, lse_hot = _hot_zone(
        hot_k_ptr + hot_off, hot_v_ptr + hot_off, s_ht, n_hot, q_lo, q_hi, qk_scale, m_i, l_i, acc_lo, acc_hi,
        DH, HOT_T, PREC, VPAIR)  # fmt: skip
    tl.store(hot_lse_ptr + bh * G + g, lse_hot, mask=gmask & is_last)
    # This split's share of the row's own cold blocks (L1, then selected L2): the row's count split evenly
    # over its busy splits (``_busy_splits``), so a row shorter than the table's width (a sparse table: M + k
    # columns, n1 + k listed) keeps them busy; the splits after them take no block.
    nc = tl.load(num_cold_ptr + bh)
    if BUSY:  # standing in for the Gluon kernel (tests): its busy splits
        busy = _busy_splits(nc, num_splits, busy_blocks)
        per = (nc + busy - 1) // busy
    else:  # every split (``busy_blocks`` unused: the busy arithmetic costs 13 registers on sm_90, run 24)
        per = (nc + num_splits - 1) // num_splits
    j0 = pid_s * per
    j1 = tl.minimum(j0 + per, nc)
    row = bh.to(tl.int64) * M
    for j in range(j0, j1):
        bid = tl.load(table_ptr + row + j).to(tl.int64)
        k_ptr = ck_ptr + bid * s_cn + h * s_ch
        v_ptr = cv_ptr + bid * s_cn + h * s_ch
        kq = bid * s_kn + h * s_kh  # this block's key and value scales and mins (quantized pools)
        vq = bid * s_vn + h * s_vh
        if KIND == 0:
            m_i, l_i, acc_lo, acc_hi, lse = _dense_tile(
                k_ptr, v_ptr, s_ct, BS, q_lo, q_hi, qk_scale, m_i, l_i, acc_lo, acc_hi, DH, T, PREC
            )
        else:
            bits = tl.load(bits_ptr + bid) if MIXED else KIND
            m_i, l_i, acc_lo, acc_hi, lse = _quant_tile(
                k_ptr, v_ptr, s_ct, kmin_ptr + kq, ksc_ptr + kq, vmin_ptr + vq, vsc_ptr + vq, bits,
                qf_lo, qf_hi, m_i, l_i, acc_lo, acc_hi, DH, T, BS, KIND, MIXED, CDT, CVT, PREC, KT,
                VPAIR)  # fmt: skip
        tl.store(blk_lse_ptr + (row + j) * G + g, lse, mask=gmask)
    part = (bh * num_splits + pid_s).to(tl.int64)
    if VPAIR:  # even and odd channels
        acc_off = part * G * D + g[:, None] * D + 2 * c[None, :]
        tl.store(part_acc_ptr + acc_off, acc_lo, mask=gmask[:, None])
        tl.store(part_acc_ptr + acc_off + 1, acc_hi, mask=gmask[:, None])
    else:
        acc_off = part * G * D + g[:, None] * D + c[None, :]
        tl.store(part_acc_ptr + acc_off, acc_lo, mask=gmask[:, None])
        tl.store(part_acc_ptr + acc_off + DH, acc_hi, mask=gmask[:, None])
    tl.store(part_ml_ptr + part * 2 * G + g, m_i, mask=gmask)
    tl.store(part_ml_ptr + part * 2 * G + G + g, l_i, mask=gmask)


@triton.jit
def _partial(part_ml_ptr, part_acc_ptr, bh, s, slots, end, g, c, gmask, G: tl.constexpr, D: tl.constexpr):
    """Slot ``s`` of row ``bh``'s ``slots`` partials: (m, l) [GP] and the accumulator's halves [GP, D/2]; an
    empty partial (m -1e30, l 0, acc 0) from ``end`` on."""
    DH: tl.constexpr = D // 2
    part = (bh * slots + s).to(tl.int64)
    ok = gmask & (s < end)
    m_s = tl.load(part_ml_ptr + part * 2 * G + g, mask=ok, other=-1.0e30)
    l_s = tl.load(part_ml_ptr + part * 2 * G + G + g, mask=ok, other=0.0)
    a_off = part * G * D + g[:, None] * D + c[None, :]
    a_lo = tl.load(part_acc_ptr + a_off, mask=ok[:, None], other=0.0)
    a_hi = tl.load(part_acc_ptr + a_off + DH, mask=ok[:, None], other=0.0)
    return m_s, l_s, a_lo, a_hi


@triton.jit
def _group_rows(m, l_sum, acc_lo, acc_hi, lse, gmask, GP: tl.constexpr, GM: tl.constexpr, DH: tl.constexpr):
    """The running state of ``GP`` rows (the first ``GM`` of them the group's, the rest padding) as ``GM``
    rows: the padding emptied, then each column of the [GP / GM, GM] view reduced (the group's rows meet
    only empty ones, so the values are exact)."""
    R: tl.constexpr = GP // GM
    m = tl.max(tl.reshape(tl.where(gmask, m, -1.0e30), [R, GM]), 0)
    l_sum = tl.sum(tl.reshape(tl.where(gmask, l_sum, 0.0), [R, GM]), 0)
    acc_lo = tl.sum(tl.reshape(tl.where(gmask[:, None], acc_lo, 0.0), [R, GM, DH]), 0)
    acc_hi = tl.sum(tl.reshape(tl.where(gmask[:, None], acc_hi, 0.0), [R, GM, DH]), 0)
    lse = tl.max(tl.reshape(tl.where(gmask, lse, float("-inf")), [R, GM]), 0)
    return m, l_sum, acc_lo, acc_hi, lse


@triton.jit
def _partials4(ml_ptr, acc_ptr, bh, s0, slots, end, g, c, gmask, G: tl.constexpr, D: tl.constexpr):
    """Slots ``s0 .. s0 + 3`` (:func:`_partial` each), their loads issued together."""
    return (
        _partial(ml_ptr, acc_ptr, bh, s0, slots, end, g, c, gmask, G, D),
        _partial(ml_ptr, acc_ptr, bh, s0 + 1, slots, end, g, c, gmask, G, D),
        _partial(ml_ptr, acc_ptr, bh, s0 + 2, slots, end, g, c, gmask, G, D),
        _partial(ml_ptr, acc_ptr, bh, s0 + 3, slots, end, g, c, gmask, G, D),
    )


@triton.jit
def _fold4(m, l_sum, acc_lo, acc_hi, four):
    """The running (m, l, acc) with four partials (:func:`_partials4`) merged in."""
    m0, l0, lo0, hi0 = four[0]
    m1, l1, lo1, hi1 = four[1]
    m2, l2, lo2, hi2 = four[2]
    m3, l3, lo3, hi3 = four[3]
    m_new = tl.maximum(tl.maximum(m, m0), tl.maximum(tl.maximum(m1, m2), m3))
    alpha = tl.exp2(m - m_new)
    b0 = tl.exp2(m0 - m_new)
    b1 = tl.exp2(m1 - m_new)
    b2 = tl.exp2(m2 - m_new)
    b3 = tl.exp2(m3 - m_new)
    l_sum = l_sum * alpha + l0 * b0 + l1 * b1 + l2 * b2 + l3 * b3
    acc_lo = (acc_lo * alpha[:, None] + lo0 * b0[:, None] + lo1 * b1[:, None] + lo2 * b2[:, None]
              + lo3 * b3[:, None])  # fmt: skip
    acc_hi = (acc_hi * alpha[:, None] + hi0 * b0[:, None] + hi1 * b1[:, None] + hi2 * b2[:, None]
              + hi3 * b3[:, None])  # fmt: skip
    return m_new, l_sum, acc_lo, acc_hi


@triton.jit
def _merge_slots(ml_ptr, acc_ptr, bh, begin, end, slots, m, l_sum, acc_lo, acc_hi, g, c, gmask,
                 G: tl.constexpr, D: tl.constexpr, SB: tl.constexpr):  # fmt: skip
    """The running (m, l, acc) with row ``bh``'s partials in slots ``begin .. end - 1`` merged in, ``SB`` (1,
    4, 8 or 16) of them loaded before any of them is merged."""
    for s0 in range(begin, end, SB):
        if SB == 1:
            m0, l0, lo0, hi0 = _partial(ml_ptr, acc_ptr, bh, s0, slots, end, g, c, gmask, G, D)
            m_new = tl.maximum(m, m0)
            alpha = tl.exp2(m - m_new)
            b0 = tl.exp2(m0 - m_new)
            l_sum = l_sum * alpha + l0 * b0
            acc_lo = acc_lo * alpha[:, None] + lo0 * b0[:, None]
            acc_hi = acc_hi * alpha[:, None] + hi0 * b0[:, None]
            m = m_new
        else:
            q0 = _partials4(ml_ptr, acc_ptr, bh, s0, slots, end, g, c, gmask, G, D)
            if SB >= 8:
                q1 = _partials4(ml_ptr, acc_ptr, bh, s0 + 4, slots, end, g, c, gmask, G, D)
            if SB == 16:
                q2 = _partials4(ml_ptr, acc_ptr, bh, s0 + 8, slots, end, g, c, gmask, G, D)
                q3 = _partials4(ml_ptr, acc_ptr, bh, s0 + 12, slots, end, g, c, gmask, G, D)
            m, l_sum, acc_lo, acc_hi = _fold4(m, l_sum, acc_lo, acc_hi, q0)
            if SB >= 8:
                m, l_sum, acc_lo, acc_hi = _fold4(m, l_sum, acc_lo, acc_hi, q1)
            if SB == 16:
                m, l_sum, acc_lo, acc_hi = _fold4(m, l_sum, acc_lo, acc_hi, q2)
                m, l_sum, acc_lo, acc_hi = _fold4(m, l_sum, acc_lo, acc_hi, q3)
    return m, l_sum, acc_lo, acc_hi


@triton.jit(do_not_specialize=["num_splits", "M", "lse_w", "split2", "busy1", "busy2"])
def _merge_kernel(
    part_acc_ptr, part_ml_ptr, blk_lse_ptr, hot_lse_ptr, num_cold_ptr, out_ptr, mass_ptr, hot_mass_ptr,
    q_ptr, hot_k_ptr, hot_v_ptr, hot_slot_ptr, hot_len_ptr, qk_scale,
    num_splits, M, s_ob, s_oh, s_qb, s_qh, s_hs, s_hh, s_ht, pos_ptr, lse_w,
    count1_ptr, count2_ptr, split2, busy1, busy2,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GM: tl.constexpr, D: tl.constexpr, MB: tl.constexpr,
    HOT: tl.constexpr = False, WAIT: tl.constexpr = False, HOT_T: tl.constexpr = 64,
    PREC: tl.constexpr = "tf32", MAPPED: tl.constexpr = False, SB: tl.constexpr = 4,
    ZB: tl.constexpr = 512, AHEAD: tl.constexpr = False,
):  # fmt: skip
    """Merge the splits of one (sequence, KV head): output rows, per-block mass, hot mass. ``HOT``: the hot
    zone is attended here first (the splits hold the cold blocks only) and ``WAIT``: this launch is a
    programmatic dependent of the splits' launch, so the hot zone overlaps it and only the merge waits.
    The block lse rows are ``lse_w`` wide; ``MAPPED`` (the table split by bits): entry ``j``'s lse is at
    ``pos[row, j]`` of its row, else at ``j``. ``SB`` (1, 4 or 8) splits' partials are loaded before any
    of them is merged, so that a row of many splits waits on one memory round trip per ``SB`` of them, not
    per split; the per-block mass reads only the row's ``num_cold`` listed blocks and writes the padding
    after them ``ZB`` zeros at a time (a sparse row lists a fraction of its table's width). ``HOT``: the
    Gluon builds wrote only their busy splits' partials, which are all the merge reads: the first build's
    in slots ``0 .. split2 - 1`` (its row's count at ``count1``, ``busy1`` blocks a busy split), with
    ``MAPPED`` the second's after them (``count2``, ``busy2``). ``AHEAD``: the first ``MB`` listed blocks'
    lse are loaded with the first partials (their positions before the wait), not after the output, one
    memory round trip fewer on the merge's serial path. ``GM`` (≤ ``GP``): after the hot zone, whose
    products need 16 rows, the partials, the output and the mass are handled at ``GM`` rows (the group's, to a
    power of two), so that ``SB`` partials in flight take a quarter of the registers at ``G`` 4."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    DH: tl.constexpr = D // 2
    g = tl.arange(0, GP)
    c = tl.arange(0, DH)
    gmask = g < G
    m = tl.full([GP], -1.0e30, tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, DH], tl.float32)
    acc_hi = tl.zeros([GP, DH], tl.float32)
    nc = tl.load(num_cold_ptr + bh)
    row = bh.to(tl.int64) * M
    if AHEAD:  # where the first MB listed blocks' lse are: the partition's positions, read before the wait
        j = tl.arange(0, MB)
        valid0 = j < nc
        if MAPPED:
            at0 = bh.to(tl.int64) * lse_w + tl.load(pos_ptr + row + j, mask=valid0, other=0)
        else:
            at0 = bh.to(tl.int64) * lse_w + j
    if HOT:
        q_off = b.to(tl.int64) * s_qb + (h * G + g)[:, None] * s_qh + c[None, :]
        q_lo = tl.load(q_ptr + q_off, mask=gmask[:, None], other=0.0)
        q_hi = tl.load(q_ptr + q_off + DH, mask=gmask[:, None], other=0.0)
        hot_off = tl.load(hot_slot_ptr + b).to(tl.int64) * s_hs + h * s_hh
        m, l_sum, acc_lo, acc_hi, lse_hot = _hot_zone(
            hot_k_ptr + hot_off, hot_v_ptr + hot_off, s_ht, tl.load(hot_len_ptr + b), q_lo, q_hi, qk_scale, m,
            l_sum, acc_lo, acc_hi, DH, HOT_T, PREC)  # fmt: skip
        if WAIT:
            tl.extra.cuda.gdc_wait()
    else:
        lse_hot = tl.load(hot_lse_ptr + bh * G + g, mask=gmask, other=float("-inf"))
    if GM < GP:  # the rest at the group's own rows: the hot zone's tile had the 16 rows its products need
        m, l_sum, acc_lo, acc_hi, lse_hot = _group_rows(m, l_sum, acc_lo, acc_hi, lse_hot, gmask, GP, GM, DH)
        g = tl.arange(0, GM)
        gmask = g < G
    if AHEAD:  # ... and their lse, in flight with the first partials
        lb0 = tl.load(blk_lse_ptr + at0[:, None] * G + g[None, :], mask=valid0[:, None] & gmask[None, :],
                      other=float("-inf"))  # fmt: skip
    if HOT:  # the Gluon builds' partials: each build's busy splits (``_busy_splits``), the rest unwritten
        busy = _busy_splits(tl.load(count1_ptr + bh), split2, busy1)
        m, l_sum, acc_lo, acc_hi = _merge_slots(part_ml_ptr, part_acc_ptr, bh, 0, busy, num_splits, m, l_sum,
                                                acc_lo, acc_hi, g, c, gmask, G, D, SB)  # fmt: skip
        if MAPPED:  # the 4-bit build's, in slots split2 ..
            busy = _busy_splits(tl.load(count2_ptr + bh), num_splits - split2, busy2)
            m, l_sum, acc_lo, acc_hi = _merge_slots(part_ml_ptr, part_acc_ptr, bh, split2, split2 + busy,
                                                    num_splits, m, l_sum, acc_lo, acc_hi, g, c, gmask, G, D,
                                                    SB)  # fmt: skip
    else:  # the split kernel's: every split (the last one holds the hot zone)
        m, l_sum, acc_lo, acc_hi = _merge_slots(part_ml_ptr, part_acc_ptr, bh, 0, num_splits, num_splits, m,
                                                l_sum, acc_lo, acc_hi, g, c, gmask, G, D, SB)  # fmt: skip
    safe_l = tl.where(l_sum > 0, l_sum, 1.0)
    lse = m + tl.log2(safe_l)
    out_off = b.to(tl.int64) * s_ob + (h * G + g)[:, None] * s_oh + c[None, :]
    out_t = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_off, (acc_lo / safe_l[:, None]).to(out_t), mask=gmask[:, None])
    tl.store(out_ptr + out_off + DH, (acc_hi / safe_l[:, None]).to(out_t), mask=gmask[:, None])
    hot = tl.where(gmask, tl.exp2(lse_hot - lse), 0.0)
    tl.store(hot_mass_ptr + bh, tl.sum(hot, 0) / G)
    first = 0
    if AHEAD:
        tl.store(mass_ptr + row + j, tl.sum(tl.exp2(lb0 - lse[None, :]), 1) / G, mask=j < M)
        first = MB
    for j0 in range(first, nc, MB):  # the row's listed blocks; the padding after them below, without loads
        j = j0 + tl.arange(0, MB)
        valid = j < nc
        if MAPPED:
            at = bh.to(tl.int64) * lse_w + tl.load(pos_ptr + row + j, mask=valid, other=0)
        else:
            at = bh.to(tl.int64) * lse_w + j
        lb = tl.load(blk_lse_ptr + at[:, None] * G + g[None, :], mask=valid[:, None] & gmask[None, :],
                     other=float("-inf"))  # fmt: skip
        tl.store(mass_ptr + row + j, tl.sum(tl.exp2(lb - lse[None, :]), 1) / G, mask=j < M)
    for z0 in range(tl.maximum((nc + MB - 1) // MB * MB, first), M, ZB):
        z = z0 + tl.arange(0, ZB)
        tl.store(mass_ptr + row + z, tl.zeros([ZB], tl.float32), mask=z < M)


# Triton picks its interpreter when a kernel is defined (at this module's import); it runs no PTX (cvt=2).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


class DecodePlan(NamedTuple):
    """One launch of :func:`hybrid_decode_attention_triton` as planned (:func:`launch_plan`)."""

    kernel: DecodeKernel  # :func:`~kvtune.kernels.decode_choice.decode_kernel`'s choice
    options: DecodeKernelOptions  # as the launch uses them (:func:`_resolved`)
    meta: dict[str, object]  # the split kernel's compile-time values (the merge reads HOT_T and PREC)
    key: tuple[object, ...]  # the Gluon build's occupancy key in ``_RESIDENT`` (() for the split kernel)
    splits: int
    per: int  # cold blocks per split of a full row (a row's own count is shared out on the device)
    stages4: int = 0  # ``gluon_mixed``: the ring depth of the 4-bit build (the 8-bit one's: options)
    splits4: int = 0  # ``gluon_mixed``: the 4-bit build's split count (0: ``splits``, as the 8-bit build)

    @property
    def slots(self) -> int:
        """Partials per (sequence, KV head) row: one per split of each build."""
        if self.kernel != "gluon_mixed":
            return self.splits
        return self.splits + (self.splits4 or self.splits)


def launch_plan(
    q: torch.Tensor,
    hot_k: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    options: DecodeKernelOptions | None = None,
    kernel: DecodeKernel | None = None,
    arch: Arch | None = None,
) -> DecodePlan:
    """How :func:`hybrid_decode_attention_triton` launches on these inputs: its kernel (``kernel``, else
    :func:`~kvtune.kernels.decode_choice.decode_kernel`'s choice), options, compile-time values and split
    count (the Gluon kernel's, where it takes the launch: the merge then attends the hot zone). ``arch``: the
    limits planned with (None: :func:`~kvtune.kernels.arch.arch_of` the device of ``q``)."""
    if kernel is None:
        kernel = decode_kernel(q, pool, block_table, options, triton=True)
    B, Hq, D = q.shape
    H, M = block_table.shape[1], block_table.shape[2]
    G = Hq // H
    bits = pool.bits
    arch = arch_of(q.device) if arch is None else arch
    opts = _resolved(options_for(pool, options), hot_k.dtype, _INTERPRETING, arch, D, pool.k.shape[2], bits)
    cdt = tl.float32 if hot_k.dtype == torch.float32 else tl.float16
    prec = "ieee" if hot_k.dtype == torch.float32 else "tf32"
    mixed = bits == 8 and opts.mixed
    meta = dict(
        H=H, G=G, GP=max(16, next_pow2(G)), D=D, T=max(16, next_pow2(pool.k.shape[2])), BS=pool.k.shape[2],
        HOT_T=min(64, max(16, next_pow2(hot_k.shape[2]))), KIND=bits,
        MIXED=mixed, CDT=cdt, CVT=opts.cvt, PREC=prec, KT=opts.k_transposed,
        VPAIR=opts.v_pairs and bits == 8 and not mixed and _aligned(pool, 2),
        num_warps=opts.num_warps, num_stages=opts.num_stages,
        **({"maxnreg": opts.maxnreg} if opts.maxnreg else {}),
    )  # fmt: skip
    if kernel not in ("gluon", "gluon_mixed"):
        splits, per = plan_splits(B * H, M, q.device, opts)
        return DecodePlan(kernel, opts, meta, (), splits, per)
    # (gluon_mixed: the 8-bit build's occupancy plans both builds' splits)
    key = ("gluon", str(q.device), bits, D, pool.k.shape[2], G, opts.gluon_stages, opts.gluon_key_rows,
           opts.gluon_table_ahead, kernel == "gluon_mixed" and opts.gluon_builds, opts.gluon_tma)  # fmt: skip
    # The wave model with the build's occupancy, once known: on the H200 it beat every programs-per-SM target
    # for the Gluon kernel.
    plan = replaced(opts, programs_per_sm=opts.gluon_programs_per_sm)
    resident = _RESIDENT.get(key)
    splits, per = plan_splits(B * H, M, q.device, plan, resident and max(1, resident - WAVE_FREE))
    stages4 = 0
    if kernel == "gluon_mixed":
        asked = opts.gluon_stages4 or min(options_for(pool, options).gluon_stages, 2)
        stages4 = gluon_decode.ring_stages(arch, D, pool.k.shape[2], 4, asked)
    return DecodePlan(kernel, opts, meta, key, splits, per, stages4)


def plan_splits(
    bh: int, m: int, device: torch.device, options: DecodeKernelOptions, resident: int | None = None
) -> tuple[int, int]:
    """(number of splits, cold blocks per split) for bh = B * H programs over a table of m blocks: by the
    wave model (:func:`wave_splits`) where ``resident`` (programs of the build resident per multiprocessor)
    is given, else by ``options.programs_per_sm``. The split kernel always plans by the target; the Gluon
    kernel by the wave model once its build's occupancy is known."""
    target = options.programs_per_sm * num_sms(device)
    most = max(1, cdiv(m, options.min_blocks_per_split))
    if resident:
        splits = wave_splits(bh, max(m, 1), most, resident * num_sms(device), target)
    else:
        splits = max(1, min(cdiv(target, bh), most))
    per = max(1, cdiv(m, splits))
    return cdiv(max(m, 1), per), per


@functools.lru_cache(maxsize=4096)
def wave_splits(bh: int, m: int, most: int, slots: int, target: int) -> int:
    """The split count (1..most) with the least modeled time for bh programs per split over m blocks, when
    ``slots`` programs run at once: waves (programs / slots, rounded up) x (blocks per program + 1, the
    program's own work: q, hot zone, partials). Ties go to the program count nearest ``target``. Checked
    against the H200's split sweeps (`benchmarks/decode_attention.py --sweep`)."""

    def cost(s: int) -> tuple[int, int]:
        return wave_cost(bh, m, s, slots), abs(bh * cdiv(m, cdiv(m, s)) - target)

    best = min(range(1, most + 1), key=cost)
    return cdiv(m, cdiv(m, best))


def wave_cost(bh: int, m: int, splits: int, slots: int) -> int:
    """Modeled time of ``splits`` splits in blocks: waves x (blocks per program + 1) (:func:`wave_splits`)."""
    per = cdiv(m, splits)
    return cdiv(bh * cdiv(m, per), slots) * (per + 1)


def resident_programs(registers: int, num_warps: int, shared_bytes: int, arch: Arch = HOPPER) -> int:
    """Programs of a build that fit one multiprocessor of ``arch`` at once: by registers, by shared memory (+
    the 1 KB per block the driver reserves), at most the architecture's resident blocks (sm_90: 64K
    registers, 228 KB, 32 blocks)."""
    by_regs = arch.regs_per_sm // max(1, registers * 32 * num_warps)
    by_smem = arch.shared_per_sm // (shared_bytes + 1024)
    return max(1, min(by_regs, by_smem, arch.max_programs_per_sm))


# Programs resident per multiprocessor of each Gluon build, read from the build at its first launch (the wave
# model plans its later launches); keyed by the device and the build's compile-time values.
_RESIDENT: dict[tuple[object, ...], int] = {}


def _resident_of(kernel: object, device: torch.device) -> int | None:
    """:func:`resident_programs` of a compiled build on ``device`` (None where the launch returned none)."""
    n_regs, meta = getattr(kernel, "n_regs", None), getattr(kernel, "metadata", None)
    if not n_regs or meta is None:
        return None
    return resident_programs(int(n_regs), int(meta.num_warps), int(meta.shared), arch_of(device))


@functools.lru_cache(maxsize=64)
def _resolved(
    options: DecodeKernelOptions,
    model_dtype: torch.dtype,
    interpreting: bool,
    arch: Arch = HOPPER,
    head_dim: int = 128,
    block_size: int = 64,
    bits: int = 8,
) -> DecodeKernelOptions:
    """The options a launch uses: float32 models convert codes by cast; the interpreter cannot run PTX; on
    ``arch``, programmatic dependent launch only from sm_90 and the Gluon ring as deep as
    :func:`~kvtune.kernels.gluon_decode.ring_stages` allows (a block of ``block_size`` tokens, ``bits``)."""
    cvt = options.cvt
    if model_dtype == torch.float32:  # exact arithmetic: codes cast to float32
        cvt = 0
    elif cvt == 2 and interpreting:
        cvt = 1
    stages = options.gluon_stages
    if bits in (4, 8) and (options.gluon or options.gluon_mixed):
        stages = gluon_decode.ring_stages(arch, head_dim, block_size, bits, stages)
    return replace(options, cvt=cvt, gluon_pdl=options.gluon_pdl and arch.pdl, gluon_stages=stages,
                   gluon_tma=options.gluon_tma and arch.tma and stages > 0,
                   gluon_after_select=options.gluon_after_select and arch.pdl)  # fmt: skip


def _aligned(pool: ColdPool, size: int) -> bool:
    """Code rows start at ``size``-byte boundaries (``v_pairs``' uint16 pair loads: 2)."""
    return all(
        x.data_ptr() % size == 0 and all(st % size == 0 for st in x.stride()[:3]) for x in (pool.k, pool.v)
    )


def _check_inputs(q: torch.Tensor, hot_k: torch.Tensor, hot_v: torch.Tensor, pool: ColdPool,
                  block_table: torch.Tensor, num_cold: torch.Tensor) -> None:  # fmt: skip
    """Shapes, dtypes, devices and unit inner strides the kernel relies on (ValueError naming the rule)."""
    B, Hq, D = q.shape
    H = block_table.shape[1]
    rules = {
        "q, hot_k, hot_v and the pool on one device":
            q.device == hot_k.device == hot_v.device == pool.k.device,
        "Hq % H == 0": Hq % H == 0,
        "hot_k.shape == hot_v.shape == [S, H, C, D]":
            hot_k.shape == hot_v.shape and tuple(hot_k.shape[1::2]) == (H, D),
        "hot_k.stride() == hot_v.stride()": hot_k.stride() == hot_v.stride(),
        "unit stride on D (q, hot, pool rows)":
            all(x.stride(-1) == 1 for x in (q, hot_k, pool.k, pool.k_min, pool.v_min)),
        "pool.k.stride() == pool.v.stride()": pool.k.stride() == pool.v.stride(),
        "block_table [B, H, M] int32, num_cold [B, H]": block_table.dtype == torch.int32
        and block_table.shape[0] == B and tuple(num_cold.shape) == (B, H),
    }  # fmt: skip
    require("hybrid_decode_attention", rules, lambda: f"q {tuple(q.shape)}, hot_k {tuple(hot_k.shape)}, "
            f"block_table {tuple(block_table.shape)} {block_table.dtype}")  # fmt: skip


def _launch_mixed(q: torch.Tensor, pool: ColdPool, parts: BitsPartition, part_acc: torch.Tensor,
                  part_ml: torch.Tensor, blk_lse: torch.Tensor, qk_scale: float, plan: DecodePlan,
                  pdl: bool) -> object:  # fmt: skip
    """``gluon_mixed``: the 8-bit build over the first half of each split row (partial slots ``0 ..
    splits - 1``), then the 4-bit build over the second half (its ``splits4`` slots after those; its 4-bit
    codes fill the first ``D / 2`` bytes of the pool's ``D``-byte rows), each block's lse where
    ``parts.positions`` points. Only the second launch lets the merge start early (``pdl``): the merge's
    wait then follows both. With ``gluon_overlap`` (and ``pdl``) the 8-bit build lets the 4-bit one start
    early too, which waits for it only at its end. With ``gluon_builds`` ``"paired"`` or ``"by_id"`` both
    builds run in one launch (``gluon_decode.launch_pair``). Returns the 8-bit build or the pair (its
    occupancy plans the splits)."""
    B, _, D = q.shape
    H = parts.table.shape[1]
    w = parts.table.shape[2] // 2
    opts, slots = plan.options, plan.slots
    splits4 = slots - plan.splits
    busy8, busy4 = opts.gluon_busy_blocks, opts.gluon_busy_blocks4 or opts.gluon_busy_blocks
    head = (q, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale)
    strides = (q.stride(0), q.stride(1), pool.k.stride(0), pool.k.stride(1), pool.k_min.stride(0),
               pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1))  # fmt: skip
    common: dict[str, Any] = dict(
        H=H, G=q.shape[1] // H, D=D, T=pool.k.shape[2], key_rows=opts.gluon_key_rows,
        table_ahead=opts.gluon_table_ahead,
    )  # fmt: skip
    tma = opts.gluon_tma and gluon_decode.tma_ready(pool)
    if opts.gluon_builds != "two":  # both builds in one launch
        if tma:
            common["tma"] = gluon_decode.pair_descriptors(pool)
        return gluon_decode.launch_pair(
            (plan.splits, splits4), B * H,
            (*head, parts.table, parts.counts[0], blk_lse, parts.table[..., w:], parts.counts[1],
             blk_lse[:, w:], part_acc, part_ml, qk_scale, busy8, busy4, plan.splits, splits4, 2 * w, slots,
             *strides),
            stages=(opts.gluon_stages, plan.stages4), by_id=opts.gluon_builds == "by_id", pdl=pdl,
            after=opts.gluon_after_select, **common,
        )  # fmt: skip
    builds = ((8, opts.gluon_stages, plan.splits, busy8, 0), (4, plan.stages4, splits4, busy4, plan.splits))
    overlap = pdl and opts.gluon_overlap
    launched = []
    for i, (kind, stages, splits, busy, part0) in enumerate(builds):
        launched.append(gluon_decode.launch_cold(
            (splits, B * H),
            (*head, parts.table[..., i * w:], parts.counts[i], part_acc, part_ml, blk_lse[:, i * w:],
             qk_scale, busy, splits, 2 * w, slots, part0, *strides),
            kind=kind, stages=stages, pdl=pdl and (i == 1 or overlap), row=D, follow=overlap and i == 1,
            tma=gluon_decode.descriptors(pool, kind) if tma else None,
            after=opts.gluon_after_select and i == 0, **common,
        ))  # fmt: skip
    return launched[0]


def hybrid_decode_attention_triton(
    q: torch.Tensor,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    hot_slot: torch.Tensor,
    hot_len: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    sm_scale: float,
    options: DecodeKernelOptions | None = None,
    kernel: DecodeKernel | None = None,
    arch: Arch | None = None,
    partition: BitsPartition | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused hybrid decode attention (module docstring); the contract of ``hybrid_decode_attention_ref``.

    q [B, Hq, D]; hot_k/hot_v [S, H, C, D] model dtype; hot_slot, hot_len int32 [B]; block_table int32
    [B, H, M] (padded -1); num_cold int32 [B, H]. Returns out [B, Hq, D] (q.dtype), block_mass float32
    [B, H, M], hot_mass float32 [B, H]. ``kernel``: the choice of
    :func:`~kvtune.kernels.decode_choice.decode_kernel` where the caller made it (the dispatcher; a test
    forcing one), else made here with the Triton kernels taken as available (CPU tensors: the interpreter).
    ``arch``: the limits the launch plans with (None: those of the device; a test recording launches for a
    compile on another architecture names it). ``partition``: ``block_table`` split by bits as
    ``partition_by_bits_ref`` would split it, written by the kernels that built the table
    (:func:`~kvtune.kernels.sparse_table.sparse_block_table_parts`); ``gluon_mixed`` then reads it instead
    of launching the partition (other kernels ignore it).
    """
    if kernel is None:
        kernel = decode_kernel(q, pool, block_table, options, triton=True)
    if kernel == "reference":
        return hybrid_decode_attention_ref(
            q, hot_k, hot_v, hot_slot, hot_len, pool, block_table, num_cold, sm_scale
        )
    _check_inputs(q, hot_k, hot_v, pool, block_table, num_cold)
    B, Hq, D = q.shape
    H, M = block_table.shape[1], block_table.shape[2]
    G = Hq // H
    plan = launch_plan(q, hot_k, pool, block_table, options, kernel, arch)
    opts, meta, key, splits = plan.options, plan.meta, plan.key, plan.splits
    # Where the Gluon kernel takes the cold blocks, the merge attends the hot zone (``gluon_pdl``: as a
    # programmatic dependent, while the Gluon kernel runs); elsewhere the split kernel's last split does.
    gluon = kernel in ("gluon", "gluon_mixed")
    pdl = gluon and opts.gluon_pdl
    dev = q.device
    table = block_table.contiguous()
    ncold = num_cold if num_cold.dtype == torch.int32 else num_cold.to(torch.int32)
    ncold = ncold.contiguous()
    # gluon_mixed: the table split by block bits; the two builds' partials side by side in each row's slots
    parts = None
    if kernel == "gluon_mixed":
        parts = partition_by_bits_triton(table, ncold, pool.block_bits) if partition is None else partition
        if parts.positions.shape != (B, H, M) or parts.table.shape != (B, H, 2 * partition_width(M)):
            raise ValueError(f"partition: a split of the [{B}, {H}, {M}] table must be empty_partition({B}, "
                             f"{H}, {M})'s shapes")  # fmt: skip
    slots = plan.slots
    lse_w = parts.table.shape[2] if parts is not None else M
    part_acc = torch.empty((B * H * slots, G, D), dtype=torch.float32, device=dev)
    part_ml = torch.empty((B * H * slots, 2, G), dtype=torch.float32, device=dev)
    blk_lse = torch.empty((B * H, max(lse_w, 1), G), dtype=torch.float32, device=dev)
    # the hot zone's lse, written by the split kernel's last split (the merge that attends it reads none)
    hot_lse = part_ml if gluon else torch.empty((B * H, G), dtype=torch.float32, device=dev)
    if hot_slot.dtype != torch.int32 or hot_len.dtype != torch.int32:
        hot_slot, hot_len = hot_slot.to(torch.int32), hot_len.to(torch.int32)
    qk_scale = sm_scale * LOG2E
    if parts is not None:
        compiled = _launch_mixed(q, pool, parts, part_acc, part_ml, blk_lse, qk_scale, plan, pdl)
    elif gluon:
        compiled = gluon_decode.launch_cold(
            (splits, B * H),
            (q, pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale, table, ncold,
             part_acc, part_ml, blk_lse, qk_scale, opts.gluon_busy_blocks, splits, M, splits, 0,
             q.stride(0), q.stride(1), pool.k.stride(0), pool.k.stride(1),
             pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1)),
            H=H, G=G, D=D, T=pool.k.shape[2], kind=pool.bits, stages=opts.gluon_stages, pdl=pdl,
            key_rows=opts.gluon_key_rows, table_ahead=opts.gluon_table_ahead,
            tma=gluon_decode.descriptors(pool, pool.bits) if opts.gluon_tma and gluon_decode.tma_ready(pool)
            else None,
        )  # fmt: skip
    else:
        launch(_split_kernel, (B * H, splits) if SPLIT_MAJOR else (splits, B * H),
            q, hot_k, hot_v, hot_slot, hot_len,
            pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale, pool.block_bits, table, ncold,
            part_acc, part_ml, blk_lse, hot_lse,
            qk_scale, 1, splits, M,
            q.stride(0), q.stride(1), hot_k.stride(0), hot_k.stride(1), hot_k.stride(2),
            pool.k.stride(0), pool.k.stride(1), pool.k.stride(2),
            pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1),
            SPLIT_MAJOR=SPLIT_MAJOR, **meta,
        )  # fmt: skip
    if gluon and key not in _RESIDENT and dev.type == "cuda":
        resident = _resident_of(compiled, dev)
        if resident:
            _RESIDENT[key] = resident
    out = torch.empty_like(q)
    mass = torch.empty((B, H, M), dtype=torch.float32, device=dev)
    hot_mass = torch.empty((B, H), dtype=torch.float32, device=dev)
    hot_args = {"HOT_T": meta["HOT_T"], "PREC": meta["PREC"], "WAIT": pdl, "launch_pdl": pdl} if gluon else {}
    if gluon and MERGE_STAGES:
        hot_args["num_stages"] = MERGE_STAGES
    gp = max(16, next_pow2(G)) if gluon else next_pow2(G)  # the hot zone's products need 16 rows
    launch(_merge_kernel, (B * H,),
        part_acc, part_ml, blk_lse, hot_lse, ncold, out, mass, hot_mass,
        q, hot_k, hot_v, hot_slot, hot_len, qk_scale,
        slots, M, out.stride(0), out.stride(1),
        q.stride(0), q.stride(1), hot_k.stride(0), hot_k.stride(1), hot_k.stride(2),
        parts.positions if parts is not None else ncold, lse_w,
        *((parts.counts[0], parts.counts[1]) if parts is not None else (ncold, ncold)),
        plan.splits, opts.gluon_busy_blocks, opts.gluon_busy_blocks4 or opts.gluon_busy_blocks,
        H=H, G=G, GP=gp, D=D, MB=MASS_TILE, HOT=gluon, MAPPED=parts is not None, SB=MERGE_TILE,
        AHEAD=MASS_AHEAD, GM=next_pow2(G) if gluon and MERGE_GROUP_ROWS else gp, **hot_args,
    )  # fmt: skip
    return out, mass, hot_mass
