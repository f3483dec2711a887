"""Capacity of configs side by side under one pair of latency limits, searched as a study's trials are.

One :class:`~kvtune.tuner.worker.TrialWorker` in this process (no Ray) serves the whole run: the limits come
from the unloaded baseline (unquantized, hot 32, block 64) exactly as a study derives them (5 × its P99 TTFT,
10 × its median TPOT) unless ``--slo-ttft-ms`` / ``--slo-tpot-ms`` are given; then every config's capacity
is searched ``--repeats`` times from rate 1 (the trace's own) with the study's bracketed search
(:class:`~kvtune.tuner.capacity.CapacitySearch`, ``--granularity``, up to 12 probes, each probe stopping as
soon as its P99 is certain to fail). Printed: each search's capacity (× the trace's rate), its probes, the
output tokens/s at the capacity and the search's wall time; per config the median capacity, the largest
distance of a search from it (the noise) and the ratio to the first config's median.

    python benchmarks/capacity_compare.py --model random:llama-3.1-8b --kv-budget 4e9 \\
        --workload examples/traces/azure_conv_sample.csv --requests 96 --json capacity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import DEFAULT_BASELINE, load_workload, resolve_device
from kvtune.engine.metrics import median_spread
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import CLOCKS, SchedulerConfig
from kvtune.studies.names import CAPACITY_CLOCK, CAPACITY_GRANULARITY, CAPACITY_PROBES_COLD, SLO_PERCENTILE
from kvtune.tuner.capacity import SLO_PERCENTILES, CapacitySearch, Slo, capacity_metrics, derive_slo
from kvtune.tuner.worker import TrialWorker, local_worker
from kvtune.tuner.workload import rebase

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
DEFAULT_CONFIGS = ("q_unquantized", "q_int8", "q_int4")
TEXT = Path(__file__).resolve().parents[1] / "examples" / "text" / "wikitext2_excerpt.txt"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "configs", nargs="*", type=Path, help=f"config JSONs (default: {', '.join(DEFAULT_CONFIGS)})"
    )
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU (default)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-budget", type=float, default=None, help="bytes (default: 0.9 of the free memory)")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--length-cap", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="searches per config (default 3)")
    p.add_argument("--granularity", type=float, default=CAPACITY_GRANULARITY)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-percentile", type=float, choices=SLO_PERCENTILES, default=SLO_PERCENTILE)
    p.add_argument(
        "--clock", choices=CLOCKS, default=CAPACITY_CLOCK, help="the engine's clock (a study's default)"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def search(worker: TrialWorker, config: HybridConfig, window: tuple, slo: Slo, granularity: float) -> dict:
    """One capacity search of ``config`` from rate 1 (as the study's baseline search, not warm-started)."""
    state = CapacitySearch(1.0, granularity=granularity, max_probes=CAPACITY_PROBES_COLD)
    probes = []
    t0 = time.perf_counter()
    while (rate := state.next_rate()) is not None:
        record = worker.probe_config(config, None, (window,), rate, slo, WARMUP_REQUESTS)
        probes.append(record)
        state = state.record(rate, record["passed"])
    _, mean = capacity_metrics(probes)
    return {
        "capacity": state.capacity,
        "search": state.to_dict(),
        "tokens_per_s": mean["capacity_tokens_per_s"],
        "ttft_p99_ms": mean.get("ttft_p99_ms"),
        "tpot_p99_ms": mean.get("tpot_p99_ms"),
        "preemptions": mean.get("preemptions"),
        "peak_running": mean.get("peak_running"),
        "max_num_seqs": mean.get("max_num_seqs"),
        "probes": [{k: p[k] for k in ("rate", "passed", "aborted", "tokens_per_s")} for p in probes],
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    args = _args()
    device = resolve_device(args.device)
    budget = None if args.kv_budget is None else int(args.kv_budget)
    worker = local_worker(
        args.model, device, str(TEXT), args.dtype, budget, SchedulerConfig(clock=args.clock)
    )
    dtype = worker.spec.dtype
    requests, counts, provenance = load_workload(
        args.workload, worker.loaded.spec.max_context, args.requests, args.seed, args.length_scale,
        args.length_cap,
    )  # fmt: skip
    window = rebase(requests)
    unloaded = worker.unloaded(DEFAULT_BASELINE, window, WARMUP_REQUESTS)
    slo_record = derive_slo(unloaded, args.slo_ttft_ms, args.slo_tpot_ms, percentile=args.slo_percentile)
    slo = Slo.from_record(slo_record)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name} · {args.model} {dtype} · {Path(args.workload).name}: {len(window)} requests, "
        f"{counts.shortened} shortened · KV budget {worker.budget_bytes / 1e9:.2f} GB · {slo.describe()} "
        f"({slo_record['rule']})",
        flush=True,
    )
    configs = args.configs or [CONFIGS / f"{c}.json" for c in DEFAULT_CONFIGS]
    results: dict[str, Any] = {
        "device": name, "model": args.model, "dtype": dtype, "workload": provenance,
        "budget_bytes": worker.budget_bytes, "slo": slo_record, "granularity": args.granularity,
        "configs": {},
    }  # fmt: skip
    first: float | None = None
    for path in configs:
        config = HybridConfig.from_json_file(path)
        runs = []
        for i in range(args.repeats):
            r = search(worker, config, window, slo, args.granularity)
            runs.append(r)
            print(
                f"{path.stem:<16} #{i} capacity {r['capacity']:.3f}× ({r['search']['probes']} probes, "
                f"{'converged' if r['search']['converged'] else 'not converged'}) · {r['tokens_per_s']:.1f} "
                f"tok/s there · seqs {r['max_num_seqs']} · {r['wall_s']:.1f} s",
                flush=True,
            )
            results["configs"][path.stem] = runs
            _write(args, results)
        caps = [r["capacity"] for r in runs]
        mid = statistics.median(caps)
        noise = median_spread(caps) if mid > 0 else float("nan")
        first = mid if first is None else first
        print(
            f"  {path.stem}: median capacity {mid:.3f}× the trace's rate, largest distance from it "
            f"{100 * noise:.1f} % over {len(caps)} searches, {mid / first:.2f}× the first config's",
            flush=True,
        )
        worker.release()


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
