"""The baseline's capacity searched again and again on windows a study never saw: each probe rule's noise.

A study trusts a capacity only as far as repeated searches of one config on one window agree. This takes
``--windows`` windows of consecutive requests from a trace the study's own sample does not contain (default
``examples/traces/azure_conv_later.csv``, the 1,200 requests of the Azure conversation trace that follow
``azure_conv_sample.csv``; window ``i`` starts in the ``i``-th equal part of it), derives the latency limits
from the unquantized baseline's unloaded replay of the first window as a study does (5 × its P99 TTFT, 10 ×
its median TPOT, on the P90), and then, for each route of ``--routes``, searches the baseline's capacity
``--repeats`` times on every window with the study's bracketed search (from rate ``--start``, up to 12
rates, to 2.5 %) in one worker process (no Ray), each probe as a study's worker probes. Routes:

- ``p90``: the study's rule: P90 TTFT and P90 TPOT of the window's requests each within its limit;
- ``attainment``: at least 90 % of the requests within both limits (a count over all requests);
- ``pooled3``: P90 over the requests of three consecutive windows replayed in one probe (3 × the requests);
- ``confirm``: P90, and a rate whose probe lands within 10 % of a limit is drawn three times (majority);
- ``all``: attainment, pooled over three windows, confirmed near the decision;
- ``draws8``, ``draws12``: P90, bisected to a 10 % bracket, then 8 or 12 probes each at the estimated rate a
  replay passes half the time, the capacity being that estimate (``--probe-draws``);
- ``near``: P90, the study's baseline searches on one worker: a window's first search from ``--start``, the
  later ones started at its capacity, stepping by 1.25× rather than doubling (``near_search``).

``--unloaded N`` replays window 0 unloaded N times and prints each replay's P99 TTFT and median TPOT (the
limits still come from the first, as a study's do): how far a study's limits move from one process to the
next.

Printed: each search's capacity, rates probed and wall time; per route and window the median and the spread
((max − min) / median, the study's ``kvtune.noise`` spread); per route the largest and the median spread
over the windows and the mean search time. The JSON (rewritten after every search) keeps every probe.

    python benchmarks/capacity_noise.py --model random:llama-3.1-8b --kv-budget 1073741824 \\
        --length-scale 0.25 --requests 96 --json noise.json

``--grid`` measures every rule from one set of replays instead (``capacity_grid.py`` says how each rule reads
them): each window's first chunk replayed ``--repeats`` times at each of ``--grid-rates`` rates spaced by
``--grid-step`` (default the search's 2.5 %) around ``--grid-center`` (default: window 0's capacity by a first
search with the study's rule), each replay stopped only once every rule has failed, every request's TTFT and
TPOT kept. Printed: the planned replays (and, after the first, their estimated time), each replay's verdicts,
and after each repeat, per rule (``p90``, ``p99``, ``attainment``, ``pooledW``, ``attainment+pooledW``,
``confirm``) each window's capacities, median and spread, the largest and the median spread, and how many
grids were non-monotone (a pass above a failure) or out of the grid. The JSON is rewritten after every replay.

    python benchmarks/capacity_noise.py --grid --grid-center 3.0 --grid-rates 9 --grid-step 0.06 \\
        --model random:llama-3.1-8b --kv-budget 1073741824 --length-scale 0.25 --requests 96 --windows 3 \\
        --repeats 2 --json grid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from capacity_grid import (
    GridReplay,
    GridStop,
    grid_rates,
    passes,
    replay_to_json,
    rule_capacities,
    rule_summary,
    rules,
)

from kvtune.engine.engine import DEFAULT_BASELINE, resolve_device
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import CLOCKS, SchedulerConfig
from kvtune.engine.traces import LengthPolicy, Request, read_trace
from kvtune.studies.names import CAPACITY_CLOCK, CAPACITY_GRANULARITY, CAPACITY_PROBES_COLD, SLO_PERCENTILE
from kvtune.tuner.capacity import (
    CapacitySearch,
    Slo,
    decision_margin,
    derive_slo,
    near_search,
    saturation_rate,
)
from kvtune.tuner.worker import TrialWorker, gc_paused, local_worker
from kvtune.tuner.workload import rebase

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"
LATER = ROOT / "examples" / "traces" / "azure_conv_later.csv"


@dataclasses.dataclass(frozen=True)
class Route:
    """One probe rule: the verdict's statistic, the windows one probe replays (pooled when > 1) and the
    draws of a rate near the decision."""

    statistic: str = "percentile"
    windows: int = 1
    confirm: int = 1
    draws: int = 0
    near: bool = False  # a window's searches after its first start near the first's capacity


ROUTES = {
    "p90": Route(),
    "attainment": Route(statistic="attainment"),
    "pooled3": Route(windows=3),
    "confirm": Route(confirm=3),
    "all": Route(statistic="attainment", windows=3, confirm=3),
    "draws8": Route(draws=8),
    "draws12": Route(draws=12),
    "near": Route(near=True),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=str(LATER), help="a trace the study's sample does not contain")
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU (default)")
    p.add_argument("--requests", type=int, default=96, help="requests per window (a study's)")
    p.add_argument("--windows", type=int, default=3, help="unseen windows, each searched --repeats times")
    p.add_argument("--repeats", type=int, default=3, help="searches per route and window (default 3)")
    p.add_argument("--only", default=None, help="comma-separated windows to search (default: every one)")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of {', '.join(ROUTES)}")
    p.add_argument("--kv-budget", type=float, default=None, help="bytes (default: 0.9 of the free memory)")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--start", type=float, default=1.0, help="the rate each search starts at (× the trace's)")
    p.add_argument("--unloaded", type=int, default=1,
                   help="unloaded replays of window 0 (the limits come from the first, as a study's do; the "
                   "others are printed and kept to show how far they would move)")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--clock", choices=CLOCKS, default=CAPACITY_CLOCK, help="the engine's clock (a study's)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--grid", action="store_true", help="every rule from one set of replays on a rate grid")
    p.add_argument("--grid-rates", type=int, default=9, help="rates of the grid (default 9)")
    p.add_argument("--grid-step", type=float, default=CAPACITY_GRANULARITY,
                   help="the grid's relative step (default the search's 2.5 %%)")  # fmt: skip
    p.add_argument("--grid-center", type=float, default=None,
                   help="the grid's centre (× the trace's rate; default: a p90 search)")  # fmt: skip
    return p.parse_args()


def windows_of(args: argparse.Namespace, max_context: int) -> list[tuple[tuple[Request, ...], ...]]:
    """Per window: three consecutive chunks of ``--requests`` requests from the start of its part of the
    trace (a route replays the first, or all three pooled), each re-based to arrive from 0 ms; a part that
    holds fewer than three whole chunks gives as many as it holds (a pooled route then refuses it)."""
    trace = read_trace(args.workload)
    policy = LengthPolicy(max_context, "clip", args.length_scale, None)
    out = []
    for i in range(args.windows):
        part = (i / args.windows, (i + 1) / args.windows)
        cut = trace.sample(n=3 * args.requests, seed=0, start_fraction=part[0], end_fraction=part[1])
        fitted, _ = policy.apply(cut.requests)
        chunks = [fitted[k * args.requests : (k + 1) * args.requests] for k in range(3)]
        whole = [c for c in chunks if len(c) == args.requests]
        if not whole:
            raise SystemExit(
                f"{args.workload}: window {i} holds {len(fitted)} requests, fewer than --requests "
                f"{args.requests}; ask fewer requests or fewer --windows"
            )
        out.append(tuple(rebase(c) for c in whole))
    return out


def search(
    worker: TrialWorker, chunks: tuple[tuple[Request, ...], ...], slo: Slo, route: Route, top: float | None,
    start: float, near: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One capacity search of the baseline under ``route`` (as a study's baseline search, from ``start``;
    ``near``: started near that capacity instead)."""
    rule = dataclasses.replace(slo, statistic=route.statistic, pooled=route.windows > 1)
    state = CapacitySearch(start, CAPACITY_GRANULARITY, CAPACITY_PROBES_COLD, max_rate=top,
                           confirm=route.confirm, draws=route.draws)  # fmt: skip
    if near is not None:
        state = near_search(state, near)
    windows, probes, t0 = chunks[: route.windows], [], time.perf_counter()
    while (rate := state.next_rate()) is not None:
        record = worker.probe_config(DEFAULT_BASELINE, None, windows, rate, rule, WARMUP_REQUESTS)
        state = state.record(rate, record["passed"], record.get("margin"))
        gates = {k: record.get("mean", {}).get(k) for k in ("gated_iterations", "gate_leaks", "gate_ms")}
        keep = ("rate", "passed", "aborted", "margin", "ttft_p90_ms", "tpot_p90_ms")
        probes.append({k: record.get(k) for k in keep} | gates)
    return {"capacity": state.capacity, "search": state.to_dict(), "probes": probes,
            "wall_s": time.perf_counter() - t0}  # fmt: skip


