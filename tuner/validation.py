"""Validation before export: the best config and its unquantized baseline, re-measured on held-out requests.

The best of many noisy trials overstates itself (docs/DESIGN.md §3). Each repeat replays both configs back to
back on the same worker (which goes first alternates), on requests of the trace the search never saw;
repeats are spread over the workers. :func:`kvtune.tuner.export.paired_gain` compares the two runs of each
repeat (baseline ÷ best for latencies, best ÷ baseline for throughput, so > 1 is better); the preset reports
each side's medians with their range, and that gain (:mod:`kvtune.tuner.export`).

For the capacity objective each side of a repeat is a capacity search on the held-out window
(:func:`validate_capacity`); the searches of a repeat share one worker and run one after another (a worker
keeps one config's cache and CUDA graphs, so probes that alternated configs would rebuild them each time).
:func:`run_searches` drives any set of capacity searches over the workers (also the baseline's, when a study
starts).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
import ray
from optuna.trial import FrozenTrial, TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.traces import Request
from kvtune.studies.names import (
    ATTR_CONFIG,
    ATTR_ERROR,
    CAPACITY_PROBES_COLD,
    INTERVAL_GOAL,
    MAX_REPEATS,
    MIN_REPEATS,
)
from kvtune.studies.records import finite
from kvtune.studies.study import OBJECTIVES, StudyOptions
from kvtune.tuner import export
from kvtune.tuner.capacity import (
    CapacitySearch,
    Slo,
    capacity_metrics,
    near_search,
    probe_summary,
    within_noise,
)
from kvtune.tuner.pool import WorkerPool
from kvtune.tuner.protocol import EngineKnobs

# ---- repeats to an interval a user can act on ---------------------------------------------------------
Measure = Callable[[int, int], tuple[list[dict[str, Any]], list[dict[str, Any]]]]  # (repeats, first index)


def half_width(ratios: Sequence[float]) -> float | None:
    """The relative half-width of the gain's 95 % interval (``sqrt(hi / lo) - 1``: ±15 % is 0.15; None
    without an interval)."""
    ci = export.interval95(ratios)
    return None if ci is None else math.sqrt(ci[1] / ci[0]) - 1.0


def repeats_to_reach(ratios: Sequence[float], goal: float, most: int) -> int | None:
    """The fewest repeats (at least those done) whose interval, at the spread of ``ratios`` so far, is
    within ±``goal``; None when more than ``most`` would be needed (or the ratios have no interval)."""
    n = len(ratios)
    if n < 2 or min(ratios) <= 0:
        return None
    spread = statistics.stdev(math.log(r) for r in ratios)
    target = math.log1p(goal)
    for m in range(n, most + 1):
        t = export.T975[m - 2] if m - 1 <= len(export.T975) else export.T975[-1]
        if t * spread / math.sqrt(m) <= target:
            return m
    return None


@dataclass(frozen=True)
class RepeatPlan:
    """How validation repeats: ``first`` repeats, then more up to ``most`` towards an interval within
    ±``goal``, ``workers`` at a time, each round only when it fits before ``deadline``."""

    first: int = MIN_REPEATS
    goal: float = INTERVAL_GOAL
    most: int = MAX_REPEATS
    workers: int = 1
    deadline: float | None = None


def repeat_to_interval(
    measure: Measure,
    ratios_of: Callable[[list[dict[str, Any]], list[dict[str, Any]]], list[float] | None],
    plan: RepeatPlan,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Validation's repeats: ``plan.first`` of them, then as many more as the gain's interval needs to be
    within ±``plan.goal`` (:func:`repeats_to_reach`, re-estimated after each round), while each round fits
    before ``plan.deadline`` (a monotonic time; None: no limit) and ``plan.most`` is not passed. Returns
    both sides' runs and the ``interval`` record: the goal, the half-width reached, the repeats, and why
    it stopped."""
    t0 = time.monotonic()
    best, base = measure(plan.first, 0)
    round_s = (time.monotonic() - t0) / max(1, math.ceil(plan.first / plan.workers))
    while True:
        ratios = ratios_of(best, base)
        width = half_width(ratios) if ratios else None
        need = repeats_to_reach(ratios, plan.goal, plan.most) if ratios else None
        why = _stop_reason(width, need, len(best), round_s, plan)
        if why is not None:
            break
        assert need is not None, "a round is planned only towards a reachable goal"
        fit = _left(plan) // round_s if round_s > 0 else math.inf  # whole rounds that fit
        extra = need - len(best) if not math.isfinite(fit) else min(need - len(best), plan.workers * int(fit))
        more_best, more_base = measure(extra, len(best))
        best, base = best + more_best, base + more_base
    record = {"goal": plan.goal, "half_width": width, "repeats": len(best), "first": plan.first,
              "reached": width is not None and width <= plan.goal, "why": why}  # fmt: skip
    return best, base, record


