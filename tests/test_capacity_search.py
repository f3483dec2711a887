"""The capacity objective: the search (pure, with a synthetic monotone pass/fail), the pruning decision, the
early stop of an overloaded probe (tiny model, CPU), and a real CPU study with ``--objective capacity`` that
writes a preset and resumes (the Ray session of ``tests/conftest.py``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.studies.names import ATTR_NOISE, ATTR_PROBES, ATTR_SLO
from kvtune.studies.study import StudyOptions
from kvtune.tuner import cli
from kvtune.tuner.capacity import (
    CONCURRENCY_EXPONENT,
    EXPAND,
    NEAR_EXPAND,
    CapacitySearch,
    ProbeStop,
    Slo,
    capacity_metrics,
    derive_slo,
    near_search,
    noise_record,
    pass_rate_estimate,
    predicted_start,
    probe_passes,
    should_prune,
    violations_to_fail,
    within_noise,
)
from kvtune.tuner.job import COLD_START
from kvtune.tuner.protocol import Call, EngineKnobs, QualitySettings, WorkerSpec, next_call

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"


# ---- the search, on a synthetic config whose true capacity is known ----------------------------------------
def search_to_end(search: CapacitySearch, capacity: float) -> tuple[CapacitySearch, list[float]]:
    """Run ``search`` against a monotone pass/fail (a rate passes iff it is at most ``capacity``); the
    capacity reported after each probe."""
    reported = []
    while (rate := search.next_rate()) is not None:
        search = search.record(rate, rate <= capacity)
        reported.append(search.capacity)
    return search, reported


@pytest.mark.parametrize("truth", [0.013, 0.3, 0.97, 1.0, 1.03, 1.51, 2.11, 3.9, 17.0])
def test_search_brackets_then_bisects_to_the_granularity(truth: float) -> None:
    search, reported = search_to_end(CapacitySearch(start=1.0, granularity=0.05, max_probes=16), truth)
    assert search.converged
    assert search.lo is not None and search.hi is not None
    assert search.lo <= truth < search.hi and search.hi / search.lo - 1 <= 0.05
    assert search.capacity == search.lo
    assert reported == sorted(reported)  # the reported lower bound only grows


def test_warm_start_first_probe_and_probe_count() -> None:
    """Warm-started at the baseline's capacity, INT8's 1.51x and INT4's 2.11x each take at most 8 probes."""
    for truth in (1.51, 2.11, 0.8):
        search, _ = search_to_end(CapacitySearch(start=1.0), truth)
        assert search.probes[0][0] == 1.0
        assert search.converged and len(search.probes) <= 8
    search, _ = search_to_end(CapacitySearch(start=1.0), 1.0)  # the baseline itself
    assert search.probes[:2] == ((1.0, True), (2.0, False))


@pytest.mark.parametrize("truth", [2.0, 2.9, 3.0, 3.1, 3.3, 4.4, 9.0])
def test_a_search_started_near_its_answer_steps_by_five_percent_then_more(truth: float) -> None:
    """Started at a capacity measured before (3.0x), a search brackets by a 5 % step, each later step in
    the same direction the square of the one before, and converges to the same granularity in fewer probes
    than from 1.0x, none of them far below the answer; an answer within 5 % takes at most three probes."""
    near, _ = search_to_end(near_search(CapacitySearch(1.0, 0.025, 12), 3.0), truth)
    cold, _ = search_to_end(CapacitySearch(1.0, 0.025, 12), truth)
    assert near.probes[0] == (3.0, truth >= 3.0) and near.expand == NEAR_EXPAND and near.escalate
    up = truth >= 3.0
    steps = [b / a if up else a / b for (a, _), (b, _) in zip(near.probes, near.probes[1:])]
    one_side = next((i + 1 for i, (_, ok) in enumerate(near.probes[1:]) if ok != up), len(near.probes))
    expected = [min(EXPAND, NEAR_EXPAND ** (2**i)) for i in range(one_side - 1)]
    assert steps[: one_side - 1] == pytest.approx(expected)  # 1.05, 1.1025, 1.2155, ... up to 2
    assert near.converged and near.lo is not None and near.hi is not None
    assert near.lo <= truth < near.hi and near.hi / near.lo - 1 <= 0.025
    assert min(r for r, _ in near.probes) >= min(3.0, truth / 2.0) / (1 + 1e-9)
    if abs(math.log(truth / 3.0)) < math.log(1.25):  # within ±25 %: fewer probes than a cold search
        assert len(near.probes) < len(cold.probes)
    if abs(math.log(truth / 3.0)) < math.log(NEAR_EXPAND):
        assert len(near.probes) <= 3
    assert near.to_dict()["expand"] == NEAR_EXPAND and near.to_dict()["escalate"] is True
    assert "expand" not in cold.to_dict() and "escalate" not in cold.to_dict()


def test_a_trial_starts_where_its_sequences_against_the_baselines_predict() -> None:
    """A trial's search starts at the baseline's capacity x (its max_num_seqs / the baseline's) ** 0.75 by
    near steps, and warm_start still starts it at the best capacity so far where that is higher. An H200
    study's first trial (run 32d: INT8 at 31 sequences against 19, baseline 7.24x, capacity 10.02x) took 7
    probes from the baseline's capacity; from the prediction the same answer takes 3."""
    from kvtune.tuner.capacity import warm_start

    base = CapacitySearch(7.24, granularity=0.025)
    started = predicted_start(base, 31, 19)
    assert started.start == pytest.approx(7.24 * (31 / 19) ** 0.75) and started.escalate
    assert started.expand == NEAR_EXPAND and started.granularity == base.granularity
    predicted, _ = search_to_end(started, 10.02)
    plain, _ = search_to_end(base, 10.02)
    assert len(plain.probes) == 7 and len(predicted.probes) <= 3 and predicted.converged
    assert predicted.lo is not None and predicted.lo <= 10.02 < predicted.hi
    fewer = predicted_start(base, 10, 19)  # a factor of 0.5: fewer sequences, a lower start
    assert fewer.start < base.start and search_to_end(fewer, 5.0)[0].converged
    assert predicted_start(base, None, 19) is base and predicted_start(base, 31, None) is base
    above = warm_start(started, 9.0, noise=0.025)  # the prediction above the best: kept, and a first
    assert above.start == started.start and above.step_down == pytest.approx(9.0 * 0.975)  # failure there
    worse = above.record(above.start, False)  # probes the best's noise edge next, where a failure prunes
    assert worse.next_rate() == pytest.approx(9.0 * 0.975)
    assert should_prune(worse.record(9.0 * 0.975, False), 9.0, 0.025)
    assert warm_start(started, 9.0) is started  # no noise measured: as it was
    below = warm_start(started, 12.0, noise=0.025)
    assert below.start == 12.0 and below.step_down == pytest.approx(12.0 * 0.975)
    # a best of 0 (a feasible trial that passed no rate) is no best: no edge at 0 to probe after a failure
    nothing = warm_start(started, 0.0, noise=0.34)
    assert nothing is started and nothing.record(started.start, False).next_rate() > 0
    assert CONCURRENCY_EXPONENT == 0.75


