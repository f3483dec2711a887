"""A decode step of one attention layer as device work only (plain torch and kvtune's kernel launchers; no
vLLM import, no read of a device tensor on the host): the path of the CUDA backend that CUDA graphs capture.

A batch in which every request has one new token (``max_query_len == 1``) is a decode batch. Per layer, for
request ``r`` of ``L`` tokens after the step (``P = L − 1`` before it), from vLLM's tensors of the step
(``seq_lens``, the two groups' block tables, the hot group's slot mapping) and nothing else:

1. the new K/V go to the hot pages;
2. the hot tokens ``sealed(P)·bs … L−1`` are gathered into a dense ``[R, H, window, D]`` zone
   (``window = hot_tokens + block_size``, which holds them all);
3. where ``sealed(L) > sealed(P)`` (one block at most), block ``sealed(P)`` — the zone's first ``bs``
   tokens — is sealed into its cold page;
4. :func:`~kvtune.kernels.decode_attention.hybrid_decode_attention` attends the ``sealed(P)`` cold blocks
   (vLLM's ``[R, W]`` cold table spread over the KV heads) and the zone.

This is :func:`kvtune.vllm_plugin.step.run_layer` for such a batch (same pages in, same pages and outputs
out, up to the kernels' arithmetic): a request never reads the cold page it seals itself, so sealing every
block before attending is the order ``run_layer`` uses for blocks another request reads. Fixed shapes
throughout: rows without a block to seal, and padding tokens (slot −1), write into vLLM's null block (block
0), which vLLM never hands to a request and which this path never reads as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvtune.kernels.decode_attention import hybrid_decode_attention
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant import seal_blocks
from kvtune.vllm_plugin.step import StepPlan, run_layer

NULL_BLOCK = 0  # vLLM's null block: the first block of the pool, never allocated to a request


@dataclass(frozen=True)
class Geometry:
    """What the step needs of a layer's settings: the hot window, the block, the hot page and the bits."""

    hot_tokens: int
    block_size: int
    hot_block: int
    bits: int

    @property
    def window(self) -> int:
        """Hot tokens a request attends at most: ``hot_tokens + block_size``."""
        return self.hot_tokens + self.block_size


def is_decode_batch(max_query_len: int, num_reqs: int, num_tokens: int) -> bool:
    """Every request of the batch has exactly one new token (host values of vLLM's metadata)."""
    return max_query_len == 1 and num_reqs == num_tokens


