"""What a prompt chunk's keys and values need around its attention: the rule and its PyTorch reference.

A layer of prompt chunks (:meth:`~kvtune.cache_impl.hybrid_cache.HybridCache.prefill_chunks`) attends over
*packed* keys and values ``[2, K, H, D]`` (a K plane and a V plane): per chunk its cached prefix (sealed
blocks, dequantized), its hot tokens, then its new tokens. Then the chunk's sealed blocks are quantized from
the packed rows, and the rest of them becomes its hot zone. Two operations do that without a gather of their
own, each one kernel on CUDA (:mod:`kvtune.kernels.triton_chunk_kv`):

* ``pack_kv(pool, hot, k, v, kind, src)``: packed row ``r`` is, by ``kind[r]``,
  - ``PREFIX`` (0): token ``src % bs`` of cold block ``src // bs``, dequantized (``min + code · scale`` in
    float32, as :func:`~kvtune.kernels.quant_ref.dequantize_gathered`; a block demoted to 4 bits in an 8-bit
    pool unpacked as such; an unquantized pool's values as they are);
  - ``HOT`` (1): hot-zone entry ``src`` = ``slot · C + position`` of ``hot`` ``[2, S, H, C, D]``;
  - ``NEW`` (2): row ``src`` of ``k``, ``v`` ``[N, H, D]``;

  rounded once to the packed dtype.
* ``hot_write(hot, k, v, slots, positions, rows)``: ``hot[0][slots[i], :, positions[i]] = k[rows[i]]`` and
  the same for V (``rows`` None: row ``i``), rounded to the hot zones' dtype. A decode step's append of its
  new token is the same operation, one row per sequence.

Both take only device tensors of fixed shapes and read nothing back on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant_ref import codes_of_rows

PREFIX, HOT, NEW = 0, 1, 2


def pack_kv_ref(
    pool: ColdPool, hot: Tensor, k: Tensor, v: Tensor, kind: Tensor, src: Tensor, dtype: torch.dtype
) -> Tensor:
    """Packed keys and values ``[2, K, H, D]`` in ``dtype`` (module docstring). ``hot`` ``[2, S, H, C, D]``;
    ``k``, ``v`` ``[N, H, D]``; ``kind``, ``src`` ``[K]`` int64. Reads the rows' kinds on the host (the CPU
    path; the kernel reads nothing back)."""
    out = torch.empty((2, kind.shape[0], *k.shape[1:]), dtype=dtype, device=k.device)
    cap = hot.shape[3]
    for which in (PREFIX, HOT, NEW):
        rows = (kind == which).nonzero().squeeze(1)
        if not len(rows):
            continue
        s = src[rows]
        if which == PREFIX:
            x = torch.stack(_dequantize_tokens(pool, s))
        elif which == HOT:
            x = hot[:, s // cap, :, s % cap].transpose(0, 1)
        else:
            x = torch.stack([k[s], v[s]])
        out[:, rows] = x.to(dtype)
    return out


def _dequantize_tokens(pool: ColdPool, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[n, H, D]`` float32 of cold tokens ``src`` (``block · bs + t``)."""
    bs = pool.k.shape[2]
    blk, t = src // bs, src % bs
    if pool.bits == 0:
        return pool.k[blk, :, t].float(), pool.v[blk, :, t].float()
    bits = pool.block_bits[blk][:, None]  # [n, 1]: broadcast over the heads
    kc = codes_of_rows(pool.k[blk, :, t][:, :, None], bits, pool.bits)[:, :, 0]  # [n, H, D]
    vc = codes_of_rows(pool.v[blk, :, t][:, :, None], bits, pool.bits)[:, :, 0]
    k = pool.k_min[blk].float() + kc * pool.k_scale[blk].float()
    v = pool.v_min[blk, :, t].float()[..., None] + vc * pool.v_scale[blk, :, t].float()[..., None]
    return k, v


def hot_write_ref(
    hot: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor, rows: Tensor | None = None
) -> None:
    """``hot`` ``[2, S, H, C, D]`` at ``(slots[i], positions[i])`` gets row ``rows[i]`` (or ``i``) of ``k``,
    ``v`` ``[N, H, D]``, every head."""
    k, v = (k[rows], v[rows]) if rows is not None else (k[: len(slots)], v[: len(slots)])
    hot[0][slots, :, positions] = k.to(hot.dtype)
    hot[1][slots, :, positions] = v.to(hot.dtype)