def test_a_plain_search_keeps_its_step() -> None:
    """Without escalation (a cold search, a trial's), every bracketing step is ``expand``."""
    search, _ = search_to_end(CapacitySearch(1.0, 0.025, 12, expand=1.25), 3.0)
    rates = [r for r, _ in search.probes[:5]]
    assert rates == pytest.approx([1.0, 1.25, 1.25**2, 1.25**3, 1.25**4])


def test_a_search_near_nothing_stays_as_it_was() -> None:
    search = CapacitySearch(1.0)
    assert near_search(search, 0.0) is search and near_search(search, math.inf) is search
    with pytest.raises(ValueError, match=r"`expand > 1` must hold, but got expand=1\.0"):
        CapacitySearch(1.0, expand=1.0)


def test_probe_budget_stops_an_unbracketed_search() -> None:
    far_above, _ = search_to_end(CapacitySearch(start=1.0, max_probes=5), 1000.0)
    assert len(far_above.probes) == 5 and not far_above.converged
    assert far_above.capacity == 16.0 and far_above.hi is None  # a lower bound: every probe passed
    far_below, reported = search_to_end(CapacitySearch(start=1.0, max_probes=5), 1e-6)
    assert len(far_below.probes) == 5 and far_below.capacity == 0.0 and reported == [0.0] * 5
    assert far_below.hi == 1.0 / 16


def test_a_search_stops_at_the_saturation_rate() -> None:
    """Above ``max_rate`` every window arrives within one step: a config that passes there is saturated (its
    capacity the cap, a lower bound) after fewer probes than an uncapped search spends; one below the cap is
    found as without it; a warm start above the cap starts at it."""
    free, _ = search_to_end(CapacitySearch(start=1.0, max_probes=8), 1000.0)
    capped, reported = search_to_end(CapacitySearch(start=1.0, max_probes=8, max_rate=10.0), 1000.0)
    assert [r for r, _ in capped.probes] == [1.0, 2.0, 4.0, 8.0, 10.0]
    assert capped.saturated and capped.capacity == 10.0 and capped.hi is None and reported[-1] == 10.0
    assert len(capped.probes) < len(free.probes) and not free.saturated
    assert capped.to_dict()["saturated"] and capped.to_dict()["max_rate"] == 10.0
    below, _ = search_to_end(CapacitySearch(start=1.0, granularity=0.05, max_probes=16, max_rate=10.0), 9.0)
    assert below.converged and not below.saturated and below.lo <= 9.0 < below.hi <= 10.0  # type: ignore[operator]
    assert not below.near_saturation and capped.near_saturation and not free.near_saturation
    short, _ = search_to_end(CapacitySearch(start=1.0, granularity=0.05, max_probes=16, max_rate=10.0), 9.9)
    assert short.converged and not short.saturated and short.near_saturation  # one step below the cap
    high = CapacitySearch(start=50.0, max_rate=10.0)
    assert high.next_rate() == 10.0 and high.record(10.0, False).next_rate() == 5.0
    with pytest.raises(ValueError, match="max_rate > 0"):
        CapacitySearch(start=1.0, max_rate=0.0)


def test_the_saturation_rate_is_the_window_span_over_one_unloaded_step() -> None:
    from kvtune.tuner.capacity import saturation_rate

    at = lambda *ms: [SimpleNamespace(arrival_ms=m) for m in ms]
    derived = derive_slo({"ttft_p99_ms": 40.0, "tpot_p50_ms": 2.0, "step_ms": 2.5, "completed": 8})
    assert saturation_rate([at(100.0, 300.0, 900.0), at(0.0, 50.0)], derived) == 400.0  # 800 ms / 2 ms
    given = derive_slo(None, ttft_ms=100.0, tpot_ms=20.0)  # no unloaded replay: no cap
    assert saturation_rate([at(0.0, 800.0)], given) is None
    assert saturation_rate([at(5.0, 5.0)], derived) is None  # everything at once at any rate


def test_granularity_sets_the_probes() -> None:
    coarse, _ = search_to_end(CapacitySearch(start=1.0, granularity=0.05, max_probes=20), 1.37)
    fine, _ = search_to_end(CapacitySearch(start=1.0, granularity=0.025, max_probes=20), 1.37)
    assert len(fine.probes) == len(coarse.probes) + 1
    assert fine.hi / fine.lo - 1 <= 0.025  # type: ignore[operator]


@pytest.mark.parametrize(
    ("start", "granularity", "probes"), [(0.0, 0.05, 8), (math.nan, 0.05, 8), (1.0, 0.0, 8), (1.0, 0.05, 0)]
)
def test_a_search_refuses_what_cannot_run(start: float, granularity: float, probes: int) -> None:
    with pytest.raises(ValueError, match="must hold"):
        CapacitySearch(start, granularity, probes)


def test_a_trial_starts_at_the_best_capacity_once_it_beats_the_baseline() -> None:
    """Warm start at the baseline's capacity until a feasible trial carries more; then a config below the best
    fails its first probe and is pruned after one probe, and one above it goes up from the best."""
    from kvtune.tuner.capacity import warm_start

    base = CapacitySearch(2.0, granularity=0.025)
    assert warm_start(base, None) is base and warm_start(base, 1.5) is base
    started = warm_start(base, 5.0)
    assert started.start == 5.0 and started.next_rate() == 5.0
    assert started.granularity == base.granularity and started.max_probes == base.max_probes
    worse = started.record(5.0, False)
    assert should_prune(worse, 5.0)
    better = started.record(5.0, True)
    assert better.next_rate() == pytest.approx(5.0 * NEAR_EXPAND) and not should_prune(better, 5.0)


