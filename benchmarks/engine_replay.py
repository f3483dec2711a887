"""Saturation replays of one trace sample, the engine against the engine as it was, repeated.

For each config (default: unquantized, INT8, INT4) and each budget, the sample is replayed ``--repeats``
times by the engine with its defaults (CUDA graphs for decode-only iterations, mixed iterations, derived
``max_num_seqs``) and, with ``--baseline``, once by the engine as it was (``--no-graphs``, separate
prefill forwards, ``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192). Printed per run: output tokens/s,
P99 TTFT and TPOT, preemptions, peak KV memory against the budget, the share of the forwards' device time
in iterations that carry prompt tokens; per (config, budget): the mean tokens/s, the repeats' spread (the
largest distance of a repeat from their median, over the median) of tokens/s and P99 TPOT, the speed-up over
the baseline, and tokens/s against the first config's. ``--clock wall,device`` runs the repeats once on each
clock (``SchedulerConfig.clock``: the device clock adds each iteration's CUDA-event time and leaves the host
between iterations out), on the same kept cache and graphs, and reports each clock apart. Each replay runs
with Python's garbage collector collected before it and off during it, as a trial's probes run (``--gc on``
leaves it on, to see what its collections cost a replay), and nvidia-smi samples the SM clock, power and
throttling beside it (``--no-gpu-state``: not). ``--no-mixed`` prefills prompts in forwards of their own
between decode steps, which then all replay their CUDA graphs (``SchedulerConfig.mixed``), where by default
decode rows and prompt chunks share one op-by-op forward. ``--profile DIR``
replays each (config, budget) once more under the PyTorch profiler after its repeats and writes where the
device time went (DIR/<config>_<budget>.txt: the kernels with the most device time, their share of the
replay's wall time).

Device-busy without the profiler: each forward (a graph replay, or an op-by-op prompt/mixed forward) is
bracketed by CUDA events; ``busy`` is their summed device time over the replay's wall time (ReplayMetrics'
``device_busy``), and ``launch`` the host's launch time of the op-by-op forwards over their device time (near
or above 1: those forwards are launch-bound and the device idles inside them, so ``busy`` overstates its
work there). ``--versus OTHER.json`` (another run's ``--json``, e.g. the same benchmark over an older
checkout on ``PYTHONPATH``) prints each (config, budget)'s tokens/s against that run's; metrics an older
engine does not report print as n/a.

    python benchmarks/engine_replay.py --model random:llama-3.1-8b --requests 32 --kv-budget 4e9 \\
        --kv-budget default --baseline --workload examples/traces/azure_conv_sample.csv --json out.json

Each (engine, config) pair first serves the sample once unmeasured (``--prime``, on by default): its
warm-up compiles every kernel and that replay captures every CUDA graph the sample reaches, so the measured
repeats that follow reuse the same cache and graphs (the engine keeps them between replays of one config)
and capture nothing. ``--no-prime`` measures from the first replay on, whose captures are taken off its
clock. ``--time-scale`` (default 0, all requests at once) replays open-loop instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_state import GpuSampler

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine import engine as engine_module
from kvtune.engine.engine import default_budget_bytes, load_workload, resolve_device
from kvtune.engine.metrics import median_spread
from kvtune.engine.model import load_model
from kvtune.engine.options import DTYPES, WARMUP_REQUESTS, ReplayOptions
from kvtune.engine.replay import Replayer
from kvtune.engine.scheduler import CLOCKS, SchedulerConfig
from kvtune.tuner.worker import gc_paused

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
DEFAULT_CONFIGS = ("q_unquantized", "q_int8", "q_int4")
BASELINE = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, graphs=False, mixed=False)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="*", type=Path)
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-budget",
        action="append",
        default=None,
        help="KV budget in bytes (4e9), or 'default' (0.9 of the free device memory); repeatable",
    )
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--length-cap", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=0.0, help="0: saturation (all requests at once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", action="store_true", help="also replay once with the engine as it was")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--prime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the sample once unmeasured before the repeats (default on; repeat -1 in the JSON)",
    )
    p.add_argument(
        "--clock",
        default="wall",
        help="the repeats' clock: wall, device, or both comma-separated (each gets --repeats)",
    )
    p.add_argument("--profile", type=Path, default=None, help="folder: one more replay profiled per config")
    p.add_argument(
        "--forwards",
        action="store_true",
        help="record each op-by-op forward with prompt tokens (device and host launch ms) in --json, and "
        "print per repeat how many the host's launching bound",
    )
    p.add_argument(
        "--gc",
        choices=("paused", "on"),
        default="paused",
        help="Python's garbage collector during each replay: collected before, then off (paused: as a "
        "trial's probes run) or left on",
    )
    p.add_argument(
        "--no-gpu-state",
        action="store_true",
        help="do not sample the SM clock, power and throttling with nvidia-smi during the replays (its "
        "queries take driver locks the replay's launches may wait on)",
    )
    p.add_argument(
        "--profile-stacks",
        action="store_true",
        help="with --profile: record Python stacks and list the host's waits (synchronisations, copies to "
        "the host) by where they are called",
    )
    p.add_argument(
        "--no-mixed",
        action="store_true",
        help="prompts prefilled in forwards of their own between decode steps (which keep their CUDA graphs) "
        "instead of sharing a forward with the decode rows",
    )
    p.add_argument(
        "--piecewise",
        action="store_true",
        help="forwards with prompt tokens run their dense parts as CUDA graphs per token bucket, attention "
        "eagerly between them (kvtune.engine.piecewise)",
    )
    p.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="forwards with prompt tokens whose shapes fit replayed whole as one graph per shape bucket "
        "(kvtune.engine.mixed_graphs)",
    )
    p.add_argument(
        "--capture-on",
        type=int,
        default=None,
        help="with --mixed-graphs: the use of a shape that captures its graph (default: the engine's, "
        "kvtune.engine.engine.MIXED_CAPTURE_ON; 1: its first use)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--versus", type=Path, default=None, help="another run's --json: tokens/s against it")
    args = p.parse_args()
    args.clocks = [c.strip() for c in args.clock.split(",") if c.strip()]
    if not args.clocks or not set(args.clocks) <= set(CLOCKS):
        p.error(f"--clock: expected {' or '.join(CLOCKS)} (comma-separated), got {args.clock!r}")
    return args


def _budget(text: str, loaded: Any, device: torch.device) -> int:
    return default_budget_bytes(loaded, device) if text == "default" else int(float(text))


def main() -> None:
    args = _args()
    if args.capture_on is not None:
        engine_module.MIXED_CAPTURE_ON = args.capture_on
    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device, dtype=DTYPES[args.dtype])
    requests, counts, provenance = load_workload(
        args.workload, loaded.spec.max_context, args.requests, args.seed, args.length_scale, args.length_cap
    )
    configs = args.configs or [CONFIGS / f"{c}.json" for c in DEFAULT_CONFIGS]
    budgets = [(b, _budget(b, loaded, device)) for b in (args.kv_budget or ["default"])]
    ours = SchedulerConfig(
        args.max_num_seqs,
        args.max_num_batched_tokens,
        mixed=not args.no_mixed,
        piecewise=args.piecewise,
        mixed_graphs=args.mixed_graphs,
    )
    engines = [("engine", ours, args.repeats)] + ([("baseline", BASELINE, 1)] if args.baseline else [])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mean_in = statistics.mean(r.input_length for r in requests)
    mean_out = statistics.mean(r.output_length for r in requests)
    print(
        f"{name} · {args.model} · {Path(args.workload).name}: {len(requests)} requests (mean {mean_in:.0f} + "
        f"{mean_out:.0f} tokens, {counts.shortened} shortened) · time scale {args.time_scale:g}",
        flush=True,
    )
    header = f"{'config':<16} {'budget':>9} {'engine':>8} {'clock':>6} {'#':>2} {'tok/s':>8} {'TTFT99':>8}"
    header += f" {'TPOT99':>8}"
    header += f" {'preempt':>7} {'peakKV GB':>9} {'seqs':>5} {'prefill':>7} {'steps':>6} {'graphs':>6}"
    print(f"{header} {'busy':>6} {'launch':>6}")
    results: list[dict[str, Any]] = []
    for label, budget in budgets:
        for path in configs:
            config = HybridConfig.from_json_file(path)
            for engine_name, options, repeats in engines:
                engine = Replayer(loaded, device, ReplayOptions(budget, 0, options)).engine(config)
                runs = [(c, i) for c in args.clocks for i in range(repeats)]
                if args.prime and engine_name == "engine":  # the engine as it was captures nothing
                    runs.insert(0, (args.clocks[0], -1))
                for clock, i in runs:
                    t0 = time.perf_counter()
                    forwards: list[dict[str, float]] | None = [] if args.forwards else None
                    paused = gc_paused() if args.gc == "paused" else contextlib.nullcontext()
                    sampler = GpuSampler(enabled=not args.no_gpu_state)
                    with paused, sampler:
                        m = engine.with_clock(clock).replay(
                            requests, args.time_scale, warmup_requests=WARMUP_REQUESTS, forwards=forwards
                        )
                    d = m.to_dict()
                    if forwards is not None:
                        d["forwards"] = forwards
                        print(_forwards_line(forwards), flush=True)
                    d["wall_s"] = time.perf_counter() - t0
                    d["gpu"] = sampler.summary()
                    d["gc"] = args.gc
                    results.append({"config": path.stem, "budget": label, "budget_bytes": budget,
                                    "engine": engine_name, "clock": clock, "repeat": i,
                                    "metrics": d})  # fmt: skip
                    _row(path.stem, label, engine_name, clock, i, d, budget)
                    _write(args, ours, name, provenance, results)
                if args.profile is not None and engine_name == "engine":
                    walls = [r["metrics"]["wall_s"] for r in results[-len(runs) :] if r["repeat"] >= 0]
                    _profile(
                        engine.with_clock(args.clocks[0]),
                        requests,
                        args,
                        args.profile / f"{path.stem}_{label}.txt",
                        statistics.median(walls) if walls else None,
                    )
                engine.release()
                del engine
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for clock in args.clocks:
                _summary(results, path.stem, label, clock)
        for clock in args.clocks:
            _versus_first(results, label, [p.stem for p in configs], clock)
    if args.versus is not None and args.versus.is_file():
        _versus_run(results, json.loads(args.versus.read_text())["results"], args.versus.name)
    elif args.versus is not None:
        print(f"  --versus {args.versus}: no such file (the other run did not finish): no ratio")


def _forwards_line(forwards: list[dict[str, float]]) -> str:
    """One line over a replay's op-by-op forwards with prompt tokens: their device and host launch time, and
    those the host bound (launching took at least 90 % of the forward's device time: the device waited)."""
    device = sum(f["device_ms"] for f in forwards)
    launch = sum(f["launch_ms"] for f in forwards)
    bound = [f for f in forwards if f["launch_ms"] >= 0.9 * f["device_ms"]]
    bound_ms = sum(f["device_ms"] for f in bound)
    return (
        f"    prompt forwards: {len(forwards)}, device {device:.0f} ms, host launch {launch:.0f} ms; "
        f"host-bound (launch >= 0.9 x device) {len(bound)}: device {bound_ms:.0f} ms"
    )


# the host waiting on the device: synchronisations and copies to the host (which wait for the stream)
HOST_WAITS = ("cudaEventSynchronize", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _profile(
    engine: Any, requests: Any, args: argparse.Namespace, out: Path, unprofiled_wall_s: float | None
) -> None:
    """One replay under the PyTorch profiler: the 30 kernels with the most device time (and on a GPU the 30
    host operations with the most CPU time of their own: where the host waits), and the sum of all
    kernels against the replay's wall time (the rest is the device waiting for the host), profiled and, since
    the profiler slows the host but not the kernels, against the median wall of the unprofiled repeats (the
    device's kernel-busy share as the replay runs)."""
    from torch._C._profiler import _ExperimentalConfig  # verbose: Python stacks on every operation
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    t0 = time.perf_counter()
    verbose = _ExperimentalConfig(verbose=True) if args.profile_stacks else None
    with profile(activities=activities, with_stack=args.profile_stacks, experimental_config=verbose) as prof:
        m = engine.replay(requests, args.time_scale, warmup_requests=WARMUP_REQUESTS)
        if cuda:
            torch.cuda.synchronize(engine.device)
    wall_s = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_s = sum(e.device_time for e in kernels) / 1e6
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort, row_limit=30, max_name_column_width=70)
    if cuda:  # the host's side: where it waits on the device (synchronisations, copies to the host)
        host = averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
        table += "\nthe host's operations by their own CPU time:\n" + host
    if args.profile_stacks:  # where the host waits: each wait's nearest caller with a Python stack
        waits: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        for e in prof.events():
            if e.name not in HOST_WAITS:
                continue
            caller = e
            while caller is not None and not caller.stack:
                caller = caller.cpu_parent
            key = (e.name, tuple(caller.stack[:8]) if caller is not None else ("(no Python caller)",))
            waits.setdefault(key, []).append(e.self_cpu_time_total)
        top = sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:20]
        lines = [
            f"{name}: {len(t)} calls, {sum(t) / 1e3:.1f} ms\n    " + "\n    ".join(stack)
            for (name, stack), t in top
        ]
        table += "\nthe host's waits by where they are called:\n" + ("\n".join(lines) or "none") + "\n"
    head = (
        f"{engine.config.to_json(None)}\nprofiled replay: {wall_s:.2f} s wall, {m.tokens_per_s:.1f} tok/s, "
        f"kernels {busy_s:.2f} s of device time ({100 * busy_s / wall_s:.1f} % of the wall), "
        f"{len(kernels)} kernels, prefill share {m.prefill_share:.3f}"
    )
    if unprofiled_wall_s:
        head += (
            f"; kernels over the unprofiled wall ({unprofiled_wall_s:.2f} s): "
            f"{100 * busy_s / unprofiled_wall_s:.1f} % kernel-busy"
        )
    head += "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + table)
    print(f"  profile: {head.splitlines()[1]} -> {out}", flush=True)