def _gates(metrics: dict[str, Any]) -> str:
    """The gated clock's counters of one replay (empty on another clock)."""
    if not metrics.get("gated_iterations"):
        return ""
    return f" ({metrics.get('gate_leaks', 0):.0f} of {metrics['gated_iterations']:.0f} gates leaked)"


def _probe_gates(probes: list[dict[str, Any]]) -> str:
    """The gated clock's counters summed over a search's probes (each the mean over its windows)."""
    gated = sum(float(p.get("gated_iterations") or 0) for p in probes)
    if not gated:
        return ""
    leaks = sum(float(p.get("gate_leaks") or 0) for p in probes)
    return f", {leaks:.0f} of {gated:.0f} gates leaked"


def spread(capacities: list[float]) -> float:
    mid = statistics.median(capacities)
    return (max(capacities) - min(capacities)) / mid if mid > 0 else float("inf")


def main() -> None:
    args = _args()
    device = resolve_device(args.device)
    budget = None if args.kv_budget is None else int(args.kv_budget)
    worker = local_worker(
        args.model, device, str(TEXT), args.dtype, budget, SchedulerConfig(clock=args.clock)
    )
    windows = windows_of(args, worker.loaded.spec.max_context)
    unloaded = worker.unloaded(DEFAULT_BASELINE, windows[0][0], WARMUP_REQUESTS)
    record = derive_slo(unloaded, args.slo_ttft_ms, args.slo_tpot_ms, percentile=SLO_PERCENTILE)
    again = [worker.unloaded(DEFAULT_BASELINE, windows[0][0], WARMUP_REQUESTS)
             for _ in range(args.unloaded - 1)]  # fmt: skip
    if again:  # how far the limits would move with the unloaded replay repeated in one process
        keys = ("ttft_p99_ms", "tpot_p50_ms", "ttft_p99_repeats", "gated_iterations", "gate_leaks")
        record["unloaded_repeats"] = [{k: u.get(k) for k in keys} for u in (unloaded, *again)]
        ms = lambda v: "—" if v is None else f"{v:.2f}"
        said = [f"P99 TTFT {ms(u['ttft_p99_ms'])} ms, median TPOT {ms(u['tpot_p50_ms'])} ms{_gates(u)}"
                for u in record["unloaded_repeats"]]  # fmt: skip
        print("unloaded replays: " + "; ".join(said), flush=True)
    slo = Slo.from_record(record)
    print(f"{args.model} on {device}, {Path(args.workload).name}: {args.windows} windows of {args.requests} "
          f"requests · {slo.describe()} · {args.clock} clock", flush=True)  # fmt: skip
    if args.grid:
        grid(args, worker, windows, slo, record)
        return
    results: dict[str, Any] = {"args": vars(args), "slo": record, "routes": {}}
    summary = []
    for name in args.routes.split(","):
        route, spreads, walls = ROUTES[name], [], []
        results["routes"][name] = runs = []
        only = None if args.only is None else {int(w) for w in args.only.split(",")}
        for w, chunks in enumerate(windows):
            if only is not None and w not in only:
                continue
            if len(chunks) < route.windows:
                raise SystemExit(
                    f"route {name}: window {w} holds {len(chunks)} chunk(s) of {args.requests} requests, not "
                    f"the {route.windows} it pools; ask fewer requests or fewer --windows"
                )
            top = saturation_rate(chunks[: route.windows], record)
            caps = []
            for r in range(args.repeats):
                at = caps[0] if route.near and caps else None
                one = search(worker, chunks, slo, route, top, args.start, at) | {"window": w}
                runs.append(one)
                caps.append(one["capacity"])
                walls.append(one["wall_s"])
                err = one["search"].get("stderr")
                err = f", ± {100 * err:.1f} %" if err is not None else ""
                gates = _probe_gates(one["probes"])
                print(f"  {name:<10} window {w} #{r}: capacity {one['capacity']:.3f}x ({len(one['probes'])} "
                      f"probes{err}{gates}) · {one['wall_s']:.1f} s", flush=True)  # fmt: skip
                _write(args, results)
            spreads.append(spread(caps))
            print(f"  {name:<10} window {w}: median {statistics.median(caps):.3f}x, spread "
                  f"{100 * spreads[-1]:.1f} %", flush=True)  # fmt: skip
        mid, mean_s = 100 * statistics.median(spreads), statistics.fmean(walls)
        summary.append(f"{name:<10} spread max {100 * max(spreads):5.1f} %, median {mid:5.1f} % · "
                       f"{mean_s:6.1f} s a search")  # fmt: skip
        print("ROUTE " + summary[-1], flush=True)
        worker.release()
    print("noise per route (spread of the baseline's capacity over repeated searches of one window):")
    print("\n".join(summary))