def test_pruning_needs_a_failure_at_or_below_the_best_capacity() -> None:
    search = CapacitySearch(start=1.0)
    assert not should_prune(search, 1.5)  # nothing probed
    failed_at_1 = search.record(1.0, False)
    assert should_prune(failed_at_1, 1.5) and should_prune(failed_at_1, 1.0)
    assert not should_prune(failed_at_1, 0.9)  # it may still carry more than 0.9
    assert not should_prune(failed_at_1, None) and not should_prune(failed_at_1, 0.0)  # no best known yet
    passed = search.record(1.0, True)
    assert not should_prune(passed, 1.5)  # no upper bound yet
    assert should_prune(passed.record(2.0, False), 2.0)


def test_next_call_runs_probes_until_the_search_ends() -> None:
    search = CapacitySearch(start=1.0, max_probes=2)
    assert next_call(Call.CONFIGURE, -1, 1, False, search) == (Call.PROBE, 0)
    assert next_call(Call.CONFIGURE, -1, 1, False) == (Call.WINDOW, 0)
    one = search.record(1.0, True)
    assert next_call(Call.PROBE, 0, 1, False, one) == (Call.PROBE, 1)
    assert next_call(Call.PROBE, 1, 1, False, one.record(2.0, True)) == (Call.FINISH, -1)
    assert next_call(Call.FINISH, -1, 1, False, one) == (Call.QUALITY, -1)


# ---- one probe -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "need"), [(1, 1), (2, 2), (4, 2), (100, 2), (101, 2), (102, 3), (200, 3)])
def test_violations_that_make_the_p99_fail(n: int, need: int) -> None:
    assert violations_to_fail(n) == need
    rng = np.random.default_rng(n)
    for _ in range(50):  # that many latencies above the limit: numpy's P99 is above it, whatever the rest
        values = rng.uniform(0, 1, n)
        values[rng.choice(n, need, replace=False)] = 1.0 + rng.uniform(0, 1, need)
        assert np.percentile(values, 99) > 1.0


@pytest.mark.parametrize(("n", "need"), [(10, 2), (11, 2), (96, 11), (100, 11)])
def test_violations_that_make_the_p90_fail(n: int, need: int) -> None:
    assert violations_to_fail(n, 90.0) == need
    rng = np.random.default_rng(n)
    for _ in range(50):
        values = rng.uniform(0, 1, n)
        values[rng.choice(n, need, replace=False)] = 1.0 + rng.uniform(0, 1, need)
        assert np.percentile(values, 90) > 1.0
    values = np.concatenate([np.zeros(n - need + 1), np.full(need - 1, 1.001)])  # one fewer: it may pass
    assert np.percentile(values, 90) <= 1.0


def test_limits_on_the_p90() -> None:
    """A P90 rule reads the metrics' P90s, tolerates ~10 % of violators before it stops a probe, and is
    recorded; a record without a percentile is a P99 one; other percentiles are refused."""
    slo = Slo(ttft_ms=100.0, tpot_ms=10.0, percentile=90.0)
    assert slo.describe() == "P90 TTFT ≤ 100 ms and P90 TPOT ≤ 10 ms"
    metrics = {"ttft_p90_ms": 90.0, "tpot_p90_ms": 9.0, "ttft_p99_ms": 500.0, "tpot_p99_ms": 50.0,
               "completed": 20, "refused": 0}  # fmt: skip
    assert probe_passes(metrics, slo) and not probe_passes(metrics, Slo(100.0, 10.0))
    assert ProbeStop(slo, requests=96).allowed == 11 and ProbeStop(Slo(100.0, 10.0), 96).allowed == 2
    record = derive_slo(None, 100.0, 10.0, percentile=90.0)
    assert Slo.from_record(record) == slo
    assert Slo.from_record({"ttft_ms": 1.0, "tpot_ms": 1.0}).percentile == 99.0
    with pytest.raises(ValueError, match="percentile must be one of"):
        Slo(1.0, 1.0, percentile=95.0)


def seq(arrival: float, tokens: list[float], out: int) -> SimpleNamespace:
    return SimpleNamespace(arrival_ms=arrival, token_ms=tokens, request=SimpleNamespace(output_length=out))


def test_probe_stop_fires_once_the_p99_cannot_pass() -> None:
    slo = Slo(ttft_ms=100.0, tpot_ms=10.0)
    stop = ProbeStop(slo, requests=4)  # two violators fail a P99 over 4
    seqs = [seq(0, [50, 55], 8), seq(0, [], 8), seq(10, [], 8), seq(1000, [], 8)]
    assert not stop(50.0, seqs)  # nobody has waited 100 ms yet; the last one has not arrived
    assert not stop(105.0, seqs)  # one waited 105 ms without a first token
    assert stop(111.0, seqs) and stop.ttft_violations == 2
    tpot = ProbeStop(slo, requests=4)
    slow = [seq(0, [5.0], 11), seq(0, [6.0], 11), seq(0, [7.0, 8.0], 11)]
    assert not tpot(90.0, slow)  # (90 - 5) / 10 = 8.5 ms per token so far: may still pass
    assert tpot(120.0, slow) and tpot.tpot_violations >= 2  # > 10 ms per token, whatever comes next


def test_probe_passes_needs_both_limits_and_every_request() -> None:
    slo = Slo(ttft_ms=100.0, tpot_ms=10.0)
    good = {"ttft_p99_ms": 90.0, "tpot_p99_ms": 9.0, "completed": 8, "refused": 0}
    assert probe_passes(good, slo)
    assert not probe_passes(good | {"ttft_p99_ms": 101.0}, slo)
    assert not probe_passes(good | {"tpot_p99_ms": 10.5}, slo)
    assert not probe_passes(good | {"refused": 1}, slo)
    assert probe_passes(good | {"tpot_p99_ms": math.nan}, slo)  # single-token outputs: no TPOT to break


