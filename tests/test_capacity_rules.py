"""The capacity rule's noise routes: the attainment statistic, windows pooled into one verdict, and a rate
drawn again when its probe lands near the decision (pure, on synthetic request times; one pooled probe on
the tiny model)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from typing import Any

import pytest

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.metrics import RequestTiming
from kvtune.tuner.capacity import (
    DRAWS_BRACKET,
    CapacitySearch,
    ProbeStop,
    Slo,
    capacity_metrics,
    decision_margin,
    derive_slo,
    pass_rate_estimate,
    requests_pass,
    violations_to_fail,
    windows_margin,
)
from kvtune.tuner.protocol import QualitySettings, WorkerSpec

SLO = Slo(ttft_ms=100.0, tpot_ms=10.0, percentile=90.0)
ATTAIN = Slo(ttft_ms=100.0, tpot_ms=10.0, percentile=90.0, statistic="attainment")


def timing(ttft: float, tpot: float, tokens: int = 5) -> RequestTiming:
    return RequestTiming(0, 0.0, tuple(ttft + tpot * i for i in range(tokens)))


@pytest.mark.parametrize(("requests", "expected"), [(1, 1), (10, 2), (96, 10), (97, 10), (288, 29)])
def test_attainment_fails_once_more_than_the_tolerated_share_is_out(requests: int, expected: int) -> None:
    assert violations_to_fail(requests, 90.0, "attainment") == expected


@pytest.mark.parametrize(
    ("slow_ttft", "slow_tpot", "passes"),
    [(1, 0, True), (0, 1, True), (1, 1, False), (2, 0, False)],  # of 10 requests, 90 % must meet both
)
def test_attainment_counts_a_request_outside_either_limit(
    slow_ttft: int, slow_tpot: int, passes: bool
) -> None:
    times = [timing(500.0, 1.0)] * slow_ttft + [timing(1.0, 50.0)] * slow_tpot
    times += [timing(1.0, 1.0)] * (10 - len(times))
    assert requests_pass(times, ATTAIN, 10) is passes
    assert (decision_margin(times, ATTAIN) >= 0) is passes


def test_a_request_not_served_fails_the_verdict() -> None:
    times = [timing(1.0, 1.0)] * 9
    assert requests_pass(times, ATTAIN, 9) and not requests_pass(times, ATTAIN, 10)


def test_the_percentile_margin_is_the_tighter_limit() -> None:
    times = [timing(50.0, 8.0, tokens=3)] * 10
    assert decision_margin(times, SLO) == pytest.approx(min(1 - 50 / 100, 1 - 8 / 10))
    windows = [{"ttft_p90_ms": 50.0, "tpot_p90_ms": 8.0}, {"ttft_p90_ms": 120.0, "tpot_p90_ms": 1.0}]
    assert windows_margin(windows, SLO) == pytest.approx(-0.2)  # the worst window's


def test_attainment_stop_counts_both_limits_and_a_pooled_stop_spans_windows() -> None:
    stop = ProbeStop(ATTAIN, requests=20)  # 3 of 20 outside: fails
    assert stop.allowed == 3
    late = [_Seq(0.0, (), 4), _Seq(0.0, (5.0, 500.0), 2)]  # no first token after 200 ms; a slow TPOT
    assert not stop(200.0, late)
    assert (stop.ttft_violations, stop.tpot_violations) == (1, 1)
    stop.next_window()
    assert stop(200.0, [_Seq(0.0, (), 4)])  # the third, in the next window


def test_a_percentile_stop_counts_each_limit_apart() -> None:
    stop = ProbeStop(SLO, requests=10)
    assert stop.allowed == 2
    assert not stop(200.0, [_Seq(0.0, (), 4), _Seq(0.0, (5.0, 500.0), 2)])  # one of each: no limit broken


class _Seq:
    def __init__(self, arrival_ms: float, token_ms: tuple[float, ...], output_length: int) -> None:
        self.arrival_ms, self.token_ms = arrival_ms, list(token_ms)
        self.request = type("R", (), {"output_length": output_length})()


def test_slo_records_its_rule_and_an_old_record_decides_on_the_percentile() -> None:
    record = derive_slo(None, 100.0, 10.0, percentile=90.0, verdict=ATTAIN.rule() | {"pooled": True})
    slo = Slo.from_record(record)
    assert (slo.statistic, slo.pooled) == ("attainment", True)
    assert "≥ 90 % of requests" in slo.describe() and "windows pooled" in slo.describe()
    old = Slo.from_record({"ttft_ms": 1.0, "tpot_ms": 1.0})
    assert (old.statistic, old.pooled, old.percentile) == ("percentile", False, 99.0)
    with pytest.raises(ValueError, match="statistic must be one of \\['percentile', 'attainment'\\]"):
        Slo(1.0, 1.0, statistic="mean")


# ---- a rate drawn again near the decision ---------------------------------------------------------------
def run(search: CapacitySearch, draws: dict[float, list[tuple[bool, float]]]) -> CapacitySearch:
    """Drive ``search`` with scripted draws per rate (rates below 1.5 pass far from the limit, above fail
    far from it, unless scripted)."""
    while (rate := search.next_rate()) is not None:
        script = draws.get(round(rate, 6))
        passed, margin = script.pop(0) if script else (rate < 1.5, 0.5 if rate < 1.5 else -0.5)
        search = search.record(rate, passed, margin)
    return search


def test_a_draw_near_the_decision_is_drawn_again_and_the_majority_decides() -> None:
    near_fail_then_passes = {1.0: [(False, -0.01), (True, 0.02), (True, 0.03)]}
    search = run(CapacitySearch(1.0, 0.05, 12, confirm=3), near_fail_then_passes)
    assert [r for r, _ in search.probes[:3]] == [1.0, 1.0, 1.0]
    assert search.verdicts()[1.0] is True and search.lo is not None and search.lo >= 1.0
    assert search.to_dict()["confirmed"] == [1.0]


def test_agreeing_draws_stop_at_the_majority_and_far_draws_are_not_repeated() -> None:
    search = run(CapacitySearch(1.0, 0.05, 12, confirm=3), {1.0: [(True, 0.05), (True, 0.05)]})
    rates = [r for r, _ in search.probes]
    assert rates.count(1.0) == 2  # two of three agree: no third draw
    assert all(rates.count(r) == 1 for r in rates if r != 1.0)  # margins of 0.5: decided at once
    plain = run(CapacitySearch(1.0, 0.05, 12), {1.0: [(True, 0.05)]})
    assert [r for r, _ in plain.probes].count(1.0) == 1 and plain.capacity == search.capacity


@pytest.mark.parametrize("confirm", [0, 2])
def test_confirm_must_be_odd(confirm: int) -> None:
    with pytest.raises(ValueError, match=f"confirm` must be odd and >= 1, but got confirm={confirm}"):
        CapacitySearch(1.0, confirm=confirm)


# ---- draws at the estimated 50 % rate ---------------------------------------------------------------------
def _logistic(r50: float, scale: float, rng: random.Random) -> Callable[[float], bool]:
    """A replay whose verdict is a draw: it passes at rate r with probability 1 / (1 + (r / r50) ** (1/s))."""
    return lambda r: rng.random() < 1.0 / (1.0 + math.exp((math.log(r) - math.log(r50)) / scale))


def _search(search: CapacitySearch, replay: Callable[[float], bool]) -> CapacitySearch:
    while (rate := search.next_rate()) is not None:
        search = search.record(rate, replay(rate))
    return search


def test_the_pass_rate_estimate_is_the_midpoint_of_one_pass_and_one_failure() -> None:
    assert pass_rate_estimate([(2.0, True)], 0.05) is None
    assert pass_rate_estimate([(2.0, False), (4.0, False)], 0.05) is None
    found = pass_rate_estimate([(2.0, True), (4.0, False)], 0.05)
    assert found is not None and found[0] == pytest.approx(math.sqrt(8.0), rel=1e-9)
    # a failure below a pass (a draw) still gives one estimate, between them
    found = pass_rate_estimate([(2.0, False), (2.2, True), (2.4, False)], 0.05)
    assert found is not None and 2.0 < found[0] < 2.4


def test_the_pass_rate_estimate_finds_the_rate_that_passes_half_the_time() -> None:
    rng = random.Random(7)
    replay = _logistic(3.0, 0.05, rng)
    probes = [(r, replay(r)) for r in (2.4, 2.6, 2.8, 3.0, 3.2, 3.4, 3.6) for _ in range(60)]
    found = pass_rate_estimate(probes, 0.05)
    assert found is not None
    estimate, stderr = found
    assert abs(estimate / 3.0 - 1.0) < 3 * stderr and stderr < 0.01


def test_a_search_with_draws_bisects_to_a_ten_percent_bracket_then_draws_at_the_estimate() -> None:
    passes_below = lambda r: r < 3.0  # no noise: every draw lands on the edge
    search = _search(CapacitySearch(1.0, draws=6), passes_below)
    assert search.bracketed is not None and len(search.probes) == search.bracketed + 6
    bracket = search.probes[: search.bracketed]
    assert search.lo is not None and search.hi is not None and search.hi / search.lo - 1 <= DRAWS_BRACKET
    assert search.lo == max(r for r, ok in bracket if ok)
    assert search.hi == min(r for r, ok in bracket if not ok)
    estimate = pass_rate_estimate(search.probes, search.scale)
    assert estimate is not None and search.capacity == pytest.approx(estimate[0])
    assert 2.9 < search.capacity < 3.1
    record = search.to_dict()
    assert record["draws"] == 6 and record["bracketed"] == search.bracketed and record["stderr"] > 0
    # without draws the same replays give the highest passing rate, bisected to the granularity
    plain = _search(CapacitySearch(1.0), passes_below)
    assert plain.capacity == plain.lo and plain.hi / plain.lo - 1 <= plain.granularity


def test_a_search_with_draws_spends_none_when_nothing_passed_or_it_saturated() -> None:
    never = _search(CapacitySearch(1.0, max_probes=4, draws=8), lambda r: False)
    assert never.bracketed is None and never.capacity == 0.0 and len(never.probes) == 4
    always = _search(CapacitySearch(1.0, max_rate=5.0, draws=8), lambda r: True)
    assert always.saturated and always.bracketed is None and always.capacity == 5.0


def test_draws_make_repeated_searches_agree_where_single_draws_scatter() -> None:
    """Repeated searches of one noisy config (a pass probability 5 % wide in log rate, as measured on an
    H200): with 12 draws the capacities spread at most two thirds as much as the single-draw bisection's."""
    rng = random.Random(1)
    replay = _logistic(3.0, 0.05, rng)
    spread = lambda caps: statistics.pstdev(math.log(c) for c in caps)
    plain = [_search(CapacitySearch(1.0, 0.025, 12), replay).capacity for _ in range(150)]
    drawn = [_search(CapacitySearch(1.0, 0.025, 12, draws=12), replay).capacity for _ in range(150)]
    assert spread(drawn) < 0.67 * spread(plain)
    assert abs(statistics.median(drawn) / 3.0 - 1.0) < 0.02  # the estimate is of the 50 % rate


