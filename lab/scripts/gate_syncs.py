"""Where the gated clock's gates open early: every synchronization with the device between a gate and the
iteration's last launch, by the kvtune lines that reached it, over replays on the gated clock; and, for the
waits PyTorch's check does not see (an event's synchronize, a pinned allocation), the host time of the main
calls inside each gate and the first of them whose end found the gate already open.

PyTorch's synchronization check (``torch.cuda.set_sync_debug_mode("warn")``) is switched on while a gate is
open; each warning's stack is folded to its innermost kvtune frames and counted. Printed per replay: the
gated iterations, the gates that opened early (``gate_leaks``), the gates' sleep and the clock's duration,
then the synchronizing sites. From the repository root on the GPU:

    python lab/scripts/gate_syncs.py [--model random:llama-3.1-8b] [--rate 3.0]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from capacity_noise import windows_of

from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.plan import StepBuffers
from kvtune.engine.engine import DEFAULT_BASELINE, Engine
from kvtune.engine.graphs import DecodeGraphs
from kvtune.engine.model import LlamaModel, load_model
from kvtune.engine.scheduler import SchedulerConfig

p = argparse.ArgumentParser()
p.add_argument("--workload", default="examples/traces/azure_conv_later.csv")
p.add_argument("--model", default="random:llama-3.1-8b")
p.add_argument("--requests", type=int, default=96)
p.add_argument("--rate", type=float, default=3.0, help="loaded replay: × the window's own rate")
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--device", default="cuda", help="cpu: the script's own check (nothing is gated there)")
p.add_argument("--no-cudnn-sdpa", action="store_true", help="PyTorch's cuDNN attention backend off")
args = p.parse_args()
if args.no_cudnn_sdpa:
    torch.backends.cuda.enable_cudnn_sdp(False)

sites: collections.Counter[tuple[str, ...]] = collections.Counter()
gate, close = Engine._gate, Engine._gate_close
# while a gate is open: its host start, its mark, the calls timed inside (name, ms, whether it had opened)
current: list[Any] = []
# leaked iterations, by the first timed call that saw the gate open
opened_in: collections.Counter[str] = collections.Counter()
call_ms: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)  # (call, leaked): its host ms
# (leaked, a device allocation inside, a pinned host allocation inside): gated iterations
allocs: collections.Counter[tuple[bool, bool, bool]] = collections.Counter()
closed, started = [0], time.perf_counter()
# (iteration kind, leaked): (host ms, the gate's planned ms) of each gated iteration
kinds: dict[tuple[str, bool], list[tuple[float, float]]] = collections.defaultdict(list)


def _alloc_counts() -> tuple[int, int]:
    """cudaMalloc and cudaHostAlloc calls so far (both may wait for the device: implicit synchronizations
    that PyTorch's check does not report); -1 where this PyTorch does not count them."""
    if not torch.cuda.is_available():
        return -1, -1
    device = torch.cuda.memory_stats().get("num_device_alloc", -1)
    host = (
        torch.cuda.host_memory_stats().get("num_host_alloc", -1)
        if hasattr(torch.cuda, "host_memory_stats")
        else -1
    )
    return int(device), int(host)


# each gated prompt alone (kind prefill), in order: its tokens (the forward's chunk), whether a
# prompt of that many tokens came before, its first segment's host ms, leaked, a cudaMalloc inside
prompts: list[tuple[int, bool, float, bool, bool]] = []
prompt_lengths: set[int] = set()
forward = Engine._forward
forward_tokens: list[int | None] = [None]  # the prompt tokens of the forward about to gate


def watched_forward(self, run, slots, chunks, start, progress):  # type: ignore[no-untyped-def]
    forward_tokens[0] = sum(n for _, n in chunks)
    return forward(self, run, slots, chunks, start, progress)


Engine._forward = watched_forward  # type: ignore[method-assign]


def watched_gate(self, run, key):  # type: ignore[no-untyped-def]
    mark = gate(self, run, key)
    current[:] = [time.perf_counter(), run, [], _alloc_counts(), key[0], run.gate.planned, forward_tokens[0]]
    forward_tokens[0] = None
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    return mark


def watched_close(self, run, excused=False):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    if current and run.gate is not None and not excused:
        leaked = _opened(run)
        calls = current[2]
        (device0, host0), (device1, host1) = current[3], _alloc_counts()
        allocs[(leaked, device1 > device0 >= 0, host1 > host0 >= 0)] += 1
        if leaked:
            first = next((name for name, _, seen in calls if seen), "after the last timed call")
            opened_in[first] += 1
        for name, ms, _ in calls:
            call_ms[(name, leaked)].append(ms)
        kinds[(current[4], leaked)].append(((time.perf_counter() - current[0]) * 1000, current[5]))
        if current[4] == "prefill" and current[6] is not None:
            n, host0 = current[6], run.gate.host[0] if run.gate.host else float("nan")
            prompts.append((n, n in prompt_lengths, host0, leaked, device1 > device0 >= 0))
            prompt_lengths.add(n)
    current.clear()
    closed[0] += 1
    if closed[0] % 25 == 0:  # progress: a run whose gates grow too long shows it before its limit
        g = self._gates
        sizes = ", ".join(f"{k}/{n}{'' if f else ' layers'} {g.ms((k, n), f):.1f}" for k, n, f in g._host)
        print(f"  [{closed[0]} gated iterations closed, {time.perf_counter() - started:.0f} s] gates (ms): "
              f"{sizes}", flush=True)  # fmt: skip
    return close(self, run, excused)


def _opened(run: Any) -> bool:
    """Whether a gate of the iteration (one between its layers, or the one open now) ended early."""
    return run.gate is not None and (run.gate.leaked or run.gate.last.query())


def timed(owner: Any, name: str) -> None:
    """Time ``owner.name`` while a gate is open, noting whether the gate had opened by its end."""
    inner = getattr(owner, name)

    def call(*a: Any, **k: Any) -> Any:
        if not current:
            return inner(*a, **k)
        t = time.perf_counter()
        out = inner(*a, **k)
        current[2].append((f"{owner.__name__}.{name}", (time.perf_counter() - t) * 1000, _opened(current[1])))
        return out

    setattr(owner, name, call)


for owner, names in (
    (
        HybridCache,
        ("prepare_step", "finish_step", "begin_step_slots", "end_step", "prefill", "prefill_chunks"),
    ),
    (DecodeGraphs, ("prepare", "run")),
    (LlamaModel, ("prefill", "forward_mixed")),
    (StepBuffers, ("wait_staging", "upload")),
    (torch.Tensor, ("pin_memory",)),
):
    for name in names:
        timed(owner, name)


def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    if "synchroniz" not in str(message):
        return
    frames = [f for f in traceback.extract_stack() if "/kvtune/" in f.filename]
    sites[tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:])] += 1


