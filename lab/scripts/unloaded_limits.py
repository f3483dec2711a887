"""The unloaded replay the capacity limits come from, repeated in one process: each measurement's P99 TTFT
and median TPOT, beside the P99 TTFT of the unmeasured replay that primes it, the host's launch time over
the device time of its op-by-op forwards (above 1: launch-bound, the host's jitter reaches the device
clock) and the SM clock nvidia-smi saw meanwhile (a lightly loaded GPU may lower it). Run it in several
processes to see how far the limits move between studies. From the repository root on the GPU:

    python lab/scripts/unloaded_limits.py --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from capacity_noise import TEXT, windows_of
from gpu_state import GpuSampler

from kvtune.engine.engine import DEFAULT_BASELINE, resolve_device
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import CLOCKS, SchedulerConfig
from kvtune.tuner.worker import local_worker

p = argparse.ArgumentParser()
p.add_argument("--workload", default="examples/traces/azure_conv_later.csv")
p.add_argument("--model", default="random:llama-3.1-8b")
p.add_argument("--requests", type=int, default=96)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--clock", choices=CLOCKS, default="device")
args = p.parse_args()
t0 = time.perf_counter()
clock = SchedulerConfig(clock=args.clock)
worker = local_worker(args.model, resolve_device(None), str(TEXT), None, 1 << 30, clock)
ns = argparse.Namespace(workload=args.workload, windows=3, requests=args.requests, length_scale=0.25)
window = windows_of(ns, worker.loaded.spec.max_context)[0][0]
print(f"worker ready in {time.perf_counter() - t0:.1f} s", flush=True)
for k in range(args.repeats):
    t1 = time.perf_counter()
    with GpuSampler(period_ms=50) as gpu:
        u = worker.unloaded(DEFAULT_BASELINE, window, WARMUP_REQUESTS)
    launch = f"launch/device {u.get('launch_ratio', float('nan')):.2f}"
    if u.get("gated_iterations"):
        launch += f", {u.get('gate_leaks', 0):.0f} of {u['gated_iterations']:.0f} gates leaked"
    clock = GpuSampler.describe(gpu.summary())
    first, each = u["unprimed_ttft_p99_ms"], ", ".join(f"{x:.2f}" for x in u["ttft_p99_repeats"])
    print(
        f"unloaded #{k}: P99 TTFT {u['ttft_p99_ms']:.2f} ms (median of {each}; priming: {first:.2f} ms), "
        f"median TPOT {u['tpot_p50_ms']:.3f} ms · {launch} · {clock} · {time.perf_counter() - t1:.1f} s",
        flush=True,
    )
