"""Every probe rule's capacity from one set of replays: the pure half of ``capacity_noise.py --grid``.

A capacity search decides each probe on one replay, so measuring a rule's noise by its own repeated searches
costs a search (8-9 replays) per rule, window and repeat. Here the unquantized baseline is replayed once per
(window, repeat, rate) of a geometric grid, every request's TTFT and TPOT kept, and each rule reads the
capacity a search of it would have seen from the same replays: the highest grid rate that passes with every
lower grid rate passing (:func:`grid_capacity`; a pass above a failure is reported as non-monotone). Rules
(:func:`rules`; limits of the study's ``kvtune.slo``):

- ``p90``: the study's rule, each limit on the P90 of the window's requests;
- ``p99``: each limit on the P99;
- ``attainment``: at least 90 % of the requests within both limits;
- ``pooledW``: the P90 over the requests of all W windows replayed at one rate in one repeat (one set of
  W × the requests: one capacity per repeat, over the windows together);
- ``attainment+pooledW``: attainment over that pooled set;
- ``confirm``: the P90, with a replay whose margin (:func:`~kvtune.tuner.capacity.decision_margin`) lies
  within 10 % of a limit decided by the strict majority (``R // 2 + 1`` of ``R``: both of 2, 2 of 3 as the
  search's ``--probe-confirm 3``) of the P90 verdicts of all R repeats' replays of that window at that rate
  (:func:`confirm_verdicts`). A replay the study's P90 probe would have stopped early is a failure that is
  never near, as in a search. All repeats share those draws where a real search draws its own, so every
  repeat near a rate takes the same verdict there: the emulated spread likely understates the rule's noise.

A replay stops early only once every rule has certainly failed at its rate (:class:`GridStop`). The grid's
resolution bounds what a spread can show: capacities are grid rates, so a spread below one grid step reads 0,
and a capacity at either end of the grid is a bound (``below_grid``: the lowest rate failed, capacity 0;
``above_grid``: every rate passed).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.tuner.capacity import ProbeStop, Slo, decision_margin, requests_pass

NEAR = 0.1  # a P90 margin below this (in magnitude) is near the decision: CapacitySearch's ``near``


@dataclass(frozen=True)
class GridReplay:
    """One replay of a window at one grid rate: the finished requests' times (objects with ``ttft_ms`` and
    ``tpot_ms``, None for one token) of ``requests`` replayed. ``stopped``: ended early, every rule having
    certainly failed; ``aborted``: the study's P90 probe would have stopped it (its ProbeStop fired)."""

    window: int
    repeat: int
    rate: float
    requests: int
    timings: tuple[Any, ...]
    stopped: bool = False
    aborted: bool = False


@dataclass(frozen=True)
class Times:
    """One request's times as the JSON keeps them (a :class:`~kvtune.engine.metrics.RequestTiming`'s)."""

    ttft_ms: float
    tpot_ms: float | None


def replay_to_json(replay: GridReplay, wall_s: float) -> dict[str, Any]:
    """What the JSON keeps of a replay: its place, flags and every finished request's TTFT and TPOT."""
    return {
        "window": replay.window, "repeat": replay.repeat, "rate": replay.rate, "requests": replay.requests,
        "completed": len(replay.timings), "stopped": replay.stopped, "aborted": replay.aborted,
        "wall_s": wall_s, "ttft_ms": [t.ttft_ms for t in replay.timings],
        "tpot_ms": [t.tpot_ms for t in replay.timings],
    }  # fmt: skip


def replay_from_json(d: Mapping[str, Any]) -> GridReplay:
    """The replay :func:`replay_to_json` wrote, to judge again."""
    pairs = zip(d["ttft_ms"], d["tpot_ms"], strict=True)
    times = tuple(Times(float(a), None if b is None else float(b)) for a, b in pairs)
    return GridReplay(int(d["window"]), int(d["repeat"]), float(d["rate"]), int(d["requests"]), times,
                      bool(d["stopped"]), bool(d["aborted"]))  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """A probe rule: its limits (statistic, percentile, pooling) and the draws near the decision."""

    slo: Slo
    confirm: bool = False