segment_done = Engine._segment_done
# (kind, segment index): [leaked segments, host ms of each segment] (0: the iteration's first segment)
segments: dict[tuple[str, int], list[Any]] = collections.defaultdict(lambda: [0, []])


def watched_segment(self, g):  # type: ignore[no-untyped-def]
    """Which segment of an iteration leaked first (the first, a layer's, the last), and its host time."""
    was, index = g.leaked, len(g.host)
    segment_done(self, g)
    cell = segments[(g.key[0], index)]
    cell[0] += int(g.leaked and not was)
    cell[1].append(g.host[-1])


Engine._segment_done = watched_segment  # type: ignore[method-assign]
warm_rows = LlamaModel.warm_rows


warmed = [0, 0, 0.0]  # since the last replay's line: calls that ran a new row count, counts, wall ms


def watched_warm_rows(self, counts, logits=()):  # type: ignore[no-untyped-def]
    """Row counts run ahead of the clock (the replay's prompts, an eager forward's before its gate)."""
    t = time.perf_counter()
    n = warm_rows(self, counts, logits)
    if n:
        warmed[0], warmed[1], warmed[2] = (
            warmed[0] + 1,
            warmed[1] + n,
            warmed[2] + (time.perf_counter() - t) * 1e3,
        )
    return n


