"""Hybrid decode attention in PyTorch: one query token per sequence over its hot zone and its listed cold
blocks. The reference (the executable spec, and the CPU path) of :mod:`kvtune.kernels.decode_attention`.

Layout: :mod:`kvtune.kernels.layout`. Query head ``j`` belongs to KV head ``j // G`` (``G = Hq / H``, the
usual grouped-query order). Every listed token is older than the query, so no causal mask is needed, and
the order of tokens within the softmax does not matter.
"""

from __future__ import annotations

import torch

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant_ref import dequantize_gathered

_CHUNK_ELEMENTS = 1 << 26  # dequantized elements per batch chunk of the reference (bounds its memory)


def _chunk_size(batch: int, per_sequence: int) -> int:
    return max(1, min(batch, _CHUNK_ELEMENTS // max(1, per_sequence)))


def _attend_chunk(
    qg: torch.Tensor,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    hot_len: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qg [B, H, G, D] (already scaled) → out [B, H, G, D], block_mass [B, H, M], hot_mass [B, H]
    (float32)."""
    b, h, g, _ = qg.shape
    m, c = block_table.shape[2], hot_k.shape[2]
    valid = torch.arange(m, device=qg.device)[None, None, :] < num_cold[..., None]
    heads = torch.arange(h, device=qg.device)[None, :, None]
    k, v = dequantize_gathered(pool, block_table.long().clamp(min=0), heads)  # [B, H, M, bs, D]
    s_cold = torch.einsum("bhgd,bhmtd->bhgmt", qg, k)
    s_cold = s_cold.masked_fill(~valid[:, :, None, :, None], float("-inf")).flatten(3)
    hot_ok = torch.arange(c, device=qg.device)[None, :] < hot_len[:, None]
    s_hot = torch.einsum("bhgd,bhcd->bhgc", qg, hot_k).masked_fill(~hot_ok[:, None, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s_cold, s_hot], dim=-1), dim=-1).nan_to_num(0.0)
    p_cold, p_hot = p[..., : s_cold.shape[-1]], p[..., s_cold.shape[-1] :]
    out = torch.einsum("bhgx,bhxd->bhgd", p_cold, v.flatten(2, 3)) + torch.einsum(
        "bhgc,bhcd->bhgd", p_hot, hot_v
    )
    block_mass = p_cold.reshape(b, h, g, m, pool.layout.block_size).sum(-1).mean(2)
    return out, block_mass, p_hot.sum(-1).mean(2)


def hybrid_decode_attention_ref(
    q: torch.Tensor,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    hot_slot: torch.Tensor,
    hot_len: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over hot tokens + listed cold blocks, in float32.

    q: [B, Hq, D]; hot_k, hot_v: [S, H, C, D] (sequence slot, KV head, hot position, channel), model dtype;
    hot_slot, hot_len: [B] int32 (sequence ``b`` reads ``hot_k[hot_slot[b], :, :hot_len[b]]``); block_table:
    [B, H, M] int32 physical block ids (first ``num_cold[b, h]`` valid, then -1); num_cold: [B, H] int32.
    Returns out [B, Hq, D] (q.dtype), block_mass [B, H, M] float32 (softmax probability on each listed block,
    averaged over the KV head's query group; 0 on padding) and hot_mass [B, H] float32.
    """
    bsz, hq, d = q.shape
    h = hot_k.shape[1]
    qg = q.float().view(bsz, h, hq // h, d) * sm_scale
    per_seq = h * block_table.shape[2] * pool.layout.block_size * d * 2
    step = _chunk_size(bsz, per_seq)
    outs, masses, hots = [], [], []
    for lo in range(0, bsz, step):
        sl = slice(lo, lo + step)
        slots = hot_slot[sl].long()
        o, bm, hm = _attend_chunk(
            qg[sl],
            hot_k[slots].float(),
            hot_v[slots].float(),
            hot_len[sl],
            pool,
            block_table[sl],
            num_cold[sl],
        )
        outs.append(o)
        masses.append(bm)
        hots.append(hm)
    out = torch.cat(outs).reshape(bsz, hq, d).to(q.dtype)
    return out, torch.cat(masses), torch.cat(hots)
