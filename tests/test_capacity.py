"""The byte budget: capacity in blocks and sequences, CacheFullError, what a step needs."""

from __future__ import annotations

import pytest
import torch

from kvtune.cache_impl.block_pool import CacheFullError
from kvtune.cache_impl.hybrid_cache import ModelKVShape, kv_bytes_for
from kvtune.cache_impl.layout import cache_layout
from kvtune.tests.cache_testlib import SHAPE, config, decode_step, new_cache, prefill, qkv

LLAMA3_8B = ModelKVShape(num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [SHAPE, LLAMA3_8B])
@pytest.mark.parametrize("length", [100, 8192])
def test_capacity_grows_as_bits_shrink(shape: ModelKVShape, length: int) -> None:
    budget = 64 * kv_bytes_for(config(hot_tokens=32, block_size=64), shape, [length])
    lay = {
        b: cache_layout(config(hot_tokens=32, block_size=64, quantization_bits=b), shape, budget)
        for b in (0, 8, 4)
    }
    assert lay[0].num_blocks < lay[8].num_blocks < lay[4].num_blocks
    assert lay[0].max_sequences(length) <= lay[8].max_sequences(length) <= lay[4].max_sequences(length)
    assert all(x.total_bytes <= budget for x in lay.values())


def test_long_sequences_fit_more_often_when_quantized() -> None:
    budget = 16 * kv_bytes_for(config(hot_tokens=32, block_size=64), LLAMA3_8B, [8192])
    fits = [
        cache_layout(
            config(hot_tokens=32, block_size=64, quantization_bits=b), LLAMA3_8B, budget, max_seqs=64
        ).max_sequences(8192)
        for b in (0, 8, 4)
    ]
    assert 15 <= fits[0] < fits[1] < fits[2]  # 64 reserved hot zones cost the unquantized layout one sequence


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("length", [1, 16, 23, 24, 100])
def test_kv_bytes_for_one_sequence_is_exactly_enough(bits: int, length: int) -> None:
    cfg = config(quantization_bits=bits)
    cache = new_cache(cfg, budget=kv_bytes_for(cfg, SHAPE, [length]), max_seqs=1)
    assert cache.fits_ever(length) and not cache.fits_ever(max(length, 16) + 8)
    assert cache.can_allocate(length) and cache.layout.num_blocks == cache.layout.blocks_for(length)


def test_budget_below_one_hot_zone_is_an_error() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        new_cache(config(), budget=100)


def test_full_cache_refuses_then_step_raises() -> None:
    cfg = config()
    n = 16 + 2 * 8 + 7  # two blocks, hot zone one token short of sealing
    cache = new_cache(cfg, budget=kv_bytes_for(cfg, SHAPE, [n]), max_seqs=1)
    q, k, v = qkv(0, n + 1)
    prefill(cache, 0, list(range(n)), q[:, :n], k[:, :n], v[:, :n])
    assert not cache.can_allocate(1)  # no slot left
    assert cache.blocks_needed_for_step([0]) == 1 > cache.blocks_free()
    with pytest.raises(CacheFullError):
        decode_step(cache, [0], 0.0, q[:, n:], k[:, n:], v[:, n:])
    cache.check_integrity()
    cache.free_sequence(0)
    cache.check_integrity()


def test_stats_count_bytes_in_use() -> None:
    cfg = config()
    cache = new_cache(cfg)
    q, k, v = qkv(1, 40)
    prefill(cache, 0, list(range(40)), q, k, v)
    stats = cache.stats()
    assert stats["kv_bytes_in_use"] == kv_bytes_for(cfg, SHAPE, [40])
    assert stats["total_bytes"] <= stats["budget_bytes"]
    cache.free_sequence(0)
    cache.check_integrity()
