"""One attention layer of one vLLM step over the hybrid cache (plain torch; no vLLM import).

A request with ``L`` tokens computed after the step and ``q`` of them new (``P = L − q`` before) holds
``sealed(n) = max(0, (n − hot_tokens) // bs)`` cold blocks: the count is a function of the length alone, so
nothing per request is stored between steps (vLLM's batch rows move and carry no request id). Per layer:

1. the new K/V go to the hot pages (vLLM's slot mapping of the hot group);
2. cold blocks that a request reads this step but that another request of the batch seals this step (a
   prefix hit on blocks computed in the same step) are sealed first;
3. each request attends: its ``sealed(P)`` cold blocks dequantized, then tokens ``sealed(P)·bs … L−1`` from
   the hot pages, causal from position ``P`` (prefill attends, then seals, as kvtune's engine does);
4. blocks ``sealed(P) … sealed(L)−1`` are sealed from the hot pages into their cold pages with kvtune's
   quantizers (per-channel keys, per-token values; bits 0 copies).

Tokens older than the window (``hot_tokens + bs``) are always sealed before vLLM frees their hot pages:
vLLM keeps the newest ``window − 1`` computed tokens, and ``L − sealed(L)·bs < hot_tokens + bs``.
A prefix hit reads the hit's sealed blocks at their stored precision. Re-sealing a block another request
already sealed (a shared prefix) writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant import dequantize_blocks, seal_blocks


def sealed_blocks(length: int, hot_tokens: int, block_size: int) -> int:
    """Cold blocks of a request of ``length`` computed tokens."""
    return max(0, (length - hot_tokens) // block_size)


@dataclass(frozen=True)
class SealJob:
    """Block ``index`` of request ``row`` goes into cold page ``cold_id``."""

    row: int
    index: int
    cold_id: int


@dataclass(frozen=True)
class StepPlan:
    """What every layer of one step does, from vLLM's metadata of the two groups (see the module docstring).

    query_start: [R + 1] token offsets; seq_lens: [R] tokens computed after the step;
    cold_table: [R, max cold blocks] and hot_table: [R, max hot blocks] page ids;
    hot_slots: [T] hot page id · hot_block + offset of each new token (−1: padding).
    """

    query_start: Sequence[int]
    seq_lens: Sequence[int]
    cold_table: torch.Tensor
    hot_table: torch.Tensor
    hot_slots: torch.Tensor
    hot_tokens: int
    block_size: int
    hot_block: int
    bits: int
    early: tuple[SealJob, ...] = field(init=False)
    late: tuple[SealJob, ...] = field(init=False)

    def __post_init__(self) -> None:
        jobs: list[SealJob] = []
        read: set[int] = set()
        for r in range(len(self.seq_lens)):
            before, after = (
                self.sealed_before(r),
                sealed_blocks(self.seq_lens[r], self.hot_tokens, self.block_size),
            )
            read.update(int(b) for b in self.cold_table[r, :before].tolist())
            jobs += [SealJob(r, j, int(self.cold_table[r, j])) for j in range(before, after)]
        object.__setattr__(self, "early", tuple(j for j in jobs if j.cold_id in read))
        object.__setattr__(self, "late", tuple(j for j in jobs if j.cold_id not in read))

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, row: int) -> int:
        return self.query_start[row + 1] - self.query_start[row]

    def sealed_before(self, row: int) -> int:
        """Cold blocks request ``row`` reads this step."""
        return sealed_blocks(self.seq_lens[row] - self.query_len(row), self.hot_tokens, self.block_size)


def write_hot(
    plan: StepPlan, hot_k: torch.Tensor, hot_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """New tokens' K/V [T, H, D] into the hot pages ``hot_k``/``hot_v`` [B, H, hot_block, D]."""
    slots = plan.hot_slots[: k.shape[0]]
    keep = slots >= 0
    blk, off = slots[keep] // plan.hot_block, slots[keep] % plan.hot_block
    hot_k[blk, :, off] = k[keep].to(hot_k.dtype)
    hot_v[blk, :, off] = v[keep].to(hot_v.dtype)


def read_hot(plan: StepPlan, hot: torch.Tensor, row: int, start: int, end: int) -> torch.Tensor:
    """Tokens ``start … end−1`` of request ``row`` from the hot pages: [end − start, H, D]."""
    pos = torch.arange(start, end, device=hot.device)
    blk = plan.hot_table[row].to(hot.device)[pos // plan.hot_block].long()
    return hot[blk, :, pos % plan.hot_block]


def seal(
    plan: StepPlan, jobs: Sequence[SealJob], pool: ColdPool, hot_k: torch.Tensor, hot_v: torch.Tensor
) -> None:
    """Seal ``jobs`` from the hot pages into their cold pages (one call for all of them)."""
    if not jobs:
        return
    bs = plan.block_size
    ks = [read_hot(plan, hot_k, j.row, j.index * bs, (j.index + 1) * bs) for j in jobs]
    vs = [read_hot(plan, hot_v, j.row, j.index * bs, (j.index + 1) * bs) for j in jobs]
    ids = torch.tensor([j.cold_id for j in jobs], dtype=torch.long, device=hot_k.device)
    seal_blocks(pool, ids, torch.stack(ks), torch.stack(vs), plan.bits)


def attend(
    plan: StepPlan,
    row: int,
    pool: ColdPool,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    q: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Request ``row``'s new queries q [q_len, Hq, D] over its cold blocks and hot tokens → [q_len, Hq, D]."""
    length, before = plan.seq_lens[row], plan.sealed_before(row)
    start = before * plan.block_size
    keys, values = [], []
    if before:
        ids = plan.cold_table[row, :before].to(q.device).long()
        ck, cv = dequantize_blocks(pool, ids)  # [n, H, bs, D] float32
        keys.append(ck.transpose(1, 2).flatten(0, 1).to(q.dtype))
        values.append(cv.transpose(1, 2).flatten(0, 1).to(q.dtype))
    keys.append(read_hot(plan, hot_k, row, start, length).to(q.dtype))
    values.append(read_hot(plan, hot_v, row, start, length).to(q.dtype))
    return causal_attention(q, torch.cat(keys), torch.cat(values), sm_scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D], the last T of k, v [P, H, D]; query ``i`` sees keys ``0 … P − T + i`` → [T, Hq, D]."""
    square = q.shape[0] == k.shape[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=None if square else causal_lower_right(q.shape[0], k.shape[0]),
        is_causal=square,
        scale=sm_scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def run_layer(
    plan: StepPlan,
    pool: ColdPool,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    attend_singles: Callable[[list[int]], None] | None = None,
) -> None:
    """Steps 1-4 of the module docstring for one layer; writes ``out`` [T, Hq, D]. ``attend_singles``: attends
    the requests of one new token (their rows, all at once) in place of one dense attention each."""
    write_hot(plan, hot_k, hot_v, k, v)
    seal(plan, plan.early, pool, hot_k, hot_v)
    singles = [] if attend_singles is None else [r for r in range(plan.num_reqs) if plan.query_len(r) == 1]
    for row in range(plan.num_reqs):
        a, b = plan.query_start[row], plan.query_start[row + 1]
        if b > a and not (singles and b - a == 1):
            out[a:b] = attend(plan, row, pool, hot_k, hot_v, q[a:b], sm_scale).to(out.dtype)
    if singles and attend_singles is not None:
        attend_singles(singles)
    seal(plan, plan.late, pool, hot_k, hot_v)