def rules(slo: Slo, windows: int) -> dict[str, Rule]:
    """The rules evaluated on one set of replays, under the limits of ``slo`` (see the module docstring)."""
    p90 = dataclasses.replace(slo, percentile=90.0, statistic="percentile", pooled=False)
    attainment = dataclasses.replace(p90, statistic="attainment")
    return {
        "p90": Rule(p90),
        "p99": Rule(dataclasses.replace(p90, percentile=99.0)),
        "attainment": Rule(attainment),
        f"pooled{windows}": Rule(dataclasses.replace(p90, pooled=True)),
        f"attainment+pooled{windows}": Rule(dataclasses.replace(attainment, pooled=True)),
        "confirm": Rule(p90, confirm=True),
    }


def grid_rates(center: float, count: int, step: float) -> tuple[float, ...]:
    """``count`` rates spaced by the factor ``1 + step`` around ``center`` (which is one of them when
    ``count`` is odd)."""
    if not (center > 0 and count >= 1 and step > 0):
        raise ValueError(f"`center > 0, count >= 1, step > 0` must hold, but got {center=} {count=} {step=}")
    return tuple(center * (1.0 + step) ** (k - (count - 1) / 2) for k in range(count))


def grid_capacity(verdicts: Mapping[float, bool]) -> dict[str, Any]:
    """The capacity a search sees on a grid's verdicts (rate -> passed): the highest rate that passes with
    every lower rate passing (0 when the lowest fails); ``non_monotone``: the rates that pass above a
    failure."""
    rates = sorted(verdicts)
    first_fail = next((i for i, r in enumerate(rates) if not verdicts[r]), len(rates))
    return {
        "capacity": rates[first_fail - 1] if first_fail > 0 else 0.0,
        "non_monotone": [r for r in rates[first_fail:] if verdicts[r]],
        "below_grid": first_fail == 0,
        "above_grid": first_fail == len(rates),
    }


def passes(replays: Sequence[GridReplay], slo: Slo) -> bool:
    """The verdict of ``slo`` on replays judged as one set (one replay, or a pooled probe's windows): none
    stopped early, every request served, the statistic within its limits."""
    if any(r.stopped for r in replays):
        return False
    timings = [t for r in replays for t in r.timings]
    return requests_pass(timings, slo, sum(r.requests for r in replays))


def confirm_verdicts(replays: Sequence[GridReplay], slo: Slo) -> dict[tuple[int, int, float], bool]:
    """The ``confirm`` rule's verdict of each replay (window, repeat, rate): its own P90 verdict, or, when
    its margin is within ``NEAR`` of the decision, the strict majority of the P90 verdicts of every repeat's
    replay of its window at its rate; a replay the P90 probe would have stopped is a failure, never near."""
    draws: dict[tuple[int, float], list[bool]] = {}
    for r in replays:
        draws.setdefault((r.window, r.rate), []).append(passes([r], slo))
    out = {}
    for r in replays:
        own = passes([r], slo)
        near = not (r.aborted or r.stopped) and abs(decision_margin(r.timings, slo)) < NEAR
        if near:
            votes = draws[(r.window, r.rate)]
            own = sum(votes) >= len(votes) // 2 + 1
        out[(r.window, r.repeat, r.rate)] = own
    return out


def rule_capacities(
    replays: Sequence[GridReplay], slo: Slo, rates: Sequence[float], windows: int
) -> dict[str, list[dict[str, Any]]]:
    """Per rule, the capacity of each (window, repeat) whose grid is complete (every rate replayed), as
    :func:`grid_capacity` reads it; a pooled rule's ``window`` is ``"pooled"``, one per repeat whose every
    window is complete."""
    grid = {(r.window, r.repeat, r.rate): r for r in replays}
    complete = sorted({(w, k) for w, k, _ in grid if all((w, k, x) in grid for x in rates)})
    repeats = sorted({k for _, k in complete if all((w, k) in complete for w in range(windows))})
    out: dict[str, list[dict[str, Any]]] = {}
    for name, rule in rules(slo, windows).items():
        if rule.slo.pooled:
            sets = {k: {x: passes([grid[w, k, x] for w in range(windows)], rule.slo) for x in rates}
                    for k in repeats}  # fmt: skip
            out[name] = [{"window": "pooled", "repeat": k, **grid_capacity(v)} for k, v in sets.items()]
            continue
        verdict = confirm_verdicts(replays, rule.slo) if rule.confirm else None
        caps = []
        for w, k in complete:
            got = {x: verdict[w, k, x] if verdict else passes([grid[w, k, x]], rule.slo) for x in rates}
            caps.append({"window": w, "repeat": k, **grid_capacity(got)})
        out[name] = caps
    return out


