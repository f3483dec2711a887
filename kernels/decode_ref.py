"""Hybrid decode attention: one query token per sequence over its hot zone and its listed cold blocks.

Layout: :mod:`kvtune.kernels.layout`. Query head ``j`` belongs to KV head ``j // G`` (``G = Hq / H``, the
usual grouped-query order). Every listed token is older than the query, so no causal mask is needed, and
the order of tokens within the softmax does not matter.

Which kernel computes a launch (the PyTorch reference, the Triton split kernel, or the Gluon cold kernel and
the merge) is decided by :func:`decode_kernel` alone. ``triton_decode`` imports this module (the reference,
the choice); this module imports the Triton modules only inside its functions, on first use, so importing
either never imports the other one back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant import dequantize_gathered
from kvtune.kernels.triton_common import tileable_head_dim

if TYPE_CHECKING:  # not imported at run time: triton_decode imports this module
    from kvtune.kernels.triton_decode import DecodeKernelOptions

DecodeKernel = Literal["reference", "split", "gluon"]

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


def decode_kernel(
    q: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    options: DecodeKernelOptions | None = None,
    *,
    triton: bool | None = None,
) -> DecodeKernel:
    """Which kernel computes one hybrid decode attention launch; the only place that decides it.

    * ``"reference"``: :func:`hybrid_decode_attention_ref` (PyTorch), where the Triton kernels may not run on
      ``q`` (``triton``; None: :func:`~kvtune.kernels.backend.use_triton`, i.e. a CUDA tensor, Triton
      installed and not ``KVTUNE_KERNELS=torch``) or its head dim does not tile
      (:func:`~kvtune.kernels.triton_common.tileable_head_dim`).
    * ``"gluon"``: the Gluon cold kernel (``gluon_decode``) over the cold blocks, then the Triton merge
      kernel, which attends the hot zone before it merges. Taken where the options (``options``; None: the
      pool's defaults, ``triton_decode.options_for``) ask for it (``gluon``) and ``gluon_decode.supported``
      holds: a CUDA fp16/bf16 model, a 4-bit pool or an 8-bit one read without per-block bits, head dim 64
      or 128, blocks of 16, 32 or 64 tokens, at most 8 query heads per KV head.
    * ``"split"``: otherwise, the Triton split kernel (cold blocks and hot zone), then the merge kernel.

    ``triton_decode.hybrid_decode_attention_triton`` asks with ``triton=True``: called directly (tests,
    benchmarks) it runs the Triton kernels on the device ``q`` is on, the interpreter's on a CPU.
    """
    if not (use_triton(q) if triton is None else triton) or not tileable_head_dim(q.shape[2]):
        return "reference"
    from kvtune.kernels import gluon_decode
    from kvtune.kernels.triton_decode import options_for

    opts = options_for(pool, options)
    mixed = pool.bits == 8 and opts.mixed
    if opts.gluon and gluon_decode.supported(
        q, pool.bits, mixed, pool.k.shape[2], tuple(pool.k.stride()), block_table.shape[1]
    ):
        return "gluon"
    return "split"


def hybrid_decode_attention(
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
    """See :func:`hybrid_decode_attention_ref`; computed by the kernel :func:`decode_kernel` picks (the fused
    Triton kernels on CUDA tensors)."""
    kernel = decode_kernel(q, pool, block_table)
    if kernel == "reference":
        return hybrid_decode_attention_ref(
            q, hot_k, hot_v, hot_slot, hot_len, pool, block_table, num_cold, sm_scale
        )
    from kvtune.kernels.triton_decode import hybrid_decode_attention_triton

    return hybrid_decode_attention_triton(
        q, hot_k, hot_v, hot_slot, hot_len, pool, block_table, num_cold, sm_scale, kernel=kernel
    )