def test_draws_and_confirm_are_two_rules() -> None:
    with pytest.raises(ValueError, match="`confirm` and `draws` are two rules"):
        CapacitySearch(1.0, confirm=3, draws=4)
    with pytest.raises(ValueError, match="`draws >= 0` must hold, but got draws=-1"):
        CapacitySearch(1.0, draws=-1)


def test_capacity_metrics_take_the_highest_passing_probe_at_or_below_the_searchs_capacity() -> None:
    probe = lambda rate, ok, tokens: {"rate": rate, "passed": ok, "mean": {"tokens_per_s": tokens},
                                      "windows": []}  # fmt: skip
    probes = [probe(2.0, True, 200.0), probe(3.2, True, 320.0), probe(3.0, False, 0.0),
              probe(2.8, True, 280.0)]  # fmt: skip
    _, highest = capacity_metrics(probes)
    assert highest["capacity"] == 3.2 and highest["capacity_tokens_per_s"] == 320.0
    _, estimated = capacity_metrics(probes, 2.9)
    assert estimated["capacity"] == 2.9 and estimated["capacity_tokens_per_s"] == 280.0
    _, none = capacity_metrics(probes, 0.0)
    assert none["capacity"] == 0.0 and none["capacity_tokens_per_s"] == 0.0


# ---- one pooled probe on the tiny model --------------------------------------------------------------------
def test_a_pooled_probe_judges_the_union_of_its_windows() -> None:
    """Ten short requests, then one long prompt whose TTFT alone breaks the limit: judged window by window
    (90 % attainment) the probe fails at the second window; pooled, 10 of 11 requests (91 %) meet it."""
    from kvtune.engine.traces import Request
    from kvtune.tuner.worker import TrialWorker

    quality = QualitySettings(model="random:tiny", text_path="unused")
    spec = WorkerSpec(model="random:tiny", device="cpu", quality=quality, threads=1, budget_bytes=1 << 26)
    worker = TrialWorker(spec)
    calm = tuple(Request(i, 1000.0 * i, 8, 4) for i in range(10))
    long = (Request(99, 0.0, 4000, 4),)  # a prompt of 4,000 tokens: its TTFT is many short ones'
    config = HybridConfig("hybrid_v2", 16, 16, 0)
    short_ttft = 3 * worker.replay(config, calm, 1.0, 1)["ttft_p99_ms"]  # room for a slow host
    long_ttft = worker.replay(config, long, 1.0, 1)["ttft_p99_ms"]
    assert long_ttft > 2 * short_ttft, "the long prompt's TTFT must be far above the short ones'"
    limit = (short_ttft * long_ttft) ** 0.5
    apart = Slo(limit, 1e6, 90.0, statistic="attainment")
    alone = worker.probe_config(config, None, (calm, long), 1.0, apart, 1)
    pooled = worker.probe_config(
        config, None, (calm, long), 1.0, Slo(limit, 1e6, 90.0, "attainment", True), 1
    )
    assert not alone["passed"] and len(alone["windows"]) == 2
    assert pooled["passed"] and pooled["margin"] == pytest.approx(10 / 11 - 0.9)


