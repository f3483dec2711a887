"""Access rule, IAI, planning thresholds, demotion/promotion and the throttled queue, on a fake clock."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtune.cache_impl.layout import QUEST_SUMMARY_ENV
from kvtune.cache_impl.tiers import L1, L2, MigrationQueue, Migrations, TierState, load_factor, threshold_ms
from kvtune.kernels.access import (
    accessed_blocks_ref,
    inter_access_interval,
    update_access,
    update_access_ref,
)
from kvtune.kernels.layout import ColdLayout
from kvtune.kernels.quant import seal_blocks
from kvtune.kernels.quest_summary import summary8
from kvtune.tests.cache_testlib import config, decode_step, new_cache, prefill, qkv

TABLE = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]], dtype=torch.int32)  # one sequence, two KV heads
COUNT = torch.tensor([[4, 4]], dtype=torch.int32)


def _mass(head0: list[float], head1: list[float]) -> torch.Tensor:
    return torch.tensor([[head0, head1]], dtype=torch.float32)


def _state(bits: int) -> tuple[TierState, list]:
    state = TierState(num_layers=1, num_blocks=4, device=torch.device("cpu"))
    pool = ColdLayout(8, 2, 16, bits, torch.float32).allocate(4, "cpu")
    seal_blocks(pool, torch.arange(4), torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16), bits)
    state.reset([0, 1, 2, 3], now_ms=0.0)
    return state, [pool]


def _access(state: TierState, now: float, head0: list[float], head1: list[float]) -> list[int]:
    mass = _mass(head0, head1)
    acc = accessed_blocks_ref(state.last_access.shape[1], mass, TABLE, COUNT)
    update_access(state.last_access[0], state.ema[0], mass, TABLE, COUNT, now)
    return acc.nonzero().flatten().tolist()


def test_access_rule_and_ema() -> None:
    state, _ = _state(8)
    # cold mass 0.8 per head, uniform share 0.2: block 0 (head 0) and block 3 (head 1) are above it
    assert _access(state, 100.0, [0.5, 0.1, 0.1, 0.1], [0.1, 0.1, 0.0, 0.6]) == [0, 3]
    assert _access(state, 400.0, [0.5, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2]) == [0]  # 0.2 is not above 0.2
    assert state.last_access[0].tolist() == [400.0, 0.0, 0.0, 100.0]
    ema = state.ema[0].tolist()
    assert ema[0] == 0.25 * 300 + 0.75 * 100 and ema[3] == 100.0 and math.isnan(ema[1])
    iai = inter_access_interval(state.last_access[0], state.ema[0], 500.0).tolist()
    assert iai == [150.0, 500.0, 500.0, 400.0]


@pytest.mark.parametrize(("lengths", "factor"), [([512], 1.0), ([128, 2048], 1.0), ([], 0.0), ([256], 0.5)])
def test_load_factor_is_geometric_mean_over_512(lengths: list[int], factor: float) -> None:
    assert load_factor(lengths) == pytest.approx(factor)
    cfg = config(migration_threshold_ms=200.0)
    assert threshold_ms(cfg, lengths) == pytest.approx(200.0 * (1 + 0.2 * factor))


@pytest.mark.parametrize(("bits", "demoted_bits"), [(8, 4), (4, 4), (0, 0)])
def test_demotion_then_promotion_follow_the_formulas(bits: int, demoted_bits: int) -> None:
    cfg = config(
        sparse_top_k=8, migration_threshold_ms=200.0
    )  # threshold 240 at length 512, demote above 360
    state, pools = _state(bits)
    in_use = np.ones(4, dtype=bool)
    _access(state, 100.0, [0.5, 0.1, 0.1, 0.1], [0.1, 0.1, 0.0, 0.6])
    _access(state, 400.0, [0.5, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2])
    plan = state.plan(cfg, 500.0, in_use, [512])  # IAI = [150, 500, 500, 400]
    assert plan.blocks.tolist() == [1, 2, 3] and (plan.targets == L2).all()
    assert state.apply(plan, pools) == 3
    assert state.tier_host[0].tolist() == [L1, L2, L2, L2]
    assert pools[0].block_bits.tolist() == [bits, demoted_bits, demoted_bits, demoted_bits]
    _access(state, 550.0, [0.1, 0.1, 0.1, 0.5], [0.2, 0.2, 0.2, 0.2])  # ema(3) = 0.25·450 + 0.75·100 = 187.5
    _access(state, 600.0, [0.1, 0.1, 0.1, 0.5], [0.2, 0.2, 0.2, 0.2])  # ema(3) = 153.125 < 240
    plan = state.plan(cfg, 610.0, in_use, [512])  # IAI(0) = max(150, 210) = 210 < 360: stays in L1
    assert plan.blocks.tolist() == [3] and plan.targets.tolist() == [L1]
    state.apply(plan, pools)
    assert state.tier_host[0].tolist() == [L1, L2, L2, L1] and pools[0].block_bits[3] == demoted_bits
    state.check()


def test_nothing_is_demoted_without_sparse_tier() -> None:
    state, _ = _state(8)
    plan = state.plan(config(sparse_top_k=0, migration_threshold_ms=1.0), 1e6, np.ones(4, dtype=bool), [512])
    assert len(plan) == 0


def test_blocks_not_in_use_are_not_planned() -> None:
    state, _ = _state(8)
    in_use = np.array([True, False, True, False])
    plan = state.plan(config(sparse_top_k=8, migration_threshold_ms=1.0), 1e6, in_use, [512])
    assert plan.blocks.tolist() == [0, 2]


def _migrations(n: int) -> Migrations:
    return Migrations(
        np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64), np.full(n, L2, dtype=np.int64)
    )


@pytest.mark.parametrize(
    ("throttling", "max_per_step", "interval", "takes"),
    [
        (False, None, 2, [5, 0]),
        (True, None, 2, [3, 2, 0]),
        (True, 1, 2, [1, 1, 1, 1, 1, 0]),
        (True, 2, 4, [2, 2, 1]),
    ],
)
def test_queue_throttling(
    throttling: bool, max_per_step: int | None, interval: int, takes: list[int]
) -> None:
    cfg = config(
        migration_throttling=throttling, max_migrations_per_step=max_per_step, migration_interval=interval
    )
    queue = MigrationQueue(cfg)
    queue.replace(_migrations(5))
    refcount = np.ones(5, dtype=np.int32)
    assert [len(queue.take(refcount)) for _ in takes] == takes


def test_queue_new_plan_replaces_rest_and_drops_finished() -> None:
    queue = MigrationQueue(config(migration_throttling=True, max_migrations_per_step=2))
    queue.replace(_migrations(5))
    queue.take(np.ones(5, dtype=np.int32))
    queue.replace(_migrations(3))
    assert len(queue) == 3
    taken = queue.take(np.array([0, 1, 1], dtype=np.int32))  # block 0's sequence finished
    assert taken.blocks.tolist() == [1, 2] and len(queue) == 0


@pytest.mark.parametrize(("throttling", "done_per_step"), [(False, [12, 0]), (True, [3, 3])])
def test_cache_plans_every_interval_and_demotes(
    throttling: bool, done_per_step: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threshold 1 ms and 1 s steps: at the planning step every in-use block is cold enough to go to L2.
    The cache keeps the e4m3 summary (KVTUNE_QUEST_SUMMARY=1): it follows every seal and demotion."""
    monkeypatch.setenv(QUEST_SUMMARY_ENV, "1")
    cfg = config(
        quantization_bits=8,
        sparse_top_k=8,
        migration_interval=3,
        migration_threshold_ms=1.0,
        migration_throttling=throttling,
        max_migrations_per_step=3 if throttling else None,
    )
    cache = new_cache(cfg)
    n = 16 + 6 * 8  # 6 sealed blocks, 2 layers: 12 (layer, block) pairs
    q, k, v = qkv(3, n + 6)
    prefill(cache, 0, list(range(n)), q[:, :n], k[:, :n], v[:, :n])
    done = []
    for t in range(n, n + 5):
        decode_step(cache, [0], 1000.0 * (t - n + 1), q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        done.append(cache.stats()["migrations_done"])
    assert done[:2] == [0, 0]
    assert [done[2], done[3] - done[2]] == done_per_step
    stats = cache.stats()
    assert stats["plans"] == 1 and stats["l2_blocks"] == done[-1]
    assert cache.debug_stats()["migrations_queued"] == 12 - done[-1]
    cache.check_integrity()
    for pool in cache.pools:  # the e4m3 summary follows every seal and demotion
        assert pool.summary is not None and (pool.block_bits == 4).any()
        want = summary8(pool)
        assert torch.equal(pool.summary.lo.view(torch.uint8), want.lo.view(torch.uint8))
        assert torch.equal(pool.summary.span.view(torch.uint8), want.span.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_access_update_equals_reference(seed: int) -> None:
    """The listed-blocks-only update gives the reference's statistics (shared blocks, padding, NaN EMAs)."""
    gen = torch.Generator().manual_seed(seed)
    n, b, h, m = 11, 3, 2, 5
    table = torch.randint(0, n, (b, h, m), generator=gen, dtype=torch.int32)
    num_cold = torch.randint(1, m + 1, (b, h), generator=gen, dtype=torch.int32)
    table = torch.where(torch.arange(m) < num_cold[..., None], table, -1)
    mass = torch.rand((b, h, m), generator=gen)
    last = torch.rand(n, generator=gen, dtype=torch.float64) * 100
    ema = torch.where(torch.rand(n, generator=gen) < 0.5, float("nan"), 50.0).to(torch.float64)
    ref_last, ref_ema = last.clone(), ema.clone()
    acc_ref = update_access_ref(ref_last, ref_ema, mass, table, num_cold, 200.0)
    update_access(last, ema, mass, table, num_cold, 200.0)
    assert acc_ref.any() and torch.equal(last, ref_last)
    torch.testing.assert_close(ema, ref_ema, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("throttling", "explicit"), [(False, None), (True, None), (True, 2)])
def test_device_queue_follows_the_host_spec(seed: int, throttling: bool, explicit: int | None) -> None:
    """The cache's device queue (plan_pending, apply_pending) against the host spec (plan, MigrationQueue,
    apply) over random statistics, tiers and in-use masks: the same tiers, bits, counts and queue after
    every step, planning every third step."""
    layers, n, bits = 3, 12, 8
    cfg = config(
        sparse_top_k=8,
        migration_throttling=throttling,
        max_migrations_per_step=explicit,
        migration_interval=3,
        migration_threshold_ms=100.0,
    )
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    layout = ColdLayout(8, 2, 16, bits, torch.float32, summary=True)
    states = [TierState(layers, n, torch.device("cpu")) for _ in range(2)]
    pools = [layout.allocate_layers(layers, n, "cpu") for _ in range(2)]
    kv = torch.randn(layers, 2, n, 8, 2, 16, generator=gen)
    for layer_pools in pools:
        for pool, x in zip(layer_pools, kv):
            seal_blocks(pool, torch.arange(n), x[0], x[1], bits)
    host, dev = states
    queue = MigrationQueue(cfg)
    done, lengths = 0, [700, 300]
    for step in range(1, 13):
        now = 50.0 * step
        touched = torch.rand(layers, n, generator=gen) < 0.3  # accessed since: a fresh interval
        for state in states:
            interval = now - state.last_access
            ema = torch.where(torch.isnan(state.ema), interval, 0.25 * interval + 0.75 * state.ema)
            state.ema.copy_(torch.where(touched, ema, state.ema))
            state.last_access.copy_(torch.where(touched, now, state.last_access))
        refcount = rng.integers(0, 3, n).astype(np.int32)
        dev.sync_in_use(refcount, 0, step)
        if step % cfg.migration_interval == 0:
            queue.replace(host.plan(cfg, now, refcount > 0, lengths))
            dev.plan_pending(cfg, now, threshold_ms(cfg, lengths))
        done += host.apply(queue.take(refcount), pools[0])
        dev.apply_pending(cfg, pools[1])
        queue.drop_unused(refcount)
        assert np.array_equal(host.tier_host, dev.tier_host), step
        assert int(dev.done) == done, step
        assert dev.queued() == len(queue), step
        for a, b in zip(*pools):
            assert torch.equal(a.block_bits, b.block_bits) and torch.equal(a.k, b.k)
            assert a.summary is not None and b.summary is not None
            assert torch.equal(a.summary.span.view(torch.uint8), b.summary.span.view(torch.uint8))
            assert torch.equal(b.summary.span.view(torch.uint8), summary8(b).span.view(torch.uint8))
    assert done > 0 and (host.tier_host == L2).any()


def test_device_queue_plans_only_when_due() -> None:
    """A captured step plans at every replay: the result is kept only where ``due`` is set."""
    cfg = config(sparse_top_k=8, migration_threshold_ms=1.0, migration_interval=2)
    state = TierState(1, 4, torch.device("cpu"))
    state.reset([0, 1, 2, 3], now_ms=0.0)
    state.sync_in_use(np.ones(4, dtype=np.int32), 0, 0)
    state.plan_pending(cfg, 1e4, 1.0, torch.tensor(False))
    assert state.queued() == 0 and int(state.budget) == 0
    state.plan_pending(cfg, 1e4, 1.0, torch.tensor(True))
    assert state.queued() == 4 and int(state.budget) == 2
    state.enabled.fill_(False)  # a capture's warm-up: nothing migrates
    state.apply_pending(cfg, [])
    assert state.queued() == 4 and int(state.done) == 0
    state.enabled.fill_(True)
    state.apply_pending(cfg, [])
    assert state.queued() == 0 and int(state.done) == 4 and float(state.l2_peak) == 1.0
