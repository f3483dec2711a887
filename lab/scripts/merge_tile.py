"""Decode attention's kernels one by one, with the merge loading 1 or MERGE_TILE splits' partials at a time
(``--tiles``: other counts, at the padded 16 rows or at the group's own, ``MERGE_GROUP_ROWS``).

For the dense INT8 / INT4 rows (64 x 8K, 16 x 32K) and the sparse rows (16 x 32K, 4 x 128K: L1 1/8 + top
2,048, as ``benchmarks/decode_attention.py`` sets them up), in one process: the attention as CUDA graph
replays (median of ``do_bench_cudagraph``) with ``triton_decode.MERGE_TILE`` = 1 and its default, SDPA bf16
beside them, and each kernel's device time (``torch.profiler`` over eager launches) with the split count
the launch planned. Writes ``merge_tile.json`` and prints a table.

    python lab/scripts/merge_tile.py --out $OUT [--smoke]   (--smoke: tiny shapes, TRITON_INTERPRET=1)
        [--busy 1:0,24:4,11:4:2:6] [--mass 0:64,1:64] [--tiles 4,16g] [--splits 9,17] [--mixed-splits p:1,9:3]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import triton_decode


def sparse_inputs(case: da.Case) -> tuple[dict, tuple]:
    """The inputs of ``da.sparse_case`` and the table the selection makes for them (selected once)."""
    inp, blocks, tier, count = da.sparse_setup(case)
    table, num_cold, _ = da.select_table(
        inp["q"], inp["pool"], blocks, tier, da.SPARSE_TOKENS // da.BS, count, None
    )
    return inp, (table, num_cold)


def forced_plan(n: int):
    """A stand-in for ``triton_decode.plan_splits`` that plans ``n`` splits (fewer where a split would hold
    no block) whatever the occupancy."""

    def fixed(bh, m, device, options, resident=None):
        per = max(1, -(-m // n))
        return -(-max(m, 1) // per), per

    return fixed


def set_tile(tile: str) -> None:
    """The merge's partials in flight (``MERGE_TILE``) and, with a trailing g, at the group's rows."""
    triton_decode.MERGE_TILE = int(tile.rstrip("g"))
    triton_decode.MERGE_GROUP_ROWS = tile.endswith("g")


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Device µs per call of each kernel ``fn`` launches (eager), by kernel name."""
    fn()
    if da.DEVICE != "cuda":
        return {}
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:60]] += ev.device_time / iters
    return dict(out)


