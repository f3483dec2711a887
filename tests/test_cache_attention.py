"""Cache attention against dense attention over the same K/V, and the decode kernel reference on its own."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kvtune.kernels.decode_attention import hybrid_decode_attention
from kvtune.kernels.layout import ColdLayout
from kvtune.kernels.quant import seal_blocks
from kvtune.tests.cache_testlib import SHAPE, config, decode_step, dense, new_cache, prefill, qkv

HOT, BS = 16, 8
TOL = {torch.float32: 2e-5}
# (prompt length, decode steps): 1, block_size ± 1, around hot_tokens, the seal boundary, many blocks
CASES = [
    (1, 0),
    (1, 3),
    (BS - 1, 2),
    (BS + 1, 1),
    (HOT - 1, 2),
    (HOT, 1),
    (HOT + 1, 9),
    (HOT + BS - 1, 2),
    (HOT + BS, 1),
    (3, HOT + BS + 2),
    (HOT + 6 * BS + 3, BS + 2),
]


@pytest.mark.parametrize(("prompt", "steps"), CASES)
def test_unquantized_cache_equals_dense(prompt: int, steps: int) -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=0))
    q, k, v = qkv(prompt * 31 + steps, prompt + steps)
    _, outs = prefill(cache, 7, list(range(prompt)), q[:, :prompt], k[:, :prompt], v[:, :prompt])
    tol = TOL[torch.float32]
    for layer in range(SHAPE.num_layers):
        assert torch.allclose(
            outs[layer][-1], dense(q[layer, prompt - 1], k[layer, :prompt], v[layer, :prompt]), atol=tol
        )
    for t in range(prompt, prompt + steps):
        out = decode_step(cache, [7], float(t), q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        want = torch.stack([dense(q[i, t], k[i, : t + 1], v[i, : t + 1]) for i in range(SHAPE.num_layers)])
        assert torch.allclose(torch.stack([o[0] for o in out]), want, atol=tol)
    cache.check_integrity()


def test_batched_sequences_of_different_lengths_equal_dense() -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS))
    lens = [1, HOT + BS - 1, HOT + 3 * BS]
    data = [qkv(n, n + 4) for n in lens]
    for sid, (n, (q, k, v)) in enumerate(zip(lens, data)):
        prefill(cache, sid, [sid] * n, q[:, :n], k[:, :n], v[:, :n])
    for step in range(4):
        pos = [n + step for n in lens]
        q_k_v = [torch.stack([d[i][:, p] for d, p in zip(data, pos)], dim=1) for i in range(3)]
        out = decode_step(cache, [0, 1, 2], float(step), *q_k_v)
        for b, ((q, k, v), p) in enumerate(zip(data, pos)):
            assert torch.allclose(
                out[1][b], dense(q[1, p], k[1, : p + 1], v[1, : p + 1]), atol=TOL[torch.float32]
            )
    cache.check_integrity()


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("num_cold", [0, 1, 3])
def test_decode_reference_masses_sum_to_one(bits: int, num_cold: int) -> None:
    layout = ColdLayout(block_size=BS, num_kv_heads=2, head_dim=16, bits=bits, dtype=torch.float32)
    pool = layout.allocate(4, "cpu")
    seal_blocks(pool, torch.arange(4), torch.randn(4, BS, 2, 16), torch.randn(4, BS, 2, 16), bits)
    hot_k, hot_v = torch.randn(3, 2, HOT + BS, 16), torch.randn(3, 2, HOT + BS, 16)
    table = torch.full((2, 2, 3), -1, dtype=torch.int32)
    table[:, :, :num_cold] = torch.tensor([2, 0, 3][:num_cold], dtype=torch.int32)
    counts = torch.full((2, 2), num_cold, dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    out, mass, hot = hybrid_decode_attention(
        q,
        hot_k,
        hot_v,
        torch.tensor([2, 0], dtype=torch.int32),
        torch.tensor([1, HOT], dtype=torch.int32),
        pool,
        table,
        counts,
        0.25,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(mass.sum(-1) + hot, torch.ones(2, 2))
    assert (mass[:, :, num_cold:] == 0).all()


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.02), (4, 0.25)])
def test_quantized_cache_output_error_is_small(bits: int, bound: float) -> None:
    """Relative output error vs the unquantized cache on random K/V (a sanity bound, not a quality claim)."""
    n = HOT + 8 * BS
    q, k, v = qkv(bits, n + 1)
    outs = []
    for b in (0, bits):
        cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=b))
        prefill(cache, 0, list(range(n)), q[:, :n], k[:, :n], v[:, :n])
        outs.append(decode_step(cache, [0], 0.0, q[:, n : n + 1], k[:, n : n + 1], v[:, n : n + 1])[1])
        cache.check_integrity()
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < rel < bound


def _bytes_after(cfg: Any, demotable: bool, steps: int = 20) -> tuple[int, dict]:
    """Two sequences (40 and 75 prompt tokens) decoded ``steps`` steps; bytes read and the cache's stats."""
    cache = new_cache(cfg)
    for pool in cache.pools:
        pool.may_demote = demotable
    q, k, v = qkv(5, 75 + steps)
    for seq_id, n in ((0, 40), (1, 75)):
        prefill(cache, seq_id, list(range(seq_id, seq_id + n)), q[:, :n], k[:, :n], v[:, :n])
    for t in range(steps):
        sl = slice(75 + t, 75 + t + 1)
        both = [torch.cat([x[:, sl]] * 2, dim=1) for x in (q, k, v)]
        decode_step(cache, [0, 1], 10.0 * t, *both)
    return cache.attention_bytes_read, cache.stats()


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_bytes_read_follow_the_formula(bits: int) -> None:
    """Host counting (no block can change precision) = the device count = hot zones + every block's cost."""
    cfg = config(quantization_bits=bits)
    host, _ = _bytes_after(cfg, demotable=False)
    device, _ = _bytes_after(cfg, demotable=True)
    assert host == device
    h, d, bs, hot, elem = SHAPE.num_kv_heads, SHAPE.head_dim, 8, 16, 4
    per_block = 2 * bs * d * elem if bits == 0 else 2 * bs * d * bits // 8 + 4 * d + 4 * bs
    want = 0
    for t in range(20):
        for n in (40 + t + 1, 75 + t + 1):
            sealed = (n - hot) // bs
            want += SHAPE.num_layers * h * (2 * (n - sealed * bs) * d * elem + sealed * per_block)
    assert host == want