def spread(capacities: Sequence[float]) -> float:
    """(max − min) / median: the study's ``kvtune.noise`` spread."""
    mid = statistics.median(capacities)
    return (max(capacities) - min(capacities)) / mid if mid > 0 else math.inf


def rule_summary(capacities: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rule's figures over its (window, repeat) capacities: each window's capacities, median and spread
    (None with one repeat, or when a capacity is out of the grid: a bound, not a measure), the largest and
    the median spread over the windows that have one, and the count of non-monotone and out-of-grid grids."""
    by_window: dict[Any, list[Mapping[str, Any]]] = {}
    for c in capacities:
        by_window.setdefault(c["window"], []).append(c)
    windows = {}
    for w, got in by_window.items():
        caps = [float(c["capacity"]) for c in got]
        bounded = any(c["below_grid"] or c["above_grid"] for c in got)
        windows[str(w)] = {"capacities": caps, "median": statistics.median(caps), "out_of_grid": bounded,
                           "spread": spread(caps) if len(caps) > 1 and not bounded else None}  # fmt: skip
    spreads = [w["spread"] for w in windows.values() if w["spread"] is not None]
    return {
        "windows": windows,
        "spread_max": max(spreads, default=None),
        "spread_median": statistics.median(spreads) if spreads else None,
        "non_monotone": sum(1 for c in capacities if c["non_monotone"]),
        "out_of_grid": sum(1 for c in capacities if c["below_grid"] or c["above_grid"]),
    }


class GridStop:
    """The engine's stop for one grid replay: fires once every rule has certainly failed at its rate, never
    earlier. One :class:`~kvtune.tuner.capacity.ProbeStop` per rule's count, each asked every iteration:
    P90, P99 and attainment over the window's ``requests``; P90 and attainment over the pooled ``pooled``
    requests, counting the violations of ``prior`` (the same repeat's earlier windows at this rate, whole:
    a stopped or short one has already failed every pooled rule). The confirm rule fails for certain once
    the P90's stop fired (``aborted``: the study's probe would have stopped there)."""

    def __init__(self, slo: Slo, requests: int, pooled: int, prior: Sequence[GridReplay] = ()) -> None:
        per_window = rules(slo, 1)
        self.p90 = ProbeStop(per_window["p90"].slo, requests)
        self.stops = [self.p90, ProbeStop(per_window["p99"].slo, requests),
                      ProbeStop(per_window["attainment"].slo, requests)]  # fmt: skip
        self.fired = False
        if any(r.stopped or len(r.timings) < r.requests for r in prior):
            return  # the pooled rules already failed
        p90 = per_window["p90"].slo
        done = [t for r in prior for t in r.timings]
        ttft = sum(t.ttft_ms > p90.ttft_ms for t in done)
        tpot = sum(t.tpot_ms is not None and t.tpot_ms > p90.tpot_ms for t in done)
        either = sum(not _within(t, p90) for t in done)
        pooled_p90 = ProbeStop(per_window["pooled1"].slo, pooled)
        pooled_p90.ttft_violations, pooled_p90.tpot_violations = ttft, tpot
        pooled_att = ProbeStop(per_window["attainment+pooled1"].slo, pooled)
        pooled_att.ttft_violations = either
        self.stops += [pooled_p90, pooled_att]

    def __call__(self, now_ms: float, seqs: Sequence[Any]) -> bool:
        fired = [stop(now_ms, seqs) for stop in self.stops]  # every one, every iteration
        self.fired = all(fired)
        return self.fired


def _within(timing: Any, slo: Slo) -> bool:
    tpot = timing.tpot_ms
    return timing.ttft_ms <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)