def forced_splits(plan: triton_decode.DecodePlan, width: int, n8: int, n4: int) -> triton_decode.DecodePlan:
    """``plan`` with the 8-bit build's split count forced to about ``n8`` over a table ``width`` blocks wide
    (whole blocks per split) and the 4-bit build's to ``n4``."""
    per = max(1, -(-width // n8))
    return plan._replace(splits=-(-width // per), per=per, splits4=n4)


def measure(
    kind: str,
    b: int,
    length: int,
    bits: int,
    opts: dict,
    tiles: list[str],
    iters: int,
    splits: list[int],
    mixed: list[tuple[str, str]],
    busy: list[tuple[int, int]],
    masses: list[tuple[int, int]],
) -> dict:
    """One case timed (graph replays) and profiled (eager) with each merge tile, their outputs compared;
    then with each split count of ``splits`` forced, (sparse INT8) each build's of ``mixed``, and (the
    Gluon kernels) each (``gluon_busy_blocks``, ``gluon_busy_blocks4``) of ``busy``."""
    planned_plan = triton_decode.launch_plan
    default_mass = (getattr(triton_decode, "MASS_AHEAD", False), getattr(triton_decode, "MASS_TILE", 64))
    if kind == "dense":
        inp = da.make_inputs(da.Case(b, length, bits))
        table, num_cold = inp["block_table"], inp["num_cold"]
        opt = opts["int8" if bits == 8 else f"int{bits}"]
    else:
        inp, (table, num_cold) = sparse_inputs(da.sparse_rows(b, length, bits))
        opt = opts[f"sparse{bits}"]

    def run() -> tuple:
        return da.run_hybrid({**inp, "block_table": table, "num_cold": num_cold}, opt)

    plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], table, opt)
    row: dict = dict(kind=kind, batch=b, length=length, bits=bits, kernel=plan.kernel)
    outs = {}
    want = run()[0].float()
    for tile in tiles:
        set_tile(tile)
        outs[tile] = [x.float() for x in run()]
        ms = da.bench(run)
        plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], table, opt)
        row[f"tile{tile}"] = dict(ms=ms, splits=plan.splits, per=plan.per, kernels=kernel_times(run, iters))
    set_tile(tiles[-1])
    for ahead, mass in masses:  # the per-block mass, with the last tile: first step early or not, its step
        triton_decode.MASS_AHEAD, triton_decode.MASS_TILE = bool(ahead), mass
        diff = float((run()[0].float() - want).abs().max())
        row[f"mass{ahead}:{mass}"] = dict(ms=da.bench(run), max_diff=diff, kernels=kernel_times(run, iters))
    triton_decode.MASS_AHEAD, triton_decode.MASS_TILE = default_mass
    planned = triton_decode.plan_splits
    for forced in splits:  # the split count forced (the wave model's choice replaced)
        triton_decode.plan_splits = forced_plan(forced)
        try:
            ms = da.bench(run)
            plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], table, opt)
            row[f"splits{forced}"] = dict(ms=ms, splits=plan.splits, kernels=kernel_times(run, iters))
        finally:
            triton_decode.plan_splits = planned
    if plan.kernel == "gluon_mixed":
        want = run()[0].float()
        for s8, s4 in mixed:  # each build's split count forced ("p": the planned 8-bit count)

            def both(*a, s8=s8, s4=s4, **k):
                p = planned_plan(*a, **k)
                return forced_splits(p, a[3].shape[2], p.splits if s8 == "p" else int(s8), int(s4))

            triton_decode.launch_plan = both
            try:
                ms = da.bench(run)
                p = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], table, opt)
                diff = float((run()[0].float() - want).abs().max())
                row[f"mixed{s8}:{s4}"] = dict(ms=ms, splits=p.splits, splits4=p.splits4, max_diff=diff,
                                              kernels=kernel_times(run, iters))  # fmt: skip
            finally:
                triton_decode.launch_plan = planned_plan
    if kind == "sparse" and plan.kernel in ("gluon", "gluon_mixed"):  # a dense row keeps every split busy
        want = run()[0].float()
        for b8, b4, *more in busy:  # more: the 8-bit ring's stages, then the 8-bit build's splits forced
            opt_b = replace(opt, gluon_busy_blocks=b8, gluon_busy_blocks4=b4)
            if more:
                opt_b = replace(opt_b, gluon_stages=more[0])

            def run_b(o=opt_b) -> tuple:
                return da.run_hybrid({**inp, "block_table": table, "num_cold": num_cold}, o)

            forced8 = more[1] if len(more) > 1 else 0

            def split8(*a, n=forced8, **k):
                p = planned_plan(*a, **k)
                return forced_splits(p, a[3].shape[2], n, p.splits4 or p.splits) if n else p

            triton_decode.launch_plan = split8
            try:
                ms = da.bench(run_b)
                diff = float((run_b()[0].float() - want).abs().max())
                name = ":".join(str(x) for x in (b8, b4, *more))
                row[f"busy{name}"] = dict(ms=ms, max_diff=diff, kernels=kernel_times(run_b, iters))
            finally:
                triton_decode.launch_plan = planned_plan
    # the same sums in another order: the outputs and masses agree to float rounding
    row["max_diff"] = [float((x - y).abs().max()) for x, y in zip(outs[tiles[0]], outs[tiles[-1]])]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--splits", type=lambda x: [int(v) for v in x.split(",")], default=[],
                    help="split counts to force at 4 x 128K (e.g. 9,17), beside the planned one")  # fmt: skip
    ap.add_argument("--mixed-splits", type=lambda x: [tuple(v.split(":")) for v in x.split(",")], default=[],
                    help="sparse INT8: 8-bit:4-bit splits to force (p: planned), e.g. p:1,9:3")  # fmt: skip
    ap.add_argument(
        "--busy",
        type=lambda x: [tuple(int(b) for b in v.split(":")) for v in x.split(",")],
        default=[],
        help="gluon_busy_blocks:gluon_busy_blocks4[:gluon_stages[:8-bit splits forced]] to time, e.g. "
        "1:0,24:4,11:4:2:6",
    )
    ap.add_argument("--tiles", type=lambda x: x.split(","), default=None,
                    help="merge tiles to time, a g after the count: at the group's rows "
                    "(MERGE_GROUP_ROWS), e.g. 4,8g,16g (default: 1 and MERGE_TILE)")  # fmt: skip
    ap.add_argument("--mass", type=lambda x: [tuple(int(b) for b in v.split(":")) for v in x.split(",")],
                    default=[], help="MASS_AHEAD:MASS_TILE pairs to time, e.g. 0:64,1:64,1:128")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    da.GRAPHS = da.DEVICE == "cuda"
    opts = da.defaults()
    dense = [(64, 8192), (16, 32768)]
    sparse = [(16, 32768), (4, 131072)]
    if args.smoke:
        dense, sparse, da.SPARSE_TOKENS = [(2, 512)], [(1, 2048), (1, 4096)], 128
    tiles = args.tiles or [str(t) for t in sorted({1, getattr(triton_decode, "MERGE_TILE", 1)})]
    rows = []
    cases = [("dense", b, length, bits) for b, length in dense for bits in (8, 4)]
    cases += [("sparse", b, length, bits) for b, length in sparse for bits in (8, 4, 0)]
    cases += [("dense", b, length, bits) for b, length in sparse[1:] for bits in (8, 4)]
    sdpa: dict[tuple[int, int], float] = {}
    for kind, b, length, bits in cases:
        if (b, length) not in sdpa:
            sdpa[(b, length)] = da.sdpa_case(b, length)[0]
        forced = args.splits if (b, length) == sparse[-1] else []  # the fewest rows: 4 x 128K
        row = measure(
            kind, b, length, bits, opts, tiles, args.iters, forced, args.mixed_splits, args.busy, args.mass
        )
        row["sdpa_ms"] = sdpa[(b, length)]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if da.DEVICE == "cuda":
            torch.cuda.empty_cache()
    (args.out / "merge_tile.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name()
        if da.DEVICE == "cuda" else "cpu", rows=rows), indent=1))  # fmt: skip
    print(
        "| case | kernel | SDPA | "
        + " | ".join(f"merge tile {t}: ms (x SDPA); splits; merge µs" for t in tiles)
        + " | max diff (out, mass, hot mass) |"
    )
    for r in rows:
        cells = []
        for t in tiles:
            x = r[f"tile{t}"]
            merge = sum(v for k, v in x["kernels"].items() if "merge" in k)
            cells.append(f"{x['ms']:.4f} ({x['ms'] / r['sdpa_ms']:.2f}x); {x['splits']}; {merge:.1f}")
        cells.append(", ".join(f"{d:.1e}" for d in r["max_diff"]))
        bits = "unq" if r["bits"] == 0 else f"INT{r['bits']}"
        name = f"{r['kind']} {bits} {r['batch']}x{r['length'] // 1024}K"
        print(f"| {name} | {r['kernel']} | {r['sdpa_ms']:.4f} | " + " | ".join(cells) + " |")
    for r in rows:
        forced = [r[k] for k in r if k.startswith("mixed")]
        if forced:
            cells = ", ".join(
                f"{x['splits']}:{x['splits4']} {x['ms']:.4f} ({x['max_diff']:.0e})" for x in forced
            )
            last = r[f"tile{tiles[-1]}"]
            head = f"mixed {r['batch']}x{r['length']}: {last['splits']}:{last['splits']} {last['ms']:.4f} ms"
            print(f"{head}; forced 8-bit:4-bit splits: {cells}")
    for prefix, what in (("mass", "merge mass ahead:tile"), ("busy", "busy blocks 8-bit:4-bit")):
        for r in rows:
            timed = [k for k in r if k.startswith(prefix)]
            if timed:
                last = r[f"tile{tiles[-1]}"]
                cells = ", ".join(f"{k[4:]} {r[k]['ms']:.4f} ({r[k]['max_diff']:.0e})" for k in timed)
                print(f"{r['kind']} {r['bits']} {r['batch']}x{r['length']}: default {last['ms']:.4f} ms "
                      f"({last['splits']} splits); {what}: {cells}")  # fmt: skip
    for r in rows:
        forced = [k for k in r if k.startswith("splits")]
        if forced:
            cells = ", ".join(f"{r[k]['splits']} splits {r[k]['ms']:.4f} ms" for k in forced)
            last = r[f"tile{tiles[-1]}"]
            print(
                f"{r['kind']} {r['bits']} {r['batch']}x{r['length']}: planned {last['splits']} splits "
                f"{last['ms']:.4f} ms; forced: {cells}"
            )
    for r in rows:
        for t in tiles:
            ks = ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(r[f"tile{t}"]["kernels"].items(), key=lambda kv: -kv[1])
            )
            print(f"{r['kind']} {r['bits']} {r['batch']}x{r['length']} tile {t}: {ks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