def test_sparse_tier_bytes_count_quest_and_selected_blocks_only() -> None:
    """With blocks in L2, a step reads fewer cold bytes than with all in L1, plus Quest's key bounds."""
    cfg = config(quantization_bits=8, sparse_top_k=8, migration_interval=4, migration_threshold_ms=5.0)
    sparse, stats = _bytes_after(cfg, demotable=True, steps=24)
    assert stats["l2_blocks"] > 0
    dense_bytes, _ = _bytes_after(config(quantization_bits=8), demotable=True, steps=24)
    assert 0 < sparse < dense_bytes


def _chunked_prefill(cache: Any, seq_id: int, tokens: list[int], q, k, v, chunks: list[int]) -> list:
    """Prefill in chunks of these sizes (the last one takes the rest); per chunk, every layer's output."""
    cached = cache.add_sequence(seq_id, tokens)
    bounds = [cached]
    for c in chunks:
        bounds.append(min(len(tokens), bounds[-1] + c))
    bounds.append(len(tokens))
    outs = []
    for a, b in itertools.pairwise(bounds):
        if b > a:
            layers = range(SHAPE.num_layers)
            outs.append([cache.prefill(i, seq_id, q[i, a:b], k[i, a:b], v[i, a:b]) for i in layers])
            cache.check_integrity()
    return outs


