"""Prefix sharing of sealed blocks: chained hashes, refcounts, the LRU of freed blocks, hits at current
tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtune.cache_impl.block_pool import BlockPool, CacheFullError, chain_hashes
from kvtune.cache_impl.tiers import L2, Migrations
from kvtune.tests.cache_testlib import SHAPE, config, decode_step, dense, new_cache, prefill, qkv

HOT, BS = 16, 8
PROMPT = list(range(100, 100 + HOT + 4 * BS + 3))  # seals 4 blocks


def _shared(prompt: list[int], tail: list[int]) -> list[int]:
    return prompt + tail


def test_chained_hash_depends_on_the_parent() -> None:
    a = chain_hashes([1] * 8 + [2] * 8, 8, 2)
    b = chain_hashes([3] * 8 + [2] * 8, 8, 2)
    assert a[0] != b[0] and a[1] != b[1]
    assert chain_hashes([1] * 8 + [2] * 8 + [9], 8, 2) == a


@pytest.mark.parametrize("bits", [0, 8])
def test_second_sequence_reuses_prefix_and_everything_is_freed(bits: int) -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=bits))
    q, k, v = qkv(1, len(PROMPT) + 1)
    n = len(PROMPT)
    assert prefill(cache, 1, PROMPT, q[:, :n], k[:, :n], v[:, :n])[0] == 0
    other = PROMPT[: 2 * BS] + [7] * (len(PROMPT) - 2 * BS)  # shares two blocks
    assert cache.can_allocate(len(other), other)
    cached, outs = prefill(cache, 2, other, q[:, : len(other)], k[:, : len(other)], v[:, : len(other)])
    assert cached == 2 * BS
    assert cache.stats()["prefix_hit_blocks"] == 2
    if bits == 0:  # the hit prefix is attended exactly
        want = dense(q[0, n - 1], k[0, :n], v[0, :n])
        assert torch.allclose(outs[0][-1], want, atol=2e-5)
    decode_step(
        cache,
        [1, 2],
        1.0,
        q[:, -1:].expand(-1, 2, -1, -1),
        k[:, -1:].expand(-1, 2, -1, -1),
        v[:, -1:].expand(-1, 2, -1, -1),
    )
    cache.check_integrity()
    cache.free_sequence(1)
    cache.free_sequence(2)
    cache.check_integrity()
    assert cache.blocks_free() == cache.layout.num_blocks and cache.stats()["blocks_in_use"] == 0


def test_freed_blocks_stay_reusable_until_memory_is_needed() -> None:
    cfg = config(hot_tokens=HOT, block_size=BS)
    cache = new_cache(cfg, budget=2 * 4 * cache_block_bytes(cfg) + 4 * hot_bytes(cfg), max_seqs=2)
    q, k, v = qkv(2, 200)
    prefill(cache, 1, PROMPT, q[:, : len(PROMPT)], k[:, : len(PROMPT)], v[:, : len(PROMPT)])
    cache.free_sequence(1)
    assert cache.stats()["blocks_cached_free"] == 4
    cached, _ = prefill(cache, 2, PROMPT, q[:, : len(PROMPT)], k[:, : len(PROMPT)], v[:, : len(PROMPT)])
    assert cached == 4 * BS  # LRU hit
    cache.free_sequence(2)
    big = list(range(5000, 5000 + HOT + cache.layout.num_blocks * BS))  # needs every block: evicts the LRU
    prefill(
        cache,
        3,
        big,
        q[:, :1].expand(-1, len(big), -1, -1),
        k[:, :1].expand(-1, len(big), -1, -1),
        v[:, :1].expand(-1, len(big), -1, -1),
    )
    assert cache.stats()["block_evictions"] == 4
    cache.free_sequence(3)
    assert cache.add_sequence(4, PROMPT) == 0
    cache.free_sequence(4)
    cache.check_integrity()


def cache_block_bytes(cfg) -> int:
    from kvtune.cache_impl.layout import block_bytes

    return block_bytes(cfg, SHAPE)


def hot_bytes(cfg) -> int:
    from kvtune.cache_impl.layout import hot_bytes_per_seq

    return hot_bytes_per_seq(cfg, SHAPE)


def test_hit_keeps_precision_and_tier() -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=8, sparse_top_k=BS))
    q, k, v = qkv(3, len(PROMPT))
    prefill(cache, 1, PROMPT, q, k, v)
    block = cache._seqs[1].blocks[0]
    cache.tiers.apply(Migrations(np.array([0]), np.array([block]), np.array([L2])), cache.pools)
    cache.free_sequence(1)
    assert cache.add_sequence(2, PROMPT) == 4 * BS
    assert cache.tiers.tier_host[0, block] == L2 and int(cache.pools[0].block_bits[block]) == 4
    assert cache.tiers.tier_host[1, block] != L2 and int(cache.pools[1].block_bits[block]) == 8
    cache.free_sequence(2)
    cache.check_integrity()


@pytest.mark.parametrize("extra", [0, 1, BS, 3 * BS])
def test_hit_never_takes_the_hot_zone(extra: int) -> None:
    """A longer cached prompt only lends the blocks this prompt would seal itself."""
    cache = new_cache(config(hot_tokens=HOT, block_size=BS))
    long = _shared(PROMPT, list(range(HOT + 4 * BS)))
    q, k, v = qkv(4, len(long))
    prefill(cache, 1, long, q, k, v)
    short = long[: HOT + 2 * BS + extra]
    cached = cache.add_sequence(2, short)
    assert cached == ((len(short) - HOT) // BS) * BS and len(short) - cached >= HOT
    cache.free_sequence(2)
    cache.free_sequence(1)
    cache.check_integrity()


def test_prompt_block_sealed_in_decode_becomes_shareable() -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS))
    prompt = list(range(HOT + BS + 2))  # seals 1 block in prefill; block 2 holds prompt tokens 8..15 + hot
    q, k, v = qkv(5, len(prompt) + BS)
    n = len(prompt)
    prefill(cache, 1, prompt, q[:, :n], k[:, :n], v[:, :n])
    for t in range(n, n + BS - 2):
        decode_step(cache, [1], float(t), q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
    assert len(cache._seqs[1].blocks) == 2
    assert cache.add_sequence(2, prompt + [1] * BS) == 2 * BS
    cache.free_sequence(1)
    cache.free_sequence(2)
    cache.check_integrity()


def test_block_pool_refcounts() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.register(a[0], 11)
    pool.acquire([a[0]])
    assert pool.release([a[0], a[0], a[1]]) == [a[0], a[1]]
    assert pool.num_cached_free() == 1 and pool.match([11]) == [a[0]]
    with pytest.raises(CacheFullError):
        pool.allocate(4)
    pool.check_integrity(np.zeros(3, dtype=np.int32))