def test_every_new_cache_is_primed_before_it_is_measured(monkeypatch) -> None:
    """A probe on a cache the engine does not keep (a new config, a window of other lengths) first serves
    its window at once, unmeasured; a probe that reuses the kept cache (another rate of the same window and
    config) does not."""
    from kvtune.engine.replay import Replayer
    from kvtune.engine.traces import Request
    from kvtune.tuner.worker import TrialWorker

    quality = QualitySettings(model="random:tiny", text_path="unused")
    spec = WorkerSpec(model="random:tiny", device="cpu", quality=quality, threads=1, budget_bytes=1 << 26)
    worker = TrialWorker(spec)
    scales: list[float] = []
    replay = Replayer.replay
    monkeypatch.setattr(
        Replayer,
        "replay",
        lambda self, c, r, t, *a, **k: (scales.append(t), replay(self, c, r, t, *a, **k))[1],
    )
    short = tuple(Request(i, 50.0 * i, 8, 4) for i in range(4))
    longer = tuple(Request(i, 50.0 * i, 8, 9) for i in range(4))  # other lengths: another cache
    slo = Slo(1e6, 1e6, 90.0)
    config, other = HybridConfig("hybrid_v2", 16, 16, 0), HybridConfig("hybrid_v2", 16, 16, 8)
    for probe in [(config, short, 1.0), (config, short, 2.0), (config, longer, 1.0), (other, longer, 1.0)]:
        worker.probe_config(probe[0], None, (probe[1],), probe[2], slo, 1)
    assert scales == [0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0]  # primed (0: at once) before 1st, 3rd and 4th


