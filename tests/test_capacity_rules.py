"""The capacity rule's noise routes: the attainment statistic, windows pooled into one verdict, and a rate
drawn again when its probe lands near the decision (pure, on synthetic request times; one pooled probe on
the tiny model)."""

from __future__ import annotations

import pytest

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.metrics import RequestTiming
from kvtune.tuner.capacity import (
    CapacitySearch,
    ProbeStop,
    Slo,
    decision_margin,
    derive_slo,
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
        ((), ("percentile", False, 1)),
        (
            ("--probe-statistic", "attainment", "--probe-pool", "--probe-confirm", "3"),
            ("attainment", True, 3),
        ),
    ],
)
def test_the_probe_flags_set_the_jobs_rule(flags: tuple[str, ...], rule: tuple[str, bool, int]) -> None:
    import argparse
    from pathlib import Path

    from kvtune.search_spaces.cards import resolve_gpu
    from kvtune.tuner.commands import tune

    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    trace = str(root / "examples" / "traces" / "azure_conv_sample.csv")
    args = parser.parse_args(["--gpu", "cpu", "--workload", trace, "--model", "random:tiny", *flags])
    job = tune.build_job(args, resolve_gpu("cpu", []), tune.CPU)
    assert (job.probe.statistic, job.probe.pooled, job.probe.confirm) == rule