@pytest.mark.parametrize("chunks", [[1], [5, 20, 1], [BS, BS, BS], [HOT + BS + 3], [HOT - 1, 2 * BS + 1]])
def test_chunked_prefill_of_an_unquantized_cache_equals_dense(chunks: list[int]) -> None:
    """Any chunking gives the dense outputs for every prompt token and for the decode steps after it."""
    prompt, steps = HOT + 6 * BS + 3, BS + 2
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=0))
    q, k, v = qkv(len(chunks), prompt + steps)
    outs = _chunked_prefill(cache, 3, list(range(prompt)), q, k, v, chunks)
    got = torch.cat([torch.stack(o) for o in outs], dim=1)  # [L, prompt, Hq, D]
    for t in (0, prompt // 2, prompt - 1):
        want = torch.stack([dense(q[i, t], k[i, : t + 1], v[i, : t + 1]) for i in range(SHAPE.num_layers)])
        assert torch.allclose(got[:, t], want, atol=TOL[torch.float32])
    for t in range(prompt, prompt + steps):
        out = decode_step(cache, [3], float(t), q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        want = torch.stack([dense(q[i, t], k[i, : t + 1], v[i, : t + 1]) for i in range(SHAPE.num_layers)])
        assert torch.allclose(torch.stack([o[0] for o in out]), want, atol=TOL[torch.float32])
    cache.check_integrity()


def test_prompt_attention_never_asks_cudnn() -> None:
    """A prompt chunk's attention (a first chunk and a later one) runs with PyTorch's cuDNN SDPA backend off:
    it plans each new pair of lengths on the host (59 ms median on an H200 for a prompt's first layer), which
    the engine would pay once per prompt length and a gated iteration's first gate would not cover."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    calls: list[bool] = []

    class Watch(TorchFunctionMode):  # a mode, so a later chunk's causal-bias object still dispatches the call
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is F.scaled_dot_product_attention:
                calls.append(torch.backends.cuda.cudnn_sdp_enabled())
            return func(*args, **(kwargs or {}))

    assert torch.backends.cuda.cudnn_sdp_enabled()  # on by default: the cache turns it off for its calls
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=0))
    q, k, v = qkv(1, 2 * HOT + BS)
    with Watch():
        _chunked_prefill(cache, 3, list(range(2 * HOT + BS)), q, k, v, [HOT + 3, HOT + BS - 3])
    assert len(calls) == 2 * SHAPE.num_layers and not any(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and restores it


def test_chunked_prefill_of_an_int8_cache_stays_close_and_seals_the_same_blocks() -> None:
    prompt = HOT + 5 * BS + 2
    q, k, v = qkv(11, prompt + 1)
    caches = [new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=8)) for _ in range(2)]
    _chunked_prefill(caches[0], 0, list(range(prompt)), q, k, v, [])
    _chunked_prefill(caches[1], 0, list(range(prompt)), q, k, v, [7, BS + 3])
    outs = [decode_step(c, [0], 1.0, q[:, -1:], k[:, -1:], v[:, -1:]) for c in caches]
    for a, b in zip(*outs):
        assert float((a - b).norm() / b.norm()) < 0.02  # later chunks attend to dequantized earlier ones
    assert [c.stats()["blocks_in_use"] for c in caches] == [5, 5]


def test_prefill_chunk_errors_name_what_was_expected() -> None:
    cache = new_cache(config(hot_tokens=HOT, block_size=BS))
    q, k, v = qkv(2, 30)
    cache.add_sequence(1, list(range(30)))
    with pytest.raises(ValueError, match=r"expects layer 0 and 1\.\.30 tokens, got 31"):
        cache.prefill(0, 1, *(torch.cat([x[0], x[0, :1]]) for x in (q, k, v)))
    cache.prefill(0, 1, q[0, :10], k[0, :10], v[0, :10])
    with pytest.raises(ValueError, match=r"expects layer 1 and 10 tokens, got 12"):
        cache.prefill(1, 1, q[1, :12], k[1, :12], v[1, :12])
    with pytest.raises(ValueError, match=r"expects layer 1"):
        cache.prefill(0, 1, q[0, 10:20], k[0, 10:20], v[0, 10:20])
    cache.check_integrity()


def test_chunked_prefill_after_a_prefix_hit_equals_dense() -> None:
    """A second sequence reuses the first one's prompt blocks, then prefills the rest in chunks."""
    prompt = HOT + 4 * BS + 5
    q, k, v = qkv(21, prompt + 1)
    at = lambda t: torch.stack(
        [dense(q[i, t], k[i, : t + 1], v[i, : t + 1]) for i in range(SHAPE.num_layers)]
    )
    cache = new_cache(config(hot_tokens=HOT, block_size=BS, quantization_bits=0))
    prefill(cache, 0, list(range(prompt)), q[:, :prompt], k[:, :prompt], v[:, :prompt])
    outs = _chunked_prefill(cache, 1, list(range(prompt)), q, k, v, [3, BS + 1])
    assert cache.stats()["prefix_hit_blocks"] == 4
    assert torch.allclose(torch.stack([o[-1] for o in outs[-1]]), at(prompt - 1), atol=TOL[torch.float32])
    out = decode_step(cache, [1], 1.0, q[:, -1:], k[:, -1:], v[:, -1:])
    assert torch.allclose(torch.stack([o[0] for o in out]), at(prompt), atol=TOL[torch.float32])
    cache.check_integrity()


def test_step_index_tensors_are_16_byte_aligned_whatever_the_batch() -> None:
    """Triton specializes a kernel on whether each pointer argument is 16-byte aligned: the step's packed
    index tensors (hot lengths, tables, seal lists) must keep their alignment as the batch and the number of
    sealing sequences change, or kernels compile again in the middle of a replay."""
    cache = new_cache(config(quantization_bits=8), max_seqs=5)
    q, k, v = qkv(0, 40)
    for sid, n in enumerate([7, 9, 15, 18, 23]):
        prefill(cache, sid, list(range(100 * sid, 100 * sid + n)), q[:, :n], k[:, :n], v[:, :n])
    seals = set()
    for step in range(24):
        ids = list(range(1 + step % 5))
        plan = cache.begin_step(ids, float(step))
        seals.add(len(plan.seal_blocks))
        for name, value in vars(plan).items():
            if isinstance(value, torch.Tensor) and value.numel():
                assert value.data_ptr() % 16 == 0, f"batch {len(ids)}, {len(plan.seal_blocks)} seals: {name}"
        b = len(ids)
        for layer in range(SHAPE.num_layers):
            cache.decode(layer, plan, q[layer, :b], k[layer, :b], v[layer, :b])
        cache.end_step(plan)
    assert {1, 2} <= seals or {1, 3} <= seals, f"seal counts met: {seals}"


def test_compile_kernels_leaves_an_empty_cache_as_it_was_and_refuses_a_used_one() -> None:
    cache = new_cache(config(quantization_bits=8, sparse_top_k=16, block_size=8))
    before = (cache.blocks.num_free(), [p.block_bits.clone() for p in cache.pools], cache.tiers.tier.clone())
    cache.compile_kernels()
    after = (cache.blocks.num_free(), [p.block_bits.clone() for p in cache.pools], cache.tiers.tier.clone())
    assert before[0] == after[0] and torch.equal(before[2], after[2])
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    q, k, v = qkv(1, 20)
    prefill(cache, 0, list(range(20)), q, k, v)
    with pytest.raises(ValueError, match="must be empty"):
        cache.compile_kernels()