def test_a_prime_cuts_outputs_on_the_cache_the_probe_reuses(monkeypatch) -> None:
    """The priming replay serves every prompt whole with outputs cut to ``PRIME_OUTPUT_TOKENS``, on a cache
    built for the whole requests: the measured replay after it builds none."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.replay import Replayer
    from kvtune.engine.traces import Request
    from kvtune.tuner.worker import PRIME_OUTPUT_TOKENS, TrialWorker

    quality = QualitySettings(model="random:tiny", text_path="unused")
    spec = WorkerSpec(model="random:tiny", device="cpu", quality=quality, threads=1, budget_bytes=1 << 26)
    worker = TrialWorker(spec)
    replays: list[tuple[float, int]] = []
    fresh: list[bool] = []
    replay, cache_for = Replayer.replay, Engine._cache_for
    monkeypatch.setattr(
        Replayer,
        "replay",
        lambda self, c, r, t, *a, **k: (
            replays.append((t, max(x.output_length for x in r))),
            replay(self, c, r, t, *a, **k),
        )[1],
    )
    monkeypatch.setattr(
        Engine, "_cache_for", lambda self, s: (out := cache_for(self, s), fresh.append(out[2]))[0]
    )
    requests = tuple(Request(i, 50.0 * i, 8, PRIME_OUTPUT_TOKENS + 9) for i in range(4))
    worker.probe_config(HybridConfig("hybrid_v2", 16, 16, 0), None, (requests,), 1.0, Slo(1e6, 1e6, 90.0), 1)
    assert replays == [(0.0, PRIME_OUTPUT_TOKENS), (1.0, PRIME_OUTPUT_TOKENS + 9)]
    assert fresh == [True, False]  # the probe reuses the primed cache


# ---- decisions beyond the noise --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failed_at", "noise", "pruned"),
    [(5.0, 0.0, True), (5.0, 0.19, False), (4.2, 0.19, False), (4.05, 0.19, True), (3.0, 0.19, True)],
)
def test_a_trial_is_pruned_only_below_the_best_by_more_than_the_noise(
    failed_at: float, noise: float, pruned: bool
) -> None:
    from kvtune.tuner.capacity import should_prune

    search = CapacitySearch(5.0).record(failed_at, False)
    assert should_prune(search, 5.0, noise) is pruned


def test_after_failing_at_the_best_a_trial_probes_the_edge_of_the_noise() -> None:
    from kvtune.tuner.capacity import should_prune, warm_start

    started = warm_start(CapacitySearch(2.0), 5.0, noise=0.2)
    assert started.next_rate() == 5.0
    failed = started.record(5.0, False)
    assert not should_prune(failed, 5.0, 0.2) and failed.next_rate() == pytest.approx(4.0)
    assert should_prune(failed.record(4.0, False), 5.0, 0.2)  # clearly below: pruned after two probes
    tie = failed.record(4.0, True)  # within the noise: measured on, between 4 and 5
    assert not should_prune(tie, 5.0, 0.2) and 4.0 < (tie.next_rate() or 0) < 5.0
    assert warm_start(CapacitySearch(2.0), 5.0).step_down is None  # no noise: halving, as before


def _study_with(capacities: list[float]) -> tuple:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for i, c in enumerate(capacities):
        trial = study.ask()
        trial.set_user_attr("kvtune.config", {"hot_tokens": 16 * (i + 1)})
        trial.set_constraint("ran", 0.0)
        study.tell(trial, c)
    return study, study.trials[0]


def test_configs_within_the_noise_of_the_best_are_named_as_ties_in_the_claim() -> None:
    from kvtune.tuner.export import capacity_section
    from kvtune.tuner.validation import ties

    study, best = _study_with([6.10, 6.10, 4.8, 5.9])
    tied = ties(study, best, threshold=0.19)
    assert [t["trial"] for t in tied] == [1, 3]  # 4.8 is 21 % below 6.1: not a tie
    assert ties(study, best, threshold=0.025) == [tied[0]]
    validation = {"slo": {"ttft_ms": 1.0, "tpot_ms": 1.0}, "noise": {"threshold": 0.19}, "ties": tied}
    gain = {"ratio": 1.8, "interval95": [1.5, 2.1], "per_repeat": [1.8] * 3, "verdict": "better"}
    section = capacity_section("capacity", validation, gain)
    assert "ties with trial(s) 1, 3 within the study's noise (±19 %)" in section["claim"]
    assert section["ties"] == tied
    assert "ties" not in capacity_section("capacity", validation | {"ties": []}, gain)


@pytest.mark.parametrize(
    ("flags", "rule"),
    [
        ((), ("percentile", False, 1, 0)),
        (
            ("--probe-statistic", "attainment", "--probe-pool", "--probe-confirm", "3"),
            ("attainment", True, 3, 0),
        ),
        (("--probe-draws", "8"), ("percentile", False, 1, 8)),
    ],
)
def test_the_probe_flags_set_the_jobs_rule(flags: tuple[str, ...], rule: tuple[str, bool, int, int]) -> None:
    job = _cpu_job(flags)
    assert (job.probe.statistic, job.probe.pooled, job.probe.confirm, job.probe.draws) == rule


@pytest.mark.parametrize(("flags", "piecewise"), [((), False), (("--piecewise",), True)])
def test_the_piecewise_flag_reaches_the_workers_engine(flags: tuple[str, ...], piecewise: bool) -> None:
    assert _cpu_job(flags).spec.scheduler.piecewise is piecewise


def _cpu_job(flags: tuple[str, ...]) -> Any:
    """The job ``kvtune --gpu cpu`` builds from ``flags`` on the tiny model and the Azure sample."""
    import argparse
    from pathlib import Path

    from kvtune.search_spaces.cards import resolve_gpu
    from kvtune.tuner.commands import tune

    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    trace = str(root / "examples" / "traces" / "azure_conv_sample.csv")
    args = parser.parse_args(["--gpu", "cpu", "--workload", trace, "--model", "random:tiny", *flags])
    return tune.build_job(args, resolve_gpu("cpu", []), tune.CPU)
