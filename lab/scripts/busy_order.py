"""The decode kernels' launch order (row-major or split-major) against busy splits and split counts.

For the sparse rows (16 x 32K, 4 x 128K: L1 1/8 + top 2,048, the table selected once, as
``benchmarks/decode_attention.py`` sets them up) and the dense rows (64 x 8K, 16 x 32K, 4 x 128K), INT8, INT4
and unquantized, in one process: the attention as CUDA graph replays (median of ``do_bench_cudagraph``)
launched row-major and split-major (``gluon_decode.SPLIT_MAJOR`` for the Gluon builds,
``triton_decode.SPLIT_MAJOR`` for the split kernel, which takes the unquantized rows); for each
``gluon_busy_blocks`` (INT4) or (8-bit, 4-bit) pair (sparse INT8 on ``gluon_mixed``) of the lists below; for
the split counts forced at 4 x 128K; and with the default options planned with ``--free`` slots a
multiprocessor left out (``triton_decode.WAVE_FREE``). ``--rounds`` passes over everything, so each cell has
that many timings. The outputs of the two orders must be the same bit for bit (each program computes the same
thing). Writes ``busy_order.json`` and prints a table.

    python lab/scripts/busy_order.py --out $OUT [--rounds 2] [--free 0,1,2] [--smoke]
    (--smoke: tiny shapes under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da
from merge_tile import forced_plan, sparse_inputs

from kvtune.kernels import gluon_decode, triton_decode

BUSY4 = [(1, 0), (8, 0), (12, 0), (16, 0), (18, 0), (24, 0), (36, 0)]
BUSY8 = [(20, 4), (1, 0), (12, 4), (16, 4), (24, 4), (32, 4), (20, 8), (32, 8)]
FORCED = {4: [16], 8: [12]}  # split counts forced at 4 x 128K (run 25f's fastest)


def width(bits: int) -> str:
    return f"INT{bits}" if bits else "unquantized"


def time_variant(
    inp: dict, opt, forced: int, free: int, major: bool
) -> tuple[float, list[torch.Tensor], dict]:
    """One variant in one order: its graph-replay ms, its outputs and its plan (``forced``: the split count
    forced, 0 for the planned one; ``free``: ``triton_decode.WAVE_FREE`` while it runs)."""
    planned = triton_decode.plan_splits
    defaults = gluon_decode.SPLIT_MAJOR, triton_decode.SPLIT_MAJOR, triton_decode.WAVE_FREE
    gluon_decode.SPLIT_MAJOR = triton_decode.SPLIT_MAJOR = major
    triton_decode.WAVE_FREE = free
    if forced:
        triton_decode.plan_splits = forced_plan(forced)
    try:

        def run():
            return da.run_hybrid(inp, opt)

        run()  # a build's first launch reads its occupancy, and the launches after it plan by the wave model
        outs = [x.clone() for x in run()]
        ms = da.bench(run)
        p = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opt)
        return ms, outs, dict(kernel=p.kernel, splits=p.splits, slots=p.slots)
    finally:
        triton_decode.plan_splits = planned
        gluon_decode.SPLIT_MAJOR, triton_decode.SPLIT_MAJOR, triton_decode.WAVE_FREE = defaults


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--free", default="0", help="triton_decode.WAVE_FREE values, each a pass (e.g. 0,1,2)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    da.GRAPHS = da.DEVICE == "cuda"
    opts = da.defaults()
    sparse, dense = da.SPARSE_SHAPES, da.QUICK_SHAPES
    free = [int(f) for f in args.free.split(",") if int(f)]
    if args.smoke:
        sparse, dense, da.SPARSE_TOKENS = [(1, 2048)], [(2, 512)], 128
    cases = []  # (name, inputs, options variants {label: (options, forced split count or 0)})
    for b, length in sparse:
        for bits in (8, 4, 0):
            inp, (table, num_cold) = sparse_inputs(da.sparse_rows(b, length, bits))
            inp = {**inp, "block_table": table, "num_cold": num_cold}
            base = opts[f"sparse{bits}"]
            variants = {f"busy {b8}:{b4}": (replace(base, gluon_busy_blocks=b8, gluon_busy_blocks4=b4), 0, 0)
                        for b8, b4 in {8: BUSY8, 4: BUSY4, 0: [(1, 0)]}[bits]}  # fmt: skip
            variants.update({f"default, {f} free": (base, 0, f) for f in free})
            if (b, length) == sparse[-1] and bits:
                variants.update({f"forced {n}": (base, n, 0) for n in FORCED[bits]})
            cases.append((f"sparse {width(bits)} {b}x{length // 1024}K", (b, length), inp, variants))
    for b, length in dense:
        for bits in (8, 4, 0):
            inp = da.make_inputs(da.Case(b, length, bits))
            dense_opt = opts["int8" if bits == 8 else f"int{bits}"]
            variants = {"default": (dense_opt, 0, 0)} | {f"{f} free": (dense_opt, 0, f) for f in free}
            cases.append((f"dense {width(bits)} {b}x{length // 1024}K", (b, length), inp, variants))
    sdpa = {shape: da.sdpa_case(*shape)[0] for shape in {c[1] for c in cases}}
    times: dict[tuple[str, str, bool], list[float]] = {}
    info: dict[tuple[str, str], dict] = {}
    for rnd in range(args.rounds):
        for name, _, inp, variants in cases:
            for label, (opt, forced, f) in variants.items():
                ms, outs, plan = zip(*(time_variant(inp, opt, forced, f, major) for major in (False, True)))
                same = all(torch.equal(x, y) for x, y in zip(*outs))
                was = info.get((name, label), {}).get("same_bits", True)
                info[(name, label)] = dict(**plan[1], same_bits=was and same)
                for major, t in zip((False, True), ms):
                    times.setdefault((name, label, major), []).append(t)
                print(
                    json.dumps(dict(round=rnd, case=name, variant=label, ms=ms, same_bits=same)), flush=True
                )
            if da.DEVICE == "cuda":
                torch.cuda.empty_cache()
    rows = []
    for name, shape, _, variants in cases:
        for label in variants:
            r, s = times[(name, label, False)], times[(name, label, True)]
            rows.append(dict(case=name, variant=label, sdpa_ms=sdpa[shape], row_major_ms=r, split_major_ms=s,
                             **info[(name, label)]))  # fmt: skip
    device = torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu"
    (args.out / "busy_order.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    print(f"{device}; graph replays; ms median of each round (min-max over {args.rounds} rounds)")
    print("| case | variant | kernel | splits (slots) | row-major ms | split-major ms | × SDPA | same bits |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        rm, sm = r["row_major_ms"], r["split_major_ms"]

        def span(x: list[float]) -> str:
            return f"{statistics.median(x):.4f} ({min(x):.4f}-{max(x):.4f})"

        print(f"| {r['case']} | {r['variant']} | {r['kernel']} | {r['splits']} ({r['slots']}) | {span(rm)} | "
              f"{span(sm)} | {statistics.median(sm) / r['sdpa_ms']:.3f} | {r['same_bits']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
