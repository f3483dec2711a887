"""The study's time budget and validation's interval goal: the plan's split (pure), the repeats chosen
towards a ±15 % interval (a scripted measurement), and a real CPU capacity study under a budget that ends
within it and says in its preset what the budget cut (the Ray session of ``tests/conftest.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from kvtune.tuner.budget import EXPORT_S, FIRST_SEARCH, VALIDATION_MARGIN, BudgetPlan, budget_record
from kvtune.tuner.job import NEAR_PROBES, near_search_s, priced_searches, revisit_s
from kvtune.tuner.validation import RepeatPlan, half_width, repeat_to_interval, repeats_to_reach

ROOT = Path(__file__).resolve().parents[1]


# ---- the plan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("workers", "rounds"), [(1, 3), (2, 2), (3, 1), (4, 1)])
def test_the_plan_reserves_validations_rounds_and_one_trial_before_the_end(workers: int, rounds: int) -> None:
    plan = BudgetPlan(600.0, started=1000.0, search_s=10.0, sides=2, first=3, workers=workers)
    first = (FIRST_SEARCH - 1.0) * 10.0  # the best config's first search: more probes than a near one
    assert plan.validation_s() == pytest.approx(VALIDATION_MARGIN * (rounds * 2 * 10.0 + first))
    assert plan.search_deadline() == pytest.approx(1000.0 + 600.0 - EXPORT_S - plan.validation_s() - 12.5)
    assert "search about" in plan.describe(now=1100.0) and "100 s spent" in plan.describe(now=1100.0)
    # the baseline at two knobs in the first round only: three searches a repeat there, two after it
    knobs = BudgetPlan(600.0, 1000.0, 10.0, sides=3, first=3, workers=workers, later=2)
    assert knobs.validation_s() == pytest.approx(VALIDATION_MARGIN * ((3 + 2 * (rounds - 1)) * 10.0 + first))


def test_the_plan_counts_each_validation_searchs_set_up_and_the_trials_as_they_took() -> None:
    """Every validation search sets its config's cache up again: as the baseline's first probe did where
    that was measured, else as a trial's first probe; once trials finished, the trial the search phase keeps
    room for is as long as theirs (median), not one bare search."""
    plan = BudgetPlan(600.0, started=0.0, search_s=20.0, sides=3, first=3, workers=1, later=2)
    assert plan.switch_s == 0.0 and plan.trial_s is None
    first = (FIRST_SEARCH - 1.0) * 20.0
    bare = plan.validation_s()
    revised = plan.observed(switch_s=8.0, trial_s=40.0)
    assert bare == pytest.approx(VALIDATION_MARGIN * (7 * 20.0 + first))
    assert revised.validation_s() == pytest.approx(VALIDATION_MARGIN * (7 * 28.0 + first))
    assert revised.search_deadline() == pytest.approx(600.0 - EXPORT_S - revised.validation_s() - 1.25 * 40.0)
    again = dataclasses.replace(revised, revisit_s=3.0)  # the set-up of a config met before: cheaper
    assert again.validation_s() == pytest.approx(VALIDATION_MARGIN * (7 * 23.0 + first))
    assert plan.observed(8.0, None).search_deadline() == pytest.approx(
        600 - EXPORT_S - revised.validation_s() - 1.25 * 28.0
    )
    assert revised.observed(None, None) == revised  # nothing new measured: the plan as it was
    assert revised.first_repeats(now=600.0 - EXPORT_S - revised.validation_s()) == 3  # validation just fits


@pytest.mark.parametrize(
    ("search_s", "switch_s", "revisit", "sides", "best", "took", "before"),
    [
        (23.6, 12.0, 7.8, 2, 0.80, 255.0, 270.0),  # 30d
        (18.7, 3.3, 3.8, 2, 0.76, 178.0, 198.0),  # 32b
        (22.5, 3.5, 5.0, 2, 0.93, 196.0, 241.0),  # 32d
        (21.6, 7.1, 4.0, 2, 0.80, 135.0, 226.0),  # 33a
        (25.0, 12.1, 4.6, 2, 0.94, 225.0, 261.0),  # 33c
        (18.6, 6.9, 3.8, 3, 0.51, 196.0, 227.0),  # 35c
        (16.6, 6.9, 3.9, 3, 0.56, 174.0, 207.0),  # 36c
    ],
)
def test_validation_planned_from_both_sides_probes_covers_what_it_took(
    search_s: float, switch_s: float, revisit: float, sides: int, best: float, took: float, before: float
) -> None:
    """Seven H200 studies (runs 30d-36c: Llama-3.1-8B shape, 1 GiB, 96 held-out requests whose output tokens
    are 1.59x the search window's, a probe at their root, 1.26x; ``sides`` 3 where the best trial's engine
    knobs were not the defaults; figures from ``lab/scripts/budget_retro.py``): validation took ``took``
    seconds, which the plan of runs 32-36 (every search priced as the baseline's) put at ``before``. The plan
    now prices the best config's searches at ``best`` of the baseline's probe cost: it stays above what
    validation took but for 2 s once (35c), and frees 25-33 s where the best config was 4-bit."""
    plan = BudgetPlan(570.0, 0.0, search_s, sides=sides, first=3, workers=1, later=2, revisit_s=revisit,
                      scale=1.59**0.5, best_scale=best).observed(switch_s, None)  # fmt: skip
    assert plan.validation_s() > took - 3.0
    if best < 0.6:
        assert before - 35.0 < plan.validation_s() < before - 24.0


def test_the_best_configs_probes_are_priced_against_the_baselines() -> None:
    from types import SimpleNamespace

    from kvtune.tuner.job import best_probe_scale

    probe = lambda wall, prime=None: {"rate": 1.0, "wall_s": wall, **({"prime_s": prime} if prime else {})}
    noise = {"searches": [{"probes": [probe(10.0, 4.0), probe(6.0)]}, {"probes": [probe(6.0), probe(5.0)]}]}
    best = SimpleNamespace(user_attrs={"kvtune.probes": [probe(7.0, 4.0), probe(3.0), probe(2.0)]})
    assert best_probe_scale(best, noise) == pytest.approx(3.0 / 6.0)  # medians, set-ups left out
    assert best_probe_scale(None, noise) == 1.0 and best_probe_scale(best, {}) == 1.0
    slow = SimpleNamespace(user_attrs={"kvtune.probes": [probe(60.0)]})
    assert best_probe_scale(slow, noise) == 2.0  # bounded
    plan = BudgetPlan(600.0, 0.0, 10.0, sides=2, first=3, workers=1, later=2)
    half = dataclasses.replace(plan, best_scale=0.5)
    assert half.validation_s() == pytest.approx(
        VALIDATION_MARGIN * (3 * 10.0 + 3 * 5.0 + (FIRST_SEARCH - 1) * 5.0)
    )


def test_a_search_set_up_again_is_priced_as_the_baselines_first_probe_did() -> None:
    probe = lambda prime: {"rate": 1.0, "wall_s": 9.0, **({"prime_s": prime} if prime else {})}
    assert revisit_s({"searches": [{"probes": [probe(4.0), probe(0.0)]}, {"probes": [probe(0.0)]}]}) == 4.0
    assert revisit_s({}) is None and revisit_s({"searches": [{"probes": [probe(None)]}]}) is None


def test_a_near_search_is_priced_at_its_probes_median_not_one_long_searchs_wall() -> None:
    """The baseline's near searches of an H100 study: 3 probes, then 5 (its capacity 9 % below the first's);
    their mean wall, 35 s, would price every search of validation as the long one."""
    searches = [
        [{"wall_s": 8.2}, {"wall_s": 6.8}, {"wall_s": 7.8}],
        [{"wall_s": 7.9}, {"wall_s": 10.2}, {"wall_s": 10.8}, {"wall_s": 9.9}, {"wall_s": 8.6}],
    ]
    assert near_search_s(35.1, searches) == pytest.approx(NEAR_PROBES * 8.4)
    with_setup = [[{"wall_s": 14.0, "prime_s": 5.0}, {"wall_s": 9.0}, {"wall_s": 9.0}]]
    assert near_search_s(40.0, with_setup) == pytest.approx(NEAR_PROBES * 9.0)  # the set-up left out
    assert near_search_s(35.1, [[{"rate": 1.0}], []]) == 35.1  # no walls recorded: the measured wall


def test_with_mixed_graphs_a_search_is_priced_from_the_baselines_first_search() -> None:
    """Run 42a's baseline (an H100, mixed graphs): the near searches replayed the first's shapes from their
    graphs, so their probes cost about two thirds of what a new window's or config's do; op by op (42b) the
    two kinds cost the same, and the near searches price as before."""
    first = [[{"wall_s": 8.8, "prime_s": 3.7}, {"wall_s": 5.4}, {"wall_s": 4.5}]]
    near = [
        [{"wall_s": 4.3}, {"wall_s": 3.1}, {"wall_s": 3.3}],
        [{"wall_s": 4.0}, {"wall_s": 3.1}, {"wall_s": 3.1}],
    ]
    mixed, op = (priced_searches(first, near, mixed_graphs=m) for m in (True, False))
    assert near_search_s(10.4, mixed) == pytest.approx(NEAR_PROBES * 5.1)  # the set-up left out
    assert near_search_s(10.4, op) == pytest.approx(NEAR_PROBES * 3.2)
    assert priced_searches([], near, mixed_graphs=True) is near  # all searches at once: none came first


def test_validation_plans_fewer_first_repeats_only_when_the_plans_do_not_fit() -> None:
    """Validation starting late (the budget spent before the search) plans the most first repeats of those
    asked that fit before the end, down to three (the fewest whose interval a user can act on), and says so
    in the record."""
    plan = BudgetPlan(
        600.0, started=0.0, search_s=10.0, sides=2, first=5, workers=1
    )  # 126.5 s for 5, 80.5: 3
    assert plan.validation_s(5) == pytest.approx(126.5, abs=0.01)
    assert plan.validation_s(3) == pytest.approx(80.5, abs=0.01)
    assert plan.first_repeats(now=100.0) == 5 and plan.first_repeats(now=460.0) == 5
    assert plan.first_repeats(now=480.0) == 4  # 5 would end at 606.5 s, past the 595 s of the plan's end
    assert plan.first_repeats(now=510.0) == 3
    assert plan.first_repeats(now=580.0) == 3  # none fits: the fewest, past the end
    assert BudgetPlan(600.0, 0.0, 10.0, first=3).first_repeats(now=590.0) == 3
    assert BudgetPlan(600.0, 0.0, 10.0, first=5, workers=5).first_repeats(now=560.0) == 5  # one round: 34.5 s
    interval = {"reached": False, "repeats": 3, "first": 3, "why": "within"}
    record = budget_record(BudgetPlan(600.0, 0.0, 10.0, first=5), {}, 1, 20, interval)
    assert "validation: 3 first repeats instead of 5, the time left" in record["cut"]


def test_a_fixed_rate_plan_keeps_a_share_for_validation_and_a_budget_must_be_positive() -> None:
    assert BudgetPlan(100.0, 0.0, None).validation_s() == pytest.approx(20.0)
    with pytest.raises(ValueError, match="`budget_s > 0` must hold, but got budget_s=0"):
        BudgetPlan(0.0, 0.0, None)


def test_the_record_names_what_the_budget_cut() -> None:
    plan = BudgetPlan(60.0, 0.0, 5.0)
    interval = {"reached": False, "repeats": 3, "why": "the time budget: ±40 % after 3 repeats"}
    record = budget_record(plan, {"baseline_s": 20.0}, 4, 20, interval)
    assert record["cut"] == ["search: 4 of 20 trials finished when the time budget ended it",
                             "validation: 3 repeats, the time budget: ±40 % after 3 repeats"]  # fmt: skip
    assert budget_record(plan, {}, 20, 20, {"reached": True, "why": "within"})["cut"] == []


# ---- repeats towards the interval goal ---------------------------------------------------------------------
def test_half_width_and_the_repeats_an_interval_needs() -> None:
    assert half_width([2.0, 2.0, 2.0]) == pytest.approx(0.0)
    ratios = [1.8, 2.0, 2.3]
    assert half_width(ratios) is not None and half_width(ratios) > 0.15  # type: ignore[operator]
    need = repeats_to_reach(ratios, 0.15, 12)
    assert need is not None and 3 < need <= 12
    assert repeats_to_reach([1.0, 3.0, 9.0], 0.15, 12) is None  # too spread for 12


def scripted(ratios: list[float]) -> Any:
    """A measurement whose repeat ``i`` has the gain ``ratios[i]`` (best ``ratio``, baseline 1)."""

    def measure(k: int, first: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        got = ratios[first : first + k]
        return [{"capacity": r} for r in got], [{"capacity": 1.0} for _ in got]

    return measure


def ratios_of(best: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[float]:
    return [b["capacity"] / u["capacity"] for b, u in zip(best, base)]


def test_validation_repeats_until_the_interval_is_within_the_goal() -> None:
    ratios = [1.7, 2.0, 2.3, 1.9, 2.1, 2.0, 1.95, 2.05, 2.0, 2.0, 2.0, 2.0]
    best, _, record = repeat_to_interval(scripted(ratios), ratios_of, RepeatPlan(3, workers=2))
    assert len(best) > 3 and record["reached"] and record["half_width"] <= 0.15
    assert record["why"].startswith("the interval is within ±15 %")
    tight, _, same = repeat_to_interval(scripted([2.0] * 12), ratios_of, RepeatPlan(3))
    assert len(tight) == 3 and same["reached"]  # already within: no more repeats


@pytest.mark.parametrize(
    ("deadline", "why"), [(-1.0, "the time budget"), (math.inf, "the repeats spread too much")]
)
def test_validation_says_why_it_could_not_reach_the_goal(deadline: float, why: str) -> None:
    ratios = [1.0, 3.0, 9.0] * 4 if why.startswith("the repeats") else [1.7, 2.0, 2.4] * 4
    plan = RepeatPlan(3, deadline=time.monotonic() + deadline)
    best, _, record = repeat_to_interval(scripted(ratios), ratios_of, plan)
    assert len(best) == 3 and not record["reached"] and record["why"].startswith(why)


# ---- a real CPU study under a budget ---------------------------------------------------------------------
def test_a_budgeted_study_ends_within_its_budget_and_says_what_was_cut(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """The tiny CPU study asked for 500 trials in 40 s: the budget covers the workers' start, the search,
    validation and the export; the preset says the search was cut and how validation's interval ended."""
    import dataclasses

    from kvtune.tests.tuner_fakes import tiny_job
    from kvtune.tuner.job import tune

    budget_s, preset = 40.0, tmp_path / "preset.json"
    job = dataclasses.replace(
        tiny_job(tmp_path, trials=500), time_budget_s=budget_s, write_preset=True, out=str(preset)
    )
    said: list[str] = []
    t0 = time.monotonic()
    report = tune(job, events=lambda e: said.append(e.message) if e.kind == "phase" else None)
    elapsed = time.monotonic() - t0
    print(f"budgeted CPU study: {elapsed:.1f} s of {budget_s:g}, {report.finished} trials")
    assert elapsed <= budget_s * 1.15  # the whole run, validation and export included
    assert report.budget_spent and 1 <= report.finished < 500
    metrics = json.loads(preset.read_text())["metrics"]
    budget = metrics["budget"]
    assert budget["budget_s"] == budget_s and set(budget["phases_s"]) >= {"baseline_s", "search_s"}
    # where the phase before the search went, on the console (a capacity study adds the unloaded replay and
    # the baseline's searches)
    parts = next(line for line in said if line.startswith("baseline phase: "))
    assert all(f"{part} " in parts for part in ("workers", "calibration")), parts
    assert f"search: {report.finished} of 500 trials finished when the time budget ended it" in budget["cut"]
    assert metrics["interval"]["goal"] == 0.15 and metrics["repeats"] == metrics["interval"]["repeats"] >= 3