def sealed_counts(lengths: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """:func:`~kvtune.vllm_plugin.step.sealed_blocks` of every length, on the device (int64)."""
    return ((lengths.long() - geo.hot_tokens).clamp(min=0)) // geo.block_size


def write_hot_slots(
    geo: Geometry,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """New tokens' K/V [T, H, D] into the hot pages [B, H, hot_block, D] at vLLM's slots [T] (−1: padding,
    written into the null block)."""
    s = slots[: k.shape[0]].long().clamp(min=0)
    blk, off = s // geo.hot_block, s % geo.hot_block
    hot_k[blk, :, off] = k.to(hot_k.dtype)
    hot_v[blk, :, off] = v.to(hot_v.dtype)


def gather_hot(
    geo: Geometry, hot: torch.Tensor, hot_table: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> torch.Tensor:
    """Tokens ``start … length−1`` of each request from the hot pages [B, H, hot_block, D] through its row
    of ``hot_table`` [R, W]: a dense [R, H, window, D] zone, zero past each request's tokens."""
    pos = start[:, None] + torch.arange(geo.window, device=hot.device)  # [R, window]
    valid = pos < length[:, None]
    col = (pos // geo.hot_block).clamp(max=hot_table.shape[1] - 1)
    blk = torch.where(valid, hot_table.long().gather(1, col), NULL_BLOCK)
    zone = hot[blk, :, pos % geo.hot_block]  # [R, window, H, D]
    zone = torch.where(valid[..., None, None], zone, torch.zeros((), dtype=zone.dtype, device=zone.device))
    return zone.transpose(1, 2).contiguous()


def cold_table_per_head(cold_table: torch.Tensor, num_cold: torch.Tensor, heads: int) -> torch.Tensor:
    """vLLM's cold table [R, W] as the kernels' [R, H, W] int32: the first ``num_cold`` entries, then −1."""
    cols = torch.arange(cold_table.shape[1], device=cold_table.device)
    table = torch.where(cols[None, :] < num_cold[:, None], cold_table.to(torch.int32), -1)
    return table[:, None, :].expand(-1, heads, -1).contiguous()


def decode_layer(
    geo: Geometry,
    pool: ColdPool,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    cold_table: torch.Tensor,
    hot_table: torch.Tensor,
    hot_slots: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
) -> None:
    """Steps 1-4 of the module docstring for ``R`` requests of one token each: q [R, Hq, D], k, v [R, H, D],
    seq_lens [R], cold_table [R, Wc], hot_table [R, Wh], hot_slots [R]; writes ``out`` [R, Hq, D]."""
    rows, heads = q.shape[0], hot_k.shape[1]
    write_hot_slots(geo, hot_k, hot_v, hot_slots, k, v)
    lengths = seq_lens[:rows].long()
    before, after = sealed_counts(lengths - 1, geo), sealed_counts(lengths, geo)
    start = before * geo.block_size
    zone_k = gather_hot(geo, hot_k, hot_table[:rows], start, lengths)
    zone_v = gather_hot(geo, hot_v, hot_table[:rows], start, lengths)
    table = cold_table[:rows]
    index = (after - 1).clamp(min=0, max=table.shape[1] - 1)[:, None]
    ids = torch.where(after > before, table.long().gather(1, index)[:, 0], NULL_BLOCK)
    bs = geo.block_size
    seal_blocks(pool, ids, zone_k[:, :, :bs].transpose(1, 2), zone_v[:, :, :bs].transpose(1, 2), geo.bits)
    num_cold = before.to(torch.int32)
    per_head = cold_table_per_head(table, num_cold, heads)
    result, _, _ = hybrid_decode_attention(
        q,
        zone_k,
        zone_v,
        torch.arange(rows, device=q.device, dtype=torch.int32),
        (lengths - start).to(torch.int32),
        pool,
        per_head,
        num_cold[:, None].expand(-1, heads).contiguous(),
        sm_scale,
    )
    out.copy_(result.to(out.dtype))


@dataclass(frozen=True)
class Batch:
    """vLLM's metadata of one step for both groups of a layer (the same for every layer of the step).

    query_start_cpu: [R + 1] token offsets (host); seq_lens: [R] tokens after the step; cold_table [R, Wc]
    and hot_table [R, Wh]: page ids; hot_slots: [T] hot slot of each token (−1 padding);
    max_query_len, num_tokens: vLLM's host values.
    """

    geo: Geometry
    query_start_cpu: torch.Tensor
    seq_lens: torch.Tensor
    cold_table: torch.Tensor
    hot_table: torch.Tensor
    hot_slots: torch.Tensor
    max_query_len: int
    num_tokens: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return is_decode_batch(self.max_query_len, self.num_reqs, self.num_tokens)

    @cached_property
    def plan(self) -> StepPlan:
        """The host plan of :mod:`kvtune.vllm_plugin.step` (reads the lengths and the cold table on the
        host: prefill and mixed batches only), built once per step."""
        r, g = self.num_reqs, self.geo
        return StepPlan(
            query_start=self.query_start_cpu[: r + 1].tolist(),
            seq_lens=self.seq_lens[:r].cpu().tolist(),
            cold_table=self.cold_table[:r].cpu(),
            hot_table=self.hot_table[:r],
            hot_slots=self.hot_slots.long(),
            hot_tokens=g.hot_tokens,
            block_size=g.block_size,
            hot_block=g.hot_block,
            bits=g.bits,
        )


def layer_step(
    batch: Batch,
    pool: ColdPool,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
) -> None:
    """The CUDA backend's step of one layer over its first ``batch.num_tokens`` tokens: a decode batch takes
    :func:`decode_layer` (device work only), any other batch :func:`~kvtune.vllm_plugin.step.run_layer`
    (prefill attends, then seals; the CPU backend's step)."""
    n = batch.num_tokens
    if batch.is_decode:
        decode_layer(
            batch.geo, pool, hot_k, hot_v, q[:n], k[:n], v[:n], batch.seq_lens, batch.cold_table,
            batch.hot_table, batch.hot_slots, sm_scale, out[:n],
        )  # fmt: skip
        return
    run_layer(batch.plan, pool, hot_k, hot_v, q[:n], k[:n], v[:n], sm_scale, out[:n])
