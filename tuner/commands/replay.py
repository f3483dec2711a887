"""``kvtune replay --config CFG --workload TRACE``: replay a trace sample on one config, print its metrics."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import load_workload, resolve_device
from kvtune.engine.metrics import json_safe
from kvtune.engine.model import load_model
from kvtune.engine.options import (
    CPU_LENGTH_CAP,
    CPU_LENGTH_SCALE,
    DTYPES,
    MAX_NUM_SEQS_CAP,
    WARMUP_REQUESTS,
    ReplayOptions,
    length_defaults,
)
from kvtune.engine.replay import Replayer
from kvtune.engine.scheduler import CLOCKS, DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from kvtune.tuner.commands import Limits, check_numbers
from kvtune.tuner.console import progress_bar, table_console

NAME = "replay"
HELP = "replay a workload sample on one hybrid_v2 config and report latency, bandwidth and memory metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="hybrid_v2 config JSON file")
    parser.add_argument("--workload", required=True, help="trace: Mooncake JSONL or Azure CSV")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, random:<shape>, a HF directory or a .gguf"
    )
    parser.add_argument("--requests", type=int, default=100, help="requests replayed (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="picks where the sample starts in the trace")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="model precision (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="KV budget in GB (default: 0.9 of the free device memory; CPU: capped at 4 GiB)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="factor on inter-arrival times (default: calibrated so the unquantized baseline "
        "runs at --load of its saturation throughput); 0 = all requests at once",
    )
    parser.add_argument(
        "--load", type=float, default=0.75, help="target load of the calibration (default 0.75)"
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help=f"factor on request lengths (default: 1 on CUDA, {CPU_LENGTH_SCALE:g} on CPU)",
    )
    parser.add_argument(
        "--length-cap",
        type=int,
        default=None,
        help=f"cap on prompt + output tokens (default: none on CUDA, {CPU_LENGTH_CAP} on CPU)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_REQUESTS,
        help=f"warm-up requests, not measured (default {WARMUP_REQUESTS})",
    )
    parser.add_argument(
        "--max-num-seqs",
        "--max-batch",
        dest="max_num_seqs",
        type=int,
        default=None,
        help="most sequences running at once (default: as many of the workload's mean length as the KV "
        f"budget holds, at most {MAX_NUM_SEQS_CAP})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-tokens",
        dest="max_num_batched_tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens of one engine iteration, decode tokens and prompt chunks together; longer prompts go in "
        f"chunks (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        help="run every decode step eagerly (default: decode-only iterations replay CUDA graphs on CUDA)",
    )
    parser.add_argument(
        "--no-mixed",
        dest="mixed",
        action="store_false",
        help="prefill prompts in forwards of their own before each decode step (the former engine; default: "
        "decode tokens and prompt chunks in one forward)",
    )
    parser.add_argument(
        "--piecewise",
        action="store_true",
        help="forwards with prompt tokens (up to 2,048) run their projections, norms and MLP as CUDA graphs "
        "captured per token bucket, their attention eagerly between them (default: op by op)",
    )
    parser.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="forwards with prompt tokens whose shapes fit run whole as one CUDA graph per shape bucket, "
        "attention and cache writes inside, captured on a shape's second use (needs the graphs)",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="what the replay's clock counts: host time (wall, the default), each iteration's time on the "
        "device (device: the host's jitter between iterations does not move arrivals or token times) or that "
        "with the host's launch gaps held off the device (gated)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's choice)"
    )
    parser.add_argument("--json", default=None, help="write the metrics and their provenance to this file")


LIMITS: Limits = {
    "--requests": (1, True),
    "--budget-gb": (0, False),
    "--time-scale": (0, True),
    "--load": (0, False),
    "--length-scale": (0, False),
    "--length-cap": (1, True),
    "--warmup": (0, True),
    "--threads": (1, True),
}


def run(args: argparse.Namespace) -> int:
    check_numbers(args, LIMITS)
    config = HybridConfig.from_json_file(args.config)
    scheduler = SchedulerConfig(  # bad limits fail before loading
        args.max_num_seqs, args.max_num_batched_tokens, graphs=args.graphs, mixed=args.mixed,
        clock=args.clock, piecewise=args.piecewise, mixed_graphs=args.mixed_graphs,
    )  # fmt: skip
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if cpu else torch.bfloat16)
    console = Console(stderr=True)
    with console.status(f"loading {args.model}"):
        loaded = load_model(args.model, device, dtype)
    default_scale, default_cap = length_defaults(device)
    scale = args.length_scale if args.length_scale is not None else default_scale
    cap = args.length_cap if args.length_cap is not None else default_cap
    requests, _counts, workload = load_workload(
        args.workload, loaded.spec.max_context, args.requests, args.seed, scale, cap
    )
    budget = int(args.budget_gb * 1e9) if args.budget_gb is not None else None
    replayer = Replayer(loaded, device, ReplayOptions(budget, args.warmup, scheduler))
    budget = replayer.budget_bytes
    time_scale = args.time_scale
    if time_scale is None:
        with console.status(f"calibrating the time scale (unquantized baseline at load {args.load})"):
            time_scale = replayer.calibrate(requests, args.load, config)
    with progress_bar(console) as bar:
        task = bar.add_task("replay", total=len(requests))
        metrics = replayer.replay(config, requests, time_scale, lambda d, t: bar.update(task, completed=d))
    result = metrics.to_dict()
    table_console().print(_table(result, config, args.model, time_scale, budget))
    for warning in metrics.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if args.json:
        record = {
            "metrics": result,
            "config": config.to_dict(),
            "model": args.model,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "budget_bytes": budget,
            "time_scale": time_scale,
            "workload": workload,
        }
        Path(args.json).write_text(json.dumps(json_safe(record), indent=2) + "\n", encoding="utf-8")
    return 0


ROWS: tuple[tuple[str, str, str], ...] = (
    ("TTFT P50 / P90 / P99", "ttft", "ms"),
    ("TPOT P50 / P90 / P99", "tpot", "ms"),
    ("inter-token P50 / P90 / P99", "itl", "ms"),
    ("end-to-end P50 / P90 / P99", "e2e", "ms"),
)


DEBUG_ROWS = (
    "hot_attention_share",
    "l1_attention_share",
    "l2_attention_share",
    "l2_occupancy",
    "migrations_done",
    "migrations_queued",
    "seal_key_rel_error",
    "seal_value_rel_error",
)


def _table(m: dict[str, Any], config: HybridConfig, model: str, time_scale: float, budget: int) -> Table:
    table = Table(title=f"kvtune replay: {model}, {_describe(config)}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, unit in ROWS:
        values = " / ".join(_fmt(m[f"{key}_p{p}_ms"]) for p in (50, 90, 99))
        table.add_row(label, f"{values} {unit}")
    table.add_row("output tokens/s", _fmt(m["tokens_per_s"]))
    table.add_row(
        "attention bandwidth",
        f"{_fmt(m['attn_bandwidth_gbs'])} GB/s "
        f"({_fmt(100 * m['attn_utilization'])} % of copy {_fmt(m['copy_bandwidth_gbs'])} GB/s)",
    )
    table.add_row(
        "bookkeeping per step",
        f"{_fmt(m['bookkeeping_ms_per_step'])} ms "
        f"({_fmt(100 * m['bookkeeping_share'])} % of {_fmt(m['step_ms'])} ms)",
    )
    table.add_row("peak KV memory", f"{m['peak_kv_bytes'] / 1e9:.3f} GB of {budget / 1e9:.3f} GB")
    table.add_row("peak running sequences", str(m["peak_running"]))
    graphs = "CUDA graphs" if m.get("cuda_graphs") else "static steps" if m.get("graphs") else "eager"
    table.add_row(
        "engine",
        f"max_num_seqs {m.get('max_num_seqs')}, max_num_batched_tokens {m.get('max_num_batched_tokens')}, "
        f"{graphs}, {'mixed' if m.get('mixed') else 'separate'} iterations"
        + (f", {m['piecewise_forwards']} prompt forwards in pieces" if m.get("piecewise_forwards") else ""),
    )
    table.add_row("completed / refused / clipped", f"{m['completed']} / {m['refused']} / {m['clipped']}")
    table.add_row("preemptions", str(m["preemptions"]))
    table.add_row("prefill chunks", str(m["prefill_chunks"]))
    table.add_row("prefix-hit rate", f"{_fmt(100 * m['prefix_hit_rate'])} %")
    table.add_row("time scale", _fmt(time_scale))
    for key, value in m.get("debug", {}).items():
        if key in DEBUG_ROWS:
            table.add_row(f"debug: {key}", _fmt(float(value)))
    return table


def _describe(config: HybridConfig) -> str:
    bits = "unquantized" if config.quantization_bits == 0 else f"INT{config.quantization_bits}"
    sparse = f", sparse_top_k {config.sparse_top_k}" if config.sparse_top_k else ""
    return f"{bits}, hot {config.hot_tokens}, block {config.block_size}{sparse}"


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
