"""Where a new cache's set-up goes: the unmeasured replay that primes a config before its first probe.

A study's trial pays one set-up per config (6-12 s on an H200, Llama-3.1-8B shape, 1 GiB, 96 requests of
0.25x lengths), its validation one per search: the priming replay serves the window all at once, capturing
the decode graphs of every bucket it meets. For each config this times, on the gated clock a study uses:
the priming replay (wall, graph captures, iterations), the same replay again on the kept cache, and a
priming replay with outputs cut to ``--cut`` tokens followed by the full one (what a short prime would leave
to the first measured replay); ``--worker``: the worker's own prime (outputs cut, on the cache the whole
requests reuse), then two whole replays. ``--profile`` runs the host profiler (cProfile) over the first
priming replay. From the repository root on the GPU:

    python lab/scripts/prime_cost.py [--workload examples/traces/azure_conv_later.csv] [--cut 16]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time
from pathlib import Path
from typing import Any

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.engine import DEFAULT_BASELINE, resolve_device
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.engine.traces import LengthPolicy, read_trace
from kvtune.studies.names import CAPACITY_CLOCK
from kvtune.tuner.worker import local_worker, outputs_cut
from kvtune.tuner.workload import rebase

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"

p = argparse.ArgumentParser()
p.add_argument("--model", default="random:llama-3.1-8b")
p.add_argument("--workload", default=str(ROOT / "examples" / "traces" / "azure_conv_later.csv"))
p.add_argument("--requests", type=int, default=96)
p.add_argument("--length-scale", type=float, default=0.25)
p.add_argument("--kv-budget", type=int, default=1 << 30)
p.add_argument("--cut", type=int, default=16, help="output tokens of the short prime")
p.add_argument("--profile", action="store_true", help="cProfile the first priming replay")
p.add_argument("--worker", action="store_true", help="the worker's own prime, then two whole replays")
p.add_argument("--device", default="cuda")
args = p.parse_args()

device = resolve_device(args.device)
clock = SchedulerConfig(clock=CAPACITY_CLOCK)
worker = local_worker(args.model, device, str(TEXT), None, args.kv_budget, clock)
trace = read_trace(args.workload)
cut = trace.sample(n=args.requests, seed=0, start_fraction=0.75, end_fraction=1.0)
fitted, _ = LengthPolicy(worker.loaded.spec.max_context, "clip", args.length_scale, None).apply(cut.requests)
requests = tuple(rebase(fitted))
prompts, outputs = sum(r.input_length for r in requests), sum(r.output_length for r in requests)
print(f"{len(requests)} requests, prompts {prompts} tokens, outputs {outputs}")

configs = {
    "unquantized": DEFAULT_BASELINE,
    "int8": dataclasses.replace(DEFAULT_BASELINE, quantization_bits=8),
    "int4": dataclasses.replace(DEFAULT_BASELINE, quantization_bits=4),
}
replayer = worker.replayer


def timed(config: HybridConfig, reqs: tuple[Any, ...], label: str, profile: bool = False) -> dict[str, Any]:
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    m = replayer.replay(config, reqs, 0.0, warmup=WARMUP_REQUESTS)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t
    d = m.to_dict()
    print(
        f"  {label:<22} wall {wall:6.2f} s  captures {d.get('graph_captures', 0):>3} in "
        f"{d.get('graph_capture_ms', 0.0) / 1000:5.2f} s  clock {d['duration_s']:5.2f} s  steps "
        f"{d['decode_steps']:>5}  mixed {d.get('mixed_iterations', 0):>4}  "
        f"busy {d.get('device_busy', float('nan')):.2f}"
    )
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print("\n".join(s.getvalue().splitlines()[:60]))
    return d | {"wall_s": wall}


short = outputs_cut(requests, args.cut)
for i, (name, config) in enumerate(configs.items()):
    print(name)
    replayer.release()
    if args.worker:  # the worker's prime, then two whole replays
        t = time.perf_counter()
        worker._prime(replayer, config, requests, WARMUP_REQUESTS, None)
        print(f"  {'worker prime':<22} wall {time.perf_counter() - t:6.2f} s")
        timed(config, requests, "first whole replay")
        timed(config, requests, "again (kept cache)")
        continue
    timed(config, requests, "prime (new cache)", profile=args.profile and i == 0)
    timed(config, requests, "again (kept cache)")
    replayer.release()
    timed(config, short, f"short prime ({args.cut} out)")
    timed(config, requests, "then the full replay")
