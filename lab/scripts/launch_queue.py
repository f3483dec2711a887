"""How many launches the host can enqueue behind a sleeping device before a launch blocks: the depth that
bounds a gate of the gated clock (an eager forward of a Llama-3.1-8B shape launches about a thousand ops).

The device sleeps ``--sleep-ms``; meanwhile the host launches ``--launches`` tiny kernels (an in-place add on
a 1-element tensor) and times each launch; a launch that took longer than 1 ms waited for the queue. Prints
the first such launch's index and the host's time there. From the repository root on the GPU:

    python lab/scripts/launch_queue.py [--sleep-ms 300] [--launches 4000]
"""

from __future__ import annotations

import argparse
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--sleep-ms", type=float, default=300.0)
p.add_argument("--launches", type=int, default=4000)
args = p.parse_args()

x = torch.zeros(1, device="cuda")
for _ in range(100):  # warm-up: the kernel loaded, the allocator's block held
    x.add_(1)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
torch.cuda._sleep(1 << 24)
b.record()
b.synchronize()
cycles_per_ms = (1 << 24) / a.elapsed_time(b)
for op in ("add", "sleep-free"):
    torch.cuda.synchronize()
    if op == "add":
        torch.cuda._sleep(int(args.sleep_ms * cycles_per_ms))
    times, t0 = [], time.perf_counter()
    for _ in range(args.launches):
        t = time.perf_counter()
        x.add_(1)
        times.append((time.perf_counter() - t) * 1000.0)
    total = (time.perf_counter() - t0) * 1000.0
    torch.cuda.synchronize()
    blocked = next((i for i, ms in enumerate(times) if ms > 1.0), None)
    print(
        f"{op}: {args.launches} launches in {total:.1f} ms of host time behind a {args.sleep_ms:.0f}-ms sleep"
        if op == "add"
        else f"{op}: {args.launches} launches in {total:.1f} ms of host time on a running device",
        f"· first launch over 1 ms: {blocked} ({times[blocked]:.1f} ms)"
        if blocked is not None
        else "· no launch over 1 ms",
        flush=True,
    )
