"""Where the gated clock's gates open early: every synchronization with the device between a gate and the
iteration's last launch, by the kvtune lines that reached it, over replays on the gated clock.

PyTorch's synchronization check (``torch.cuda.set_sync_debug_mode("warn")``) is switched on while a gate is
open; each warning's stack is folded to its innermost kvtune frames and counted. Printed per replay: the
gated iterations, the gates that opened early (``gate_leaks``), the gates' sleep and the clock's duration,
then the synchronizing sites. From the repository root on the GPU:

    python lab/scripts/gate_syncs.py [--model random:llama-3.1-8b] [--rate 3.0]
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from capacity_noise import windows_of

from kvtune.engine.engine import DEFAULT_BASELINE, Engine
from kvtune.engine.model import load_model
from kvtune.engine.scheduler import SchedulerConfig

p = argparse.ArgumentParser()
p.add_argument("--workload", default="examples/traces/azure_conv_later.csv")
p.add_argument("--model", default="random:llama-3.1-8b")
p.add_argument("--requests", type=int, default=96)
p.add_argument("--rate", type=float, default=3.0, help="loaded replay: × the window's own rate")
args = p.parse_args()

sites: collections.Counter[tuple[str, ...]] = collections.Counter()
gate, close = Engine._gate, Engine._gate_close


def watched_gate(self, run):  # type: ignore[no-untyped-def]
    mark = gate(self, run)
    torch.cuda.set_sync_debug_mode("warn")
    return mark


def watched_close(self, run, excused=False):  # type: ignore[no-untyped-def]
    torch.cuda.set_sync_debug_mode("default")
    close(self, run, excused)


def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    if "synchroniz" not in str(message):
        return
    frames = [f for f in traceback.extract_stack() if "/kvtune/" in f.filename]
    sites[tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:])] += 1


Engine._gate, Engine._gate_close = watched_gate, watched_close  # type: ignore[method-assign]
warnings.showwarning = record
warnings.simplefilter("always")
cuda = torch.device("cuda")
loaded = load_model(args.model, cuda, dtype=torch.bfloat16)
ns = argparse.Namespace(workload=args.workload, windows=3, requests=args.requests, length_scale=0.25)
window = windows_of(ns, loaded.spec.max_context)[0][0]
engine = Engine(loaded, DEFAULT_BASELINE, 1 << 30, cuda, SchedulerConfig(clock="gated"))
for name, scale in (("unloaded", 1000.0), (f"{args.rate}x", 1.0 / args.rate), ("at once", 0.0)):
    for k in range(2):
        m = engine.replay(window, scale, warmup_requests=4).to_dict()
        print(
            f"{name} #{k}: {m['gated_iterations']} gated iterations, {m['gate_leaks']} opened early "
            f"({m['gate_stretches']} before their planned length), gates "
            f"{m['gate_ms'] / 1000:.2f} s, clock {m['duration_s']:.2f} s, "
            f"P99 TTFT {m['ttft_p99_ms']:.1f} ms, "
            f"median TPOT {m['tpot_p50_ms']:.2f} ms",
            flush=True,
        )
print(f"synchronizing sites inside open gates: {sum(sites.values())}")
for where, n in sites.most_common(20):
    print(f"{n:6d}  " + " <- ".join(reversed(where)))