def _write(
    args: argparse.Namespace, ours: SchedulerConfig, name: str, provenance: Any, results: list
) -> None:
    """The results so far (written after every replay: a run cut short keeps what it measured)."""
    if args.json:
        out = {
            "model": args.model,
            "device": name,
            "workload": provenance,
            "time_scale": args.time_scale,
            "engine_options": ours.to_dict(),
            "baseline_options": BASELINE.to_dict(),
            "results": results,
        }
        args.json.write_text(json.dumps(out, indent=1, default=str))


def _row(
    config: str, budget: str, engine: str, clock: str, i: int, d: dict[str, Any], budget_bytes: int
) -> None:
    cells = (
        f"{config:<16} {budget:>9} {engine:>8} {clock:>6} {i:>2} {d['tokens_per_s']:>8.1f} "
        f"{d['ttft_p99_ms']:>8.1f} "
        f"{d['tpot_p99_ms']:>8.2f} {d['preemptions']:>7} "
        f"{d['peak_kv_bytes'] / 1e9:>5.2f}/{budget_bytes / 1e9:<5.1f}"
    )
    graphs = "cuda" if d.get("cuda_graphs") else "static" if d.get("graphs") else "eager"
    share = d.get("prefill_share")
    share_text = (
        f"{100 * share:>6.1f}%" if isinstance(share, float) and math.isfinite(share) else f"{'n/a':>7}"
    )
    gpu = GpuSampler.describe(d.get("gpu") or {})
    busy = f"{_pct(d.get('device_busy')):>6} {_ratio(d.get('launch_ratio')):>6}"
    print(
        f"{cells} {d['max_num_seqs']:>5} {share_text} {d['decode_steps']:>6} {graphs:>6} {busy} {gpu}",
        flush=True,
    )


