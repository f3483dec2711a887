"""Cache attention against dense attention over the same K/V, and the decode kernel reference on its own."""

from __future__ import annotations

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
