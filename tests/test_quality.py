"""Quality measurement on CPU with the tiny random model (parameters scaled down)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.aggregation import AGGREGATION_PAIRS, aggregation_prompt, aggregation_prompts
from kvtune.engine.quality import (
    PASSKEY_DEPTHS,
    PasskeyTrial,
    measure_quality,
    passkey_forced_steps,
    passkey_passed,
    passkey_prompt,
    passkey_trials,
    text_token_ids,
    window_starts,
)
from kvtune.tuner.cli import main

EXCERPT = Path(__file__).resolve().parents[1] / "examples" / "text" / "wikitext2_excerpt.txt"
SMALL = {"windows": 2, "prefill_tokens": 64, "decode_tokens": 24, "step_ms": 50.0}


@pytest.fixture(scope="module")
def text() -> str:
    return EXCERPT.read_text(encoding="utf-8")[:20_000]


def _config(bits: int, **kw) -> HybridConfig:
    return HybridConfig("hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=bits, **kw)


@pytest.fixture(scope="module")
def results(tiny, text):
    return {bits: measure_quality(tiny, _config(bits), text, passkey=False, **SMALL) for bits in (0, 4, 8)}


def test_unquantized_config_matches_its_baseline(results):
    r = results[0]
    assert r.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert r.top1_agreement == 1.0 and r.ppl_change_pct == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_config_measures_a_finite_cost_on_cold_blocks(results, bits):
    d = results[bits].to_dict()
    assert all(
        math.isfinite(d[k]) for k in ("mean_kl", "top1_agreement", "ppl", "ppl_base", "ppl_change_pct")
    )
    assert d["mean_kl"] > 0 and 0 < d["cold_attention_share"] <= 1
    assert d["passkey_rate"] is None and d["windows"] == 2 and len(d["text_sha256"]) == 64


def test_four_bits_cost_more_than_eight(results):
    assert results[4].mean_kl > results[8].mean_kl


def test_passkey_runs_beside_the_baseline(tiny, text):
    config = _config(8, sparse_top_k=16, migration_interval=4, migration_threshold_ms=100.0)
    r = measure_quality(tiny, config, text, windows=1, prefill_tokens=32, decode_tokens=4, passkey=True)
    assert 0.0 <= r.passkey_rate <= 1.0 and 0.0 <= r.passkey_base_rate <= 1.0


def test_text_too_short_for_the_windows_is_an_error():
    with pytest.raises(ValueError, match="windows"):
        window_starts(100, windows=2, window_tokens=60)


def test_passkey_trials_cover_ten_depths_within_the_lengths():
    trials = passkey_trials(_config(8), 2048, 8192, 50.0)
    assert len(trials) == PASSKEY_DEPTHS and {t.depth for t in trials} == {i / 9 for i in range(10)}
    assert min(t.length for t in trials) == 1024 and max(t.length for t in trials) == 4096


@pytest.mark.parametrize(
    ("sparse_top_k", "length", "forced"),
    [(0, 1024, 8), (64, 1024, 201), (64, 4096, 301), (64, 200, 100)],
)
def test_passkey_forces_decode_steps_until_demotion_can_happen(sparse_top_k, length, forced):
    config = HybridConfig(
        "hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=8, sparse_top_k=sparse_top_k
    )
    assert passkey_forced_steps(config, length, 50.0) == forced


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_has_the_requested_length_and_key(tiny, depth):
    trial = PasskeyTrial(300, depth, "71432", forced=8)
    prompt = passkey_prompt(tiny, trial)
    assert len(prompt) == 300
    assert passkey_passed(tiny, "71432", prompt) and not passkey_passed(tiny, "99999", prompt)


def test_quality_command_prints_and_writes_json(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(_config(8).to_json(), encoding="utf-8")
    out = tmp_path / "q.json"
    argv = [
        "quality",
        "--config",
        str(config),
        "--model",
        "random:tiny",
        "--text",
        str(EXCERPT),
        "--windows",
        "1",
        "--prefill",
        "48",
        "--decode",
        "8",
        "--no-passkey",
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    assert json.loads(out.read_text())["decode_tokens"] == 8
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--windows", "0", "--windows 0: must be >= 1"), ("--decode", "-2", "--decode -2: must be >= 1"),
     ("--step-ms", "0", "--step-ms 0: must be > 0")],
)  # fmt: skip
def test_quality_command_refuses_bad_sizes_before_loading(tmp_path, capsys, option, value, message):
    config = tmp_path / "c.json"
    config.write_text(_config(8).to_json(), encoding="utf-8")
    assert main(["quality", "--config", str(config), "--model", "no-such-model", option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"kvtune: error: {message}"


# ---- the aggregation probe ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "pairs"), [(37, 1), (337, AGGREGATION_PAIRS), (401, AGGREGATION_PAIRS), (1000, 16)]
)
def test_aggregation_prompt_spreads_the_facts_and_asks_them_all_back(tiny, text, length, pairs):
    tokenize = lambda s: text_token_ids(tiny, s)
    filler = tokenize(text[:3000])
    p = aggregation_prompt(tokenize, filler, 1, length, pairs, seed=3)
    assert len(p.values) == pairs and p.tokens[0] == 1 and p.context == length
    recalled = bytes(p.tokens[p.context :]).decode()
    context = bytes(p.tokens[1 : p.context]).decode()
    for lo, hi in p.values:
        value = bytes(p.tokens[lo:hi]).decode()
        assert len(value.strip()) == 4 and value in recalled
        assert f"is{value}." in context.replace(" ", "") or f"is {value.strip()}." in context
    depths = sorted(context.index(bytes(p.tokens[lo:hi]).decode()) for lo, hi in p.values)
    assert depths[-1] - depths[0] >= (len(context) // 2 if pairs > 1 else 0)  # spread over the context


def test_aggregation_prompts_of_one_probe_are_equal_in_length_and_differ(tiny, text):
    tokenize = lambda s: text_token_ids(tiny, s)
    a, b = aggregation_prompts(tokenize, tokenize(text[:5000]), None, 500, prompts=2, pairs=6)
    assert (len(a.tokens), a.context) == (len(b.tokens), b.context) and a.tokens != b.tokens


def test_aggregation_prompt_without_room_is_an_error(tiny):
    tokenize = lambda s: text_token_ids(tiny, s)
    with pytest.raises(ValueError, match="no room for 6 facts"):
        aggregation_prompt(tokenize, [65] * 100, None, 100, 6, seed=0)


@pytest.mark.parametrize(("bits", "sparse"), [(0, 0), (8, 16)])
def test_aggregation_probe_runs_beside_the_baseline(tiny, text, bits, sparse):
    config = _config(bits, sparse_top_k=sparse, migration_interval=4, migration_threshold_ms=100.0)
    r = measure_quality(tiny, config, text, windows=1, prefill_tokens=32, decode_tokens=4, passkey=False,
                        aggregation=True)  # fmt: skip
    assert 0.0 <= r.aggregation_rate <= 1.0 and 0.0 <= r.aggregation_base_rate <= 1.0
    assert math.isfinite(r.aggregation_nll) and r.aggregation_base_nll > 0
    if bits == 0 and sparse == 0:  # the unquantized cache against itself
        assert (r.aggregation_rate, r.aggregation_nll) == (r.aggregation_base_rate, r.aggregation_base_nll)


def test_aggregation_probe_asks_as_many_prompts_as_given(tiny, text):
    """``aggregation_prompts`` prompts of AGGREGATION_PAIRS facts each, in one batch; fewer than one is an
    error naming the rule."""
    config = _config(8, sparse_top_k=16, migration_interval=4, migration_threshold_ms=100.0)
    kw: dict = dict(windows=1, prefill_tokens=32, decode_tokens=4, passkey=False, aggregation=True)
    r = measure_quality(tiny, config, text, aggregation_prompts=3, **kw)
    assert r.aggregation_facts == 3 * AGGREGATION_PAIRS and 0.0 <= r.aggregation_rate <= 1.0
    assert measure_quality(tiny, config, text, **kw).aggregation_facts == 2 * AGGREGATION_PAIRS
    with pytest.raises(ValueError, match="`aggregation_prompts >= 1`"):
        measure_quality(tiny, config, text, aggregation_prompts=0, **kw)


def test_quality_without_the_probe_reports_none(results):
    d = results[8].to_dict()
    assert d["aggregation_rate"] is None and d["aggregation_base_nll"] is None


@pytest.mark.parametrize("skip", [False, True])
def test_quality_command_reports_the_aggregation_probe_unless_skipped(tmp_path, capsys, skip):
    config = tmp_path / "c.json"
    config.write_text(_config(8).to_json(), encoding="utf-8")
    out = tmp_path / "q.json"
    argv = ["quality", "--config", str(config), "--model", "random:tiny", "--text", str(EXCERPT),
            "--windows", "1", "--prefill", "48", "--decode", "4", "--no-passkey", "--device", "cpu",
            "--json", str(out)]  # fmt: skip
    assert main(argv + ["--no-aggregation"] * skip) == 0
    rate = json.loads(out.read_text())["aggregation_rate"]
    assert (rate is None) if skip else (0.0 <= rate <= 1.0)
    assert json.loads(out.read_text())["aggregation_facts"] == (None if skip else 2 * AGGREGATION_PAIRS)
    assert ("skipped" in capsys.readouterr().out.split("pairs recalled")[1].splitlines()[0]) == skip


def test_the_baselines_dense_forward_gives_the_unquantized_caches_decode_logits(tiny, text):
    """The baseline's logits come from one dense causal forward per window: those of decoding the window
    through the unquantized cache step by step (same keys and values, sums in another order), and kept per
    model and windows, so a second config's measurement reuses them."""
    from kvtune.engine.quality import _Pair, _window_ids, baseline_logits

    ids = text_token_ids(tiny, text)
    windows = [_window_ids(tiny, ids, s, 64 + 24 + 1) for s in (0, 500)]
    dense = baseline_logits(tiny, windows, 64)
    pair = _Pair(tiny, _config(0), len(windows[0]), 50.0, num_seqs=2)
    pair.prefill_through_model([w[:64] for w in windows])
    for step, pos in enumerate(range(64, len(windows[0]) - 1)):
        _, base = pair.decode([w[pos] for w in windows], pos)
        for row in range(2):
            torch.testing.assert_close(dense[row][step], base[row], rtol=1e-5, atol=1e-5)
    assert baseline_logits(tiny, windows, 64) is dense