def _finite(x: Any) -> bool:
    return isinstance(x, float | int) and math.isfinite(x)


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if _finite(x) else "n/a"


def _ratio(x: Any) -> str:
    return f"{x:.2f}" if _finite(x) else "n/a"


def _measured(
    results: list[dict[str, Any]], config: str, budget: str, engine: str, clock: str
) -> list[dict[str, Any]]:
    """The metrics of the measured replays (the unmeasured first one left out) of one (config, budget,
    engine, clock)."""
    key = (config, budget, engine, clock)
    return [
        r["metrics"]
        for r in results
        if (r["config"], r["budget"], r["engine"], r["clock"]) == key and r["repeat"] >= 0
    ]


def _summary(results: list[dict[str, Any]], config: str, budget: str, clock: str) -> None:
    mine = _measured(results, config, budget, "engine", clock)
    base = _measured(results, config, budget, "baseline", clock)
    tps = [m["tokens_per_s"] for m in mine]
    tpot = [m["tpot_p99_ms"] for m in mine]
    text = (
        f"  {config} @ {budget}, {clock} clock: {statistics.mean(tps):.1f} tok/s over {len(tps)} repeats, "
        f"largest distance from the median: tok/s {100 * median_spread(tps):.1f} % (<= 3 %), "
        f"P99 TPOT {100 * median_spread(tpot):.1f} % (<= 5 %)"
    )
    busy = [m["device_busy"] for m in mine if _finite(m.get("device_busy"))]
    if busy:
        mean, spread = 100 * statistics.mean(busy), 100 * median_spread(busy)
        text += f"; device busy {mean:.1f} % (spread {spread:.1f} %)"
    if base:
        text += f"; {statistics.mean(tps) / base[0]['tokens_per_s']:.2f}× the engine as it was (>= 3×)"
    print(text, flush=True)