def test_the_costs_the_trials_measured_for_the_plan() -> None:
    """Each trial's set-up is its longest ``prime_s`` (its first probe's; the others only find the cache
    there); a trial's wall is the median of those that ran; one that reused another's result counts in
    neither."""
    import datetime

    import optuna
    from optuna.trial import FrozenTrial, TrialState

    from kvtune.studies.names import ATTR_PROBES, ATTR_REUSED
    from kvtune.tuner.job import observed_costs

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    assert observed_costs(study) == (None, None)
    t0 = datetime.datetime(2026, 1, 1)
    cases = [([12.0, 0.001, 0.001], 70.0, False), ([8.0, 0.002], 20.0, False), ([0.5], 1.0, True)]
    for i, (primes, wall, reused) in enumerate(cases):
        probes = [
            {"rate": 1.0 + j, "passed": True, "prime_s": p, "wall_s": p + 5} for j, p in enumerate(primes)
        ]
        attrs = {ATTR_PROBES: probes} | ({ATTR_REUSED: 0} if reused else {})
        pruned = i == 1
        study.add_trial(
            FrozenTrial(
                number=i,
                trial_id=i,
                state=TrialState.PRUNED if pruned else TrialState.COMPLETE,
                value=None if pruned else 2.0,
                datetime_start=t0,
                datetime_complete=t0 + datetime.timedelta(seconds=wall),
                params={},
                distributions={},
                user_attrs=attrs,
                system_attrs={},
                intermediate_values={},
            )
        )
    switch, trial_s = observed_costs(study)
    assert switch == pytest.approx(10.0)  # the median of 12 and 8; the reused trial's 0.5 left out
    assert trial_s == pytest.approx(45.0)  # the median of 70 and 20 s; the reused trial's 1 s left out
