"""The Quest selection's single-program kernel at other warp counts and chunk sizes, in the same run.

Runs 50c-50e found the kernel's time per chunk of 64 L2 blocks (~1.4 µs) the same at 128 programs (16 x
32K) and at 32 (4 x 128K), with the blocks' ids scattered or consecutive, with half its barriers gone and
with twice the bytes in flight: not the card's memory but each multiprocessor's issue, at 8 warps (one
program of 210 registers a thread) and ~530 instructions a warp a chunk (sm_90 SASS). This times the same
kernel with ``NUM_WARPS`` and ``CHUNK`` of :mod:`kvtune.kernels.triton_sparse_table` set otherwise (16 warps:
4 a scheduler, 128 registers a thread), on the sparse rows of ``benchmarks/decode_attention.py`` (L1 1/8 +
top ``--tokens``, the 8-bit pool with its L2 blocks demoted to 4 bits), from the pool's fp16 bounds and from
the float8 summary. CUDA graph replays (median of ``do_bench_cudagraph``), µs, ``--rounds`` times in turn.
The byte counter is the step's, made once (the engine's: no fill a layer); every variant's table, counts
and bytes are checked against the default build's first.

Split variants ``sW:C:S[:R]`` time the split selection (:mod:`kvtune.kernels.triton_sparse_split`: ``S``
scoring programs a row, 0 = planned, then a merge launch) with its span programs at ``W`` warps and ``C``
blocks a step, capped at ``R`` registers a thread (0: no cap; default the options'): at one warp a program
meets no other warp until the merge.

``--baseline FILE``: also the single kernel of another version of that module (a copy of the file), at its
own defaults, as ``base``.

    python lab/scripts/select_warps.py --out $OUT [--variants 8:64,16:64,8:32] [--baseline F] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import triton_sparse_split as tss
from kvtune.kernels import triton_sparse_table as tst
from kvtune.kernels.quest_summary import summary8
from kvtune.kernels.sparse_table_choice import SelectOptions

DEFAULT = (tst.NUM_WARPS, tst.CHUNK)
SPLIT_DEFAULT = (tss.NUM_WARPS, tss.CHUNK)


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("triton_sparse_table_base", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_row(b: int, length: int, tokens: int, rounds: int, variants: list, base) -> dict:
    l1 = (length - da.HOT) // da.BS // 8
    q, pool, blocks, tier = da.quest_inputs(da.Case(b, length, 8, l1_blocks=l1))
    summary = summary8(pool)
    k_blocks = tokens // da.BS

    def run(variant, summ, count):
        def fn():
            if variant == "base":
                return base.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summ)
            if len(variant) >= 3:  # the split selection: warps, chunk, splits (0: planned)[, register cap]
                tss.NUM_WARPS, tss.CHUNK = variant[:2]
                cap = variant[3] if len(variant) > 3 else SelectOptions().maxnreg
                try:
                    opts = SelectOptions(split=True, splits=variant[2] or None, maxnreg=cap or None)
                    return tss.sparse_block_table_split_triton(
                        q, pool, blocks, tier, k_blocks, count, opts, summ
                    )
                finally:
                    tss.NUM_WARPS, tss.CHUNK = SPLIT_DEFAULT
            tst.NUM_WARPS, tst.CHUNK = variant
            try:
                return tst.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summ)
            finally:
                tst.NUM_WARPS, tst.CHUNK = DEFAULT

        return fn

    row: dict = dict(batch=b, length=length, tokens=tokens, times={}, errors={})
    variants = variants + (["base"] if base is not None else [])
    cases = [(v, bounds, summ) for bounds, summ in (("fp16", None), ("fp8", summary)) for v in variants]
    name = {v: "base" if v == "base" else f"{v[0]}w {v[1]}" + "".join(f" {k} {x}" for k, x in
            zip(("split", "regs"), v[2:], strict=False)) for v in variants}  # fmt: skip
    for v, bounds, summ in cases:
        want_count, got_count = da.zero_count(), da.zero_count()
        want = run(DEFAULT, summ, want_count)()
        got = run(v, summ, got_count)()
        same = all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        if not same or int(got_count.total) != int(want_count.total):
            row["errors"][f"{bounds} {name[v]}"] = "table, counts or bytes differ from the default's"
    count = da.zero_count()
    for _ in range(rounds):
        for v, bounds, summ in cases:
            key = f"{bounds} {name[v]}"
            if key not in row["errors"]:
                row["times"].setdefault(key, []).append(da.bench(run(v, summ, count)) * 1e3)
    row["median_us"] = {k: statistics.median(t) for k, t in row["times"].items()}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", default="2048,0", help="the sparse tier's top-k tokens (0: the split alone)")
    ap.add_argument("--shapes", default="16:32768,4:131072", help="batch:length, comma-separated")
    ap.add_argument("--variants", default="8:64,16:64,8:32", help="warps:chunk, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another version of triton_sparse_table.py, timed as base")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape (CPU, TRITON_INTERPRET=1)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in bl.split(":")) for bl in args.shapes.split(",")]
    variants = [tuple(int(x) for x in v.removeprefix("s").split(":")) for v in args.variants.split(",")]
    if args.smoke:
        shapes = [(1, 1024 * 12)]
    da.GRAPHS = da.DEVICE == "cuda"
    base = load_module(args.baseline) if args.baseline else None
    rows = [
        case_row(b, n, int(t), args.rounds, variants, base) for b, n in shapes for t in args.tokens.split(",")
    ]
    out = dict(device=torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu", rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "select_warps.json").write_text(json.dumps(out, indent=1))
    for r in rows:
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r["median_us"].items())
        shape = f"{r['batch']} x {r['length'] // 1024}K"
        print(f"{shape}, top {r['tokens']}: {cells}; errors {r['errors'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
