"""One capacity probe repeated in one worker process: how much does a probe's verdict move between repeats?

A study's worker serves every probe of every trial in one process, one after another. A capacity search
that reads 3.6× at the start of a process and 1.7× a few minutes later (the same config, the same window)
is noise the study cannot see past. This replays a study's search window as a worker's probe does (the
worker's replayer, its priming, no garbage collection inside a replay) but whole (no early stop), at each
of ``--rates``, for each config of ``--order`` in turn (default: the baseline four times, INT8 three times),
on the engine's wall or device clock (``--clock``). Printed per replay: P90 and P99 of the TTFT and of the
per-request TPOT over the requests, P99 of the time between tokens over every gap, the decode step, the
iterations, the share of prefill, tokens/s and, on a GPU, the SM clock and power (``nvidia-smi``); then,
per (config, rate), the spread of each statistic over its repeats and, given limits (``--slo-ttft-ms``,
``--slo-tpot-ms``), how many repeats each candidate rule passes: a rule whose verdict flips between repeats of
one probe makes a capacity search a random walk. ``--max-num-batched-tokens`` sets the engine's iteration
budget (a prefill chunk's length bounds the stall a short request's TPOT can take). The JSON keeps every
request's TTFT, TPOT and token count, so any other statistic can be judged from it afterwards.

    python benchmarks/probe_drift.py --model random:llama-3.1-8b --kv-budget 1073741824 --length-scale 0.25 \\
        --workload examples/traces/azure_conv_sample.csv --requests 96 --rates 2,3,4 --json drift.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from gpu_state import GpuSampler

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import resolve_device
from kvtune.engine.metrics import RequestTiming, median_spread
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import CLOCKS, DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from kvtune.engine.traces import read_trace
from kvtune.tuner.worker import gc_paused, local_worker
from kvtune.tuner.workload import WorkloadSample

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
TEXT = Path(__file__).resolve().parents[1] / "examples" / "text" / "wikitext2_excerpt.txt"
FIELDS = (
    "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "step_ms", "decode_steps", "mixed_iterations",
    "prefill_share", "duration_s", "tokens_per_s", "peak_running", "preemptions", "graph_captures",
)  # fmt: skip


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU (default)")
    p.add_argument("--requests", type=int, default=96, help="requests in the window (a study's, seed 0)")
    p.add_argument("--kv-budget", type=float, default=None, help="bytes (default: 0.9 of the free memory)")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--rates", default="1", help="rates (× the window's own arrival rate), comma-separated")
    p.add_argument(
        "--order", default="q_unquantized*4,q_int8*3,q_unquantized*3",
        help="configs (examples/configs names) and how many probes each, in order",
    )  # fmt: skip
    p.add_argument("--clock", choices=CLOCKS, default="wall", help="the engine's clock (default wall)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"tokens of one engine iteration ({DEFAULT_MAX_NUM_BATCHED_TOKENS}, a study's baseline's)",
    )  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="with --slo-tpot-ms: each rule's verdicts")
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def _order(text: str) -> list[tuple[str, int]]:
    steps = []
    for item in text.split(","):
        name, _, count = item.partition("*")
        steps.append((name.strip(), int(count or 1)))
    return steps


MIN_TOKENS = 8  # the per-request TPOT of "tpot8": requests with at least this many output tokens
RULES = {  # a probe's verdict: (TTFT statistic, TPOT statistic) each at most its limit
    "P99": ("ttft_p99_ms", "tpot_p99_ms"),
    f"P99, TPOT of >= {MIN_TOKENS} tokens": ("ttft_p99_ms", "tpot8_p99_ms"),
    "P90": ("ttft_p90_ms", "tpot_p90_ms"),
}


def _statistics(timings: list[RequestTiming]) -> dict[str, float]:
    """Candidate statistics of one replay for a capacity limit: TTFT and per-request TPOT (of every request
    with two tokens or more, and of those with ``MIN_TOKENS`` or more) at P90 and P99 over the requests, the
    time between tokens at P90 and P99 over every gap."""
    ttft = [t.ttft_ms for t in timings]
    tpot = [t.tpot_ms for t in timings if t.tpot_ms is not None]
    tpot8 = [t.tpot_ms for t in timings if t.tpot_ms is not None and len(t.token_ms) >= MIN_TOKENS]
    gaps = [g for t in timings for g in t.itl_ms]
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("tpot8", tpot8), ("tbt", gaps)):
        for q in (90, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) if values else math.nan
    return out


def main() -> None:
    args = _args()
    device = resolve_device(args.device)
    budget = None if args.kv_budget is None else int(args.kv_budget)
    scheduler = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, clock=args.clock)
    worker = local_worker(args.model, device, str(TEXT), args.dtype, budget, scheduler)
    dtype = worker.spec.dtype
    sample = WorkloadSample(args.workload, args.requests, windows=1, seed=0, length_scale=args.length_scale)
    window = sample.search_windows(read_trace(args.workload), worker.loaded.spec.max_context)[0]
    rates = [float(r) for r in args.rates.split(",")]
    print(
        f"{args.model} {dtype} on {device}: {len(window)} requests at {args.rates}× their rate, "
        f"{args.clock} clock",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for rate in rates:
        for name, count in _order(args.order):
            config = HybridConfig.from_json_file(CONFIGS / f"{name}.json")
            for _ in range(count):  # the worker primes each new cache before its first replay
                timings: list[RequestTiming] = []
                with gc_paused(), GpuSampler() as sampler:
                    metrics = worker.replay(config, window, 1.0 / rate, WARMUP_REQUESTS, timings=timings)
                gpu = sampler.summary()
                row = {
                    "config": name, "rate": rate, "at_s": time.perf_counter() - start,
                    **{k: metrics.get(k) for k in FIELDS}, "statistics": _statistics(timings),
                    "requests": [[t.rid, t.ttft_ms, t.tpot_ms, len(t.token_ms)] for t in timings],
                    "gpu": gpu,
                }  # fmt: skip
                rows.append(row)
                st = row["statistics"]
                print(
                    f"{row['at_s']:7.1f} s {name:<14} ×{rate:<5g} TTFT90/99 {st['ttft_p90_ms']:6.1f}/"
                    f"{st['ttft_p99_ms']:6.1f} · TPOT90/99 {st['tpot_p90_ms']:6.2f}/"
                    f"{st['tpot_p99_ms']:6.2f} · "
                    f"TBT99 {st['tbt_p99_ms']:6.1f} · step {metrics['step_ms']:5.2f} ms × "
                    f"{metrics['decode_steps']} · mixed {metrics['mixed_iterations']} · prefill "
                    f"{100 * metrics['prefill_share']:4.1f} % · {metrics['tokens_per_s']:7.1f} tok/s"
                    + (f" · {GpuSampler.describe(gpu)}" if gpu else ""),
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
            worker.release()
    print("spread (largest distance from the median) of each statistic over a (config, rate)'s repeats:")
    for (name, rate), group in itertools.groupby(rows, key=lambda r: (r["config"], r["rate"])):
        stats = [r["statistics"] for r in group]
        if len(stats) > 1:
            line = " · ".join(f"{k} {100 * median_spread([s[k] for s in stats]):.0f} %" for k in stats[0])
            print(f"  {name} ×{rate:g} ({len(stats)}): {line}", flush=True)
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        return
    print(f"repeats that pass TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms, by rule:")
    for (name, rate), group in itertools.groupby(rows, key=lambda r: (r["config"], r["rate"])):
        stats = [r["statistics"] for r in group]
        verdicts = []
        for rule, (ttft, tpot) in RULES.items():
            passed = sum(s[ttft] <= args.slo_ttft_ms and s[tpot] <= args.slo_tpot_ms for s in stats)
            verdicts.append(f"{rule} {passed}/{len(stats)}")
        print(f"  {name} ×{rate:g}: " + " · ".join(verdicts), flush=True)


if __name__ == "__main__":
    main()
