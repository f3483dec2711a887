"""Validation before export: the best config and its unquantized baseline, re-measured on held-out requests.

The best of many noisy trials overstates itself (docs/DESIGN.md §3). Each repeat replays both configs back to
back on the same worker (which goes first alternates), on requests of the trace the search never saw;
repeats are spread over the workers. :func:`kvtune.tuner.export.paired_gain` compares the two runs of each
repeat (baseline ÷ best for latencies, best ÷ baseline for throughput, so > 1 is better); the preset reports
each side's medians with their range, and that gain (:mod:`kvtune.tuner.export`).
"""

from __future__ import annotations

from typing import Any

import optuna
import ray
from optuna.trial import FrozenTrial, TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.traces import Request
from kvtune.studies.names import MIN_REPEATS
from kvtune.studies.records import finite
from kvtune.studies.study import OBJECTIVES, StudyOptions
from kvtune.tuner.pool import WorkerPool


def feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(c <= 0 for c in trial.constraints.values())


def best_trial(study: optuna.Study, options: StudyOptions) -> FrozenTrial | None:
    """The feasible completed trial with the best primary objective (Pareto mode: among the Pareto front)."""
    pool = [t for t in (study.best_trials if options.pareto else study.trials) if feasible(t)]
    if not pool:
        return None
    sign = 1.0 if OBJECTIVES[options.objective][1] == "minimize" else -1.0
    return min(pool, key=lambda t: (sign * t.values[0], t.number))


def validate(
    pool: WorkerPool,
    best: HybridConfig,
    requests: tuple[Request, ...],
    time_scale: float,
    repeats: int = MIN_REPEATS,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Replay ``best`` and ``best.unquantized()`` ``repeats`` times each: the metrics of every run of each,
    with the ``worker`` that ran it."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"`repeats >= {MIN_REPEATS}` must hold, but got repeats={repeats}")
    baseline = best.unquantized()
    refs = []
    for r in range(repeats):
        actor = pool.actors[r % len(pool.actors)]
        first, second = (best, baseline) if r % 2 == 0 else (baseline, best)
        one, two = (actor.replay.remote(c, requests, time_scale, WARMUP_REQUESTS) for c in (first, second))
        refs.append((one, two) if r % 2 == 0 else (two, one))
    runs = [(ray.get(b), ray.get(base)) for b, base in refs]
    where = [_worker_name(pool.infos[r % len(pool.infos)]) for r in range(repeats)]
    return (
        [{**finite(b), "worker": w} for (b, _), w in zip(runs, where)],
        [{**finite(base), "worker": w} for (_, base), w in zip(runs, where)],
    )


def _worker_name(info: Any) -> str:
    """``host/gpu0`` (or ``host/cpu``): where a validation repeat ran."""
    gpus = ",".join(g for g in info.gpu_ids if g)
    return f"{info.hostname}/{'gpu' + gpus if gpus else 'cpu'}"