def _left(plan: RepeatPlan) -> float:
    return math.inf if plan.deadline is None else plan.deadline - time.monotonic()


def _stop_reason(
    width: float | None, need: int | None, done: int, round_s: float, plan: RepeatPlan
) -> str | None:
    """Why validation repeats no more (None: it repeats again)."""
    if width is None:
        return "no interval: a side scored 0 in a repeat"
    if width <= plan.goal:
        return f"the interval is within ±{100 * plan.goal:.0f} % after {done} repeats"
    if need is None:
        return (
            f"the repeats spread too much: ±{100 * plan.goal:.0f} % would take more than {plan.most} repeats "
            f"(±{100 * width:.0f} % after {done})"
        )
    if _left(plan) < round_s:
        return (
            f"the time budget: ±{100 * width:.0f} % after {done} repeats; ±{100 * plan.goal:.0f} % needs "
            f"about {need}, {round_s:.0f} s a round of {plan.workers}"
        )
    return None


def feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(c <= 0 for c in trial.constraints.values())


def best_trial(study: optuna.Study, options: StudyOptions) -> FrozenTrial | None:
    """The feasible completed trial with the best primary objective (Pareto mode: among the Pareto front)."""
    pool = [t for t in (study.best_trials if options.pareto else study.trials) if feasible(t)]
    if not pool:
        return None
    sign = 1.0 if OBJECTIVES[options.objective][1] == "minimize" else -1.0
    return min(pool, key=lambda t: (sign * t.values[0], t.number))


def ties(study: optuna.Study, best: FrozenTrial, threshold: float) -> list[dict[str, Any]]:
    """The feasible complete trials (other configs than ``best``'s) whose capacity is within the study's
    noise ``threshold`` of the best's: the search cannot rank them, so a preset names them as ties."""
    top, seen, out = best.values[0], {json.dumps(best.user_attrs.get(ATTR_CONFIG), sort_keys=True)}, []
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    for t in sorted(trials, key=lambda t: -t.values[0]):
        key = json.dumps(t.user_attrs.get(ATTR_CONFIG), sort_keys=True)
        if t.number == best.number or key in seen or not feasible(t) or ATTR_ERROR in t.user_attrs:
            continue
        if within_noise(t.values[0], top, threshold):
            seen.add(key)
            out.append({"trial": t.number, "capacity": t.values[0], "config": t.user_attrs.get(ATTR_CONFIG)})
    return out


