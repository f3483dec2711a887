"""Replay one trace sample through several cache configs: same model, sample, budget and time scale.

What ``kvtune replay`` does for one config, for several in one process (the model is loaded once and the time
scale calibrated once, on the unquantized baseline, then shared), and a table of the result:

    python benchmarks/replay_compare.py --model random:llama-3-8b --workload TRACE --requests 64 \\
        --budget-gb 40 examples/configs/q_unquantized.json examples/configs/q_int8.json ...

Writes every config's full metrics to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import load_workload, resolve_device
from kvtune.engine.model import load_model
from kvtune.engine.options import DTYPES, ReplayOptions
from kvtune.engine.replay import Replayer
from kvtune.engine.scheduler import SchedulerConfig

COLUMNS = (
    ("tpot_p50_ms", "TPOT p50"),
    ("tpot_p99_ms", "TPOT p99"),
    ("ttft_p99_ms", "TTFT p99"),
    ("tokens_per_s", "tok/s"),
    ("attn_bandwidth_gbs", "attn GB/s"),
    ("attn_utilization", "attn util"),
    ("bookkeeping_share", "bookkeep"),
    ("peak_running", "peak batch"),
    ("preemptions", "preempt"),
    ("prefix_hit_rate", "prefix hit"),
)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", type=Path)
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-gb", type=float, required=True)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--length-cap", type=int, default=None)
    p.add_argument(
        "--max-num-seqs", "--max-batch", type=int, default=None, help="default: what the budget holds"
    )
    p.add_argument("--load", type=float, default=0.75)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    args = _args()
    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device, dtype=DTYPES[args.dtype])
    requests, _counts, provenance = load_workload(
        args.workload, loaded.spec.max_context, args.requests, args.seed, args.length_scale, args.length_cap
    )
    budget = int(args.budget_gb * 1e9)
    configs = [HybridConfig.from_json_file(p) for p in args.configs]
    t0 = time.perf_counter()
    replayer = Replayer(
        loaded, device, ReplayOptions(budget, scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs))
    )
    scale = replayer.calibrate(requests, args.load, configs[0])
    print(
        f"model {args.model} on {device} ({_device_name(device)}), {len(requests)} requests, budget "
        f"{args.budget_gb} GB, time scale {scale:.4g} (calibrated in {time.perf_counter() - t0:.1f} s)"
    )
    results = {}
    for path, config in zip(args.configs, configs, strict=True):
        metrics = replayer.replay(config, requests, scale).to_dict()  # shortened requests count themselves
        results[path.stem] = {"config": config.to_dict(), "metrics": metrics}
        print(path.stem, " ".join(f"{label}={_fmt(metrics.get(key))}" for key, label in COLUMNS), flush=True)
    if args.json:
        out = {
            "model": args.model,
            "device": _device_name(device),
            "time_scale": scale,
            "budget_bytes": budget,
            "sample": provenance,
            "results": results,
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
