"""Sealing (quantize + pack) and dequantization of cold blocks; layout in :mod:`kvtune.kernels.layout`.

Keys are quantized asymmetrically per channel over the block's tokens, values per token over the channels:
``code = round((x − min) / scale)`` clamped to ``[0, 2^bits − 1]``, ``x ≈ min + code · scale``.

This module is the PyTorch reference (the executable spec and the fallback of the Triton launcher in
:mod:`kvtune.kernels.triton_quant`) and the helpers the other references share; :mod:`kvtune.kernels.quant`
dispatches between them.
"""

from __future__ import annotations

import torch

from kvtune.kernels.layout import ColdPool, levels_for_bits
from kvtune.kernels.quest_summary import write_summary

_F16_TINY = 2.0**-24  # the smallest fp16 subnormal
_F16_REL = 2.0**-10  # one fp16 ulp relative to the value (at least)


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """fp16 values ``>= x`` (float32 in), at most one ulp above the nearest rounding."""
    y = x.to(torch.float16)
    bumped = (y.float() + y.float().abs() * _F16_REL + _F16_TINY).to(torch.float16)
    return torch.where(y.float() < x, bumped, y)


def _round_down_f16(x: torch.Tensor) -> torch.Tensor:
    """fp16 values ``<= x`` (float32 in)."""
    y = x.to(torch.float16)
    bumped = (y.float() - y.float().abs() * _F16_REL - _F16_TINY).to(torch.float16)
    return torch.where(y.float() > x, bumped, y)


def min_scale(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (min, scale) with ``min <= lo`` and ``min + levels · scale >= hi`` (float32 in, same shape
    out)."""
    lo16 = _round_down_f16(lo)
    scale16 = _round_up_f16((hi - lo16.float()).clamp(min=0) / levels)
    return lo16, scale16


def quantize(x: torch.Tensor, lo16: torch.Tensor, scale16: torch.Tensor, levels: int) -> torch.Tensor:
    """uint8 codes of ``x`` (float32) given broadcastable fp16 min and scale."""
    scale = scale16.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round((x - lo16.float()) / safe).clamp(0, levels).to(torch.uint8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[.., D]`` uint8 codes < 16 → ``[.., D/2]`` bytes: low nibble channel c, high nibble channel c +
    D/2."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[.., D/2]`` bytes → ``[.., D]`` uint8 codes."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def _quantize_block(
    k: torch.Tensor, v: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v ``[n, H, bs, D]`` float32 → codes k, v ``[n, H, bs, D]`` uint8 and fp16 k_min, k_scale ``[n, H,
    D]``, v_min, v_scale ``[n, H, bs]``."""
    levels = levels_for_bits(bits)
    k_min, k_scale = min_scale(k.amin(dim=2), k.amax(dim=2), levels)
    v_min, v_scale = min_scale(v.amin(dim=3), v.amax(dim=3), levels)
    kc = quantize(k, k_min[:, :, None, :], k_scale[:, :, None, :], levels)
    vc = quantize(v, v_min[..., None], v_scale[..., None], levels)
    return kc, vc, k_min, k_scale, v_min, v_scale


def _to_row(pool: ColdPool, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[.., D]`` as the pool's rows ``[.., code_dim]`` (4-bit codes in an 8-bit slot: first D/2
    bytes)."""
    if bits == 8:
        return codes
    packed = pack_int4(codes)
    if pool.bits == 4:
        return packed
    return torch.cat([packed, torch.zeros_like(packed)], dim=-1)


def check_seal_bits(pool: ColdPool, bits: int) -> None:
    """A block is stored at the pool's bits, or at 4 bits in an 8-bit pool (ValueError otherwise)."""
    if bits not in (pool.bits, 4 if pool.bits == 8 else pool.bits):
        raise ValueError(f"bits={bits} cannot be stored in a {pool.bits}-bit pool")


def seal_blocks_ref(
    pool: ColdPool,
    block_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Write ``n`` blocks into pool rows ``block_ids`` ``[n]`` int64.

    k, v: ``[n, bs, H, D]`` model dtype (token-major, as the hot zone hands them over), or, with ``rows``
    ``[n]``, ``[N, bs, H, D]`` of which block ``i`` is ``k[rows[i]]`` (a view of the hot zones, no copy
    first). ``bits`` is the pool's bits, or 4 in an 8-bit pool (a block stored at 4 bits in its 8-bit slot).
    Bits 0 copies K/V and stores the key min per channel (``k_min``) and ``max − min`` (``k_scale``).
    """
    check_seal_bits(pool, bits)
    if rows is not None:
        k, v = k[rows], v[rows]
    kt = k.permute(0, 2, 1, 3)
    vt = v.permute(0, 2, 1, 3)
    if bits == 0:
        lo, scale = min_scale(kt.float().amin(dim=2), kt.float().amax(dim=2), 1)
        pool.k[block_ids] = kt.to(pool.k.dtype)
        pool.v[block_ids] = vt.to(pool.v.dtype)
        pool.k_min[block_ids], pool.k_scale[block_ids] = lo, scale
        pool.block_bits.index_fill_(0, block_ids.long(), 0)  # capture-safe: no host tensor
        write_summary(pool, block_ids)
        return
    kc, vc, k_min, k_scale, v_min, v_scale = _quantize_block(kt.float(), vt.float(), bits)
    pool.k[block_ids] = _to_row(pool, kc, bits)
    pool.v[block_ids] = _to_row(pool, vc, bits)
    pool.k_min[block_ids], pool.k_scale[block_ids] = k_min, k_scale
    pool.v_min[block_ids], pool.v_scale[block_ids] = v_min, v_scale
    pool.block_bits.index_fill_(0, block_ids.long(), bits)
    write_summary(pool, block_ids)


def codes_of_rows(rows: torch.Tensor, block_bits: torch.Tensor, pool_bits: int) -> torch.Tensor:
    """Pool rows ``[..., bs, code_dim]`` uint8 → float32 codes ``[..., bs, D]``.

    ``block_bits`` ``[...]`` selects, in an 8-bit pool, the rows of blocks demoted to 4 bits.
    """
    if pool_bits == 4:
        return unpack_int4(rows).float()
    d = rows.shape[-1]
    demoted = unpack_int4(rows[..., : d // 2]).float()
    return torch.where((block_bits == 4)[..., None, None], demoted, rows.float())


def dequantize_gathered(
    pool: ColdPool, ids: torch.Tensor, heads: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V of the listed blocks, float32.

    Without ``heads``: ids ``[n]`` → ``[n, H, bs, D]``. With ``heads`` (broadcastable to ``ids``): one head
    per entry → ``[*ids.shape, bs, D]``.
    """
    index = (ids,) if heads is None else (ids, heads)
    if pool.bits == 0:
        return pool.k[index].float(), pool.v[index].float()
    bits = pool.block_bits[ids]
    if heads is None:
        bits = bits[:, None]
    kc = codes_of_rows(pool.k[index], bits, pool.bits)
    vc = codes_of_rows(pool.v[index], bits, pool.bits)
    k = pool.k_min[index].float()[..., None, :] + kc * pool.k_scale[index].float()[..., None, :]
    v = pool.v_min[index].float()[..., None] + vc * pool.v_scale[index].float()[..., None]
    return k, v


def dequantize_blocks_ref(pool: ColdPool, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of blocks ``block_ids`` ``[n]``: float32 ``[n, H, bs, D]`` each (``x = min + code · scale``)."""
    return dequantize_gathered(pool, block_ids)