def test_limits_are_derived_from_the_unloaded_baseline_unless_given() -> None:
    unloaded = {"ttft_p99_ms": 40.0, "tpot_p50_ms": 8.0, "step_ms": 7.0, "completed": 16}
    record = derive_slo(unloaded)
    assert (record["ttft_ms"], record["tpot_ms"]) == (200.0, 80.0)  # 5x the P99 TTFT, 10x the median TPOT
    assert record["source"] == {"ttft_ms": "derived", "tpot_ms": "derived"}
    given = derive_slo(unloaded, ttft_ms=500.0)
    assert (given["ttft_ms"], given["tpot_ms"], given["source"]["ttft_ms"]) == (500.0, 80.0, "given")
    assert derive_slo(None, 1.0, 2.0)["unloaded"] is None
    with pytest.raises(ValueError, match="pass --slo-ttft-ms"):
        derive_slo({"ttft_p99_ms": math.nan})


def test_capacity_metrics_are_those_of_the_highest_passing_probe() -> None:
    probe = lambda rate, ok, tps: {"rate": rate, "passed": ok, "windows": [{"tokens_per_s": tps}],
                                   "mean": {"tokens_per_s": tps}}  # fmt: skip
    windows, mean = capacity_metrics([probe(1.0, True, 10.0), probe(2.0, False, 5.0), probe(1.4, True, 14.0)])
    assert (mean["capacity"], mean["capacity_tokens_per_s"], mean["capacity_probes"]) == (1.4, 14.0, 3)
    assert mean["capacity_failed_rate"] == 2.0 and windows == [{"tokens_per_s": 14.0}]
    _, none = capacity_metrics([probe(1.0, False, 3.0), probe(0.5, False, 2.0)])
    assert (none["capacity"], none["capacity_tokens_per_s"]) == (0.0, 0.0)


def test_noise_record_and_within_noise() -> None:
    noise = noise_record([1.0, 1.02, 0.98], [100.0] * 3, {}, granularity=0.05)
    assert noise["median"] == 1.0 and noise["spread"] == pytest.approx(0.04)
    assert noise["threshold"] == 0.05  # the granularity, when the spread is smaller
    assert within_noise(1.0, 1.04, noise["threshold"]) and not within_noise(1.0, 1.2, noise["threshold"])


def test_engine_knobs_follow_vllm_rules() -> None:
    assert EngineKnobs(4096, 256).to_dict() == {"max_num_batched_tokens": 4096, "max_num_seqs": 256}
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_num_seqs"):
        EngineKnobs(128, 256)


def test_pareto_is_refused_for_capacity() -> None:
    with pytest.raises(ValueError, match="capacity already is the throughput"):
        StudyOptions("sqlite:///x.db", "s", "capacity", True, 0, False)


# ---- a probe on the tiny model -------------------------------------------------------------------------
def test_an_overloaded_probe_stops_early_and_a_light_one_passes() -> None:
    from kvtune.engine.traces import Request
    from kvtune.tuner.worker import TrialWorker

    quality = QualitySettings(model="random:tiny", text_path=str(TEXT))
    spec = WorkerSpec(model="random:tiny", device="cpu", quality=quality, threads=1, budget_bytes=1 << 26)
    worker = TrialWorker(spec)
    window = tuple(Request(i, 100.0 * i, 48, 24) for i in range(24))
    config = HybridConfig("hybrid_v2", 16, 16, 0)
    unloaded = worker.unloaded(config, window, 2)
    # measured after one priming replay, whose P99 TTFT is kept beside the three measured (and in the record)
    assert unloaded["completed"] == len(window) and unloaded["unprimed_ttft_p99_ms"] > 0
    repeats = unloaded["ttft_p99_repeats"]  # the replay kept is the one with the median P99 TTFT
    assert len(repeats) == 3 and unloaded["ttft_p99_ms"] == sorted(repeats)[1]
    record = derive_slo(unloaded)
    assert record["unloaded"]["unprimed_ttft_p99_ms"] == unloaded["unprimed_ttft_p99_ms"]
    slo = Slo.from_record(record)
    full = worker.replay(config, window, 0.0, 2)  # all at once, no stop: the whole queue is served
    # A limit the burst breaks for sure (mixed iterations prefill 24 short prompts together, so on this tiny
    # model a burst may well meet the derived one): the probe must notice and stop before serving the rest.
    tight = Slo(ttft_ms=full["ttft_p50_ms"] / 4, tpot_ms=slo.tpot_ms)
    heavy = worker.probe_config(config, None, (window,), 1e6, tight, 2)  # as good as all at once
    assert not heavy["passed"] and heavy["aborted"]
    assert heavy["windows"][0]["probe_aborted"] is True
    assert heavy["windows"][0]["completed"] < len(window) == full["completed"]
    assert heavy["windows"][0]["duration_s"] < full["duration_s"] / 2  # engine clock: it stopped early
    light = worker.probe_config(config, None, (window,), 1e-3, slo, 2)  # arrivals 100 s apart
    assert light["passed"] and not light["aborted"] and light["windows"][0]["completed"] == len(window)


def test_validation_searches_the_baseline_at_its_other_knobs_and_keeps_the_better(ray_cluster: Any) -> None:
    """On capacity the unquantized baseline of validation's first round is searched with the best trial's
    knobs resolved for it and with the defaults; its side of the repeat is the higher capacity of the two,
    both kept; the later repeats search it only at the knobs that carried more there, and the knobs with
    the higher median are the baseline's."""
    from kvtune.engine.traces import Request
    from kvtune.tests.tuner_fakes import tiny_spec
    from kvtune.tuner.job import _baseline_engines
    from kvtune.tuner.pool import WorkerPool, plan_placement
    from kvtune.tuner.validation import validate_capacity

    pool = WorkerPool(tiny_spec(), plan_placement(None, 1, 1.0))
    pool.start()
    try:
        window = tuple(Request(i, 200.0 * i, 32, 32) for i in range(6))
        knobs = (EngineKnobs(64, 8), EngineKnobs(64, 1))  # the baseline one at a time: a poor choice
        best, base = validate_capacity(
            pool, HybridConfig("hybrid_v2", 16, 16, 8), knobs, window, Slo(5.0, 400.0), (512.0, 512.0),
            3.0, 3, alternative=EngineKnobs(128, 8),
        )  # fmt: skip
    finally:
        pool.stop()
    assert len(best) == len(base) == 3
    assert all(b["engine"] == knobs[0].to_dict() and "alternatives" not in b for b in best)
    lead = base[0]  # one worker: the first round is the first repeat
    caps = [a["capacity"] for a in lead["alternatives"]]
    assert [a["engine"] for a in lead["alternatives"]] == [knobs[1].to_dict(), EngineKnobs(128, 8).to_dict()]
    assert lead["capacity"] == max(caps)
    assert lead["engine"] == lead["alternatives"][caps.index(max(caps))]["engine"]
    won = lead["alternatives"][1 if caps[1] > caps[0] else 0]["engine"]
    assert all("alternatives" not in run and run["engine"] == won for run in base[1:])
    engines = [{"max_num_seqs": 1}, {"max_num_seqs": 8}]
    chosen = _baseline_engines(
        [{"alternatives": [{"capacity": 1.0}, {"capacity": c}]} for c in (2, 3, 0.5)], engines
    )
    assert chosen["baseline_engine"] == engines[1] and chosen["baseline_engines"][1]["median_capacity"] == 2


