"""Small shapes and a dense reference for the cache tests."""

from __future__ import annotations

from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache, ModelKVShape

SHAPE = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, dtype=torch.float32)


def config(**kw: Any) -> HybridConfig:
    base: dict[str, Any] = dict(
        kv_cache_strategy="hybrid_v2", hot_tokens=16, block_size=8, quantization_bits=0
    )
    return HybridConfig(**{**base, **kw})


def new_cache(
    cfg: HybridConfig, budget: int = 1 << 20, max_seqs: int = 4, shape: ModelKVShape = SHAPE
) -> HybridCache:
    return HybridCache(cfg, shape, budget, "cpu", max_seqs=max_seqs)


def qkv(seed: int, n: int, shape: ModelKVShape = SHAPE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [L, n, Hq, D], k, v [L, n, H, D] float32."""
    g = torch.Generator().manual_seed(seed)
    lq = (shape.num_layers, n, shape.num_q_heads, shape.head_dim)
    lk = (shape.num_layers, n, shape.num_kv_heads, shape.head_dim)
    return torch.randn(lq, generator=g), torch.randn(lk, generator=g), torch.randn(lk, generator=g)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one query q [Hq, D] over k, v [P, H, D] (grouped heads) → [Hq, D]."""
    hq, d = q.shape
    h = k.shape[1]
    qg = q.view(h, hq // h, d) * d**-0.5
    p = torch.einsum("hgd,phd->hgp", qg, k).softmax(-1)
    return torch.einsum("hgp,phd->hgd", p, v).reshape(hq, d)


def prefill(
    cache: HybridCache, seq_id: int, tokens: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
):
    """Register + prefill all layers with the uncached part of q/k/v [L, P, ...]; returns (cached, outs)."""
    cached = cache.add_sequence(seq_id, tokens)
    outs = [
        cache.prefill(layer, seq_id, q[layer, cached:], k[layer, cached:], v[layer, cached:])
        for layer in range(q.shape[0])
    ]
    return cached, outs


def decode_step(cache: HybridCache, seq_ids: list[int], now: float, q, k, v) -> list[torch.Tensor]:
    """One step; q [L, B, Hq, D], k, v [L, B, H, D]; returns each layer's output [B, Hq, D]."""
    plan = cache.begin_step(seq_ids, now)
    outs = [cache.decode(layer, plan, q[layer], k[layer], v[layer]) for layer in range(q.shape[0])]
    cache.end_step(plan)
    return outs
