"""Prompt and mixed forwards with their dense parts as pieces (:mod:`kvtune.engine.piecewise`): the same
logits and cache contents as the eager forward, padded to a token bucket, captured as CUDA graphs on a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.engine.piecewise import PIECE_BUCKETS, PiecewiseForward, piece_buckets

HAS_CUDA = torch.cuda.is_available()


def _config(bits: int) -> HybridConfig:
    return HybridConfig("hybrid_v2", hot_tokens=16, block_size=8, quantization_bits=bits)


def _caches(model: Any, config: HybridConfig, device: str, n: int = 2) -> list[HybridCache]:
    """``n`` caches, each holding two decoding sequences (70 and 90 tokens) and two prompts to prefill."""
    out = []
    for _ in range(n):
        shape = model.kv_shape
        cache = HybridCache(config, shape, 4 * kv_bytes_for(config, shape, [400] * 6), device, max_seqs=6)
        gen = torch.Generator().manual_seed(3)
        for seq_id, length in ((0, 70), (1, 90)):
            ids = torch.randint(0, model.spec.vocab_size, (length,), generator=gen).to(device)
            cache.add_sequence(seq_id, ids.tolist())
            model.prefill(cache, seq_id, ids, 0, last_only=True)
        for seq_id, length in ((10, 60), (11, 25)):
            cache.add_sequence(seq_id, [(5 * seq_id + t) % model.spec.vocab_size for t in range(length)])
        out.append(cache)
    return out


def _mixed(
    model: Any, cache: HybridCache, chunks: list[tuple[int, int]], step: int, pieces: Any
) -> torch.Tensor:
    """One mixed forward of the two decode rows and ``chunks`` (seq_id, tokens) of the prompts."""
    dev = cache.device
    ids = [4, 9]
    pos = cache.lengths(np.array([cache.slot_of(0), cache.slot_of(1)])).tolist()
    for seq_id, n in chunks:
        seq = cache._seqs[seq_id]
        ids += [(5 * seq_id + t) % model.spec.vocab_size for t in range(seq.prefilled, seq.prefilled + n)]
        pos += list(range(seq.prefilled, seq.prefilled + n))
    plan = cache.begin_step([0, 1], 1.0 + step)
    ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
    logits = model.forward_mixed(cache, plan, ids_t, pos_t, 2, chunks, pieces=pieces)
    cache.end_step(plan)
    return logits


ITERATIONS = [[(10, 24), (11, 13)], [(10, 1)], [(10, 35), (11, 12)]]


def test_piece_buckets_cover_the_most_tokens_of_a_forward():
    assert piece_buckets(10) == [16]
    assert piece_buckets(100) == [16, 32, 64, 128]
    assert piece_buckets(8192) == list(PIECE_BUCKETS)
    pieces = PiecewiseForward(_tiny(), 100, capture=False)
    assert (pieces.max_tokens, pieces.bucket(17)) == (128, 32)
    assert pieces.fits(128) and not pieces.fits(129) and not pieces.fits(0)


def test_piece_buckets_pad_a_forward_by_at_most_a_sixteenth_above_512_tokens():
    """Padding rows cost the dense pieces' device time: doubling buckets ran the README study's 1,030-token
    prompts as 1,536 rows, and its unloaded P99 TTFT (the limits' source) read ~40 % higher than op by op."""
    pieces = PiecewiseForward(_tiny(), 2048, capture=False)
    assert pieces.max_tokens == 2048 and all(b % 16 == 0 for b in PIECE_BUCKETS)
    for n in range(257, 2049):
        assert pieces.bucket(n) <= n * (1 + (1 / 16 if n > 512 else 1 / 8)), n
    assert pieces.bucket(1030) == 1088


def _tiny() -> Any:
    from kvtune.engine.model import load_model

    return load_model("random:tiny", "cpu").model


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_pieces_give_the_eager_mixed_forwards_logits_and_cache(tiny, bits):
    """Decode rows beside prompt chunks (first chunks, later ones, a 1-token one) and a prompt alone, run
    with the dense parts as pieces over buffers padded to the token bucket: the eager forward's logits and
    cache contents (float32, on the CPU: up to the padded matrix products' rounding)."""
    model = tiny.model
    eager, piecewise = _caches(model, _config(bits), "cpu")
    pieces = PiecewiseForward(model, 64, capture=False)
    for step, chunks in enumerate(ITERATIONS):
        want = _mixed(model, eager, chunks, step, None)
        got = _mixed(model, piecewise, chunks, step, pieces)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for seq_id in (0, 1, 10, 11):
        a, b = eager._seqs[seq_id], piecewise._seqs[seq_id]
        assert (a.length, a.hot_len, a.prefilled, a.blocks) == (b.length, b.hot_len, b.prefilled, b.blocks)
        za, zb = eager.hot_kv[:, :, a.slot, :, : a.hot_len], piecewise.hot_kv[:, :, b.slot, :, : b.hot_len]
        torch.testing.assert_close(za, zb, rtol=1e-5, atol=1e-5)
    piecewise.check_integrity()


def test_pieces_give_the_eager_prefill_and_leave_longer_forwards_eager(tiny):
    """A prompt alone through the pieces: the eager prefill's last logits. A forward longer than the largest
    bucket runs eagerly: bit for bit the eager forward."""
    model = tiny.model
    ids = torch.arange(5, 45)
    small = PiecewiseForward(model, 16, capture=False)
    results = []
    for pieces in (None, PiecewiseForward(model, 64, capture=False), small):
        cache = _caches(model, _config(8), "cpu", n=1)[0]
        cache.add_sequence(20, ids.tolist())
        results.append(model.prefill(cache, 20, ids, 0, last_only=True, pieces=pieces))
        cache.check_integrity()
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[2], results[0])  # 40 tokens > 16: eager