def grid(
    args: argparse.Namespace, worker: TrialWorker, windows: list[tuple[tuple[Request, ...], ...]], slo: Slo,
    record: dict[str, Any],
) -> None:  # fmt: skip
    """``--grid``: each window replayed ``--repeats`` times at every rate of the grid, the rules judged on
    those replays (``capacity_grid.py``)."""
    center, first = args.grid_center, None
    if center is None:
        top = saturation_rate(windows[0][:1], record)
        first = search(worker, windows[0], slo, ROUTES["p90"], top, args.start)
        center = first["capacity"]
        print(f"  centre: window 0 searched by the p90 rule, {center:.3f}x ({len(first['probes'])} probes) · "
              f"{first['wall_s']:.1f} s", flush=True)  # fmt: skip
        if center <= 0:
            raise SystemExit("the search found no passing rate to centre the grid on: give --grid-center")
    rates = grid_rates(center, args.grid_rates, args.grid_step)
    total = len(rates) * len(windows) * args.repeats
    print(f"grid: {len(rates)} rates {rates[0]:.3f}-{rates[-1]:.3f}x by {100 * args.grid_step:.1f} % × "
          f"{len(windows)} windows × {args.repeats} repeats = {total} replays", flush=True)  # fmt: skip
    saturation = [saturation_rate(c[:1], record) for c in windows]
    if any(s is not None and rates[-1] > s for s in saturation):
        print(f"  note: above a window's saturation rate ({saturation}) a rate replays it at once")
    plan = {"rates": list(rates), "step": args.grid_step, "center": center, "center_search": first,
            "saturation_rates": saturation, "replays_planned": total}  # fmt: skip
    results: dict[str, Any] = {"args": vars(args), "mode": "grid", "slo": record, "grid": plan, "replays": [],
                               "rules": {}}  # fmt: skip
    done: list[GridReplay] = []
    pooled = sum(len(c[0]) for c in windows)
    for k in range(args.repeats):
        for w, chunks in enumerate(windows):
            for rate in rates:
                prior = [r for r in done if r.repeat == k and r.rate == rate]
                one, wall, counters = grid_replay(worker, chunks[0], (w, k, rate), slo, pooled, prior)
                done.append(one)
                if len(done) == 1:
                    print(f"planned: {total} replays × {wall:.1f} s (the first, at the lowest rate) ≈ "
                          f"{total * wall:.0f} s", flush=True)  # fmt: skip
                print(_replay_line(one, slo, wall, counters), flush=True)
                results["replays"].append(replay_to_json(one, wall) | {"counters": counters})
                caps = rule_capacities(done, slo, rates, len(windows))
                results["rules"] = {name: rule_summary(c) | {"capacities": c} for name, c in caps.items()}
                _write(args, results)
        print(f"after repeat {k}:\n" + _grid_summary(results["rules"], args.grid_step), flush=True)