# ---- a real CPU study ----------------------------------------------------------------------------------
# 12 requests of the Azure sample: the tiny model's baseline brackets a capacity (33x, three searches within
# 9 %) below the window's saturation rate (1,426x); 6 of the Mooncake sample, arriving in bursts, never
# overloaded it, and a study refuses such a window.
AZURE = ROOT / "examples" / "traces" / "azure_conv_sample.csv"
SMALL = [
    "--model", "random:tiny", "--quality-model", "random:tiny", "--requests", "12", "--windows", "1",
    "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1", "--quality-prefill", "24",
    "--quality-decode", "4", "--kv-budget", "128KiB", "--seed", "0", "--objective", "capacity",
]  # fmt: skip
TRIALS = 3


def argv(storage: str, *extra: str) -> list[str]:
    return ["--gpu", "cpu", "--workload", str(AZURE), "--storage", storage, "--study", "c", *SMALL, *extra]


@pytest.fixture(scope="module")
def capacity_study(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, float]:
    tmp = tmp_path_factory.mktemp("capacity")
    storage = f"sqlite:///{tmp}/c.db"
    t0 = time.perf_counter()
    assert cli.main(argv(storage, "--trials", str(TRIALS), "--out", str(tmp / "preset.json"))) == 0
    return tmp, storage, time.perf_counter() - t0


def test_capacity_study_writes_a_preset(capacity_study: tuple[Path, str, float]) -> None:
    tmp, storage, seconds = capacity_study
    print(f"CPU capacity study of {TRIALS} trials: {seconds:.1f} s")
    study = optuna.load_study(study_name="c", storage=storage)
    attrs = study.user_attrs
    assert attrs["kvtune.objective"] == "capacity"
    slo, noise = attrs[ATTR_SLO], attrs[ATTR_NOISE]
    assert slo["ttft_ms"] > 0 and slo["tpot_ms"] > 0 and slo["source"]["ttft_ms"] == "derived"
    assert slo["percentile"] == 90.0 and attrs["kvtune.identity"]["clock"] == "gated"  # the defaults
    assert noise["repeats"] == 3 and len(noise["capacities"]) == 3 and noise["median"] > 0
    top = noise["max_rate"]  # the search window's saturation rate: no probe above it
    assert 0 < noise["median"] <= top and all(
        p["rate"] <= top for s in noise["searches"] for p in s["probes"]
    )
    assert attrs["kvtune.validation"]["max_rate"] > 0
    # on one worker the baseline's searches after the first start near its capacity; so do validation's
    searches = noise["searches"]
    assert noise["cold_search_s"] > 0 and noise["search_s"] > 0 and noise["unloaded_s"] > 0
    # the first at 1.6x the calibrated rate (the baseline at 75 % of its saturation throughput), near steps
    assert searches[0]["start"] == pytest.approx(COLD_START / attrs["kvtune.time_scale"])
    assert searches[0]["expand"] == NEAR_EXPAND
    if searches[0]["converged"]:
        assert all(s["start"] == searches[0]["capacity"] and s["expand"] == NEAR_EXPAND for s in searches[1:])
    validation = attrs["kvtune.validation"]
    best_value = study.trials[validation["trial"]].values[0]
    prior = validation["prior"]  # what the held-out requests are expected to carry against the search's
    assert prior > 0
    for side, start in (("best", best_value * prior), ("baseline", noise["median"] * prior)):
        runs = validation[side]
        assert all(r["search"]["expand"] == NEAR_EXPAND for r in runs)
        # the first round (one repeat per worker): the baseline at the study's knobs first, at its capacity
        # in the study x the prior, the others there x the shift its search found (the held-out requests
        # carry more or less than expected); the repeats after it near what the first round found
        first_round = [
            r
            for r in runs[:3]
            if r["search"]["start"] == pytest.approx(start * r["search"].get("shift", 1.0))
        ]
        assert "shift" in runs[0]["search"] or side == "baseline"
        shifts = {r["search"]["shift"] for side_runs in (validation["best"], validation["baseline"])
                  for r in side_runs if "shift" in r["search"]}  # fmt: skip
        assert len(shifts) == 1 and all(s > 0 for s in shifts)  # one shift for every config
        k = len(runs[0].get("alternatives", [None]))  # searches of this side in a repeat
        own = lambda r: [{"capacity": r["capacity"], "converged": r["search"]["converged"]}]
        entries = [e for r in first_round for e in r.get("alternatives", own(r))]
        ok = lambda e: e["converged"] and e["capacity"] > 0
        found = [[e["capacity"] for e in entries[i::k] if ok(e)] for i in range(k)]
        later = {start} | {float(np.median(f)) for f in found if f}
        assert first_round and runs[0] in first_round
        rest = [r for r in runs[:3] if r not in first_round]  # the rest of the first 3 repeats
        assert all(any(r["search"]["start"] == pytest.approx(c) for c in later) for r in rest), (
            [r["search"]["start"] for r in runs], later)  # fmt: skip
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(finished) == TRIALS
    assert study.metric_names == ["capacity"]  # the dashboard's label
    for t in finished:
        assert t.user_attrs[ATTR_PROBES]
        # each probe's host seconds, and the set-up of the trial's new cache in its first (the time budget's)
        probes = t.user_attrs[ATTR_PROBES]
        assert all(p["wall_s"] >= p["prime_s"] >= 0 for p in probes) and probes[0]["prime_s"] > 0
        assert all(p["prime_s"] >= p["compile_s"] >= 0 for p in probes)  # Triton's part of the set-up
        steps = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        assert steps == sorted(steps) and all(s > 0 for s in steps)  # the capacity so far: it only grows
        passed = any(p["passed"] for p in t.user_attrs[ATTR_PROBES])
        assert bool(steps) == passed  # a trial pruned before any probe passed has no value, not 0
        assert t.state == TrialState.COMPLETE or (t.values is not None) == passed
        # the start: the baseline's capacity x the trial's sequences against the baseline's to the 0.75, or
        # the capacity of a trial completed before this one started where higher
        first = t.user_attrs[ATTR_PROBES][0]["rate"]
        earlier = [d.values[0] for d in complete if d.datetime_complete <= t.datetime_start]
        seqs = t.user_attrs["kvtune.engine"]["max_num_seqs"] / noise["engine"]["max_num_seqs"]
        predicted = noise["median"] * seqs**CONCURRENCY_EXPONENT
        assert all(p["rate"] <= top for p in t.user_attrs[ATTR_PROBES])
        assert any(first == pytest.approx(c) for c in [predicted, *earlier]), (first, predicted, earlier)
        assert first >= predicted * (1 - 1e-9)
        assert set(t.user_attrs["kvtune.engine"]) >= {"max_num_batched_tokens", "max_num_seqs"}
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.values[0] == t.user_attrs["kvtune.metrics"]["capacity"]
    preset = json.loads((tmp / "preset.json").read_text())
    metrics = preset["metrics"]
    assert metrics["objective"] == "capacity" and metrics["repeats"] >= 3
    assert "capacity" in metrics["best"] and "capacity_tokens_per_s" in metrics["baseline"]
    if "inconclusive" in metrics:  # the tiny CPU study is noisy: its validation may mean nothing, and says so
        assert metrics["claim"].startswith("inconclusive: ") and preset["recommendation"]["use"] == "baseline"
    else:
        assert "the load of the unquantized cache within" in metrics["claim"]
    assert "(limits P90 TTFT ≤" in metrics["claim"] or " within P90 TTFT ≤" in metrics["claim"]
    assert metrics["limits"]["ttft_ms"] == slo["ttft_ms"]
    # the knobs were tuned on requests shrunk for the CPU (x0.01, capped at 96): recorded, not flags
    args = preset["vllm"]["args"]
    assert "--max-num-seqs" not in args and "--max-num-batched-tokens" not in args
    assert "--additional-config" in args
    assert preset["engine_tuned_on"] == {"length_scale": 0.01, "length_cap": 96,
                                         "kv_budget_bytes": attrs["kvtune.kv_budget_bytes"]}  # fmt: skip
    assert set(preset["engine"]) >= {"max_num_batched_tokens", "max_num_seqs"}


