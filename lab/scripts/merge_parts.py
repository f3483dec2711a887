"""Where the decode merge's time goes: the attention's kernels timed one at a time, and the merge with parts
of its work taken away.

For the sparse rows (16 x 32K, 4 x 128K: L1 1/8 + top 2,048, as ``benchmarks/decode_attention.py`` sets them
up) of INT8 (``gluon_mixed``) and INT4 (``gluon``), in one process, CUDA graph replays (median of
``do_bench_cudagraph``):

* ``whole``: the attention as the launcher runs it (the merge a programmatic dependent of the cold kernel);
* ``cold``: the Gluon build(s) alone (``gluon_mixed``: without the bits partition before them, as two
  launches: ``gluon_builds`` "two");
* ``merge``: the merge alone over the partials of a finished run, launched plainly (no programmatic wait);
* ``no mass``: the merge with no per-block mass (its row counts read as 0 and a table width of 0);
* ``one partial``: the merge reading one partial a build (the builds' counts read as 0);
* ``hot only``: both (the hot zone, the output and the hot mass are left);
* ``merge, 1 stage`` and ``whole, 1 stage``: the merge compiled with ``num_stages=1`` (``MERGE_STAGES``).

``--ncu``: instead, run each case's attention a few times eagerly for Nsight Compute to read (no timing).

The merge's outputs are wrong in the last three; they are timed, not used. Prints a table and writes
``merge_parts.json``.

    python lab/scripts/merge_parts.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import gluon_decode, triton_decode


def record(run) -> tuple[list, list]:
    """The cold kernels' and the merge's launches of one run: (launch_cold args, kwargs) and (grid, args,
    kwargs), recorded while they run."""
    cold, merge = [], []
    launch_cold, merge_kernel = gluon_decode.launch_cold, triton_decode._merge_kernel

    def cold_rec(grid, args, **kw):
        cold.append((grid, args, kw))
        return launch_cold(grid, args, **kw)

    class MergeRec:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                merge.append((grid, args, kw))
                return merge_kernel[grid](*args, **kw)

            return launch

    gluon_decode.launch_cold, triton_decode._merge_kernel = cold_rec, MergeRec()
    try:
        run()
    finally:
        gluon_decode.launch_cold, triton_decode._merge_kernel = launch_cold, merge_kernel
    return cold, merge


def measure(b: int, length: int, bits: int, opt, ncu: bool = False) -> dict:
    """One sparse case's times (module docstring), ms."""
    inp, blocks, tier, count = da.sparse_setup(da.sparse_rows(b, length, bits))
    table, num_cold, _ = da.select_table(
        inp["q"], inp["pool"], blocks, tier, da.SPARSE_TOKENS // da.BS, count, None
    )

    def run() -> tuple:
        return da.run_hybrid({**inp, "block_table": table, "num_cold": num_cold}, opt)

    if ncu:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return {}
    cold, merge = record(run)
    ((grid, margs, mkw),) = merge
    plain = {**mkw, "WAIT": False, "launch_pdl": False}
    names = list(triton_decode._merge_kernel.arg_names)
    zeros = torch.zeros(4096, dtype=torch.int32, device=da.DEVICE)  # counts of 0 for every row

    def merge_with(**over):
        a = list(margs)
        for name, value in over.items():
            a[names.index(name)] = value
        return lambda: triton_decode._merge_kernel[grid](*a, **plain)

    def cold_only() -> None:
        for g, a, kw in cold:
            gluon_decode.launch_cold(g, a, **{**kw, "pdl": False})

    no_mass = dict(num_cold_ptr=zeros, M=0)
    one = dict(count1_ptr=zeros, count2_ptr=zeros)
    row = dict(batch=b, length=length, bits=bits, kernel="gluon_mixed" if len(cold) == 2 else "gluon")
    row["whole"] = da.bench(run)
    row["cold"] = da.bench(cold_only)
    row["merge"] = da.bench(merge_with())
    row["no mass"] = da.bench(merge_with(**no_mass))
    row["one partial"] = da.bench(merge_with(**one))
    row["hot only"] = da.bench(merge_with(**no_mass, **one))
    plain["num_stages"] = 1
    row["merge, 1 stage"] = da.bench(merge_with())
    triton_decode.MERGE_STAGES = 1
    try:
        row["whole, 1 stage"] = da.bench(run)
    finally:
        triton_decode.MERGE_STAGES = None
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--ncu", action="store_true", help="a few eager runs of each case for ncu; no timing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    da.GRAPHS = True
    opts = da.defaults()
    rows = []
    for b, length in ((16, 32768), (4, 131072)):
        for bits in (8, 4):
            opt = opts[f"sparse{bits}"]
            if bits == 8:  # the builds as two launches, which ``record`` finds (``gluon_builds``)
                opt = replace(opt, gluon_builds="two")
            rows.append(measure(b, length, bits, opt, args.ncu))
            if rows[-1]:
                print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.ncu:
        return 0
    out = dict(device=torch.cuda.get_device_name(), rows=rows)
    (args.out / "merge_parts.json").write_text(json.dumps(out, indent=1))
    keys = [
        "whole",
        "cold",
        "merge",
        "no mass",
        "one partial",
        "hot only",
        "merge, 1 stage",
        "whole, 1 stage",
    ]
    print("| case | " + " | ".join(f"{k} (ms)" for k in keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for r in rows:
        name = f"sparse INT{r['bits']} {r['batch']}x{r['length'] // 1024}K"
        print(f"| {name} | " + " | ".join(f"{r[k]:.4f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