def grid_replay(
    worker: TrialWorker, requests: tuple[Request, ...], where: tuple[int, int, float], slo: Slo, pooled: int,
    prior: list[GridReplay],
) -> tuple[GridReplay, float, dict[str, Any]]:  # fmt: skip
    """One replay of the baseline at ``where`` = (window, repeat, rate), as a worker's probe replays (its
    priming, no garbage collection inside), stopped only once every rule has failed; its wall time and
    the counters that tell a collapse (:data:`COUNTERS`)."""
    window, repeat, rate = where
    stop, timings = GridStop(slo, len(requests), pooled, prior), []  # type: ignore[var-annotated]
    t0 = time.perf_counter()
    with gc_paused():
        metrics = worker.replay(DEFAULT_BASELINE, requests, 1.0 / rate, WARMUP_REQUESTS, timings=timings,
                                stop=stop)  # fmt: skip
    wall = time.perf_counter() - t0
    one = GridReplay(window, repeat, rate, len(requests), tuple(timings), stop.fired, stop.p90.fired)
    return one, wall, {k: metrics.get(k) for k in COUNTERS}


COUNTERS = (
    "peak_running",
    "max_num_seqs",
    "preemptions",
    "prefill_share",
    "decode_steps",
    "compiles",
    "compile_ms",
)