def test_capacity_study_resumes(capacity_study: tuple[Path, str, float]) -> None:
    _, storage, _ = capacity_study
    before = optuna.load_study(study_name="c", storage=storage)
    old = [(t.number, t.state, t.values) for t in before.trials]
    assert cli.main(argv(storage, "--trials", str(TRIALS + 1), "--resume", "--no-export")) == 0
    after = optuna.load_study(study_name="c", storage=storage)
    assert [(t.number, t.state, t.values) for t in after.trials][: len(old)] == old
    assert len(after.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == TRIALS + 1
    assert after.user_attrs[ATTR_NOISE] == before.user_attrs[ATTR_NOISE]  # measured once, when created


def test_a_study_with_draws_reports_the_estimated_half_pass_rate(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--probe-draws``: the baseline's searches, the trials and validation bisect to a 10 % bracket and
    then draw at the estimate; each capacity stored is that estimate over the search's probes."""
    storage = f"sqlite:///{tmp_path}/d.db"
    out = str(tmp_path / "p.json")
    assert cli.main(argv(storage, "--trials", "2", "--probe-draws", "3", "--out", out)) == 0
    captured = capsys.readouterr()
    printed = " ".join((captured.err + captured.out).split())
    assert "bisected to 10%, then 3 probes at the estimated rate a replay passes half the time" in printed
    study = optuna.load_study(study_name="c", storage=storage)
    noise = study.user_attrs[ATTR_NOISE]
    assert noise["draws"] == 3
    estimate = lambda probes: pass_rate_estimate([(p["rate"], p["passed"]) for p in probes], 0.05)
    searches = [*noise["searches"], *(r["search"] for side in ("best", "baseline")
                                      for r in study.user_attrs["kvtune.validation"][side])]  # fmt: skip
    drawn = [s for s in searches if s["bracketed"] is not None]
    assert drawn, "no search reached its draws"
    if any(s["bracketed"] is not None for s in noise["searches"]):  # the table's caption: each search's error
        assert "each ±" in printed
    for s in drawn:
        assert len(s["probes"]) == s["bracketed"] + 3 and s["draws"] == 3
        assert s["capacity"] == pytest.approx(min(estimate(s["probes"])[0], s["max_rate"] or math.inf))
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        probes, value = t.user_attrs[ATTR_PROBES], t.values[0]
        assert value == t.user_attrs["kvtune.metrics"]["capacity"]
        highest = max((p["rate"] for p in probes if p["passed"]), default=0.0)
        found = estimate(probes)
        assert value == pytest.approx(highest) or (found and value == pytest.approx(found[0])), probes


@pytest.mark.parametrize(
    ("extra", "message"),
    [(("--pareto",), "capacity already is the throughput"),
     (("--resume", "--slo-ttft-ms", "12345"), "--slo-ttft-ms"),
     (("--resume", "--slo-percentile", "99"), "--slo-percentile 90, not 99"),
     (("--resume", "--clock", "wall"), 'clock="gated", not "wall"')],
)  # fmt: skip
def test_capacity_bad_input_is_one_line(
    capacity_study: tuple[Path, str, float],
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    message: str,
) -> None:
    _, storage, _ = capacity_study
    assert cli.main(argv(storage, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: ") and message in err[-1], err


def test_a_window_that_never_overloads_the_baseline_is_refused(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Six Mooncake requests all at once still meet the limits: the baseline's searches end at the
    saturation rate, and the study stops there with one line naming the flags, before anything is stored.
    The TTFT limit is given, far above any replay's, so that queueing on a host slowed by other work cannot
    fail a probe (5x the unloaded replay's did, on a loaded 2-core CPU); the TPOT limit is derived, as the
    saturation rate needs the unloaded replay's decode step."""
    storage = f"sqlite:///{tmp_path}/c.db"
    out = tmp_path / "preset.json"  # were the study not refused, its preset would land here, not in presets/
    loose = ("--slo-ttft-ms", "1e6")
    small = [a if a != "12" else "6" for a in argv(storage, "--trials", "1", "--out", str(out), *loose)]
    small[small.index(str(AZURE))] = str(TRACE)
    assert cli.main(small) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: --requests 6: the unquantized baseline met the limits"), err
    assert "reached the saturation rate" in err[-1] and "--slo-ttft-ms" in err[-1]
    assert not optuna.get_all_study_summaries(storage)


# ---- the engine knobs in the space and the preset --------------------------------------------------------
def llama_space(knobs: bool = True) -> Any:
    """The H200's space for the Llama-3.1-8B shape at a 4 GiB budget (memory-bound), engine knobs searched
    unless ``knobs`` is False."""
    import torch

    from kvtune.cache_impl.layout import ModelKVShape
    from kvtune.search_spaces.cards import resolve_gpu
    from kvtune.search_spaces.space import SearchSpace, WorkloadStats

    shape = ModelKVShape(32, 8, 128, 32, torch.bfloat16)  # Llama-3.1-8B
    stats = WorkloadStats(4096, 2048, 99.0, 1, mean_length=1140)
    return SearchSpace.build(resolve_gpu("h200"), "m", shape, stats, False, 4 << 30, knobs=knobs)


def test_engine_knobs_fit_the_budget_and_grow_with_fewer_bits() -> None:
    space = llama_space()
    holds = [space.auto_seqs(HybridConfig("hybrid_v2", 32, 64, b)) for b in (0, 8, 4)]
    assert holds[0] < holds[1] < holds[2]  # memory-bound: INT8 and INT4 run bigger batches
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(50):
        trial = study.ask()
        config = space.suggest(trial)
        knobs = space.suggest_knobs(trial, config)
        assert knobs is not None
        engine = EngineKnobs.from_dict(knobs)  # vLLM's rule holds
        assert engine.max_num_batched_tokens in (2048, 4096, 8192, 16384)
        assert 1 <= engine.max_num_seqs <= min(1024, engine.max_num_batched_tokens)
        assert space.knob_params(knobs) == {k: trial.params[k] for k in space.knob_params()}
    assert space.knob_params() == {"max_num_batched_tokens": 8192, "max_num_seqs_factor": 1.0}
    assert "max_num_batched_tokens" in space.distributions() and "engine knobs" in space.describe()


def test_the_preset_exports_the_knobs_and_the_capacity_claim() -> None:
    from kvtune.studies import records
    from kvtune.tuner import export as ex

    config = HybridConfig("hybrid_v2", 32, 64, 8)
    engine = {"max_num_batched_tokens": 4096, "max_num_seqs": 96, "max_num_seqs_factor": 1.0}
    run = lambda cap: {"capacity": cap, "capacity_tokens_per_s": 100 * cap, "worker": "h/gpu0"}
    validation = {
        "trial": 3, "config": config.to_dict(), "baseline_config": config.unquantized().to_dict(),
        "window": {"start_fraction": 0.75, "end_fraction": 1.0, "requests": 50}, "repeats": 3,
        "best": [run(c) for c in (1.50, 1.52, 1.49)], "baseline": [run(c) for c in (1.0, 1.01, 0.99)],
        "date": "2026-12-01T00:00:00+00:00", "versions": records.versions(), "engine": engine,
        "baseline_engine": engine | {"max_num_seqs": 64},
        "slo": {"ttft_ms": 400.0, "tpot_ms": 60.0, "source": {}, "rule": "5 x"},
        "noise": {"threshold": 0.05, "spread": 0.02, "median": 1.0},
    }  # fmt: skip
    lengths = {"length_scale": 1.0, "length_cap": None}  # tuned on the workload's own lengths: flags
    provenance = {"card": "h200", "objective": "capacity", "sample": lengths}
    preset = ex.build_preset(config, validation, None, provenance)
    assert preset["recommendation"]["use"] == "best"
    claim = preset["metrics"]["claim"]
    assert claim.startswith("the best config carries 1.50x the load of the unquantized cache within P99 TTFT")
    assert "≤ 400 ms" in claim and "≤ 60 ms" in claim and "within the study's noise" not in claim
    args = preset["vllm"]["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert args[args.index("--max-num-seqs") + 1] == "96"
    assert json.loads(args[-1]) == {"kvtune": config.to_dict()}  # the hybrid fields: --additional-config
    assert preset["engine"] == engine and "sized for this config's cache" in preset["vllm"]["engine"]
    base = config.unquantized()  # the best config is the baseline itself: no gain is claimed
    own = validation | {
        "config": base.to_dict(),
        "best": [run(c) for c in (1.2, 0.9, 1.0)],
        "noise": {"threshold": 0.2, "spread": 0.2, "median": 1.0},
    }  # a 30 % spread: noise
    claim = ex.build_preset(base, own, None, {"card": "h200", "objective": "capacity"})["metrics"]["claim"]
    assert claim.startswith("the best config is the unquantized cache, its own baseline: no gain within P99")
    assert "95 % interval 0.71-1.49x, are the measurement's noise" in claim


def test_warnings_name_a_window_too_small_to_load_the_engine() -> None:
    """A baseline search or a trial that passed at the saturation rate makes its capacity a lower bound: the
    study says so and asks for more requests; a spread over the goal is said too; a sound record says
    nothing."""
    from kvtune.tuner.job import capacity_warnings

    search = lambda cap, hi, sat: {"capacity": cap, "hi": hi, "saturated": sat}
    noise = noise_record([4.0, 4.1, 4.0], [1.0] * 3, {}, max_rate=40.0,
                         searches=[search(4.0, 4.1, False)] * 3)  # fmt: skip
    assert capacity_warnings({ATTR_NOISE: noise}, [3.0, 5.5]) == ()
    said = capacity_warnings({ATTR_NOISE: noise}, [40.0, 40.0, 12.0])
    assert len(said) == 1 and said[0].startswith("2 trial(s) passed at the saturation rate (40x")
    capped = [search(40.0, None, True), search(4.0, 4.1, False), search(40.0, None, True)]
    loose = noise_record([40.0, 4.0, 40.0], [1.0] * 3, {}, max_rate=40.0, searches=capped)
    first, spread = capacity_warnings({ATTR_NOISE: loose})
    assert first.startswith("the baseline passed at the saturation rate in 2 of 3 capacity searches")
    assert "raise --requests" in first and "varied by 90 %" in spread


def test_sparse_trials_whose_tier_never_held_a_block_are_named() -> None:
    """Trials whose replays kept L2 empty (l2_peak_share 0) are named; a sparse trial that used the tier
    and a dense one (no share recorded) are not."""
    from kvtune.studies.names import ATTR_METRICS
    from kvtune.tuner.job import sparse_warnings

    trial = lambda n, metrics: SimpleNamespace(number=n, user_attrs={ATTR_METRICS: metrics})
    trials = [trial(0, {"l2_peak_share": 0.0}), trial(1, {"l2_peak_share": 0.4}), trial(2, {}),
              trial(3, {"l2_peak_share": 0.0}), SimpleNamespace(number=4, user_attrs={})]  # fmt: skip
    (said,) = sparse_warnings(trials)
    assert said.startswith("2 sparse trial(s) (0, 3) never moved a block to L2")
    assert sparse_warnings(trials[1:3]) == ()


def test_the_table_marks_a_capacity_at_the_saturation_rate() -> None:
    from rich.console import Console

    from kvtune.tuner.commands.tune import capacity_table

    study = optuna.create_study(direction="maximize")
    study.set_user_attr(ATTR_NOISE, noise_record([4.0, 4.1, 4.0], [1.0] * 3, {}, max_rate=40.0))
    for value in (40.0, 12.0):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"kvtune.config": {}}))
    console = Console(record=True, width=200)
    console.print(capacity_table(study))
    text = console.export_text()
    assert "≥ 40" in text and "≥ 12" not in text and "≥: at the saturation rate (40x)" in text
    study.set_user_attr(ATTR_NOISE, noise_record([4.0, 4.1, 4.0], [1.0] * 3, {}))  # stored before the cap
    console = Console(record=True, width=200)
    console.print(capacity_table(study))
    assert "≥" not in console.export_text()


def test_the_prior_and_the_probe_scale_come_from_the_windows_output_tokens() -> None:
    """The held-out requests' expected capacity against the search's: the search windows' output tokens per
    second of arrivals over theirs; a validation probe's cost: their output tokens over all the search
    windows', within [0.5, 2]."""
    from kvtune.engine.traces import Request
    from kvtune.tuner.validation import probe_scale, window_prior

    window = lambda n, gap_ms, out: tuple(Request(i, gap_ms * i, 100, out) for i in range(n))
    search = [window(11, 100.0, 30)]  # 330 output tokens over 1 s
    held = window(11, 200.0, 45)  # 495 over 2 s: 0.75x the search's output rate
    assert window_prior(search, held) == pytest.approx(330 / 247.5)
    assert window_prior(search * 2, held) == pytest.approx(330 / 247.5)  # the windows' mean rate
    assert window_prior(search, window(11, 0.0, 45)) == 1.0  # a burst spans no time: no prior
    assert probe_scale(search, held) == pytest.approx(1.5**0.5)
    assert probe_scale(search * 2, held) == pytest.approx(0.75**0.5)
    assert probe_scale(search, window(11, 1.0, 3000)) == 2.0
    assert probe_scale(search, window(11, 1.0, 1)) == 0.5


def test_validation_plans_the_baselines_default_knobs_only_where_the_best_trials_differ() -> None:
    """The budget plans a capacity validation's first repeat from the best trial so far: two searches (the
    best config, the baseline at its knobs), three where the space's default knobs resolve otherwise for the
    baseline (searched too); none known before a trial is."""
    from kvtune.tuner.job import baseline_engines, validation_sides

    space = llama_space()
    config = HybridConfig("hybrid_v2", 32, 64, 4)

    def trial(tokens: int, factor: float) -> optuna.trial.FrozenTrial:
        engine = space.knobs_for(config, tokens, factor)
        attrs = {"kvtune.config": config.to_dict(), "kvtune.engine": engine}
        return optuna.trial.create_trial(value=3.0, user_attrs=attrs)

    default = trial(8192, 1.0)
    own, other = baseline_engines(default, space)
    assert own == space.knobs_for(config.unquantized(), 8192, 1.0) and other is None
    assert validation_sides(default, space) == 2
    own, other = baseline_engines(trial(2048, 2.0), space)
    assert own["max_num_batched_tokens"] == 2048 and other == space.knobs_for(config.unquantized(), 8192, 1.0)
    assert validation_sides(trial(2048, 2.0), space) == 3
    assert validation_sides(None, space) is None
    assert validation_sides(trial(2048, 2.0), llama_space(knobs=False)) == 2


def test_the_held_out_shift_is_the_median_found_over_start_of_converged_searches() -> None:
    from kvtune.tuner.validation import window_shift

    def searched(start: float, truth: float) -> CapacitySearch:
        return search_to_end(near_search(CapacitySearch(1.0, 0.025, 12), start), truth)[0]

    runs = [searched(10.0, 7.5), searched(6.0, 4.2), searched(3.0, 3.3)]
    ratios = sorted(s.capacity / s.start for s in runs)
    assert all(s.converged for s in runs) and window_shift(runs) == pytest.approx(ratios[1])
    assert 0.69 < window_shift(runs[:2]) < 0.76  # two searches: the mean of their ratios
    unbracketed = CapacitySearch(5.0, 0.025, 1).record(5.0, True)  # out of probes: not converged
    assert window_shift([unbracketed]) == 1.0 and window_shift([]) == 1.0


def test_one_unloaded_replay_is_measured_on_a_gpus_gated_clock() -> None:
    from kvtune.tuner.worker import UNLOADED_REPEATS, unloaded_repeats

    assert unloaded_repeats("gated", "cuda") == 1
    assert unloaded_repeats("gated", "cpu") == unloaded_repeats("device", "cuda") == UNLOADED_REPEATS == 3