@pytest.mark.parametrize("config", [_config(8), _config(4, sparse_top_k=32)], ids=["int8", "int4-sparse"])
def test_prompts_written_from_the_dense_forward_match_a_prefill_through_the_cache(tiny, text, config):
    """The prompts go into each config's cache as the dense forward's keys and values (no model pass),
    sealed and quantized as a prefill would: the decoded logits are those of prefilling the prompts through
    the model and the cache (same keys and values up to the order of the attention's sums)."""
    from kvtune.engine.quality import _Pair, _window_ids, prompt_kv

    ids = text_token_ids(tiny, text)
    windows = [_window_ids(tiny, ids, s, 64 + 24 + 1) for s in (0, 500)]
    prompts = [w[:64] for w in windows]
    kv = prompt_kv(tiny, prompts[0])
    assert len(kv) == tiny.spec.num_layers and kv[0][0].shape[0] == 64 and kv[0][0].device.type == "cpu"
    written = _Pair(tiny, config, len(windows[0]), 50.0, num_seqs=2)
    written.prefill(prompts)
    prefilled = _Pair(tiny, config, len(windows[0]), 50.0, num_seqs=2)
    prefilled.prefill_through_model(prompts)
    for cache in (written.cache, prefilled.cache, written.base, prefilled.base):
        cache.check_integrity()
    for pos in range(64, len(windows[0]) - 1):
        a, base_a = written.decode([w[pos] for w in windows], pos)
        b, base_b = prefilled.decode([w[pos] for w in windows], pos)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(base_a, base_b, rtol=1e-5, atol=1e-5)
    assert written.attention_shares() == pytest.approx(prefilled.attention_shares(), abs=1e-6)


