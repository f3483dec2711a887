"""The CUDA backend's step of one attention layer (plain torch and kvtune's kernel launchers; no vLLM
import): decode batches as device work only (no read of a device tensor on the host, fixed shapes: what a
CUDA graph captures), other batches through the CPU backend's host plan.

A batch in which every request has one new token (``max_query_len == 1``) is a decode batch. Per layer, for
request ``r`` of ``L`` tokens after the step (``P = L − 1`` before it), from vLLM's tensors of the step
(``seq_lens``, the two groups' block tables, the hot group's slot mapping) and nothing else:

1. the new K/V go to the hot pages;
2. the hot tokens ``sealed(P)·bs … L−1`` are gathered into a dense ``[R, H, window, D]`` zone
   (``window = hot_tokens + block_size``, which holds them all);
3. where ``sealed(L) > sealed(P)`` (one block at most), block ``sealed(P)`` — the zone's first ``bs``
   tokens — is sealed into its cold page with kvtune's seal (Triton on CUDA);
4. :func:`~kvtune.kernels.decode_attention.hybrid_decode_attention` (the fused Triton/Gluon kernels on
   CUDA) attends the ``sealed(P)`` cold blocks (vLLM's ``[R, W]`` cold table spread over the KV heads,
   read through the page-strided views of :func:`~kvtune.vllm_plugin.pages.cold_pool_view`) and the zone.

This is :func:`kvtune.vllm_plugin.step.run_layer` for such a batch (same pages in, same pages and outputs
out, up to the kernels' arithmetic). Every block is sealed before any request attends, which is the order
``run_layer`` keeps for a block another request reads in the step (a prefix hit on blocks computed in the
same step); a request never reads the page it seals itself, so for the others the order changes nothing.
Rows without a block to seal, and padding tokens (slot −1, rows of length 0 in a padded graph), write into
vLLM's null block (block 0), which vLLM never hands to a request and which no step reads as data.

A batch with a prefill runs :func:`mixed_layer`: ``run_layer``'s plan (prefill attends, then seals), with
its one-token requests attending through the same decode kernel.
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


@dataclass(frozen=True)
class Zone:
    """Requests of one new token each, gathered: each one's hot tokens (K and V ``[R, H, window, D]``), the
    cold blocks it reads (``num_cold`` [R] int32), its hot token count and the page of the block it seals in
    this step (``seal_ids`` [R], the null block where it seals none; the block is the zone's first ``bs``
    tokens)."""

    k: torch.Tensor
    v: torch.Tensor
    num_cold: torch.Tensor
    hot_len: torch.Tensor
    seal_ids: torch.Tensor


def decode_zone(
    geo: Geometry,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    seq_lens: torch.Tensor,
    cold_table: torch.Tensor,
    hot_table: torch.Tensor,
) -> Zone:
    """Step 2 of the module docstring (and step 3's pages) for requests of lengths ``seq_lens`` [R] after
    the step, each with one new token already in the hot pages."""
    lengths = seq_lens.long()
    before, after = sealed_counts(lengths - 1, geo), sealed_counts(lengths, geo)
    start = before * geo.block_size
    index = (after - 1).clamp(min=0, max=cold_table.shape[1] - 1)[:, None]
    return Zone(
        k=gather_hot(geo, hot_k, hot_table, start, lengths),
        v=gather_hot(geo, hot_v, hot_table, start, lengths),
        num_cold=before.to(torch.int32),
        hot_len=(lengths - start).to(torch.int32),
        seal_ids=torch.where(after > before, cold_table.long().gather(1, index)[:, 0], NULL_BLOCK),
    )


def attend_zone(
    pool: ColdPool, q: torch.Tensor, zone: Zone, cold_table: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Step 4: q [R, Hq, D] over each request's cold blocks (its row of ``cold_table`` [R, Wc]) and its
    zone, with :func:`~kvtune.kernels.decode_attention.hybrid_decode_attention` → [R, Hq, D] (q.dtype)."""
    rows, heads = q.shape[0], zone.k.shape[1]
    out, _, _ = hybrid_decode_attention(
        q,
        zone.k,
        zone.v,
        torch.arange(rows, device=q.device, dtype=torch.int32),
        zone.hot_len,
        pool,
        cold_table_per_head(cold_table, zone.num_cold, heads),
        zone.num_cold[:, None].expand(-1, heads).contiguous(),
        sm_scale,
    )
    return out


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
    rows, bs = q.shape[0], geo.block_size
    write_hot_slots(geo, hot_k, hot_v, hot_slots, k, v)
    table = cold_table[:rows]
    zone = decode_zone(geo, hot_k, hot_v, seq_lens[:rows], table, hot_table[:rows])
    block_k, block_v = zone.k[:, :, :bs].transpose(1, 2), zone.v[:, :, :bs].transpose(1, 2)  # [R, bs, H, D]
    seal_blocks(pool, zone.seal_ids, block_k, block_v, geo.bits)  # before attending: see the module docstring
    out.copy_(attend_zone(pool, q, zone, table, sm_scale).to(out.dtype))


def mixed_layer(
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
    """:func:`~kvtune.vllm_plugin.step.run_layer` for a batch with a prefill (host-planned), except that its
    requests of one new token attend through :func:`attend_zone` (one kernel launch for all of them)
    instead of one dense attention each; their blocks are sealed with the plan's."""
    plan = batch.plan

    def attend_singles(single: list[int]) -> None:
        rows = torch.tensor(single, device=q.device)
        tokens = torch.tensor([plan.query_start[r] for r in single], device=q.device)
        table = batch.cold_table[rows]
        zone = decode_zone(batch.geo, hot_k, hot_v, batch.seq_lens[rows], table, batch.hot_table[rows])
        out[tokens] = attend_zone(pool, q[tokens], zone, table, sm_scale).to(out.dtype)

    run_layer(plan, pool, hot_k, hot_v, q, k, v, sm_scale, out, attend_singles)


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
    :func:`decode_layer` (device work only), any other batch :func:`mixed_layer` (the CPU backend's step,
    prefill attends then seals, with the one-token requests through the decode kernel)."""
    n = batch.num_tokens
    if batch.is_decode:
        decode_layer(
            batch.geo, pool, hot_k, hot_v, q[:n], k[:n], v[:n], batch.seq_lens, batch.cold_table,
            batch.hot_table, batch.hot_slots, sm_scale, out[:n],
        )  # fmt: skip
        return
    mixed_layer(batch, pool, hot_k, hot_v, q[:n], k[:n], v[:n], sm_scale, out[:n])
