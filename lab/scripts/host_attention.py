"""The host's time of one eager decode attention call (dense INT8 / INT4, the sparse INT8 step's selection and
attention) at 16 x 32K, Llama-3-8B heads: microseconds a call over N calls queued without a wait (the GPU
keeps up where its time is shorter), then cProfile's top functions by own time over the same calls.

    python3 lab/scripts/host_attention.py [--calls 200] [--batches 1] [--top 25] > host.log
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels.quest_summary import summary8


def host_us(fn, calls: int, batches: int) -> tuple[float, float, float]:
    """Host µs a call (median, min, max over ``batches``): each batch ``calls`` calls back to back, the clock
    stopped before the batch's final wait."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    per.sort()
    return per[len(per) // 2], per[0], per[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batches", type=int, default=1, help="batches of --calls; the median is reported")
    ap.add_argument("--top", type=int, default=25, help="functions listed by cProfile (0: no profile)")
    args = ap.parse_args()
    opts = da.defaults()
    cases = {}
    for bits in (8, 4):
        inp = da.make_inputs(da.Case(16, 32768, bits))
        o = opts[f"int{bits}"]
        cases[f"dense INT{bits}"] = lambda inp=inp, o=o: da.run_hybrid(inp, o)
    case = da.sparse_rows(16, 32768, 8)
    inp, blocks, tier, count = da.sparse_setup(case)
    pool, k_blocks = inp["pool"], da.SPARSE_TOKENS // da.BS
    bounds = summary8(pool) if da.summary_default() else None

    def select():
        return da.select_parts(inp["q"], pool, blocks, tier, k_blocks, count, None, bounds)

    selected = select()

    def attend(sel=selected):
        table, num_cold, parts = sel
        return da.hybrid_decode_attention_triton(
            inp["q"], inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], pool, table, num_cold,
            1 / math.sqrt(da.D), options=opts["sparse8"], partition=parts,
        )  # fmt: skip

    cases["sparse INT8 selection"] = select
    cases["sparse INT8 attention"] = attend
    cases["sparse INT8 step"] = lambda: attend(select())
    for name, fn in cases.items():
        med, lo, hi = host_us(fn, args.calls, args.batches)
        spread = f"{lo:.1f}-{hi:.1f} over {args.batches} batches"
        print(f"{name}: {med:.1f} µs of host a call ({spread})", flush=True)
    for name, fn in cases.items() if args.top else ():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"\n==== {name}: {args.calls} calls, by own time\n{s.getvalue()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
