"""A vLLM-like run of one attention layer over the plugin's pages, without vLLM: what the step tests share.

:class:`Run` keeps one pool of pages the way vLLM's block pool does for one layer — one ``uint8`` tensor
whose block ``b`` is the cold page of ``b`` in the cold group and the (padded) hot page of ``b`` in the hot
group, block 0 the null block — and hands out the two groups' block tables, the hot group's slot mapping,
the lengths and the query offsets of each step, as vLLM's metadata does. Hot pages of tokens the hot window
no longer needs (those before ``sealed(P)·bs``, more than vLLM frees) are freed to the null block and
reused, so a step that read one would read another request's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, cold_layout
from kvtune.kernels.layout import ColdPool
from kvtune.vllm_plugin.decode import NULL_BLOCK, Batch, Geometry
from kvtune.vllm_plugin.pages import PageLayout, cold_pool_view, hot_views
from kvtune.vllm_plugin.step import sealed_blocks

Step = Callable[[Batch, ColdPool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def page_layout(bits: int, dtype: torch.dtype, hot: int, block: int, heads: int, dim: int) -> PageLayout:
    config = HybridConfig.from_dict(
        {"kv_cache_strategy": "hybrid_v2", "hot_tokens": hot, "block_size": block, "quantization_bits": bits}
    )
    return PageLayout(cold_layout(config, ModelKVShape(1, heads, dim, heads, dtype)))


@dataclass
class _Request:
    length: int = 0
    cold: list[int] = field(default_factory=list)
    hot: list[int] = field(default_factory=list)


class Run:
    """One layer's pages and the block bookkeeping of a few requests (see the module docstring)."""

    def __init__(self, page: PageLayout, hot_tokens: int, num_blocks: int, device: str) -> None:
        self.page, self.device = page, device
        c = page.cold
        self.geo = Geometry(hot_tokens, c.block_size, page.hot_block_size, c.bits)
        self.raw = torch.zeros(num_blocks, page.page_bytes, dtype=torch.uint8, device=device)
        self.free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.reqs: list[_Request] = []

    # ---- the pages ----------------------------------------------------------------------------------
    def pool(self) -> ColdPool:
        return cold_pool_view(self.page, self.cold_cache())

    def cold_cache(self) -> torch.Tensor:
        """The cold group's view of the pages, as vLLM binds it: [B, 1, bs, C] uint8."""
        return self.raw.view(-1, 1, self.page.cold.block_size, self.page.bytes_per_token)

    def hot_cache(self) -> torch.Tensor:
        """The hot group's view of the (padded) pages, as vLLM binds it: [B, H, hot_block, 2·D]."""
        c, hb = self.page.cold, self.page.hot_block_size
        elem = torch.empty(0, dtype=c.dtype).element_size()
        used = c.num_kv_heads * hb * 2 * c.head_dim * elem
        return self.raw[:, :used].view(c.dtype).view(-1, c.num_kv_heads, hb, 2 * c.head_dim)

    def hot_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return hot_views(self.hot_cache(), self.page.cold.head_dim)

    # ---- vLLM's bookkeeping -------------------------------------------------------------------------
    def _take(self) -> int:
        return self.free.pop()

    def _grow(self, req: _Request, length: int) -> None:
        g = self.geo
        while len(req.cold) * g.block_size < length:
            req.cold.append(self._take())
        while len(req.hot) * g.hot_block < length:
            req.hot.append(self._take())

    def _release(self, req: _Request) -> None:
        """Free the hot pages wholly before ``sealed(P)·bs`` (P: the length before the step)."""
        g = self.geo
        keep_from = sealed_blocks(req.length, g.hot_tokens, g.block_size) * g.block_size
        for i in range(keep_from // g.hot_block):
            if req.hot[i] != NULL_BLOCK:
                self.free.append(req.hot[i])
                req.hot[i] = NULL_BLOCK

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        """vLLM's block table: one row per request, padded with the null block."""
        width = max(1, *(len(r) for r in rows))
        padded = [r + [NULL_BLOCK] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def step(self, new_tokens: Sequence[int]) -> Batch:
        """The metadata of a step in which request ``r`` gets ``new_tokens[r]`` tokens (new requests are
        added as they are named)."""
        while len(self.reqs) < len(new_tokens):
            self.reqs.append(_Request())
        starts, slots = [0], []
        g = self.geo
        for req, n in zip(self.reqs, new_tokens):
            self._release(req)
            self._grow(req, req.length + n)
            for pos in range(req.length, req.length + n):
                slots.append(req.hot[pos // g.hot_block] * g.hot_block + pos % g.hot_block)
            req.length += n
            starts.append(starts[-1] + n)
        dev = self.device
        return Batch(
            geo=g,
            query_start_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor([r.length for r in self.reqs], dtype=torch.int32, device=dev),
            cold_table=self._table([r.cold for r in self.reqs]),
            hot_table=self._table([r.hot for r in self.reqs]),
            hot_slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(new_tokens),
            num_tokens=sum(new_tokens),
        )


def schedule(prompts: Sequence[int], chunk: int, decode_steps: int) -> list[list[int]]:
    """New tokens per request and step: prompts prefilled ``chunk`` tokens at a time (all requests in each
    step, a request done with its prompt takes one token: mixed batches), then ``decode_steps`` steps of one
    token each."""
    left, steps = list(prompts), []
    while any(left):
        take = [min(chunk, n) if n else 1 for n in left]
        left = [max(0, n - t) if n else 0 for n, t in zip(left, take)]
        steps.append(take)
    return steps + [[1] * len(prompts)] * decode_steps


def drive(
    run: Run, steps: Sequence[Sequence[int]], step: Step, heads_q: int, seed: int
) -> tuple[list[torch.Tensor], list[bool]]:
    """Run ``step`` over every step of ``steps`` with seeded random q/k/v (the same for every run of the
    same seed and shapes); the outputs (on the CPU, float32) and whether each step was a decode batch."""
    c = run.page.cold
    g = torch.Generator().manual_seed(seed)
    outs, decodes = [], []
    for new in steps:
        batch = run.step(new)
        t = batch.num_tokens
        q = torch.randn(t, heads_q, c.head_dim, generator=g).to(c.dtype).to(run.device)
        k = torch.randn(t, c.num_kv_heads, c.head_dim, generator=g).to(c.dtype).to(run.device)
        v = torch.randn(t, c.num_kv_heads, c.head_dim, generator=g).to(c.dtype).to(run.device)
        hot_k, hot_v = run.hot_pages()
        out = torch.zeros_like(q)
        step(batch, run.pool(), hot_k, hot_v, q, k, v, out)
        outs.append(out.float().cpu())
        decodes.append(batch.is_decode)
    return outs, decodes