def test_pieces_call_between_layers_before_every_layers_attention_but_the_first(tiny):
    model = tiny.model
    cache = _caches(model, _config(8), "cpu", n=1)[0]
    calls: list[int] = []
    ids = torch.tensor([(50 + t) % model.spec.vocab_size for t in range(60)])
    pieces = PiecewiseForward(model, 64, capture=False)
    model.prefill(cache, 10, ids, 0, last_only=True, between_layers=lambda: calls.append(1), pieces=pieces)
    assert len(calls) == len(model.layers) - 1


def test_pieces_refuse_to_capture_off_cuda(tiny):
    with pytest.raises(ValueError, match="needs a CUDA model"):
        PiecewiseForward(tiny.model, 64, capture=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: captures CUDA graphs")
@pytest.mark.parametrize(
    ("name", "dtype"), [("random:tiny", torch.float32), ("random:smollm2-135m", torch.bfloat16)],
    ids=["tiny-fp32", "smollm2-bf16"],
)  # fmt: skip
@pytest.mark.parametrize("bits", [0, 8, 4])
def test_captured_pieces_give_the_eager_forwards_gpu(name, dtype, bits):
    """On CUDA: mixed forwards whose dense parts replay as captured pieces give the eager forward's logits
    (tiny, float32: 1e-4; SmolLM2's shape in bfloat16: 4 bf16 ulps of each row's largest logit, the padded
    matrix products summing in other orders and every layer rounding) and the same sequences' state."""
    from kvtune.engine.model import load_model

    model = load_model(name, "cuda", dtype).model
    eager, piecewise = _caches(model, _config(bits), "cuda")
    pieces = PiecewiseForward(model, 64, capture=True)
    pieces.capture_all()
    assert pieces.capture_ms > 0 and len(pieces._graphs) == len(pieces.buckets) * (len(model.layers) + 1)
    for step, chunks in enumerate(ITERATIONS):
        want = _mixed(model, eager, chunks, step, None)
        got = _mixed(model, piecewise, chunks, step, pieces)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            top = want.abs().amax(dim=-1, keepdim=True)
            ulp = torch.exp2(torch.floor(torch.log2(top.clamp(min=2.0**-126))) - 7)
            diff = (got - want).abs()
            assert (diff <= 4 * ulp).all(), (step, float(diff.max()))
    for seq_id in (0, 1, 10, 11):
        a, b = eager._seqs[seq_id], piecewise._seqs[seq_id]
        assert (a.length, a.hot_len, a.prefilled, a.blocks) == (b.length, b.hot_len, b.prefilled, b.blocks)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_piecewise_worker_builds_its_pieces_at_start_and_says_how_long_capturing_took(device):
    """A study's worker with ``piecewise`` builds the model's pieces when it starts, before anything is
    timed, and its info says how long their capture took (the console's baseline phase line prints it): none
    on a CPU, where nothing is captured; on CUDA every bucket's pieces."""
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU: captures CUDA graphs")
    from pathlib import Path

    from kvtune.engine.engine import model_pieces
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.tuner.worker import local_worker

    text = str(Path(__file__).resolve().parents[1] / "examples" / "text" / "wikitext2_excerpt.txt")
    worker = local_worker(
        "random:tiny", torch.device(device), text, scheduler=SchedulerConfig(piecewise=True)
    )
    pieces = model_pieces(worker.loaded.model, worker.device)  # the one the worker built
    assert worker.info().pieces_capture_s == pytest.approx(pieces.capture_ms / 1000.0)
    if device == "cpu":
        assert pieces.capture_ms == 0 and not pieces._graphs
    else:
        assert pieces.capture_ms > 0 and len(pieces._graphs) == len(pieces.buckets) * (
            len(pieces.model.layers) + 1
        )
    plain = local_worker("random:tiny", torch.device(device), text)
    assert plain.info().pieces_capture_s == 0
