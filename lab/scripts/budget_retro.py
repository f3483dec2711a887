"""What the time budget's plan would have reserved for validation in finished studies, against what it took.

For each study database: the plan as at validation's start (the baseline's search times and first set-up from
``kvtune.noise``, the trials' set-ups and walls, the held-out probe scale from the study's own sample, the
validated trial's probes against the baseline's; with mixed graphs, the baseline's first search's probes),
priced by today's :class:`~kvtune.tuner.budget.BudgetPlan`, by the plan of runs 32-36 (every search priced as
the baseline's, the best config's first one 5/3 as many probes) and by the plan before it (the first search
priced as the baseline's cold one, each search's set-up as a trial's, 1.25x reserved), beside validation's
seconds as the study recorded them (more than its first repeats where later rounds fitted). CPU only; from
the repository root:

    python lab/scripts/budget_retro.py lab/logs/run33/33a/s/h200_capacity_llama31_8b.db [more.db ...]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import optuna

from kvtune.tuner.budget import BudgetPlan
from kvtune.tuner.job import best_probe_scale, near_search_s, observed_costs, priced_searches, revisit_s
from kvtune.tuner.validation import probe_scale
from kvtune.tuner.workload import WorkloadSample, load_trace

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 131072  # Llama-3.1-8B's: the 0.25x lengths of these studies clip nothing


def old_plan(plan: BudgetPlan, cold_s: float) -> float:
    """The plan before: the first search as the baseline's cold one, every set-up a trial's, 1.25x."""
    rounds = math.ceil(plan.first / plan.workers)
    later = plan.sides if plan.later is None else plan.later
    near = (plan.search_s or 0.0) * plan.scale + plan.switch_s
    cold = cold_s * plan.scale + plan.switch_s
    return 1.25 * (cold + (plan.sides - 1 + (rounds - 1) * later) * near)


def runs_32_36_plan(plan: BudgetPlan) -> float:
    """The plan of runs 32-36: every search as the baseline's near one, the best's first one 5/3 as many."""
    rounds = math.ceil(plan.first / plan.workers)
    later = plan.sides if plan.later is None else plan.later
    probes = (plan.search_s or 0.0) * plan.scale
    near = probes + (plan.switch_s if plan.revisit_s is None else plan.revisit_s)
    return 1.1 * ((plan.sides + (rounds - 1) * later) * near + (5 / 3 - 1.0) * probes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("db", nargs="+")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(
        "study | search s (measured → priced) | cold s | set-up s (trial / again) | scale | best | sides | "
        "planned: before | runs 32-36 | now | took"
    )
    for db in args.db:
        storage = f"sqlite:///{db}"
        study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
        noise, validation = study.user_attrs["kvtune.noise"], study.user_attrs.get("kvtune.validation")
        if not validation or "budget" not in validation:
            print(f"{db}: no validation under a time budget")
            continue
        sample = {k: v for k, v in study.user_attrs["kvtune.sample"].items() if k != "search_fraction"}
        sample["path"] = str(ROOT / sample["path"])
        s = WorkloadSample(**sample)
        trace = load_trace(s.path)
        scale = probe_scale(s.search_windows(trace, CONTEXT), s.validation_requests(trace, CONTEXT))
        sides = 3 if len(validation.get("baseline_engines") or ()) > 1 else 2
        switch, trial = observed_costs(study)
        searches = [se["probes"] for se in noise.get("searches", [])]
        # mixed graphs: their validation replays served forwards from graphs (the option is not stored)
        mixed = any((r or {}).get("mixed_graph_forwards") for r in validation.get("best") or [])
        priced = priced_searches(searches[:1], searches[1:], mixed)  # the first search, or the near ones
        search_s = near_search_s(noise.get("near_searches_s", noise["search_s"]), priced)
        plan = BudgetPlan(
            validation["budget"]["budget_s"], 0.0, search_s, sides, validation["repeats"], 1, 2,
            revisit_s=revisit_s(noise), scale=scale,
            best_scale=best_probe_scale(study.trials[validation["trial"]], noise),
        ).observed(switch, trial)  # fmt: skip
        took = validation["budget"]["phases_s"]["validation_s"]
        cold = noise["cold_search_s"]
        tag = " (mixed graphs)" if mixed else ""
        print(
            f"{db}{tag} | {noise['search_s']:.1f} → {search_s:.1f} | {cold:.1f} | {plan.switch_s:.1f} / "
            f"{plan.revisit_s or 0.0:.1f} | {scale:.2f} | {plan.best_scale:.2f} | {sides} | "
            f"{old_plan(plan, cold):.0f} | {runs_32_36_plan(plan):.0f} | {plan.validation_s():.0f} | "
            f"{took:.0f}"
        )


if __name__ == "__main__":
    main()