def _versus_run(results: list[dict[str, Any]], other: list[dict[str, Any]], name: str) -> None:
    """Mean tokens/s of each (config, budget, clock) of this run against the same key's in ``other``."""
    keys = sorted({(r["config"], r["budget"], r["clock"]) for r in results if r["engine"] == "engine"})
    for config, budget, clock in keys:
        mine = [m["tokens_per_s"] for m in _measured(results, config, budget, "engine", clock)]
        theirs = [m["tokens_per_s"] for m in _measured(other, config, budget, "engine", clock)]
        if mine and theirs:
            a, b = statistics.mean(mine), statistics.mean(theirs)
            print(f"  {config} @ {budget}, {clock} clock: {a:.1f} tok/s vs {b:.1f} in {name}: {a / b:.2f}×")


def _versus_first(results: list[dict[str, Any]], budget: str, configs: list[str], clock: str) -> None:
    means = {}
    for c in configs:
        tps = [m["tokens_per_s"] for m in _measured(results, c, budget, "engine", clock)]
        means[c] = statistics.mean(tps) if tps else math.nan
    first = means[configs[0]]
    print(
        f"  @ {budget}, {clock} clock: tok/s vs {configs[0]}: "
        + ", ".join(f"{c} {means[c] / first:.2f}×" for c in configs)
    )


if __name__ == "__main__":
    main()
