"""Replays of the baseline near its capacity, whole (no stop), with the counters that show how a replay
collapses: the same window and rate repeated. Run from the repository root on the GPU:

    python lab/scripts/collapse.py --replays 4 --at 1:2.376 --at 0:2.830
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from capacity_noise import TEXT, windows_of

from kvtune.engine.engine import DEFAULT_BASELINE, resolve_device
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.studies.names import SLO_PERCENTILE
from kvtune.tuner.capacity import Slo, decision_margin, derive_slo
from kvtune.tuner.worker import gc_paused, local_worker

p = argparse.ArgumentParser()
p.add_argument("--workload", default="examples/traces/azure_conv_later.csv")
p.add_argument("--at", action="append", default=[], help="window:rate")
p.add_argument("--replays", type=int, default=4)
args = p.parse_args()
ns = argparse.Namespace(workload=args.workload, windows=3, requests=96, length_scale=0.25)
worker = local_worker("random:llama-3.1-8b", resolve_device(None), str(TEXT), None, 1 << 30,
                      SchedulerConfig(clock="device"))  # fmt: skip
windows = windows_of(ns, worker.loaded.spec.max_context)
record = derive_slo(worker.unloaded(DEFAULT_BASELINE, windows[0][0], WARMUP_REQUESTS), None, None,
                    percentile=SLO_PERCENTILE)  # fmt: skip
slo = Slo.from_record(record)
print(slo.describe(), flush=True)
keys = ("ttft_p90_ms", "ttft_p99_ms", "tpot_p90_ms", "preemptions", "refused", "peak_running", "max_num_seqs",
        "prefill_share", "decode_steps", "mixed_iterations", "duration_s", "compiles")  # fmt: skip
for spec in args.at:
    w, rate = spec.split(":")
    requests = windows[int(w)][0]
    for k in range(args.replays):
        timings: list = []
        t0 = time.perf_counter()
        with gc_paused():
            m = worker.replay(DEFAULT_BASELINE, requests, 1.0 / float(rate), WARMUP_REQUESTS, timings=timings)
        margin = decision_margin(timings, slo)
        line = " ".join(f"{key}={m.get(key, float('nan')):.4g}" for key in keys)
        print(f"window {w} x{rate} #{k}: margin {margin:+.3f} {line} wall {time.perf_counter() - t0:.1f} s",
              flush=True)  # fmt: skip