def _replay_line(one: GridReplay, slo: Slo, wall: float, counters: dict[str, Any]) -> str:
    head = f"  window {one.window} #{one.repeat} ×{one.rate:.3f}:"
    slots = f" · slots {counters['peak_running']}/{counters['max_num_seqs']}"
    if counters.get("compiles"):
        slots += f" · {counters['compiles']} compilations, {counters['compile_ms']:.0f} ms left out"
    if one.stopped:
        served = f"{len(one.timings)}/{one.requests} served"
        return f"{head} stopped, every rule failed ({served}){slots} · {wall:.1f} s"
    judged = rules(slo, 1)
    verdicts = " ".join(f"{n} {'pass' if passes([one], judged[n].slo) else 'FAIL'}"
                        for n in ("p90", "p99", "attainment"))  # fmt: skip
    margin = decision_margin(one.timings, judged["p90"].slo)
    return f"{head} {verdicts} · P90 margin {margin:+.3f}{slots} · {wall:.1f} s"


def _grid_summary(summary: dict[str, Any], step: float) -> str:
    """Per rule: each window's capacities, median and spread; the largest and the median spread."""
    lines = []
    pct = lambda x: "  —  " if x is None else f"{100 * x:5.1f}"
    for name, s in summary.items():
        for w, fig in s["windows"].items():
            caps = ", ".join(f"{c:.3f}" for c in fig["capacities"])
            bound = " (out of the grid: a bound)" if fig["out_of_grid"] else ""
            lines.append(f"  {name:<20} window {w}: {caps} · median {fig['median']:.3f}x, spread "
                         f"{pct(fig['spread'])} %{bound}")  # fmt: skip
        lines.append(f"GRID {name:<20} spread max {pct(s['spread_max'])} %, median "
                     f"{pct(s['spread_median'])} % · non-monotone {s['non_monotone']}, out of grid "
                     f"{s['out_of_grid']}")  # fmt: skip
    lines.append(f"resolution: capacities are grid rates {100 * step:.1f} % apart (a spread below one step "
                 f"reads 0 %); out of grid: the lowest rate failed (0) or every rate passed (a lower "
                 f"bound), no spread")  # fmt: skip
    return "\n".join(lines)


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
