"""The static decode step (what CUDA graphs replay) against the eager one, and mixed iterations.

On a CPU the static step runs without capture (the same functions a graph records), with and without the
padding a replay uses (rows, table width, seal entries rounded up to the buckets): the tiny random model in
float32 must give the eager path's logits, and leave the cache in the same state. The ``gpu`` tests capture
the graphs on CUDA and compare them with the eager path there.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import kv_bytes_for, sequences_for_budget
from kvtune.engine.graphs import DecodeGraphs, row_buckets, seal_buckets, width_buckets
from kvtune.kernels.access import update_access, update_access_ref
from kvtune.kernels.quant import dequantize_blocks

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _config(bits: int, block_size: int = 8, **kw) -> HybridConfig:
    return HybridConfig("hybrid_v2", hot_tokens=16, block_size=block_size, quantization_bits=bits, **kw)


SPARSE = dict(sparse_top_k=16, migration_interval=4, migration_threshold_ms=1.0)


def _prefilled(
    tiny, config: HybridConfig, lengths: list[int], device: torch.device, spare: int = 1
) -> HybridCache:
    """A cache holding one sequence per length (seeded tokens), prefilled through the model, ``spare`` free
    slots."""
    budget = 4 * kv_bytes_for(config, tiny.model.kv_shape, [n + 64 for n in [*lengths, *[64] * spare]])
    cache = HybridCache(config, tiny.model.kv_shape, budget, device, max_seqs=len(lengths) + spare)
    gen = torch.Generator().manual_seed(7)
    for seq_id, n in enumerate(lengths):
        ids = torch.randint(0, tiny.spec.vocab_size, (n,), generator=gen)
        cache.add_sequence(seq_id, ids.tolist(), now_ms=0.0)
        tiny.model.prefill(cache, seq_id, ids.to(device), 0, last_only=True)
    return cache


def _eager_step(tiny, cache: HybridCache, ids: list[int], tokens: np.ndarray, now: float) -> torch.Tensor:
    slots = np.asarray([cache.slot_of(i) for i in ids])
    positions = torch.as_tensor(cache.lengths(slots), device=cache.device)
    plan = cache.begin_step(ids, now)
    logits = tiny.model.decode(cache, plan, torch.as_tensor(tokens, device=cache.device), positions)
    cache.end_step(plan)
    return logits


def _static_step(graphs: DecodeGraphs, ids: list[int], tokens: np.ndarray, now: float) -> torch.Tensor:
    cache = graphs.cache
    slots = np.asarray([cache.slot_of(i) for i in ids])
    info = graphs.prepare(slots, tokens, now)
    graphs.run(info)
    cache.finish_step(info)
    assert graphs.logits is not None
    return graphs.logits[: len(ids)].clone()


def _same_state(a: HybridCache, b: HybridCache, ids: list[int], exact: bool = True) -> None:
    """Both caches hold the same sequences, blocks, hot tokens, block contents and statistics (``exact``:
    bitwise; else up to float rounding in the K/V, which a quantized block may turn into one code step)."""
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-3, "atol": 1e-3}
    for i in ids:
        sa, sb = a._seqs[i], b._seqs[i]
        assert (sa.length, sa.hot_len, sa.blocks) == (sb.length, sb.hot_len, sb.blocks), i
        za = a.hot_kv[:, :, sa.slot, :, : sa.hot_len]
        zb = b.hot_kv[:, :, sb.slot, :, : sb.hot_len]
        torch.testing.assert_close(za, zb, **tol)
        blocks = torch.as_tensor(sa.blocks, dtype=torch.int64, device=a.device)
        for pa, pb in zip(a.pools, b.pools):
            if exact:
                for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits"):
                    torch.testing.assert_close(getattr(pa, name)[blocks], getattr(pb, name)[blocks], **tol)
            else:
                assert torch.equal(pa.block_bits[blocks], pb.block_bits[blocks])
                for x, y in zip(dequantize_blocks(pa, blocks), dequantize_blocks(pb, blocks)):
                    step = 2 * float(pa.k_scale.float().abs().max()) + 1e-4 if pa.bits else 1e-4
                    torch.testing.assert_close(
                        x, y, rtol=0, atol=max(step, 2 * float(pa.v_scale.float().max()))
                    )
        torch.testing.assert_close(a.tiers.last_access[:, blocks], b.tiers.last_access[:, blocks])
        torch.testing.assert_close(a.tiers.ema[:, blocks], b.tiers.ema[:, blocks], equal_nan=True)
    assert np.array_equal(a.tiers.tier_host, b.tiers.tier_host)
    if exact:
        assert a.attention_bytes_read == b.attention_bytes_read
    a.check_integrity()
    b.check_integrity()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    ("bits", "extra"), [(0, {}), (8, {}), (4, {}), (8, SPARSE)], ids=["bf0", "int8", "int4", "int8-sparse"]
)
def test_static_step_gives_the_eager_logits(tiny, bits, extra, padded):
    """Five sequences whose hot zones fill at different steps, 30 steps (every one seals a block once or
    more; the sparse config moves blocks to L2 and back): the static step's logits are the eager step's
    (bitwise without padding; padded rows and table columns only reorder float sums), and both caches
    end in the same state."""
    config = _config(bits, **extra)
    lengths = [21, 30, 39, 47, 60]
    eager, static = (_prefilled(tiny, config, lengths, CPU) for _ in range(2))
    max_blocks = static.layout.blocks_for(max(lengths) + 40)
    graphs = DecodeGraphs(tiny.model, static, 8, max_blocks, capture=False, keep_logits=True, padded=padded)
    ids = list(range(len(lengths)))
    tokens = np.arange(len(ids), dtype=np.int64) + 3
    for t in range(30):
        now = 10.0 * (t + 1)
        batch = ids if t % 7 != 3 else ids[1:4]  # the batch changes now and then
        step_tokens = tokens[: len(batch)] if t % 7 != 3 else tokens[1:4]
        want = _eager_step(tiny, eager, batch, step_tokens, now)
        got = _static_step(graphs, batch, step_tokens, now)
        if padded:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            assert torch.equal(got, want), (t, float((got - want).abs().max()))
        if t % 7 != 3:
            tokens = want.argmax(-1).numpy()
    _same_state(eager, static, ids, exact=not padded)
    if extra:
        assert eager.counters["plans"] > 0


def test_static_and_eager_steps_alternate_on_one_cache(tiny):
    """A sequence may take either step from one step to the next (an engine alternates pure-decode and
    mixed iterations): the same logits as all-eager, on a cache whose seals happen either way."""
    config = _config(8)
    lengths = [23, 31]
    eager, mixed = (_prefilled(tiny, config, lengths, CPU) for _ in range(2))
    graphs = DecodeGraphs(tiny.model, mixed, 4, 16, capture=False, keep_logits=True)
    tokens = np.array([5, 6], dtype=np.int64)
    for t in range(20):
        want = _eager_step(tiny, eager, [0, 1], tokens, float(t))
        step = _static_step if t % 3 else lambda g, i, tok, now: _eager_step(tiny, g.cache, i, tok, now)
        got = step(graphs, [0, 1], tokens, float(t))
        assert torch.equal(got, want), t
        tokens = want.argmax(-1).numpy()
    _same_state(eager, mixed, [0, 1])


def test_a_cache_without_cold_blocks_decodes(tiny):
    """A budget its hot zone fills buys no cold block: a sequence that stays in its hot zone still decodes,
    eager and as a padded static step (whose table width bucket is above 0), with the same logits."""
    from kvtune.cache_impl.layout import hot_bytes_per_seq

    config = _config(8)
    budget = hot_bytes_per_seq(config, tiny.model.kv_shape)
    caches = []
    for _ in range(2):
        cache = HybridCache(config, tiny.model.kv_shape, budget, CPU, max_seqs=1)
        assert cache.layout.num_blocks == 0 and cache.layout.num_slots == 1
        ids = torch.arange(9) + 3
        cache.add_sequence(0, ids.tolist(), now_ms=0.0)
        tiny.model.prefill(cache, 0, ids, 0, last_only=True)
        caches.append(cache)
    eager, static = caches
    graphs = DecodeGraphs(tiny.model, static, 4, 4, capture=False, keep_logits=True, padded=True)
    tokens = np.array([5], dtype=np.int64)
    for t in range(4):
        want = _eager_step(tiny, eager, [0], tokens, float(t))
        got = _static_step(graphs, [0], tokens, float(t))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens = want.argmax(-1).numpy()


HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::tolist"}


def _profiled(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """Names of the top-level operators ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]