def validate(
    pool: WorkerPool,
    best: HybridConfig,
    requests: tuple[Request, ...],
    time_scale: float,
    repeats: int = MIN_REPEATS,
    knobs: tuple[EngineKnobs | None, EngineKnobs | None] = (None, None),
    first: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Replay ``best`` and ``best.unquantized()`` ``repeats`` times each (with ``knobs`` = (best's, the
    baseline's) engine knobs): the metrics of every run of each, with the ``worker`` that ran it.
    ``first``: the index of the first repeat (more repeats after ``first`` done: any number of them)."""
    if first == 0 and repeats < MIN_REPEATS:
        raise ValueError(f"`repeats >= {MIN_REPEATS}` must hold, but got repeats={repeats}")
    baseline = best.unquantized()
    refs = []
    for r in range(first, first + repeats):
        actor = pool.actors[r % len(pool.actors)]
        sides = [(best, knobs[0]), (baseline, knobs[1])]
        lead, follow = sides if r % 2 == 0 else sides[::-1]
        one, two = (
            actor.replay.remote(c, requests, time_scale, WARMUP_REQUESTS, k) for c, k in (lead, follow)
        )
        refs.append((one, two) if r % 2 == 0 else (two, one))
    runs = [(ray.get(b), ray.get(base)) for b, base in refs]
    where = [_worker_name(pool.infos[r % len(pool.infos)]) for r in range(first, first + repeats)]
    return (
        [{**finite(b), "worker": w} for (b, _), w in zip(runs, where)],
        [{**finite(base), "worker": w} for (_, base), w in zip(runs, where)],
    )


def _worker_name(info: Any) -> str:
    """``host/gpu0`` (or ``host/cpu``): where a validation repeat ran."""
    gpus = ",".join(g for g in info.gpu_ids if g)
    return f"{info.hostname}/{'gpu' + gpus if gpus else 'cpu'}"


# ---- capacity ------------------------------------------------------------------------------------------
@dataclass
class SearchRun:
    """One capacity search of ``config`` (with ``knobs``) over ``windows``, driven on worker ``worker``."""

    worker: int
    config: HybridConfig
    knobs: EngineKnobs | None
    windows: tuple[tuple[Request, ...], ...]
    search: CapacitySearch
    probes: list[dict[str, Any]] = field(default_factory=list)
    shift: float | None = None  # its start: the config's study capacity x this (validate_capacity)

    def result(self) -> dict[str, Any]:
        """The metrics at the capacity found (:func:`~kvtune.tuner.capacity.capacity_metrics`), the
        search's state and its probes (:func:`~kvtune.tuner.capacity.probe_summary`)."""
        _, mean = capacity_metrics(self.probes, self.search.capacity)
        search = self.search.to_dict() | {"probes": [probe_summary(p) for p in self.probes]}
        if self.shift is not None:
            search["shift"] = self.shift
        return {**finite(mean), "search": search}


def run_searches(
    pool: WorkerPool,
    runs: list[SearchRun],
    slo: Slo,
    warmup: int = WARMUP_REQUESTS,
    interleave: bool = True,
    done: Callable[[SearchRun], None] | None = None,
) -> list[SearchRun]:
    """Drive every search to its end, each probe on its run's worker; returns ``runs``, updated; ``done``
    is called with each run as its search ends.

    ``interleave``: the searches sharing a worker send their probes together (the worker runs them in the
    order sent, so they alternate); else a worker runs its searches one whole search after another, in the
    order of ``runs``, so a config's cache and CUDA graphs serve all its probes (the worker rebuilds them
    whenever the config changes)."""
    inflight: dict[Any, SearchRun] = {}
    queues: dict[int, list[SearchRun]] = {}
    for run in runs:
        queues.setdefault(run.worker, []).append(run)

    def submit(run: SearchRun) -> bool:
        rate = run.search.next_rate()
        if rate is None:
            return False
        actor = pool.actors[run.worker]
        inflight[actor.probe_config.remote(run.config, run.knobs, run.windows, rate, slo, warmup)] = run
        return True

    def start_next(worker: int) -> None:
        queue = queues[worker]
        while queue and not submit(queue.pop(0)):
            pass

    for worker, queue in queues.items():
        if interleave:
            for run in queue:
                submit(run)
            queue.clear()
        else:
            start_next(worker)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        run = inflight.pop(ready[0])
        probe = ray.get(ready[0])
        run.search = run.search.record(probe["rate"], probe["passed"], probe.get("margin"))
        run.probes.append(probe)
        if not submit(run):
            if done is not None:
                done(run)
            start_next(run.worker)
    return runs


def validate_capacity(
    pool: WorkerPool,
    best: HybridConfig,
    knobs: tuple[EngineKnobs | None, EngineKnobs | None],
    requests: tuple[Request, ...],
    slo: Slo,
    starts: tuple[float, float],
    granularity: float,
    repeats: int = MIN_REPEATS,
    alternative: EngineKnobs | None = None,
    max_rate: float | None = None,
    first: int = 0,
    confirm: int = 1,
    draws: int = 0,
    done: Callable[[SearchRun], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The capacity of ``best`` and of ``best.unquantized()`` (with ``knobs`` = (best's, the baseline's)),
    each searched ``repeats`` times on ``requests``: the metrics at each capacity found, with the ``worker``
    that ran the repeat and the ``engine`` knobs. Every search starts near a capacity already measured
    (:func:`~kvtune.tuner.capacity.near_search`): the first round's (one repeat per worker) at ``starts`` =
    (best's, baseline's) expected capacities on these requests (the caller's: the study's × the
    :func:`window_prior`), the baseline at the study's own knobs first and the other sides from where its
    search moved; the later repeats at the median of what the first round found on these requests.

    ``alternative``: other engine knobs for the baseline than ``knobs[1]`` (the space's defaults), searched
    too in the first round; the baseline's side of a repeat there is the higher of its two capacities (its
    ``alternatives`` keep both), so the gain is never the baseline's loss from knobs that suit only the
    best config, and the later repeats search the baseline only at the knobs whose first-round capacities
    were higher (:func:`better_knobs`). ``max_rate``: the window's saturation rate, above which no search
    probes. ``first``: the index of the first repeat (more repeats after ``first`` done: any number of
    them). ``confirm``, ``draws``: the study's repeated probes near the decision
    (:class:`~kvtune.tuner.capacity.CapacitySearch`). ``done``: called with each search as it ends."""
    if first == 0 and repeats < MIN_REPEATS:
        raise ValueError(f"`repeats >= {MIN_REPEATS}` must hold, but got repeats={repeats}")
    base = best.unquantized()
    sides = [(best, knobs[0], starts[0]), (base, knobs[1], starts[1])]
    if alternative is not None:
        sides.append((base, alternative, starts[1]))
    workers = len(pool.actors)
    search = lambda s: near_search(CapacitySearch(s, granularity, CAPACITY_PROBES_COLD, max_rate=max_rate,
                                                  confirm=confirm, draws=draws), s)  # fmt: skip

    Side = tuple[HybridConfig, EngineKnobs | None, float]

    def round_of(
        indices: Sequence[int], round_sides: Sequence[Side], shifted: bool = False
    ) -> list[list[SearchRun]]:
        """One repeat per index, each side's whole search after another (each config's cache serves all
        its probes); which side goes first rotates from one repeat to the next. ``shifted``: the baseline
        at the study's own knobs (the last side: its study capacity is the best measured, three searches)
        first in every repeat, the other sides from where its search moved (:func:`window_shift`)."""
        n = len(round_sides)
        run = lambda r, i, shift=None: SearchRun(
            r % workers, round_sides[i][0], round_sides[i][1], (requests,),
            search(round_sides[i][2] * (shift or 1.0)), shift=shift,
        )  # fmt: skip
        rows = [[run(r, i) for i in range(n)] for r in indices]
        lead = n - 1 if shifted else None
        if lead is not None:
            run_searches(pool, [row[lead] for row in rows], slo, interleave=False, done=done)
            shift = window_shift([row[lead].search for row in rows])
            rows = [
                [row[i] if i == lead else run(r, i, shift) for i in range(n)] for r, row in zip(indices, rows)
            ]
        order = lambda r: [(r + j) % n for j in range(n)]
        others = [row[i] for r, row in zip(indices, rows) for i in order(r) if i != lead]
        run_searches(pool, others, slo, interleave=False, done=done)
        return rows

    # the first round (one repeat per worker) starts at ``starts``, the sides after the baseline's where its
    # search moved (the held-out requests carry more or less than the search's); the repeats after it
    # start near what that round measured on these requests
    indices = list(range(first, first + repeats))
    runs = round_of(indices[:workers], sides, shifted=first == 0)
    results = [[_result(run) for run in row] for row in runs]
    if indices[workers:]:
        converged = lambda i: [row[i].search.capacity for row in runs if row[i].search.converged]
        later = [(c, k, median_or(converged(i), s)) for i, (c, k, s) in enumerate(sides)]
        if len(later) > 2:  # the baseline at the knobs that carried more in the first round
            keep = 2 if better_knobs([row[1] for row in results], [row[2] for row in results]) else 1
            later = [later[0], later[keep]]
        results += [[_result(run) for run in row] for row in round_of(indices[workers:], later)]
    where = [_worker_name(pool.infos[r % len(pool.infos)]) for r in range(first, first + repeats)]
    best_runs, base_runs = [], []
    for row, w in zip(results, where):
        best_runs.append({**row[0], "worker": w})
        options = row[1:]
        chosen = max(options, key=lambda m: m.get("capacity") or 0.0)
        alternatives = [{"engine": m["engine"], "capacity": m.get("capacity"),
                         "converged": m["search"]["converged"]} for m in options]  # fmt: skip
        base_runs.append({**chosen, "worker": w} | ({"alternatives": alternatives} if len(row) > 2 else {}))
    return best_runs, base_runs


def search_line(run: SearchRun) -> str:
    """One console line of a finished validation search: the config, its capacity, probes and seconds."""
    c, search = run.config, run.search
    kind = f"INT{c.quantization_bits}" if c.quantization_bits else "unquantized"
    found = f"{search.capacity:.3g}x" if search.converged else "not converged"
    wall = sum(float(p.get("wall_s", 0.0)) for p in run.probes)
    k = run.knobs
    knobs = "" if k is None else f" ({k.max_num_seqs} seqs, {k.max_num_batched_tokens} tokens)"
    probes = f"{len(run.probes)} probes, {wall:.0f} s"
    return f"{kind} hot {c.hot_tokens} block {c.block_size}{knobs}: {found}, {probes}"


def output_rate(requests: Sequence[Request]) -> float:
    """Output tokens per second of arrivals at the trace's own rate (0 when the requests span no time)."""
    span_s = (max(r.arrival_ms for r in requests) - min(r.arrival_ms for r in requests)) / 1000.0
    return sum(r.output_length for r in requests) / span_s if span_s > 0 else 0.0


def window_prior(search: Sequence[Sequence[Request]], held_out: Sequence[Request]) -> float:
    """What the held-out requests are expected to carry against the search's, before any replay: the
    search windows' output tokens per second of arrivals over the held-out requests' (1 when either is
    unknown). A capacity is a multiple of a window's own arrival rate, and where decoding binds a config
    sustains about the same output tokens/s on either window. On an H200 (Llama-3.1-8B shape, 1 GiB,
    ``azure_conv_later.csv``) this read 0.728 where the held-out capacities were 0.694 and 0.713 of the
    study's for the baseline (two runs) and 0.728 for INT8; 0.47 for an INT4 trial whose search-window
    capacity was the best of four."""
    ours = [output_rate(w) for w in search if len(w) > 1]
    theirs = output_rate(held_out) if len(held_out) > 1 else 0.0
    return statistics.mean(ours) / theirs if ours and min(ours) > 0 and theirs > 0 else 1.0


def probe_scale(search: Sequence[Sequence[Request]], held_out: Sequence[Request]) -> float:
    """What a validation probe costs against a search probe: the square root of their output tokens' ratio
    (the held-out requests' over all the search windows': a search probe replays every window), within
    [0.5, 2]. A probe's wall grows less than its decode iterations: on an H200 (``azure_conv_later.csv``,
    96 requests, output tokens 1.59×) the held-out probes near a capacity took 1.0-1.34× the wall of the
    search window's near the baseline's (four runs), and the root reads 1.26."""
    ours = sum(r.output_length for w in search for r in w)
    theirs = sum(r.output_length for r in held_out)
    return min(2.0, max(0.5, math.sqrt(theirs / ours))) if ours > 0 else 1.0


def window_shift(searches: Sequence[CapacitySearch]) -> float:
    """How much more (or less) the held-out requests carry than the search's: the median over
    ``searches`` (each started at its config's capacity in the study) of capacity found ÷ start, over
    those that converged to a capacity; 1 when none did. Validation starts each other config's first
    search at its expected capacity × this (the baseline's search corrects the :func:`window_prior`): on an
    H200, with starts at the study's capacities, (Llama-3.1-8B shape, 1 GiB, an unseen Azure window)
    the held-out requests carried 27 % and 31 % less than the search's for INT8 and the baseline, and
    searches started at the study's capacities took 7 and 9 probes where the later repeats, started near,
    took 3."""
    found = [s.capacity / s.start for s in searches if s.converged and s.capacity > 0]
    return statistics.median(found) if found else 1.0


def better_knobs(own: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]) -> bool:
    """Whether the baseline's ``other`` knobs carried more than its ``own`` (the best trial's, resolved for
    it) over the same repeats: a higher median capacity (a tie keeps ``own``)."""
    median = lambda runs: statistics.median((r.get("capacity") or 0.0) for r in runs) if runs else 0.0
    return median(other) > median(own)


def median_or(capacities: Sequence[float], default: float) -> float:
    """The median of the positive ``capacities`` (those found), ``default`` when none is."""
    found = [float(c) for c in capacities if c > 0]
    return statistics.median(found) if found else default


def _result(run: SearchRun) -> dict[str, Any]:
    return {**run.result(), "engine": None if run.knobs is None else run.knobs.to_dict()}