def test_a_kept_prompt_serves_its_prefixes_and_the_store_keeps_its_bound(tiny, text, monkeypatch):
    """A prompt's keys and values serve every prompt it starts with (a passkey prompt split anywhere); past
    the bound the least recently used go, and one prompt above it is not kept."""
    from kvtune.engine import quality
    from kvtune.engine.quality import _PROMPT_KV, prompt_kv

    ids = text_token_ids(tiny, text)[:300]
    whole = prompt_kv(tiny, ids[:96])
    part = prompt_kv(tiny, ids[:40])
    for (k, v), (k2, v2) in zip(whole, part, strict=True):
        assert torch.equal(k[:40], k2) and torch.equal(v[:40], v2)
    one = sum(2 * k.numel() * k.element_size() for k, _ in whole)  # 96 tokens' bytes
    monkeypatch.setattr(quality, "PROMPT_KV_MAX_BYTES", 2 * one)
    _PROMPT_KV.pop(tiny.model, None)
    for start in (0, 100, 200):
        prompt_kv(tiny, ids[start : start + 96])
    assert list(_PROMPT_KV[tiny.model]) == [tuple(ids[100:196]), tuple(ids[200:296])]
    prompt_kv(tiny, ids[:250])  # above the bound alone
    assert not _PROMPT_KV[tiny.model]
