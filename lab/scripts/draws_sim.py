"""What repeated searches of one window would read if each replay's verdict were a draw: kvtune's own
``CapacitySearch`` driven by a simulated replay that passes at rate r with probability
1 / (1 + (r / r50) ** (1 / scale)) (the logistic fitted to the H200's probes, scale 0.045-0.055), for the
plain bisection and for 8, 12 and 16 draws at the estimated half-pass rate. Printed per rule: the median and
the 80th percentile of the range of three searches ((max - min) / median, the study's noise), how often it is
at most 5 %, and the mean search time at 8 s a passing and 5 s a failing probe (run 19's probes). CPU only:

    python lab/scripts/draws_sim.py --scale 0.05 --sets 400 [--lapse 0.03]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from kvtune.tuner.capacity import CapacitySearch

p = argparse.ArgumentParser()
p.add_argument("--scale", type=float, default=0.05)
p.add_argument("--r50", type=float, default=2.8)
p.add_argument("--sets", type=int, default=300, help="sets of three searches per rule")
p.add_argument("--start", type=float, default=1.0)
p.add_argument("--lapse", type=float, default=0.0, help="the simulated replays' chance to collapse anyway")
args = p.parse_args()
rng = random.Random(0)


def search(draws: int) -> tuple[float, float]:
    state, seconds = CapacitySearch(args.start, 0.025, 12, draws=draws), 0.0
    while (rate := state.next_rate()) is not None:
        passed = rng.random() < 1.0 / (1.0 + math.exp((math.log(rate) - math.log(args.r50)) / args.scale))
        passed = passed and rng.random() >= args.lapse
        seconds += 8.0 if passed else 5.0
        state = state.record(rate, passed)
    return state.capacity, seconds


print(f"scale {args.scale}, r50 {args.r50}, lapse {args.lapse}, {args.sets} sets of three searches from "
      f"{args.start}x")  # fmt: skip
for draws in (0, 8, 12, 16):
    ranges, times = [], []
    for _ in range(args.sets):
        found = [search(draws) for _ in range(3)]
        caps = [c for c, _ in found]
        ranges.append((max(caps) - min(caps)) / statistics.median(caps))
        times += [t for _, t in found]
    ranges.sort()
    name = "plain bisection" if draws == 0 else f"{draws} draws"
    within = sum(r <= 0.05 for r in ranges) / len(ranges)
    print(f"  {name:<16} range median {100 * statistics.median(ranges):4.1f} %, 80th percentile "
          f"{100 * ranges[int(0.8 * len(ranges))]:4.1f} %, at most 5 % in {within:.0%}"
          f" · {statistics.fmean(times):4.0f} s a search")  # fmt: skip