@pytest.mark.parametrize("throttled", [False, True])
def test_sparse_static_step_selects_plans_and_migrates_inside_the_graph(tiny, monkeypatch, throttled):
    """The static step of a sparse config: the forward (what a CUDA graph captures) runs the sparse
    selection on every layer, plans the tiers on every ``migration_interval``-th step and applies the queue,
    and reads nothing back to the host (so the step is one graph); its host half (``finish_step``) launches
    nothing. 4-bit blocks: the 8-bit demotion's CPU reference lists blocks with ``nonzero`` (its Triton
    kernel reads nothing back: tested against it in test_triton_kernels.py)."""
    import kvtune.cache_impl.hybrid_cache as hc

    config = _config(4, **SPARSE, migration_throttling=throttled)
    cache = _prefilled(tiny, config, [40, 52, 61], CPU)
    graphs = DecodeGraphs(tiny.model, cache, 4, cache.layout.blocks_for(100), capture=False, padded=True)
    calls = []
    real = hc.sparse_block_table_parts
    monkeypatch.setattr(hc, "sparse_block_table_parts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    slots = np.asarray([cache.slot_of(i) for i in range(3)])
    tokens = np.array([3, 4, 5])
    done = []
    for t in range(12):
        info = graphs.prepare(slots, tokens, 10.0 * (t + 1))
        calls.clear()
        forward = _profiled(lambda: graphs.run(info))  # noqa: B023
        assert len(calls) == tiny.spec.num_layers, "the sparse selection runs inside the step"
        assert not HOST_READS & set(forward), sorted(HOST_READS & set(forward))
        host = _profiled(lambda: cache.finish_step(info))  # noqa: B023
        assert host == [], (t, host)
        done.append(cache.migrations_done)
        tokens = graphs.buffers.tokens_out[:3].numpy().copy()
    assert cache.counters["plans"] == 12 // config.migration_interval
    assert done[config.migration_interval - 2] == 0 < done[config.migration_interval - 1], done
    cache.check_integrity()


def test_mixed_forward_gives_the_logits_of_separate_forwards(tiny):
    """Decode rows and two prompt chunks in one forward: the logits of a decode step and of each prefill
    run on their own (the linear layers only see a bigger batch)."""
    config = _config(8)
    caches = [_prefilled(tiny, config, [25, 33], CPU, spare=2) for _ in range(2)]
    prompts = [list(range(5, 45)), list(range(100, 117))]
    for cache in caches:
        for j, prompt in enumerate(prompts):
            cache.add_sequence(10 + j, prompt)
    tokens = np.array([4, 9], dtype=np.int64)
    want_decode = _eager_step(tiny, caches[0], [0, 1], tokens, 1.0)
    want_chunks = [
        tiny.model.prefill(caches[0], 10, torch.tensor(prompts[0][:24]), 0, last_only=True),
        tiny.model.prefill(caches[0], 11, torch.tensor(prompts[1]), 0, last_only=True),
    ]
    cache = caches[1]
    slots = np.asarray([cache.slot_of(0), cache.slot_of(1)])
    positions = cache.lengths(slots)
    plan = cache.begin_step([0, 1], 1.0)
    ids = torch.tensor([*tokens.tolist(), *prompts[0][:24], *prompts[1]])
    pos = torch.tensor([*positions.tolist(), *range(24), *range(len(prompts[1]))])
    got = tiny.model.forward_mixed(cache, plan, ids, pos, 2, [(10, 24), (11, len(prompts[1]))])
    cache.end_step(plan)
    want = torch.cat([want_decode, *want_chunks])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache.check_integrity()


def test_a_mixed_forward_of_decode_rows_alone_gives_the_decode_steps_logits(tiny):
    """No chunk beside the decode rows (``benchmarks/mixed_ops.py --chunks 0``): the decode step's logits,
    and no chunk plan asked of the cache."""
    config = _config(8)
    caches = [_prefilled(tiny, config, [25, 33], CPU) for _ in range(2)]
    tokens = np.array([4, 9], dtype=np.int64)
    want = _eager_step(tiny, caches[0], [0, 1], tokens, 1.0)
    cache = caches[1]
    positions = cache.lengths(np.asarray([cache.slot_of(0), cache.slot_of(1)]))
    plan = cache.begin_step([0, 1], 1.0)
    got = tiny.model.forward_mixed(cache, plan, torch.from_numpy(tokens), torch.from_numpy(positions), 2, [])
    cache.end_step(plan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache.check_integrity()


# prompts of the chunk tests, and three iterations of their chunks (first chunks, later chunks whose hot
# zones seal with them, 1-token chunks)
PROMPTS = {10: list(range(5, 62)), 11: list(range(100, 117)), 12: list(range(5, 29)) + [7] * 13}
ITERATIONS = [[(10, 24), (11, 16)], [(10, 1), (11, 1), (12, 30)], [(10, 32), (12, 7)]]


def _chunk_caches(tiny, config, device, prompts) -> list[HybridCache]:
    """Two caches alike: sequences 0 and 1 (25 and 33 tokens) prefilled, then ``prompts`` added."""
    caches = [_prefilled(tiny, config, [25, 33], device, spare=4) for _ in range(2)]
    for cache in caches:
        for seq_id, prompt in prompts.items():
            cache.add_sequence(seq_id, prompt)
    return caches


class _ChunkByChunk:
    """A cache as a forward without ``prefill_chunks`` sees it: each chunk through ``prefill``."""

    def __init__(self, cache: HybridCache) -> None:
        self.prefill, self.decode = cache.prefill, cache.decode


@pytest.mark.parametrize("decode_rows", [0, 2])
@pytest.mark.parametrize(
    ("bits", "extra"), [(0, {}), (8, {}), (4, {}), (8, SPARSE)], ids=["bf0", "int8", "int4", "int8-sparse"]
)
def test_fused_chunk_writes_give_the_chunk_by_chunk_prefill(tiny, bits, extra, decode_rows):
    """Three iterations of prompt chunks (first chunks, later chunks whose hot zone seals with them, 1-token
    chunks) beside decode rows: the fused path (``prefill_chunks``) gives the same logits
    bitwise and leaves the cache in the same state as one ``prefill`` per chunk."""
    config = _config(bits, **extra)
    prompts, iterations = dict(PROMPTS), ITERATIONS
    caches = _chunk_caches(tiny, config, CPU, prompts)
    done = {i: caches[0]._seqs[i].prefilled for i in prompts}
    for step, chunks in enumerate(iterations):
        tokens = np.array([4, 9][:decode_rows], dtype=np.int64)
        ids = [*tokens.tolist(), *(t for i, n in chunks for t in prompts[i][done[i] : done[i] + n])]
        pos = [*caches[0].lengths(np.arange(decode_rows)).tolist()]
        pos += [p for i, n in chunks for p in range(done[i], done[i] + n)]
        logits = []
        for cache, view in ((caches[0], caches[0]), (caches[1], _ChunkByChunk(caches[1]))):
            plan = cache.begin_step(list(range(decode_rows)), 1.0 + step) if decode_rows else None
            ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
            logits.append(tiny.model.forward_mixed(view, plan, ids_t, pos_t, decode_rows, chunks))
            if plan is not None:
                cache.end_step(plan)
        assert torch.equal(logits[0], logits[1]), (step, float((logits[0] - logits[1]).abs().max()))
        for i, n in chunks:
            done[i] += n
    _same_state(caches[0], caches[1], [0, 1, *prompts])


class _PaddedChunks:
    """A cache as a captured iteration uses it: each iteration's chunk plan padded to fixed sizes in fixed
    storage (``ChunkStaging``), each layer given ``pad.tokens`` query rows (the chunks', then rows of noise
    no chunk reads)."""

    def __init__(self, cache: HybridCache, pad: Any) -> None:
        from kvtune.cache_impl.chunks import ChunkStaging

        self.cache, self.pad, self.decode = cache, pad, cache.decode
        self.staging = ChunkStaging(pad, cache.device)
        self.plan: Any = None
        self.addresses: set[tuple[int, ...]] = set()

    def prefill_chunks(self, layer, chunks, q, k, v):
        cache, n, extra = self.cache, q.shape[0], self.pad.tokens - q.shape[0]
        if layer == 0:
            self.plan = cache.plan_chunks(chunks, self.pad, self.staging)
            fields = (self.plan.pack_kind, self.plan.seal_blocks, self.plan.hot_rows, self.plan.cu_q)
            self.addresses.add(tuple(t.data_ptr() for t in fields))
        gen = torch.Generator().manual_seed(layer)
        noise = [torch.randn((extra, *x.shape[1:]), generator=gen).to(x.dtype) for x in (q, k, v)]
        q, k, v = (torch.cat([x, z]) for x, z in zip((q, k, v), noise))
        out = cache.chunks_layer(layer, self.plan, q, k, v)
        assert out.shape[0] == self.pad.tokens
        if layer == cache.shape.num_layers - 1:
            cache.finish_chunks(self.plan, chunks)
        return out[:n]


@pytest.mark.parametrize(
    ("bits", "extra"), [(0, {}), (4, {}), (8, SPARSE)], ids=["bf0", "int4", "int8-sparse"]
)
def test_a_padded_chunk_plan_in_fixed_storage_gives_the_fused_prefill(tiny, bits, extra):
    """The iterations of the fused-writes test with every chunk plan padded to one size (packed rows, chunks,
    seals and hot writes repeated or empty, query rows of noise): the same logits bitwise and the same cache
    state, every plan at the same addresses; chunks that do not fit the sizes are refused."""
    from kvtune.cache_impl.chunks import ChunkPad

    config = _config(bits, **extra)
    prompts, iterations = dict(PROMPTS), ITERATIONS
    caches = _chunk_caches(tiny, config, CPU, prompts)
    padded = _PaddedChunks(caches[1], ChunkPad(tokens=48, rows=160, chunks=4, seals=16, hot=96))
    done = {i: caches[0]._seqs[i].prefilled for i in prompts}
    for step, chunks in enumerate(iterations):
        ids = [t for i, n in chunks for t in prompts[i][done[i] : done[i] + n]]
        pos = [p for i, n in chunks for p in range(done[i], done[i] + n)]
        logits = [
            tiny.model.forward_mixed(view, None, torch.tensor(ids), torch.tensor(pos), 0, chunks)
            for view in (caches[0], padded)
        ]
        assert torch.equal(logits[0], logits[1]), (step, float((logits[0] - logits[1]).abs().max()))
        for i, n in chunks:
            done[i] += n
    _same_state(caches[0], caches[1], [0, 1, *prompts])
    assert len(padded.addresses) == 1
    caches[1].add_sequence(13, list(range(60)))
    with pytest.raises(ValueError, match="do not fit"):
        caches[1].plan_chunks([(13, 60)], padded.pad, padded.staging)


def _mixed_iterations(tiny, config, device, run_static, steps=None):
    """Prompt chunks beside two decode rows over three iterations (first chunks, later chunks whose hot zones
    seal with them, 1-token chunks; the decode rows' zones seal on the way), eagerly through
    ``forward_mixed`` on one cache and through ``run_static(cache, slots, tokens, positions, chunks, ids,
    chunk_positions, now)`` (logits of the decode rows, then of each chunk) on another: both logits per
    iteration and both caches."""
    prompts = {**PROMPTS, 13: list(range(200, 230))}
    iterations = [*ITERATIONS[:2], [*ITERATIONS[2], (13, 5)]]
    iterations = steps or iterations + [[(13, 5)]] * 5  # the decode rows' zones seal on the way
    caches = _chunk_caches(tiny, config, device, prompts)
    done = {i: caches[0]._seqs[i].prefilled for i in prompts}
    tokens = np.array([4, 9], dtype=np.int64)
    sealed = caches[0]._seqs[0].num_blocks
    out = []
    for step, chunks in enumerate(iterations):
        ids = np.array([t for i, n in chunks for t in prompts[i][done[i] : done[i] + n]], dtype=np.int64)
        cpos = np.array([p for i, n in chunks for p in range(done[i], done[i] + n)], dtype=np.int64)
        slots = np.array([caches[0].slot_of(0), caches[0].slot_of(1)])
        positions = caches[0].lengths(slots)
        now = 1.0 + step
        plan = caches[0].begin_step([0, 1], now)
        eager = tiny.model.forward_mixed(
            caches[0], plan, torch.from_numpy(np.concatenate([tokens, ids])).to(device),
            torch.from_numpy(np.concatenate([positions, cpos])).to(device), 2, chunks,
        )  # fmt: skip
        caches[0].end_step(plan)
        static = run_static(caches[1], slots, tokens, positions, chunks, ids, cpos, now)
        out.append((eager, static))
        tokens = eager[:2].argmax(-1).cpu().numpy()
        for i, n in chunks:
            done[i] += n
    assert caches[0]._seqs[0].num_blocks > sealed  # a decode row sealed a block
    return caches, out, [0, 1, *prompts]


@pytest.mark.parametrize(
    ("bits", "extra"), [(0, {}), (8, {}), (4, {}), (8, SPARSE)], ids=["bf0", "int8", "int4", "int8-sparse"]
)
def test_a_static_mixed_iteration_gives_the_eager_mixed_forward(tiny, bits, extra):
    """The mixed iterations' runner (:class:`MixedGraphs`, uncaptured: the function a graph captures, over
    the padded shapes) gives the eager mixed forward's logits (padding only reorders float sums) and
    tokens, and leaves the cache in the same state (the sparse tier's too, planned on the way)."""
    from kvtune.engine.mixed_graphs import MixedGraphs
    from kvtune.engine.piecewise import PiecewiseForward

    config = _config(bits, **extra)
    pieces = PiecewiseForward(tiny.model, 128, capture=False)
    runners: dict[int, Any] = {}

    def run_static(cache, slots, tokens, positions, chunks, ids, cpos, now):
        if id(cache) not in runners:
            decode = DecodeGraphs(tiny.model, cache, 4, 16, capture=False, padded=True)
            runners[id(cache)] = MixedGraphs(tiny.model, cache, decode, pieces, 4, 512, False, True)
        mixed = runners[id(cache)]
        assert mixed.fits(len(slots), chunks)
        info = mixed.prepare(slots, tokens, positions, chunks, ids, cpos, now)
        got = mixed.run(info)
        mixed.finish(info)
        assert mixed.logits is not None
        r = info.decode_rows
        logits = torch.cat([mixed.logits[: len(slots)], mixed.logits[r : r + len(chunks)]])
        assert torch.equal(got, logits.argmax(-1))
        return logits

    caches, out, ids = _mixed_iterations(tiny, config, CPU, run_static)
    for step, (want, got) in enumerate(out):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"iteration {step}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    _same_state(caches[0], caches[1], ids, exact=False)
    if extra:
        assert caches[0].counters["plans"] > 0  # the tiers were planned on the way


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: CUDA graphs, FlashAttention")
@pytest.mark.parametrize("bits", [0, 8, 4])
def test_captured_mixed_iterations_give_the_eager_mixed_forward_gpu(bits):
    """SmolLM2's shape in bfloat16 on CUDA: the mixed iterations of the CPU test, each replayed as one
    captured graph (five of them replay one graph again with new chunks), give the eager mixed forward's
    logits within bf16 rounding (4 ulps of each row's largest logit, :func:`bf16_logit_bound`) and its
    tokens wherever the eager top two logits are further apart than that; both caches hold the same
    sequences and blocks, and hot zones within 4 ulps of their largest value."""
    from types import SimpleNamespace

    from kvtune.engine.mixed_graphs import MixedGraphs
    from kvtune.engine.model import load_model
    from kvtune.engine.piecewise import PiecewiseForward

    model = load_model("random:smollm2-135m", "cuda", torch.bfloat16).model
    smol = SimpleNamespace(model=model, spec=model.spec)
    pieces = PiecewiseForward(model, 128, capture=True)
    runners: dict[int, Any] = {}

    def run_static(cache, slots, tokens, positions, chunks, ids, cpos, now):
        if id(cache) not in runners:
            decode = DecodeGraphs(model, cache, 4, 16, capture=True)
            runners[id(cache)] = MixedGraphs(model, cache, decode, pieces, 4, 512, True, True)
        mixed = runners[id(cache)]
        info = mixed.prepare(slots, tokens, positions, chunks, ids, cpos, now)
        mixed.run(info)
        mixed.finish(info)
        r = info.decode_rows
        return torch.cat([mixed.logits[: len(slots)], mixed.logits[r : r + len(chunks)]]).clone()

    caches, out, ids = _mixed_iterations(smol, _config(bits, block_size=16), torch.device("cuda"), run_static)
    for step, (want, got) in enumerate(out):
        bound = 4 * bf16_logit_bound(want)
        assert ((got - want).abs() <= bound).all(), (step, float((got - want).abs().max()))
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound.squeeze(-1)
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), step
    mixed = next(iter(runners.values()))
    assert 0 < mixed.captures < len(out)
    for i in ids:
        a, b = caches[0]._seqs[i], caches[1]._seqs[i]
        assert (a.length, a.hot_len, a.blocks) == (b.length, b.hot_len, b.blocks), i
        za = caches[0].hot_kv[:, :, a.slot, :, : a.hot_len].float()
        zb = caches[1].hot_kv[:, :, b.slot, :, : b.hot_len].float()
        assert float((za - zb).abs().max()) <= 4 * float(bf16_ulp(zb.abs().max())), i


def _chunk_plan(device: torch.device | str = CPU, pad: Any = None):
    """Three chunks (block size 4): a first chunk, a later one with a cached prefix of 2 blocks and 3 hot
    tokens that seals 2 blocks, a later one with only hot tokens (``pad``: padded so)."""
    from kvtune.cache_impl.chunks import ChunkSpec, build_chunk_plan

    specs = [
        ChunkSpec(slot=2, hot_len=0, sealed=0, tokens=6, n_seal=0, blocks=np.array([], dtype=np.int64)),
        ChunkSpec(slot=0, hot_len=3, sealed=2, tokens=7, n_seal=2, blocks=np.array([9, 4, 7, 1])),
        ChunkSpec(slot=5, hot_len=2, sealed=0, tokens=1, n_seal=0, blocks=np.array([], dtype=np.int64)),
    ]
    return build_chunk_plan(specs, 4, 10, torch.device(device), pad)


def test_chunk_plan_packs_each_chunks_prefix_hot_and_new_tokens():
    """The packed rows of each chunk: its cached prefix (its blocks' tokens), its hot tokens (slot · C +
    position, C = 10), its new tokens (rows of the chunks' keys); the seals start at packed rows and the new
    hot zones index the packed rows; the offsets are what FlashAttention's variable-length form takes."""
    from kvtune.kernels.chunk_kv import HOT, NEW, PREFIX

    plan = _chunk_plan()
    kinds = [NEW] * 6 + [PREFIX] * 8 + [HOT] * 3 + [NEW] * 7 + [HOT] * 2 + [NEW]
    assert plan.pack_kind.tolist() == kinds
    prefix = [9 * 4 + t for t in range(4)] + [4 * 4 + t for t in range(4)]  # blocks 9 and 4, 4 tokens each
    chunk1 = [*prefix, 0, 1, 2, *range(6, 13)]  # prefix, hot (slot 0), new rows 6-12
    assert plan.pack_src.tolist() == [*range(6), *chunk1, 50, 51, 13]  # chunk 2: slot 5's two hot, row 13
    assert plan.key_bounds == ((0, 6), (6, 24), (24, 27)) and plan.done == (0, 11, 2)
    assert plan.bounds == ((0, 6), (6, 13), (13, 14))
    assert plan.cu_q.tolist() == [0, 6, 13, 14] and plan.cu_k.tolist() == [0, 6, 24, 27]
    assert plan.cu_q.dtype == plan.cu_k.dtype == torch.int32 and (plan.max_q, plan.max_k) == (7, 18)
    assert plan.seal_blocks.tolist() == [7, 1]
    assert plan.seal_starts.tolist() == [14, 18]  # chunk 1's stream starts after its prefix
    # new hot zones: chunk 0's 6 tokens, chunk 1's last 2 of its 10, chunk 2's 3
    assert plan.hot_rows.tolist() == [*range(6), 22, 23, 24, 25, 26]
    assert plan.hot_slots.tolist() == [2] * 6 + [0, 0] + [5] * 3
    assert plan.hot_pos.tolist() == [*range(6), 0, 1, 0, 1, 2]
    for field in ("pack_kind", "pack_src", "seal_blocks", "seal_starts", "hot_rows", "hot_slots", "hot_pos"):
        assert getattr(plan, field).data_ptr() % 16 == 0, field  # one build of each kernel


def test_a_refused_flash_call_falls_back_to_chunk_by_chunk_attention(monkeypatch):
    """Where FlashAttention's variable-length call is refused (a PyTorch built without it, say), the chunks
    attend one by one from then on, with a warning; a forced call raises."""
    from kvtune.cache_impl import hybrid_cache as hc

    def refused(*args: Any) -> torch.Tensor:
        raise RuntimeError("no kernel image is available\nmore")

    plan = _chunk_plan()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(14, 8, 16, generator=gen)
    k, v = (torch.randn(27, 2, 16, generator=gen) for _ in range(2))
    want = hc.chunks_attention(q, k, v, plan, 0.25, flash=False)
    monkeypatch.setattr(hc, "_flash_varlen", lambda q: True)
    monkeypatch.setattr(hc, "_flash_chunks", refused)
    monkeypatch.setattr(hc, "_FLASH_REFUSED", set())
    with pytest.warns(RuntimeWarning, match="refused \\(no kernel image is available\\); attending chunk by"):
        assert torch.equal(hc.chunks_attention(q, k, v, plan, 0.25), want)
    assert q.device in hc._FLASH_REFUSED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second try, no second warning
        assert torch.equal(hc.chunks_attention(q, k, v, plan, 0.25), want)
    with pytest.raises(RuntimeError, match="no kernel image"):
        hc.chunks_attention(q, k, v, plan, 0.25, flash=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: FlashAttention's variable-length kernel")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_chunks_attention_gives_the_chunk_by_chunk_attention_gpu(head_dim):
    """On CUDA in bfloat16: one FlashAttention call over every chunk's packed keys (grouped-query heads,
    the causal mask at each segment's end) gives what SDPA gives chunk by chunk, within bf16 rounding."""
    from kvtune.cache_impl.hybrid_cache import chunks_attention

    plan = _chunk_plan("cuda")
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(14, 8, head_dim, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(27, 2, head_dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    scale = head_dim**-0.5
    flash = chunks_attention(q, k, v, plan, scale, flash=True)
    each = chunks_attention(q, k, v, plan, scale, flash=False)
    assert flash.shape == each.shape == q.shape
    torch.testing.assert_close(flash.float(), each.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: FlashAttention's variable-length kernel")
def test_flash_over_a_padded_chunk_plan_gives_the_unpadded_plans_rows_gpu():
    """FlashAttention over the plan padded as a captured iteration pads it (empty chunks, more query rows
    and packed rows than the chunks hold, the longest lengths the pads'): the unpadded call's rows, within
    bf16 rounding (the longest lengths may change how the kernel splits its work)."""
    from kvtune.cache_impl.chunks import ChunkPad
    from kvtune.cache_impl.hybrid_cache import chunks_attention

    plan = _chunk_plan("cuda")
    padded = _chunk_plan("cuda", ChunkPad(tokens=32, rows=64, chunks=8, seals=4, hot=32))
    assert (padded.max_q, padded.max_k, padded.cu_q.numel()) == (32, 64, 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(32, 8, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(64, 2, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    want = chunks_attention(q[:14], k[:27], v[:27], plan, 0.125, flash=True)
    got = chunks_attention(q, k, v, padded, 0.125, flash=True)
    assert got.shape == q.shape
    torch.testing.assert_close(got[:14].float(), want.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: FlashAttention's variable-length kernel")
@pytest.mark.parametrize("bits", [0, 8, 4])
def test_fused_chunks_on_cuda_give_the_chunk_by_chunk_prefill_gpu(bits):
    """SmolLM2's shape in bfloat16 on CUDA: prompt chunks beside decode rows through one FlashAttention call
    per layer give the chunk-by-chunk prefill's logits within bf16 rounding (4 ulps of each row's largest
    logit, :func:`bf16_logit_bound`: the two attentions sum in other orders, and every layer rounds), and
    hot zones within 4 ulps of their largest value."""
    from kvtune.engine.model import load_model

    model = load_model("random:smollm2-135m", "cuda", torch.bfloat16).model
    config = _config(bits, block_size=16)
    caches = []
    for _ in range(2):
        shape = model.kv_shape
        cache = HybridCache(config, shape, kv_bytes_for(config, shape, [400] * 6), "cuda", max_seqs=6)
        for seq_id, n in ((0, 70), (1, 90)):  # prompts of their own (none a prefix of another's blocks)
            first = 3 + 1000 * seq_id
            cache.add_sequence(seq_id, list(range(first, first + n)))
            model.prefill(cache, seq_id, torch.arange(first, first + n, device="cuda"), 0, last_only=True)
        caches.append(cache)
    prompts = {10: list(range(5, 150)), 11: list(range(200, 240))}
    done = dict.fromkeys(prompts, 0)
    for step, chunks in enumerate([[(10, 100), (11, 30)], [(10, 45), (11, 10)]]):
        ids = [4, 9, *(t for i, n in chunks for t in prompts[i][done[i] : done[i] + n])]
        pos = [*caches[0].lengths(np.arange(2)).tolist()]
        pos += [p for i, n in chunks for p in range(done[i], done[i] + n)]
        logits = []
        for cache, view in ((caches[0], caches[0]), (caches[1], _ChunkByChunk(caches[1]))):
            if step == 0:
                for seq_id, prompt in prompts.items():
                    cache.add_sequence(seq_id, prompt)
            plan = cache.begin_step([0, 1], 1.0 + step)
            ids_t, pos_t = torch.tensor(ids, device="cuda"), torch.tensor(pos, device="cuda")
            logits.append(model.forward_mixed(view, plan, ids_t, pos_t, 2, chunks))
            cache.end_step(plan)
        diff = (logits[0] - logits[1]).abs()
        assert (diff <= 4 * bf16_logit_bound(logits[1])).all(), (step, float(diff.max()))
        for i, n in chunks:
            done[i] += n
    for i in prompts:
        a, b = caches[0]._seqs[i], caches[1]._seqs[i]
        assert (a.hot_len, a.sealed) == (b.hot_len, b.sealed)
        za = caches[0].hot_kv[:, :, a.slot, :, : a.hot_len].float()
        zb = caches[1].hot_kv[:, :, b.slot, :, : b.hot_len].float()
        assert float((za - zb).abs().max()) <= 4 * float(bf16_ulp(zb.abs().max())), i


def test_fused_chunks_refuse_a_layer_out_of_order(tiny):
    cache = _prefilled(tiny, _config(8), [], CPU, spare=2)
    cache.add_sequence(5, list(range(40)))
    q = torch.zeros(8, tiny.spec.num_heads, tiny.spec.head_dim)
    k = torch.zeros(8, tiny.spec.num_kv_heads, tiny.spec.head_dim)
    with pytest.raises(ValueError, match="layer by layer"):
        cache.prefill_chunks(1, [(5, 8)], q, k, k)
    with pytest.raises(ValueError, match=r"1\.\.40 tokens, got layer 0 and 41"):
        cache.prefill_chunks(
            0, [(5, 41)], torch.zeros(41, 4, 16), torch.zeros(41, 2, 16), torch.zeros(41, 2, 16)
        )


def test_update_access_takes_a_device_clock():
    """The access update with the clock as a float64 tensor (what a captured step reads) equals the float."""
    gen = torch.Generator().manual_seed(0)
    n, b, h, m = 20, 3, 2, 5
    table = torch.randint(0, n, (b, h, m), generator=gen, dtype=torch.int32)
    mass = torch.rand((b, h, m), generator=gen)
    count = torch.randint(0, m + 1, (b, h), generator=gen, dtype=torch.int32)
    out = []
    for now in (123.5, torch.tensor(123.5, dtype=torch.float64)):
        last = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 100
        ema = torch.full((n,), float("nan"), dtype=torch.float64)
        update_access(last, ema, mass, table, count, now)
        ref_last, ref_ema = last.clone(), ema.clone()
        out.append((last, ema))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], equal_nan=True)
    last = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 100
    ema = torch.full((n,), float("nan"), dtype=torch.float64)
    update_access_ref(last, ema, mass, table, count, torch.tensor(123.5, dtype=torch.float64))
    torch.testing.assert_close(last, ref_last)
    torch.testing.assert_close(ema, ref_ema, equal_nan=True)


def test_buckets():
    assert row_buckets(1) == [1] and row_buckets(6) == [1, 2, 4, 6] and row_buckets(8) == [1, 2, 4, 8]
    assert row_buckets(40) == [1, 2, 4, 8, 16, 32, 48]
    assert width_buckets(5) == [16] and width_buckets(127) == [16, 32, 48, 64, 80, 112, 128]
    assert width_buckets(40) == [16, 32, 48] and width_buckets(300)[-3:] == [192, 240, 304]
    assert seal_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_sequences_for_budget_grows_as_bits_shrink(tiny):
    shape = tiny.model.kv_shape
    budget = 8 * kv_bytes_for(_config(0), shape, [300])
    n = {bits: sequences_for_budget(_config(bits), shape, budget, 300) for bits in (0, 8, 4)}
    assert n[0] == 8 and n[0] < n[8] < n[4]


def test_cache_reset_keeps_tensors_and_forgets_state(tiny):
    cache = _prefilled(tiny, _config(8), [30, 40], CPU)
    tensors = (cache.hot_kv.data_ptr(), cache.pools[0].k.data_ptr(), cache.tiers.last_access.data_ptr())
    cache.reset()
    assert (
        cache.hot_kv.data_ptr(),
        cache.pools[0].k.data_ptr(),
        cache.tiers.last_access.data_ptr(),
    ) == tensors
    assert cache.stats()["sequences"] == 0 and cache.blocks_free() == cache.layout.num_blocks
    cache.check_integrity()
    cache.compile_kernels()  # an emptied cache is as good as a new one


# ---------------------------------------------------------------------------------------------- engine


def test_engine_static_steps_match_eager_steps(tiny):
    """The same saturation replay with static decode steps and with eager ones: same tokens out (the static
    path is used, the eager path is not), same scheduling."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    config = _config(8)
    requests = [Request(i, 0.0, 30 + 7 * i, 12 + i) for i in range(6)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [80] * 6)
    seen = {}
    for graphs in (True, False):
        engine = Engine(tiny, config, budget, CPU, SchedulerConfig(graphs=graphs))
        run = engine._run(requests, 0.0, None)
        outputs = [(s.seq_id, list(s.output)) for s in run.seqs]
        seen[graphs] = sorted((t.rid, len(t.token_ms)) for t in run.timings), outputs, run.counters
    assert seen[True][:2] == seen[False][:2]
    assert seen[True][2]["graph_steps"] > 0 and "graph_steps" not in seen[False][2]


def test_repeats_on_kept_graphs_schedule_alike(tiny, monkeypatch):
    """Replays of one window on the cache and graphs kept from the one before admit the same sequences at
    the same iterations: the timed steps (which land at once, not in flight) fall on the same steps of
    every replay. Counted on from the replay before, they moved admissions between repeats."""
    from kvtune.engine.options import ReplayOptions
    from kvtune.engine.replay import Replayer
    from kvtune.engine.scheduler import Scheduler
    from kvtune.engine.traces import LengthPolicy, read_trace

    admitted: list[tuple[int, ...]] = []
    admit = Scheduler.admit
    monkeypatch.setattr(
        Scheduler,
        "admit",
        lambda self, *a, **k: (
            out := admit(self, *a, **k),
            admitted.append(tuple(x.seq.seq_id for x in out)),
        )[0],
    )
    trace = read_trace(ROOT / "examples" / "traces" / "azure_conv_sample.csv").sample(n=16, seed=0)
    requests, _ = LengthPolicy(tiny.spec.max_context, "clip", 0.1, None).apply(trace.requests)
    replayer = Replayer(tiny, CPU, ReplayOptions(budget_bytes=60_000))  # contended: admissions wait
    runs = []
    for _ in range(3):
        admitted.clear()
        metrics = replayer.replay(_config(0, block_size=16), requests, 0.0, warmup=0)
        runs.append((list(admitted), metrics.decode_steps, metrics.graph_steps))
    assert runs[0][2] > 0 and sum(1 for a in runs[0][0] if not a) > 10  # graph steps; iterations admit none
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_slot_outputs_land_each_step_in_its_own_column():
    """Step t + 1 is launched before step t lands: each landing fills its own step's column (the oldest
    pending one), the row hides what has not landed, and the next input reads from the device (-1)."""
    from kvtune.engine.outputs import SlotOutputs
    from kvtune.engine.scheduler import Sequence
    from kvtune.engine.traces import Request

    out = SlotOutputs(2, 4)
    seq = Sequence(Request(0, 0.0, 3, 3), [1, 2, 3], 0.0)
    out.attach(seq, 1)
    slots = np.array([1])
    assert out.record(slots, np.array([7]), 1.0).size == 0  # the prompt's token, from an eager forward
    assert out.launch(slots).size == 0  # step A
    assert out.last_tokens(slots).tolist() == [-1] and list(seq.token_ms) == [1.0]
    assert out.launch(slots).tolist() == [1]  # step B, launched before A lands, completes the sequence
    out.fill(slots, np.array([8]), 2.0)  # A lands
    assert list(seq.output) == [7, 8] and list(seq.token_ms) == [1.0, 2.0]
    out.fill(slots, np.array([9]), 3.0)  # B lands
    assert list(seq.output) == [7, 8, 9] and list(seq.token_ms) == [1.0, 2.0, 3.0]
    assert out.last_tokens(slots).tolist() == [9]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
def test_steps_in_flight_give_the_eager_tokens_under_preemption(tiny, mixed):
    """A budget that forces preemptions, arrivals spread out: static steps kept in flight (their tokens fed
    on the device, landed one step later) give every sequence the tokens and the token count of the eager
    engine, and every output time is set and ordered."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    config = _config(0, block_size=16)
    requests = [Request(i, 0.5 * i, 40, 40) for i in range(5)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [80] * 2)
    seen = {}
    for graphs in (True, False):
        options = SchedulerConfig(max_num_seqs=5, graphs=graphs, mixed=mixed)
        run = Engine(tiny, config, budget, CPU, options)._run(requests, 1.0, None)
        assert all(np.all(np.diff(t.token_ms) >= 0) and t.token_ms[0] > 0 for t in run.timings)
        seen[graphs] = [(s.seq_id, list(s.output)) for s in run.seqs], run.scheduler.preemptions
    # the tokens agree; when a preemption falls is a matter of the clock, which differs between the paths
    assert seen[True][0] == seen[False][0] and seen[True][1] > 0 and seen[False][1] > 0


def test_device_clock_counts_only_the_iterations():
    """The device clock stands still until an iteration completes, then moves by its time; idle gaps are
    skipped on it as on the wall clock, and a capture (never counted) is not taken off it."""
    from kvtune.engine.engine import EngineClock

    clock = EngineClock(device=True)
    assert clock.now_ms() == 0.0
    clock.advance(2.5)
    clock.exclude(1.0)
    assert clock.now_ms() == 2.5
    clock.skip_to(10.0)
    clock.advance(1.5)
    assert clock.now_ms() == 11.5
    wall = EngineClock()
    wall.advance(1e6)  # the wall clock reads the host's time only
    assert wall.now_ms() < 1e3


def test_replay_on_the_device_clock_lasts_its_iterations(tiny):
    """On the device clock a replay lasts what its iterations took (its decode steps and prefill forwards:
    no host time between them), every token time is ordered, and the option is recorded."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    config = _config(8)
    requests = [Request(i, 3.0 * i, 30 + 7 * i, 12 + i) for i in range(5)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [80] * 5)
    engine = Engine(tiny, config, budget, CPU, SchedulerConfig(clock="device"))
    run = engine._run(requests, 1.0, None)
    assert all(np.all(np.diff(t.token_ms) >= 0) and t.ttft_ms >= 0 for t in run.timings)
    c = run.counters
    assert c["duration_ms"] >= max(t.token_ms[-1] for t in run.timings) > 0
    # every decode-bearing iteration moved the clock by its time; the prefill forwards and the arrival gaps
    # skipped (at most the last arrival, 12 ms) are all it holds besides
    assert c["decode_ms"] - 1e-6 <= c["duration_ms"] <= c["decode_ms"] + c["prefill_ms"] + 12.0 + 1e-6
    metrics = engine.replay(requests, 1.0, warmup_requests=0).to_dict()
    assert metrics["clock"] == "device" and metrics["completed"] == 5


def test_the_gated_clock_on_a_cpu_is_the_device_clock(tiny):
    """With no device to hold, the gated clock counts as the device clock does (the same iterations, the same
    requests into them) and gates nothing; the option is recorded."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    config = _config(8)
    requests = [Request(i, 3.0 * i, 30 + 7 * i, 12 + i) for i in range(5)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [80] * 5)
    engine = Engine(tiny, config, budget, CPU, SchedulerConfig(clock="gated"))
    run = engine._run(requests, 1.0, None)
    c = run.counters
    assert c["decode_ms"] - 1e-6 <= c["duration_ms"] <= c["decode_ms"] + c["prefill_ms"] + 12.0 + 1e-6
    assert "gated_iterations" not in c and run.gate is None
    metrics = engine.replay(requests, 1.0, warmup_requests=0).to_dict()
    assert metrics["clock"] == "gated" and metrics["completed"] == 5
    assert metrics["gated_iterations"] == metrics["gate_leaks"] == 0 and metrics["gate_ms"] == 0.0


def test_the_gates_size_themselves_from_the_host_times_of_their_kind(tiny, monkeypatch):
    """The gated clock's decisions, around a stand-in for the CUDA sleep whose mark reports whether it had
    completed (the sleep itself is the GPU test's): a kind's first gate assumes GATE_FIRST_MS of host time,
    later ones ask 1.25 × the longest host time of that kind's recent iterations + 0.3 ms once it has
    GATE_SETTLED of them (2 × + 1 ms before), at most GATE_MAX_MS; a kind first met with more chunks scales
    its kind's time; a gate found open counts as a leak and grows its kind's next gate (at most twice the
    leaked gate); one found open before its planned length lengthens the sleeps; a capture's or a
    compilation's iteration (excused) counts nothing; a layer slower than its history allows for sizes the
    next sleep between layers."""
    from types import SimpleNamespace

    from kvtune.engine import engine as eng
    from kvtune.engine.scheduler import SchedulerConfig

    class Mark:  # ``timer.opened``: whether the device has passed every mark (it caught up with the host)
        def query(self) -> bool:
            return timer.opened

    class Timer(eng.DeviceTimer):
        def __init__(self) -> None:
            super().__init__(CPU)
            self.cuda, self.asked, self.opened, self.stretched, self.waits = True, [], False, 1.0, 0

        def gate(self, ms: float) -> Mark:
            self.asked.append(ms)
            return Mark()

        def mark(self) -> Mark:
            return Mark()

        def stretch_sleeps(self, factor: float) -> None:
            self.stretched *= factor

        def wait(self, mark: Mark) -> None:  # the device takes 5 ms to reach the mark waited for
            self.waits += 1
            now[0] += 5.0 / 1000.0

    engine = eng.Engine(tiny, _config(8), 1 << 24, CPU, SchedulerConfig(clock="gated"))
    assert not engine._gated()  # a CPU has no device to hold
    timer = engine.timer = Timer()
    now = [0.0]  # the host's clock, moved by the test alone
    monkeypatch.setattr(eng, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    counters: dict[str, float] = {}
    run = SimpleNamespace(gate=None, add=lambda k, v: counters.__setitem__(k, counters.get(k, 0) + v),
                          compiles=SimpleNamespace(ms=0.0), compile_mark=0.0)  # fmt: skip

    def iteration(key, host_ms: float, opened: bool = False, excused: bool = False) -> float:
        timer.opened = opened
        engine._gate(run, key)
        now[0] += host_ms / 1000.0  # the host takes host_ms
        assert engine._gate_close(run, excused) == []  # no layers: no sleeps between them
        assert run.gate is None
        return timer.asked[-1]

    def asks(host_ms: float, settled: bool = False) -> Any:
        if settled:
            ms = eng.GATE_MARGIN * host_ms + eng.GATE_PAD_MS
        else:
            ms = eng.GATE_YOUNG_MARGIN * host_ms + eng.GATE_YOUNG_PAD_MS
        return pytest.approx(min(ms, eng.GATE_MAX_MS), abs=0.05)

    step, prefill = ("step", 0), ("prefill", 1)
    assert engine._gated()
    assert iteration(step, 0.5) == asks(eng.GATE_FIRST_MS)
    assert iteration(prefill, 60.0) == asks(eng.GATE_FIRST_MS)
    assert iteration(step, 0.4) == asks(0.5)  # the steps' gates from the steps' host times alone
    assert iteration(prefill, 50.0) == asks(60.0)
    assert iteration(("chunks", 3), 70.0) == asks(eng.GATE_FIRST_MS)
    assert iteration(("chunks", 6), 100.0) == asks(70.0 * 2)  # twice the chunks of the one timed
    assert iteration(("chunks", 2), 1.0) == asks(100.0)  # fewer chunks: the kind's largest time
    assert "gate_leaks" not in counters
    # a leak grows its kind's gate, by at most twice the gate it leaked
    planned = iteration(step, 6.0, opened=True)
    assert planned == asks(0.5) and counters["gate_leaks"] == 1 and "gate_stretches" not in counters
    assert iteration(step, 0.4) == asks(2 * planned)  # 6 ms counted as twice the 2-ms gate
    iteration(step, 5.0)
    assert iteration(step, 0.4) == asks(5.0)  # the host's time, once it fits
    iteration(prefill, 1000.0, opened=True)  # counted as twice its 121-ms gate: over the cap
    assert iteration(prefill, 50.0) == eng.GATE_MAX_MS
    # open before its planned length: the sleeps run short of their calibration
    iteration(step, 0.1, opened=True)
    assert counters["gate_leaks"] == 3 and counters["gate_stretches"] == 1
    assert timer.stretched == eng.GATE_MARGIN
    # a capture, or a compilation, is no measure of the host
    iteration(("mixed", 1), 500.0, excused=True)
    run.compiles.ms = 300.0
    iteration(("mixed", 1), 500.0)
    run.compile_mark = 300.0
    assert iteration(("mixed", 1), 10.0) == asks(eng.GATE_FIRST_MS)
    assert iteration(("mixed", 1), 1.0) == asks(10.0)
    iteration(("decode", 0), 400.0)
    assert iteration(("decode", 0), 1.0) == eng.GATE_MAX_MS  # 400 ms of host time asks more than the cap
    assert counters["gated_iterations"] == len(timer.asked) and counters["gate_leaks"] == 3
    assert counters["gate_ms"] == pytest.approx(sum(timer.asked))
    # an eager forward: a mark at each layer boundary, and a sleep there unless the sleeps queued after the
    # newest mark the device has passed make a layer's gate; the sleeps sized from the layers' own history,
    # their marks returned for the caller to take their time out; one leak per iteration at most
    layers, before, asked = ("prefill", 2), counters["gated_iterations"], len(timer.asked)
    engine._gate(run, layers)
    between = engine._layer_gates(run)
    assert between is not None and engine._layer_gates(SimpleNamespace(gate=None)) is None
    for host_ms, opened in ((3.0, False), (2.0, False), (2.0, False), (2.0, False), (9.0, True)):
        now[0] += host_ms / 1000.0
        timer.opened = opened
        between()
    timer.opened = False
    now[0] += 1.0 / 1000.0
    sleeps = engine._gate_close(run)
    # the device passed nothing until the 5th boundary: the 1st boundary's sleep still ahead of it at the
    # 2nd-4th, none there; at the 5th it had passed every mark, a sleep again
    assert len(sleeps) == 2 and len(timer.asked) == asked + 3
    assert counters["gate_leaks"] == 4 and counters["gated_iterations"] == before + 1
    assert counters["gate_stretches"] == 1  # a later segment's leak is no measure of the sleep's length
    assert timer.asked[-2:] == [asks(eng.GATE_FIRST_MS)] * 2  # no layer history of the kind yet
    assert engine._gates.ms(layers) == asks(3.0)  # the first segment's host time
    assert engine._gates.ms(layers, first=False) == asks(9.0)  # the later ones' (9 ms: within twice 21)
    # the first sleep over before the host's time reached it: the sleeps stretch
    engine._gate(run, layers)
    now[0] += 1.0 / 1000.0
    timer.opened = True
    engine._layer_gates(run)()
    timer.opened = False
    engine._gate_close(run)
    assert counters["gate_leaks"] == 5 and counters["gate_stretches"] == 2
    # a leaked first segment counts at most twice its sleep
    engine._gate(run, layers)
    first = timer.asked[-1]
    now[0] += 500.0 / 1000.0
    timer.opened = True
    engine._layer_gates(run)()
    timer.opened = False
    engine._gate_close(run)
    assert engine._gates.ms(layers) == asks(2 * first)
    # a pause of the host counts at most 3 × the median of its history; the layers' gates are capped lower
    sizes = eng.GateSizes()
    for _ in range(8):
        sizes.add(("mixed", 1), 2.0, first=False)
    sizes.add(("mixed", 1), 80.0, first=False)
    assert sizes.ms(("mixed", 1), first=False) == asks(6.0, settled=True)
    sizes.add(("mixed", 4), 80.0, first=False)
    assert sizes.ms(("mixed", 4), first=False) == eng.GATE_LAYER_MAX_MS
    assert counters["gate_ms"] == pytest.approx(sum(timer.asked))
    # a device still asleep GATE_AHEAD_LAYERS boundaries back: the host waits for it at each boundary from
    # there (its launch queue would otherwise fill and block a launch, a wait no clock sees); the waits
    # are counted, and left out of the segments' host times, so they size no gate
    ahead, sleeps_before = ("chunks", 5), len(timer.asked)
    engine._gate(run, ahead)
    between = engine._layer_gates(run)
    assert between is not None
    for _ in range(eng.GATE_AHEAD_LAYERS + 4):
        now[0] += 1.0 / 1000.0
        between()
    now[0] += 1.0 / 1000.0
    sleeps = engine._gate_close(run)
    assert timer.waits == counters["gate_waits"] == 4 and counters["gate_wait_ms"] == pytest.approx(20.0)
    # a sleep at the 1st boundary, none while it is ahead of the device, one more once the device has
    # passed the mark after it (the first wait)
    assert len(sleeps) == 2 and len(timer.asked) == sleeps_before + 3
    assert engine._gates.ms(ahead) == asks(1.0) and engine._gates.ms(ahead, first=False) == asks(1.0, True)
    # a layer slower than its kind's history allows for: the next sleep is sized from its own time
    engine._gate(run, ahead)
    between = engine._layer_gates(run)
    assert between is not None
    timer.opened = True  # the device passes every mark: each boundary sleeps anew
    for host_ms in (1.0, 1.0, 4.0):
        now[0] += host_ms / 1000.0
        between()
    timer.opened = False
    engine._gate_close(run)
    assert timer.asked[-3:] == [asks(1.0, True), asks(1.0, True), asks(4.0, True)]


def test_gated_replays_and_probes_pause_pythons_collector(monkeypatch):
    """Python's cyclic collector is off inside a gated replay's block and a study's probe (which collects
    first) and back on after them, even when the block raises; left on for any other replay and with
    ``KVTUNE_GC_PAUSE=0``; left off where it was off."""
    from kvtune.engine import engine as eng
    from kvtune.tuner.worker import gc_paused

    collected: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        collected.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with gc_paused():
            assert not gc.isenabled() and 2 in collected  # a full collection, then paused
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled()
    monkeypatch.setenv(eng.GC_PAUSE_ENV, "0")
    with gc_paused():
        assert gc.isenabled()
    monkeypatch.delenv(eng.GC_PAUSE_ENV)

    assert gc.isenabled()
    with eng.collector_paused(True):
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), eng.collector_paused(True):
        raise RuntimeError("a replay cut short")
    assert gc.isenabled()
    with eng.collector_paused(False):
        assert gc.isenabled()
    monkeypatch.setenv(eng.GC_PAUSE_ENV, "0")
    with eng.collector_paused(True):
        assert gc.isenabled()
    monkeypatch.delenv(eng.GC_PAUSE_ENV)
    gc.disable()
    try:
        with eng.collector_paused(True):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("bits", [0, 8])
def test_a_replay_leaves_no_cyclic_garbage(tiny, bits):
    """What pausing the collector in a gated replay relies on: a replay (prompts in chunks, mixed iterations,
    decode steps, preemptions) drops nothing that only the cyclic collector would free, so no memory piles up
    while it is paused."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    requests = [Request(i, 0.0, 20 + 9 * i, 30 + 5 * i) for i in range(16)]
    config = _config(bits)
    budget = kv_bytes_for(config, tiny.model.kv_shape, [240] * 3)  # three of the longest at once
    engine = Engine(tiny, config, budget, CPU, SchedulerConfig(max_num_batched_tokens=64))
    engine.replay(requests, 0.0, warmup_requests=2)  # kept cache, compiled kernels, first calls' caches
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = engine.replay(requests, 0.0, warmup_requests=2).to_dict()
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    assert result["completed"] == len(requests) and result["mixed_iterations"] > 0
    assert result["preemptions"] > 0, result  # the budget binds: preemption's paths run too
    assert found == 0, kinds


@pytest.mark.parametrize("graphs", [True, False], ids=["static-steps", "eager-steps"])
def test_a_gated_replay_on_a_simulated_device_keeps_it_fed_and_near_the_host(monkeypatch, graphs):
    """A whole replay on the gated clock (prompts alone, in chunks, mixed with decode rows, decode steps) of
    a 12-layer model, on a simulated device: a timeline that runs each enqueued sleep after the work before
    it and no faster than the host enqueues (its kernels take no time: the host-bound limit, where gates
    matter most). So a mark completes once the timeline reaches it (the host waits for it where CUDA's host
    would: an event's synchronize, its elapsed time), and the device idles exactly where the host falls
    behind. Once the kinds are timed (a first replay): the gates between layers let the device neither run
    dry (few leaks; the iterations' time on the clock, which is only their idle time here, near zero) nor
    fall far behind the host (by more than two layers' gates and an iteration's first: run 28c's gates ran
    away where the device fell a launch queue behind), and their sleep stays within a few times the
    replay's wall."""
    from dataclasses import replace

    from kvtune.engine import engine as eng
    from kvtune.engine import weights
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    monkeypatch.setitem(weights.SHAPES, "deep", replace(weights.SHAPES["tiny"], name="deep", num_layers=12))
    deep = load_model("random:deep", CPU)
    cursor, lead = [0.0], [0.0]  # the simulated device's time; its largest lead over the host (s)
    asked: list[float] = []

    class Mark:
        def __init__(self, at: float) -> None:
            self.at = at

        def query(self) -> bool:
            return time.perf_counter() >= self.at

        def synchronize(self) -> None:
            time.sleep(max(0.0, self.at - time.perf_counter()))

    class Timer(eng.DeviceTimer):
        def __init__(self) -> None:
            super().__init__(CPU)
            self.cuda = True

        def _enqueue(self, seconds: float) -> Mark:
            now = time.perf_counter()
            cursor[0] = max(cursor[0], now) + seconds
            lead[0] = max(lead[0], cursor[0] - now)
            return Mark(cursor[0])

        def mark(self) -> Mark:
            return self._enqueue(0.0)

        def gate(self, ms: float) -> Mark:
            asked.append(ms)
            return self._enqueue(ms / 1000.0)

        def elapsed_ms(self, start: Mark, end: Mark) -> float:  # as CUDA's: waits for the end mark
            end.synchronize()
            return (end.at - start.at) * 1000.0

        def synchronize(self) -> None:
            pass

    config = _config(8)
    requests = [Request(i, 0.02 * i, 40 + 13 * i, 6 + i % 5) for i in range(16)]
    budget = kv_bytes_for(config, deep.model.kv_shape, [120] * 16)
    scheduler = SchedulerConfig(clock="gated", max_num_batched_tokens=48, graphs=graphs)
    leaks = _record_leaks(monkeypatch)  # the GPU tests' record of a leaked gate, on this simulated device
    warmed: list[torch.device] = []
    monkeypatch.setattr(eng, "warm_pinned_pool", lambda device: warmed.append(device) or 0)
    engine = eng.Engine(deep, config, budget, CPU, scheduler)
    engine.timer = Timer()
    layer_gates, calls = engine._layer_gates, {"between": 0, "sleeps": 0}

    def counted(run):  # type: ignore[no-untyped-def]
        hook = layer_gates(run)
        if hook is None:
            return None

        def inner() -> None:
            calls["between"] += 1
            hook()

        return inner

    close = engine._gate_close

    collector: set[bool] = set()  # whether Python's cyclic collector was on at each gate's close

    def closed(run, excused=False):  # type: ignore[no-untyped-def]
        sleeps = close(run, excused)
        calls["sleeps"] += len(sleeps)
        collector.add(gc.isenabled())
        return sleeps

    engine._layer_gates, engine._gate_close = counted, closed  # type: ignore[method-assign]
    engine.replay(requests, 0.0, warmup_requests=0)  # the kinds timed (all at once: the clock, on which
    # the simulated kernels take no time, decides no arrival)
    calls["between"] = calls["sleeps"] = 0
    lead[0], t0 = 0.0, time.perf_counter()
    asked.clear()
    leaks.clear()
    forwards: list[dict[str, float]] = []
    result = engine.replay(requests, 0.0, warmup_requests=0, forwards=forwards)
    wall_ms = (time.perf_counter() - t0) * 1000.0
    m = result.to_dict()
    assert m["completed"] == len(requests) and m["mixed_iterations"] > 0
    assert (m["graph_steps"] > 0) == graphs
    rows = {int(f["decode_rows"] + f["prompt_tokens"]) for f in forwards}
    assert len(rows) > 1 and rows <= deep.model.rows_warmed  # every eager forward's row count run first
    assert {int(f["decode_rows"] + f["chunks"]) for f in forwards} <= deep.model.logits_warmed  # its logits
    assert calls["between"] % 11 == 0 and calls["between"] >= 11 * m["mixed_iterations"] > 0  # 11 a forward
    assert 0 < calls["sleeps"] < calls["between"]  # the device ahead of the host's need: no sleep there
    assert m["gate_leaks"] <= 0.25 * m["gated_iterations"], f"{m} {leaks}"  # a loaded CPU: the host jitters
    assert len(leaks) >= m["gate_leaks"]  # every leak counted is recorded (excused ones too)
    assert warmed == [CPU, CPU]  # each gated replay asks for the pinned pool first (a no-op off CUDA)
    assert collector == {False} and gc.isenabled()  # the collector paused for the gated replays alone
    for leak in leaks:
        assert leak["sized_from"] >= 0 and leak["collections"] == 0, leak
        assert leak["device_allocs"] == leak["pinned_allocs"] == 0, leak  # no CUDA: nothing counted
        assert 0 <= leak["leaked_at"] < len(leak["host_ms"]), leak
    # the forwards' time on the clock, only what the device idled here, against the host's launch time:
    # without gates the device idles as long as the host launches (a ratio near 1); a quiet CPU reads over
    # 2,000 (no leak or one), a loaded one 9.5 once (one leak whose host stalled)
    assert math.isnan(m["launch_ratio"]) or m["launch_ratio"] > 5, m
    assert lead[0] * 1000.0 < 3 * max(asked), (lead, max(asked))  # a first gate and two layers' at most
    assert 0 < m["gate_ms"] < 4 * wall_ms, (m["gate_ms"], wall_ms)


@pytest.mark.parametrize("clock", ["wall", "device"])
def test_a_compilation_inside_a_forward_is_left_out_of_the_clock(tiny, monkeypatch, clock):
    """A Triton compilation met inside a measured forward (the host stands still, the device idles between
    the forward's marks) is left out of either clock, counted and timed in the metrics: simulated here by a
    call of the JIT's compile method (which sleeps 0.4 s in place of compiling) in the first prompt
    forward, as Triton's JIT calls it on a new specialization."""
    import time

    from triton.runtime.jit import JITFunction

    from kvtune.engine.engine import Engine
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    config = _config(8)
    requests = [Request(i, 0.0, 30 + 7 * i, 12 + i) for i in range(3)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [80] * 3)
    engine = Engine(tiny, config, budget, CPU, SchedulerConfig(clock=clock, max_num_batched_tokens=64))
    steady = engine.replay(requests, 0.0, warmup_requests=0).to_dict()
    calls = {"n": 0}
    prefill, mixed = tiny.model.prefill, tiny.model.forward_mixed
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *args: time.sleep(0.4))

    def stall_once() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            JITFunction._do_compile(None, "key", {}, 0, {}, None, {}, False)

    monkeypatch.setattr(tiny.model, "prefill", lambda *a, **k: (stall_once(), prefill(*a, **k))[1])
    monkeypatch.setattr(tiny.model, "forward_mixed", lambda *a, **k: (stall_once(), mixed(*a, **k))[1])
    compile_method = JITFunction._do_compile
    stalled = engine.replay(requests, 0.0, warmup_requests=0).to_dict()
    assert calls["n"] > 1 and JITFunction._do_compile is compile_method  # restored after the replay
    assert stalled["compiles"] == 1 and 400 <= stalled["compile_ms"] < 1000
    assert steady["compiles"] == 0 and steady["compile_ms"] == 0
    # without the exclusion every request would wait 400 ms more for its first token
    assert stalled["ttft_p99_ms"] < steady["ttft_p99_ms"] + 200, (
        stalled["ttft_p99_ms"],
        steady["ttft_p99_ms"],
    )
    assert stalled["duration_s"] < steady["duration_s"] + 0.2


def test_engine_keeps_its_cache_between_replays_of_one_config(tiny):
    """A second replay of the same requests and config reuses the cache and graphs (no warm-up, same
    results); another config frees them and builds its own."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.traces import Request

    requests = [Request(i, 0.0, 30 + 7 * i, 12 + i) for i in range(5)]
    engine = Engine(tiny, _config(8), kv_bytes_for(_config(8), tiny.model.kv_shape, [80] * 5), CPU)
    first = engine.replay(requests, 0.0, warmup_requests=2).to_dict()
    kept = engine._kept[0]
    second = engine.replay(requests, 0.0, warmup_requests=2).to_dict()
    assert engine._kept[0] is kept and kept is not None
    for key in ("completed", "decode_steps", "graph_steps", "preemptions", "peak_running"):
        assert first[key] == second[key], key
    other = engine.with_config(_config(4))
    other.replay(requests, 0.0, warmup_requests=2)
    assert engine._kept[0] is not kept and engine._kept[0] is other._kept[0]


# ---------------------------------------------------------------------------------------------- GPU


def _diverged(
    t: int, message: str, *, got: torch.Tensor, want: torch.Tensor, eager: HybridCache, static: HybridCache
) -> str:
    """What a failing comparison of step ``t`` saw: the largest difference, whether the two caches still
    hold their blocks in the same tiers (a sparse config's L2 blocks are chosen by Quest bounds, which bf16
    rounding of differently batched projections can reorder) and whether the next tokens agree."""
    tiers = np.array_equal(eager.tiers.tier_host, static.tiers.tier_host)
    tokens = torch.equal(got.argmax(-1), want.argmax(-1))
    diff = float((got.float() - want.float()).abs().max())
    seen = f"max |diff| {diff:.3g}, same tiers {tiers}, same tokens {tokens}"
    return f"step {t}: replay vs eager, {seen}\n{message}"


BF16_FLOOR = 0.05  # the absolute bound these comparisons had before it was derived; never tightened below it


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at ``|x|`` (8 significant bits: ``2 ** (floor(log2 |x|) - 7)``)."""
    exponent = torch.floor(torch.log2(x.abs().float().clamp(min=2.0**-126)))
    return torch.exp2(exponent - 7)


def bf16_logit_bound(want: torch.Tensor) -> torch.Tensor:
    """The largest difference [B, 1] allowed between two bf16 computations of the logits ``want`` [B, V] that
    batch their matrix products differently: one bf16 ulp of the row's largest |logit|, at least
    :data:`BF16_FLOOR`.

    Why the row's largest and not each logit's own magnitude: a logit is ``h · w_v`` over the final hidden
    state ``h``, which is rounded to bf16 (relative error 2^-9 per element) after every layer. Two batchings
    whose float32 accumulations run in different orders round some elements of ``h`` to neighbouring bf16
    values, which moves every logit of the row by about the same absolute amount, set by the size of the
    terms summed (the row's scale), whatever the logit's own value: a logit near 0 in a row whose largest
    logits are ~16-32 can move by a good part of 0.125 (bf16's ulp there) without any logic differing.
    The logits themselves are bf16 values (``F.linear`` in bf16, then ``float()``), so two of them that differ
    at all differ by at least one ulp of their own magnitude."""
    scale = want.abs().amax(dim=-1, keepdim=True)
    return torch.clamp(bf16_ulp(scale), min=BF16_FLOOR)


def bf16_diff_report(got: torch.Tensor, want: torch.Tensor) -> str:
    """The distribution of ``|got - want|``: max, 99.99th percentile, how many exceed the old fixed bound and
    the derived one, and where the largest sits (its logit and its row's largest |logit| with their ulps)."""
    diff = (got.float() - want.float()).abs()
    bound = bf16_logit_bound(want.float()).expand_as(diff)
    i = int(diff.argmax())
    row = i // diff.shape[-1]
    flat = want.float().flatten()
    scale = float(want.float()[row].abs().max())
    q = float(torch.quantile(diff.flatten()[: 1 << 24], 0.9999))
    return (
        f"|diff| max {float(diff.max()):.4g}, p99.99 {q:.4g}, > {BF16_FLOOR}: "
        f"{int((diff > BF16_FLOOR).sum())} of {diff.numel()}, > derived bound: {int((diff > bound).sum())}; "
        f"at the max: logit {float(flat[i]):.4g} (ulp {float(bf16_ulp(flat[i])):.3g}), row max |logit| "
        f"{scale:.4g} (ulp {float(bf16_ulp(torch.tensor(scale))):.3g}, bound {float(bound.flatten()[i]):.3g})"
    )


@pytest.mark.parametrize(
    ("magnitude", "ulp"), [(1.0, 2.0**-7), (1.5, 2.0**-7), (16.0, 0.125), (31.9, 0.125), (0.3, 2.0**-9)]
)
def test_bf16_ulp_is_the_spacing_of_bfloat16_numbers(magnitude, ulp):
    x = torch.tensor([magnitude, -magnitude])
    assert torch.equal(bf16_ulp(x), torch.tensor([ulp, ulp]))
    # the next bf16 number above |x| is one ulp away
    up = torch.nextafter(
        torch.tensor(magnitude, dtype=torch.bfloat16), torch.tensor(1e9, dtype=torch.bfloat16)
    )
    if float(torch.tensor(magnitude, dtype=torch.bfloat16)) == magnitude:
        assert float(up) - magnitude == ulp


@pytest.mark.parametrize(
    ("row_max", "bound"), [(0.5, BF16_FLOOR), (12.0, 0.0625), (20.0, 0.125), (40.0, 0.25)]
)
def test_bf16_logit_bound_follows_the_rows_largest_logit(row_max, bound):
    """Rows whose largest |logit| is 20 allow 0.125 (the observed 0.074 on logits near 0 passes); rows of
    small logits keep the floor."""
    want = torch.tensor([[0.01, -row_max, 0.2], [0.01, 0.3, row_max / 2]])
    got = bf16_logit_bound(want)
    assert got.shape == (2, 1) and float(got[0, 0]) == pytest.approx(bound)
    assert "> derived bound: 0" in bf16_diff_report(want + 0.9 * got, want)
    assert "> derived bound: 0" not in bf16_diff_report(want + 1.1 * got, want)


# ---- bf16: like with like (which blocks each path attended) ------------------------------------------------

FLIP_ULPS = 16.0
"""How far a row may move (in bf16 ulps of its largest |logit|) at a step where the two paths' Quest
selections differ in some layer and KV head: bounds that nearly tie, ordered differently by a rounding of
``q``, so each path attends a valid top-k of its own, one block apart. Measured (SmolLM2's shape, bf16, the
sparse config of the GPU test): at most 6.4 on a CPU with reordered sums (the slow test below), 4.8 on an
H200."""

FLIP_SHARE = 0.1
"""The largest share of a run's (step, row) pairs whose selections may differ between the paths (a CPU with
reordered sums: 4 of 150). A path that attends the wrong blocks differs at most steps."""


def attended_blocks(table: torch.Tensor, num: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """The blocks each of the first ``batch`` (row, KV head) of a decode table attends (``table`` [B, H, M],
    first ``num`` [B, H] valid), as a set: [batch, H, width] int64 in increasing order, -1 after."""
    t = table[:batch].long()
    valid = torch.arange(t.shape[-1], device=t.device) < num[:batch, :, None]
    top = torch.iinfo(torch.int64).max
    ordered = torch.where(valid, t, top).sort(dim=-1).values
    ordered = torch.nn.functional.pad(ordered, (0, max(0, width - ordered.shape[-1])), value=top)
    return torch.where(ordered == top, -1, ordered)[..., :width]


def selection_flips(
    log_a: list[tuple[int, torch.Tensor, torch.Tensor]],
    log_b: list[tuple[int, torch.Tensor, torch.Tensor]],
    batch: int,
) -> np.ndarray:
    """Per row of one step, how many (layer, KV head) attended another set of blocks in one path than in the
    other (two :attr:`HybridCache.table_log` lists of the step, one entry per layer; widths and padding
    rows may differ)."""
    assert [e[0] for e in log_a] == [e[0] for e in log_b] and log_a, "one table per layer on both paths"
    flips = np.zeros(batch, dtype=np.int64)
    for (_, ta, na), (_, tb, nb) in zip(log_a, log_b):
        width = int(max(int(na[:batch].max()), int(nb[:batch].max()), 1))
        a, b = attended_blocks(ta, na, batch, width), attended_blocks(tb, nb, batch, width)
        flips += (a != b).any(dim=-1).sum(dim=-1).cpu().numpy()
    return flips


@dataclasses.dataclass
class Bf16Steps:
    """A run's bf16 comparison of the static step's logits with the eager step's, like with like, row by row:
    a row whose paths attended the same blocks in every layer and KV head differs by bf16 rounding only
    (within :func:`bf16_logit_bound` plus 5e-2 relative); a row whose Quest selection differs somewhere (a
    flip: two valid top-k of bounds that nearly tie) moves at most :data:`FLIP_ULPS` ulps of its largest
    |logit|, and flips stay rare (:data:`FLIP_SHARE` of the (step, row) pairs)."""

    reports: list[str] = dataclasses.field(default_factory=list)
    same_ulps: list[float] = dataclasses.field(default_factory=list)  # per (step, row) with the same blocks
    flip_ulps: list[float] = dataclasses.field(
        default_factory=list
    )  # per (step, row) whose selection flipped
    flipped_heads: int = 0

    def step(self, t: int, got: torch.Tensor, want: torch.Tensor, flips: np.ndarray) -> str | None:
        """Record step ``t``; returns what fails at it (the category first), or None."""
        got, want = got.float(), want.float()
        diff = (got - want).abs()
        ulps = (diff / bf16_ulp(want.abs().amax(dim=-1, keepdim=True))).amax(dim=-1).cpu().numpy()
        outside = (diff > bf16_logit_bound(want) + 5e-2 * want.abs()).any(dim=-1).cpu().numpy()
        flipped = flips > 0
        self.same_ulps += ulps[~flipped].tolist()
        self.flip_ulps += ulps[flipped].tolist()
        self.flipped_heads += int(flips.sum())
        rows = ", ".join(f"{u:.2f}" + ("*" if f else "") for u, f in zip(ulps, flipped))
        self.reports.append(
            f"step {t}: {bf16_diff_report(got, want)}; per row, ulps of its max |logit| (* selection differs "
            f"in {int(flips.sum())} (layer, KV head)): {rows}"
        )
        bad = np.flatnonzero(outside & ~flipped)
        if bad.size:
            return (
                f"same selection but values differ: rows {bad.tolist()} attended the same blocks on both "
                f"paths and differ by more than bf16 rounding ({ulps[bad].max():.2f} ulps of the row max)"
            )
        far = np.flatnonzero(flipped & (ulps > FLIP_ULPS))
        if far.size:
            return (
                f"selection differs: rows {far.tolist()} attended other blocks in {flips[far].tolist()} "
                f"(layer, KV head) and moved {ulps[far].max():.2f} > {FLIP_ULPS} ulps of the row max"
            )
        return None

    def verdict(self) -> str | None:
        """What fails over the whole run (flips too frequent), or None."""
        n, k = len(self.same_ulps) + len(self.flip_ulps), len(self.flip_ulps)
        if k > FLIP_SHARE * n:
            return f"selection differs too often: in {k} of {n} (step, row) pairs (> {FLIP_SHARE:.0%})"
        return None

    def summary(self) -> str:
        def dist(x: list[float]) -> str:
            return f"max {max(x):.2f}, median {float(np.median(x)):.2f}" if x else "none"

        return (
            f"bf16 summary: same selection {len(self.same_ulps)} (step, row): ulps of the row max "
            f"{dist(self.same_ulps)}; selection differs {len(self.flip_ulps)} (step, row), "
            f"{self.flipped_heads} (layer, KV head): {dist(self.flip_ulps)}"
        )


def test_table_log_keeps_every_layers_table_when_asked(tiny):
    """Off by default; as a list, each decode call appends its layer, table and counts: a dense config's
    table lists every sealed block of the row, for every KV head."""
    cache = _prefilled(tiny, _config(8), [40, 52], CPU)
    assert cache.table_log is None
    _eager_step(tiny, cache, [0, 1], np.array([3, 4]), 1.0)
    cache.table_log = []
    _eager_step(tiny, cache, [0, 1], np.array([3, 4]), 2.0)
    assert [layer for layer, _, _ in cache.table_log] == list(range(tiny.spec.num_layers))
    for _, table, num in cache.table_log:
        for row in range(2):
            blocks = cache._seqs[row].blocks
            assert num[row].tolist() == [len(blocks)] * table.shape[1]
            assert all(table[row, h, : len(blocks)].tolist() == blocks for h in range(table.shape[1]))


def test_selection_flips_compare_the_sets_of_attended_blocks():
    """Per row, the (layer, KV head) whose attended blocks differ as sets: the order, the table's width,
    entries past the count and padding rows beyond the batch do not count."""
    ta = torch.tensor([[[3, 5, -1], [3, 5, 9]], [[7, 8, -1], [7, 9, -1]]], dtype=torch.int32)
    na = torch.tensor([[2, 2], [2, 2]], dtype=torch.int32)  # row 0 head 1: the 9 lies past the count
    tb = torch.tensor(
        [[[5, 3, -1, -1], [3, 5, -1, -1]], [[7, 8, -1, -1], [7, 8, -1, -1]], [[1, 2, 3, 4], [1, 2, 3, 4]]],
        dtype=torch.int32,
    )
    nb = torch.tensor([[2, 2], [2, 2], [4, 4]], dtype=torch.int32)  # row 2: a padding row
    assert selection_flips([(0, ta, na)], [(0, tb, nb)], 2).tolist() == [0, 1]
    assert selection_flips([(0, ta, na), (1, ta, na)], [(0, tb, nb), (1, ta, na)], 2).tolist() == [0, 1]
    nb_short = torch.tensor([[2, 1], [2, 2], [4, 4]], dtype=torch.int32)
    assert selection_flips([(0, ta, na)], [(0, tb, nb_short)], 2).tolist() == [1, 1]


@pytest.mark.parametrize(
    ("flips", "moved_ulps", "category"),
    [
        ([0, 0], 2.0, None),
        ([0, 0], 5.0, "same selection but values differ: rows [1]"),
        ([0, 3], 5.0, None),
        ([0, 3], 20.0, "selection differs: rows [1]"),
    ],
)
def test_bf16_steps_name_the_category_of_a_difference(flips, moved_ulps, category):
    """Rows whose largest |logit| is 2 (ulp 2^-6, the bound at a logit near 0: 0.05, 3.2 ulps): a row that
    attended the same blocks may move by rounding only, one whose selection flipped up to FLIP_ULPS; the
    failure names which."""
    want = torch.tensor([[2.0, 0.0, 0.5], [2.0, 0.0, 0.5]])
    got = want.clone()
    got[1, 1] += moved_ulps * 2.0**-6
    failed = Bf16Steps().step(0, got, want, np.array(flips))
    assert failed is None if category is None else failed.startswith(category), failed


@pytest.mark.parametrize(("flipped_steps", "too_often"), [(1, False), (2, True)])
def test_bf16_steps_bound_how_often_selections_flip(flipped_steps, too_often):
    """Ten steps of two rows: one flipped (step, row) of 20 is rare enough (<= 10 %), three are not."""
    steps, want = Bf16Steps(), torch.tensor([[2.0, 0.0], [1.0, 0.5]])
    for t in range(10):
        flips = np.array([0, 1]) if t < flipped_steps else np.array([0, 0])
        flips = np.array([1, 1]) if t == 1 and too_often else flips
        assert steps.step(t, want, want, flips) is None
    assert (steps.verdict() is not None) == too_often, steps.summary()
    assert steps.verdict() is None or steps.verdict().startswith("selection differs too often")


class _ReorderedSums:
    """``torch.nn.functional`` for the model, but its linear layers sum their products in another order (the
    two halves of the reduction in float32, added, rounded once): what a GPU's matrix products do at another
    batch size (the library picks tiles and split-K by shape), emulated on a CPU, whose products give every
    row the same bits at any batch size."""

    def __init__(self, functional: Any) -> None:
        self._f = functional

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = x.shape[-1] // 2
        lo = self._f.linear(x[..., :h].float(), w[:, :h].float())
        out = lo + self._f.linear(x[..., h:].float(), w[:, h:].float())
        return (out if bias is None else out + bias.float()).to(x.dtype)


@pytest.fixture(scope="module")
def smollm2_bf16() -> Any:
    from kvtune.engine.model import load_model

    return load_model("random:smollm2-135m", CPU, dtype=torch.bfloat16)


@pytest.mark.slow  # each about 20-35 s on a CPU
@pytest.mark.parametrize(
    ("extra", "reordered"),
    [(SPARSE, True), (SPARSE, False), ({}, True)],
    ids=["int8-sparse-reordered", "int8-sparse", "int8-reordered"],
)
def test_bf16_steps_differ_only_where_quest_selections_flip(smollm2_bf16, monkeypatch, extra, reordered):
    """The GPU test's bf16 run on a CPU: SmolLM2's shape in bfloat16, block 16, five sequences, 30 steps, the
    eager step against the padded static step, each step's tables compared (``table_log``).

    As computed here the two paths give the same logits bitwise and attend the same blocks in every layer,
    L2 empty (the eager step's dense table, the static step's sparse one: the same blocks in the same order)
    or not: no logic differs. With the eager step's products summed in another order (as a GPU's, batched
    differently, are), a row that attends the same blocks moves by rounding only (at most 2.5 ulps of its
    largest |logit|; the dense control 3.5), while a few Quest selections flip on bounds that nearly tie
    (3 steps of 30; 7 of the run's 13,500 (layer, row, KV head) tables) and move their row 3.1 to 6.4 ulps:
    the H200's 4.8-ulp difference at step 28 of int8-sparse is such a flip."""
    import kvtune.engine.model as model_module

    loaded = smollm2_bf16
    config = _config(8, block_size=16, **extra)
    lengths = [21, 30, 39, 47, 60]
    eager, static = (_prefilled(loaded, config, lengths, CPU) for _ in range(2))
    graphs = DecodeGraphs(
        loaded.model,
        static,
        8,
        static.layout.blocks_for(max(lengths) + 40),
        capture=False,
        keep_logits=True,
        padded=True,
    )
    eager.table_log, static.table_log = [], []
    ids = list(range(len(lengths)))
    tokens = np.arange(len(ids), dtype=np.int64) + 3
    steps = Bf16Steps()
    for t in range(30):
        eager.table_log.clear()
        static.table_log.clear()
        with monkeypatch.context() as patch:
            if reordered:
                patch.setattr(model_module, "F", _ReorderedSums(model_module.F))
            want = _eager_step(loaded, eager, ids, tokens, 10.0 * (t + 1))
        got = _static_step(graphs, ids, tokens, 10.0 * (t + 1))
        flips = selection_flips(eager.table_log, static.table_log, len(ids))
        if not reordered:
            assert torch.equal(got, want) and not flips.any(), (t, flips)
        failed = steps.step(t, got, want, flips)
        assert failed is None, f"step {t}: {failed}\n{steps.reports[-1]}"
        tokens = want.argmax(-1).numpy()
    print("\n".join([*steps.reports, steps.summary()]))  # pytest -rP
    assert steps.verdict() is None, steps.verdict()
    assert max(steps.same_ulps) <= 4.0, steps.summary()  # rounding alone: a few ulps
    if reordered and extra:
        assert steps.flip_ulps, "the reordered sums flip some selections (the case this test is about)"
    else:
        assert not steps.flip_ulps, steps.summary()
    assert np.array_equal(eager.tiers.tier_host, static.tiers.tier_host)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: captures CUDA graphs")
@pytest.mark.parametrize(
    ("model", "dtype"),
    [("random:tiny", torch.float32), ("random:smollm2-135m", torch.bfloat16)],
    ids=["tiny-fp32", "smollm2-bf16"],
)
@pytest.mark.parametrize(
    ("bits", "extra"), [(0, {}), (8, {}), (4, {}), (8, SPARSE)], ids=["bf0", "int8", "int4", "int8-sparse"]
)
def test_captured_graphs_give_the_eager_logits_gpu(model, dtype, bits, extra):
    """On CUDA: graph replays (rows, widths and seals padded to buckets, attention timed inside every third
    replay) give the uncaptured static step's logits and cache state, and the eager step's logits (tiny,
    float32: 1e-4; SmolLM2's shape in bfloat16, where the Triton/Gluon attention, seal and sparse-table
    kernels run inside the graphs: :class:`Bf16Steps`, like with like: rows that attended the same blocks on
    both paths within bf16 rounding of differently batched projections, rows whose Quest selection flipped
    on near-tied bounds within :data:`FLIP_ULPS`, and rarely). The blocks the replay attended are the
    uncaptured static step's (same kernels, same shapes; its logits are checked against the replay's)."""
    from kvtune.engine.model import load_model

    cuda = torch.device("cuda")
    loaded = load_model(model, cuda, dtype=dtype)
    config = _config(bits, block_size=8 if dtype == torch.float32 else 16, **extra)  # 16: the Gluon kernel
    lengths = [21, 30, 39, 47, 60]
    eager, direct, static = (_prefilled(loaded, config, lengths, cuda) for _ in range(3))
    max_blocks = static.layout.blocks_for(max(lengths) + 40)
    graphs = DecodeGraphs(loaded.model, static, 8, max_blocks, capture=True, keep_logits=True, timing_every=3)
    plain = DecodeGraphs(loaded.model, direct, 8, max_blocks, capture=False, keep_logits=True, padded=True)
    ids = list(range(len(lengths)))
    tokens = np.arange(len(ids), dtype=np.int64) + 3
    steps = Bf16Steps()
    eager.table_log, direct.table_log = [], []
    for t in range(30):
        now = 10.0 * (t + 1)
        eager.table_log.clear()
        direct.table_log.clear()
        want = _eager_step(loaded, eager, ids, tokens, now)
        timed = graphs.timing_next()
        got = _static_step(graphs, ids, tokens, now)
        same = _static_step(plain, ids, tokens, now)
        torch.testing.assert_close(got, same, rtol=1e-5, atol=1e-5, msg=f"step {t}: replay vs uncaptured")
        why = functools.partial(_diverged, t, got=got, want=want, eager=eager, static=static)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=why)
        else:  # bf16: like with like (Bf16Steps); the failure names its category
            flips = selection_flips(eager.table_log, direct.table_log, len(ids))
            failed = steps.step(t, got, want, flips)
            assert failed is None, f"step {t}: {failed}\n{why(steps.reports[-1])}"  # the category first
        if graphs.timing_supported and timed:
            assert graphs.attention_ms() > 0
        tokens = got.argmax(-1).cpu().numpy()
    if dtype != torch.float32:  # the difference's distribution per step and over the run (pytest -rP)
        print("\n".join([*steps.reports, steps.summary()]))
        assert steps.verdict() is None, f"{steps.verdict()}\n{steps.summary()}"
    assert graphs.captures > 0 and graphs.timing_supported, "graphs captured, attention timed inside them"
    _same_state(direct, static, ids, exact=False)


def _gated_test_engine():
    """The engine the gated-clock GPU tests replay: SmolLM2's shape in bfloat16 on CUDA, INT8 (hot 32, block
    64), 1 GiB, batches of 512 tokens, on the device clock (``with_clock("gated")`` for the gated replay),
    and 24 requests that arrive at once."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    cuda = torch.device("cuda")
    model = load_model("random:smollm2-135m", cuda, dtype=torch.bfloat16)
    config = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=8)
    requests = [Request(i, 0.0, 200 + 50 * i, 40 + 5 * i) for i in range(24)]
    engine = Engine(model, config, 1 << 30, cuda, SchedulerConfig(clock="device", max_num_batched_tokens=512))
    return engine, requests


def _driver_allocs() -> tuple[int, int]:
    """The calls to the driver so far of PyTorch's device and pinned host allocators (``cudaMalloc``,
    ``cudaHostAlloc``; -1 each without CUDA)."""
    if not torch.cuda.is_available():
        return -1, -1
    stats, host = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
    return int(stats.get("num_device_alloc", -1)), int(host.get("num_host_alloc", -1))


def _record_leaks(monkeypatch):
    """The engine's leaked gates, as the test's assertion prints them: kind, planned ms, the first segment
    that leaked, whether the first sleep ran short of its plan (the SM clock rose), each segment's host ms,
    whether the iteration was excused (a capture or compilation inside), and what might have stalled the
    host: how many first segments of its kind the gate was sized from, and the device and pinned host
    allocations (the caching allocators' calls to the driver) and Python collections between the gate and
    its close, read just before the gate's sleep is enqueued and just after the engine's own close, so no
    gated segment pays for the reading. The list's ``str`` is the assertion's message: pytest shortens a
    message that is not a string."""
    import gc

    from kvtune.engine.engine import Engine

    class Leaks(list):
        gates = with_allocs = with_collections = 0  # the gates closed; those with an allocation, a collection

        def __str__(self) -> str:
            return (
                f"{list.__repr__(self)}; of {self.gates} gates {self.with_allocs} held an allocation, "
                f"{self.with_collections} a collection"
            )

        def clear(self) -> None:
            super().clear()
            self.gates = self.with_allocs = self.with_collections = 0

    gate, close = Engine._gate, Engine._gate_close
    leaks = Leaks()
    before = {"alloc": 0, "host": 0, "gc": 0}

    def counts():
        alloc, host = _driver_allocs()
        return {"alloc": alloc, "host": host, "gc": sum(g["collections"] for g in gc.get_stats())}

    def recording_gate(self, run, key):
        before.update(counts())
        return gate(self, run, key)

    def recording_close(self, run, excused=False):
        g = run.gate
        if g is None:  # an ungated iteration: nothing to record
            return close(self, run, excused)
        sized_from = len(self._gates._host.get((*g.key, True), ()))
        sleeps = close(self, run, excused)
        now = counts()
        leaks.gates += 1
        leaks.with_allocs += (now["alloc"], now["host"]) != (before["alloc"], before["host"])
        leaks.with_collections += now["gc"] != before["gc"]
        if g.leaked:
            leaks.append(
                {
                    "kind": g.key,
                    "planned_ms": round(g.planned, 2),
                    "leaked_at": g.leaked_at,
                    "short": g.short,
                    "host_ms": [round(h, 2) for h in g.host],
                    "excused": excused,
                    "sized_from": sized_from,
                    "device_allocs": now["alloc"] - before["alloc"],
                    "pinned_allocs": now["host"] - before["host"],
                    "collections": now["gc"] - before["gc"],
                }
            )
        return sleeps

    monkeypatch.setattr(Engine, "_gate", recording_gate)
    monkeypatch.setattr(Engine, "_gate_close", recording_close)
    return leaks


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: CUDA graphs")
@pytest.mark.parametrize("bits", [0, 4])
def test_mixed_graph_replays_serve_the_eager_replay_gpu(bits, monkeypatch):
    """SmolLM2's shape in bfloat16 on CUDA, 24 requests at once: with ``mixed_graphs`` the forwards with
    prompt tokens replay as graphs from a shape's second use. Every request completes in the same
    iterations, chunks and decode steps as the eager replay's; a repeat on the kept graphs meets every
    shape again (it captures those the first met once), so a third captures nothing; on the gated clock no
    graph forward's gate leaks."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    leaks = _record_leaks(monkeypatch)
    cuda = torch.device("cuda")
    model = load_model("random:smollm2-135m", cuda, dtype=torch.bfloat16)
    config = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=bits)
    requests = [Request(i, 0.0, 200 + 50 * i, 40 + 5 * i) for i in range(24)]
    runs = {}
    for option in (False, True):
        options = SchedulerConfig(clock="device", max_num_batched_tokens=512, mixed_graphs=option)
        engine = Engine(model, config, 1 << 30, cuda, options)
        first = engine.replay(requests, 0.0, warmup_requests=2).to_dict()
        runs[option] = (first, engine.replay(requests, 0.0, warmup_requests=2).to_dict())
        if option:
            gated = engine.with_clock("gated").replay(requests, 0.0, warmup_requests=2).to_dict()
    (eager, _), (graph, repeat) = runs[False], runs[True]
    for key in ("completed", "prefill_chunks", "mixed_iterations", "decode_steps"):
        assert graph[key] == eager[key] == repeat[key], key
    assert graph["completed"] == len(requests)
    assert graph["mixed_graph_forwards"] > 0 and eager["mixed_graph_forwards"] == 0
    assert repeat["mixed_graph_forwards"] >= graph["mixed_graph_forwards"]  # every shape met before
    assert gated["graph_captures"] == 0, gated["graph_captures"]
    assert gated["mixed_graph_forwards"] > 0 and gated["gate_leaks"] == 0, str(leaks)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: the gate is a sleep on the device")
def test_the_gated_clock_keeps_the_host_off_the_device_gpu(monkeypatch):
    """On CUDA the gated clock starts each iteration that finds the device idle behind a gate held until the
    host has enqueued all of it: nothing between a gate and the iteration's last launch synchronizes with
    the device (PyTorch's synchronization check raises there, naming the operation), no gate opens early,
    every request completes, and SmolLM2's launch-bound prompt forwards, whose launch gaps the device clock
    counts, take less of the gated clock: the same iterations (all requests at once, so the clock decides
    no arrival) last less."""
    from kvtune.engine.engine import Engine

    leaks = _record_leaks(monkeypatch)
    gate, close = Engine._gate, Engine._gate_close

    def strict_gate(self, run, key):
        mark = gate(self, run, key)
        torch.cuda.set_sync_debug_mode("error")
        return mark

    def strict_close(self, run, excused=False):
        torch.cuda.set_sync_debug_mode("default")
        return close(self, run, excused)

    monkeypatch.setattr(Engine, "_gate", strict_gate)
    monkeypatch.setattr(Engine, "_gate_close", strict_close)
    engine, requests = _gated_test_engine()
    engine.replay(requests, 0.0, warmup_requests=2)  # captures, compilations
    device = engine.replay(requests, 0.0, warmup_requests=2).to_dict()
    gated = engine.with_clock("gated").replay(requests, 0.0, warmup_requests=2).to_dict()
    assert device["completed"] == gated["completed"] == len(requests)
    assert gated["clock"] == "gated" and device["gated_iterations"] == 0
    assert gated["gated_iterations"] >= gated["mixed_iterations"] > 0
    assert gated["gate_leaks"] == 0, str(leaks)
    assert gated["duration_s"] < device["duration_s"], (gated["duration_s"], device["duration_s"])
    assert gated["gate_ms"] > 0 and gated["decode_steps"] == device["decode_steps"]
    torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: pinned host memory")
def test_no_gated_segment_asks_the_driver_for_pinned_memory_gpu(monkeypatch):
    """A replay on the gated clock first fills PyTorch's pinned host pool (``warm_pinned_pool``), so no gated
    iteration grows it: between a gate and its close the pool makes no call to the driver
    (``num_host_alloc``, read just before the gate's sleep is enqueued and just after the close), where a
    ``cudaHostAlloc`` would add its time to a segment the gate was not sized for."""
    from kvtune.cache_impl import chunks
    from kvtune.engine.engine import Engine

    monkeypatch.delenv(chunks.PINNED_WARM_ENV, raising=False)
    gate, close = Engine._gate, Engine._gate_close
    before: list[int] = []
    grown: list[tuple[tuple[str, int], int]] = []

    def counted_gate(self, run, key):
        before.append(_driver_allocs()[1])
        return gate(self, run, key)

    def counted_close(self, run, excused=False):
        g = run.gate
        sleeps = close(self, run, excused)
        if g is not None:
            grown.append((g.key, _driver_allocs()[1] - before[-1]))
        return sleeps

    monkeypatch.setattr(Engine, "_gate", counted_gate)
    monkeypatch.setattr(Engine, "_gate_close", counted_close)
    engine, requests = _gated_test_engine()
    engine.replay(requests, 0.0, warmup_requests=2)
    gated = engine.with_clock("gated").replay(requests, 0.0, warmup_requests=2).to_dict()
    assert gated["completed"] == len(requests) and gated["gated_iterations"] > 0 and grown
    assert all(n == 0 for _, n in grown), [(k, n) for k, n in grown if n]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: replays with CUDA graphs")
def test_engine_replays_with_cuda_graphs_gpu():
    """A small replay on CUDA with graphs: decode steps are replays, captures stay out of the clock, every
    request completes, and the result records the engine's options."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    cuda = torch.device("cuda")
    model = load_model("random:smollm2-135m", cuda, dtype=torch.bfloat16)
    config = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=8)
    requests = [Request(i, 3.0 * i, 200 + 50 * i, 60 + 5 * i) for i in range(24)]
    m = {}
    for graphs in (True, False):
        engine = Engine(model, config, 1 << 30, cuda, SchedulerConfig(graphs=graphs))
        m[graphs] = engine.replay(requests, time_scale=1.0, warmup_requests=2).to_dict()
    assert m[True]["completed"] == m[False]["completed"] == len(requests)
    assert m[True]["cuda_graphs"] and m[True]["graph_steps"] > 0 and m[True]["graph_captures"] > 0
    assert m[True]["attn_bandwidth_gbs"] > 0 and not m[False]["graphs"]
    assert m[True]["max_num_seqs"] == len(requests) and m[True]["max_num_batched_tokens"] == 8192
    # all at once, twice on one engine: the second replay reuses the cache and every graph of the first
    engine = Engine(model, config, 1 << 30, cuda, SchedulerConfig())
    first, second = (engine.replay(requests, 0.0, warmup_requests=2).to_dict() for _ in range(2))
    assert first["graph_captures"] > 0 and second["graph_captures"] == 0
    assert first["completed"] == second["completed"] == len(requests)
    assert first["decode_steps"] == second["decode_steps"]
    assert SchedulerConfig(**SchedulerConfig().to_dict()) == SchedulerConfig()  # the record builds it back