LlamaModel.warm_rows = watched_warm_rows  # type: ignore[method-assign]
Engine._gate, Engine._gate_close = watched_gate, watched_close  # type: ignore[method-assign]
warnings.showwarning = record
warnings.simplefilter("always")
cuda = torch.device(args.device)
loaded = load_model(args.model, cuda, dtype=torch.bfloat16)
ns = argparse.Namespace(workload=args.workload, windows=3, requests=args.requests, length_scale=0.25)
window = windows_of(ns, loaded.spec.max_context)[0][0]
engine = Engine(loaded, DEFAULT_BASELINE, 1 << 30, cuda, SchedulerConfig(clock="gated"))
short = tuple(dataclasses.replace(r, output_length=min(r.output_length, 8)) for r in window)
for name, scale, requests in (
    ("unloaded (8 tokens out)", 1000.0, short),
    (f"{args.rate}x", 1.0 / args.rate, window),
    ("at once", 0.0, window),
):
    for k in range(args.repeats):
        m = engine.replay(requests, scale, warmup_requests=4).to_dict()
        print(
            f"{name} #{k}: {m['gated_iterations']} gated iterations, {m['gate_leaks']} opened early "
            f"({m['gate_stretches']} before their planned length), gates "
            f"{m['gate_ms'] / 1000:.2f} s, host waits {m['gate_waits']} ({m['gate_wait_ms'] / 1000:.2f} s), "
            f"clock {m['duration_s']:.2f} s, "
            f"P99 TTFT {m['ttft_p99_ms']:.1f} ms, "
            f"median TPOT {m['tpot_p50_ms']:.2f} ms; row counts run ahead: {warmed[1]} in {warmed[0]} calls, "
            f"{warmed[2]:.0f} ms",
            flush=True,
        )
        warmed[:] = [0, 0, 0.0]
print("gated iterations by kind (count; median host ms, median gate ms), leaked / clean:")
for kind in sorted({k[0] for k in kinds}):
    cells = []
    for leaked in (True, False):
        v = kinds.get((kind, leaked), [])
        host, gated = sorted(h for h, _ in v), sorted(g for _, g in v)
        cells.append(f"{len(v)}; {host[len(v) // 2]:.2f}, {gated[len(v) // 2]:.2f}" if v else "0")
    print(f"  {kind:<8} leaked {cells[0]:<24} clean {cells[1]}")
print("segments by kind and index (0: set-up, first layer): leaked first there / all; host ms median, max")
for kind in sorted({k for k, _ in segments}):
    cells = []
    for (k, i), (leaked, host) in sorted(segments.items()):
        if k == kind and (i in (0, 1) or leaked or i % 8 == 0):
            host = sorted(host)
            cells.append(f"#{i} {leaked}/{len(host)} {host[len(host) // 2]:.2f},{host[-1]:.1f}")
    print(f"  {kind:<8} " + "  ".join(cells))
print("prompts alone (tokens; a prompt of that length before in the process): leaked / all, first segment's "
      "host ms median; with a cudaMalloc inside")  # fmt: skip
for before in (False, True):
    v = [p for p in prompts if p[1] == before]
    host = sorted(p[2] for p in v)
    print(f"  {'seen' if before else 'new '} {sum(p[3] for p in v)}/{len(v)}, "
          f"{host[len(host) // 2] if host else float('nan'):.2f} ms; "
          f"cudaMalloc in {sum(p[4] for p in v)} ({sum(p[4] and p[3] for p in v)} leaked)")  # fmt: skip
each = (f"{n} {h:.1f}{' L' if leaked else ''}{' M' if m else ''}" for n, _, h, leaked, m in prompts)
print("  every prompt in order (tokens, first segment's host ms; L leaked, M cudaMalloc): " + ", ".join(each))
print("leaked iterations, by the first timed call whose end saw the gate open:")
for name, n in opened_in.most_common():
    print(f"{n:6d}  {name}")
print("gated iterations by (opened early, a cudaMalloc inside, a cudaHostAlloc inside):")
for key, n in sorted(allocs.items()):
    print(f"{n:6d}  {key}")
print("host ms of the calls inside gates (median, max; iterations that leaked / did not):")
for name in sorted({k[0] for k in call_ms}):
    cells = []
    for leaked in (True, False):
        v = sorted(call_ms.get((name, leaked), []))
        cells.append(f"{v[len(v) // 2]:.3f}, {v[-1]:.3f} ({len(v)})" if v else "-")
    print(f"  {name:<32} leaked {cells[0]:<28} clean {cells[1]}")
print(f"synchronizing sites inside open gates: {sum(sites.values())}")
for where, n in sites.most_common(20):
    print(f"{n:6d}  " + " <- ".join(reversed(where)))
