"""The Quest selection's top-k kept two ways, in the same run: the candidates' merge (a chunk's keys above
the k-th best so far compacted and merged, the warps of the program meeting several times a chunk) against
the tournament (every key written first, each chunk's scoring meeting no other warp, then rounds that keep
the best ``TOPK`` of every 64 keys; :mod:`kvtune.kernels.triton_sparse_table`, ``TOURNEY_TOPK``).

For the sparse rows of ``benchmarks/decode_attention.py`` (16 x 32K, 4 x 128K: L1 1/8 + top ``--tokens``;
the 8-bit pool with its L2 blocks demoted to 4 bits), the single-program selection from the pool's fp16 key
bounds and from the float8 summary, and the split selection (several programs a row, then a merge; the
cache's choice where rows are few for the card) as the cache runs it, CUDA graph replays (median of
``do_bench_cudagraph``), µs, ``--rounds`` times in turn. Every variant's table, counts and bytes are
checked against the merge's on the same bounds first (they must be equal: the keys are distinct, so both
keep the same blocks in the same order).

    python lab/scripts/select_tourney.py --out $OUT [--tokens 2048,512,0] [--rounds 2] [--smoke]

Runs 50c-50e timed it on the trees of 9595911, 9ff24cb and 14155c1, whose kernel had the tournament. The
tournament was no faster where it mattered and went out of the kernel again; on later trees, first
``git checkout 14155c1 -- kernels/triton_sparse_table.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import triton_sparse_table as tst
from kvtune.kernels.quest_summary import summary8
from kvtune.kernels.sparse_table_choice import SelectOptions

# (TOURNEY_TOPK: the largest top-k the tournament keeps, TOURNEY_CHUNK: the blocks a step of its scoring)
TOURNEY = getattr(tst, "TOURNEY_TOPK", 0)  # 0: this tree's kernel has no tournament (the merge only)
KEPT = {"merge": (0, 64), "tournament": (TOURNEY, 64), "tournament128": (TOURNEY, 128)}
KINDS = {"single": SelectOptions(split=False), "split": SelectOptions(split=True)}


def contiguous(pool, blocks: torch.Tensor, tier: torch.Tensor, l1: int) -> torch.Tensor:
    """Each row's blocks renumbered to consecutive ids (oldest first), as a cache that allocated every
    sequence's blocks in one run would hold them; the tiers and the L2 blocks' 4 bits moved with them."""
    b, nc = blocks.shape
    ids = torch.arange(b * nc, device=blocks.device).view(b, nc)
    tier.fill_(da.L1)
    tier[ids[:, : nc - l1].flatten()] = da.L2
    pool.block_bits.fill_(pool.bits)
    pool.block_bits[ids[:, : nc - l1].flatten()] = 4
    return ids


def case_row(b: int, length: int, tokens: int, rounds: int, layout: str) -> dict:
    case = da.sparse_rows(b, length, 8)
    q, pool, blocks, tier = da.quest_inputs(case)
    if layout == "contiguous":
        blocks = contiguous(pool, blocks, tier, case.l1_blocks)
    summary = summary8(pool)
    k_blocks = tokens // da.BS
    kept_names = list(KEPT) if k_blocks else ["merge"]  # no selection: the split alone

    def run(kept: str, kind: str, summ):
        def fn():
            count = da.zero_count()
            tst.TOURNEY_TOPK, tst.TOURNEY_CHUNK = KEPT[kept]
            return da.select_table(q, pool, blocks, tier, k_blocks, count, KINDS[kind], summ), count

        return fn

    # the split selection has no tournament: its merge, as the cache runs it where rows are few
    variants = [(kept, kind, bounds, summ) for bounds, summ in (("fp16", None), ("fp8", summary))
                for kind in KINDS for kept in kept_names if kind == "single" or kept == "merge"]  # fmt: skip
    row: dict = dict(batch=b, length=length, tokens=tokens, k_blocks=k_blocks, layout=layout, times={},
                     errors={})  # fmt: skip
    for kept, kind, bounds, summ in variants:
        want, want_count = run("merge", kind, summ)()
        got, got_count = run(kept, kind, summ)()
        if not da.same_selection(got, got_count, want, want_count):
            row["errors"][f"{bounds} {kind} {kept}"] = "table, counts or bytes differ from the merge's"
    for _ in range(rounds):
        for kept, kind, bounds, summ in variants:
            key = f"{bounds} {kind} {kept}"
            if key not in row["errors"]:
                fn = run(kept, kind, summ)
                row["times"].setdefault(key, []).append(da.bench(lambda f=fn: f()) * 1e3)
    tst.TOURNEY_TOPK, tst.TOURNEY_CHUNK = TOURNEY, 64  # the kernel's default again
    row["median_us"] = {k: statistics.median(v) for k, v in row["times"].items()}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument(
        "--tokens", default="2048,512,0", help="the sparse tier's top-k tokens (0: the split alone)"
    )
    ap.add_argument("--shapes", default="16:32768,16:16384,4:131072", help="batch:length, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kept", default=",".join(KEPT), help="the variants of the single selection")
    ap.add_argument("--layouts", default="random", help="random (the benchmark's), contiguous (ids in a run)")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape (CPU, TRITON_INTERPRET=1)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in bl.split(":")) for bl in args.shapes.split(",")]
    if args.smoke:
        shapes = [(1, 1024 * 12)]
    da.GRAPHS = da.DEVICE == "cuda"
    tokens = [int(t) for t in args.tokens.split(",")]
    for name in set(KEPT) - set(args.kept.split(",")) - {"merge"}:
        del KEPT[name]
    if not TOURNEY and set(KEPT) != {"merge"}:
        raise SystemExit("no tournament in this tree (--kept merge, or first: git checkout 14155c1 -- "
                         "kernels/triton_sparse_table.py)")  # fmt: skip
    rows = [
        case_row(b, n, t, args.rounds, lay)
        for lay in args.layouts.split(",")
        for b, n in shapes
        for t in tokens
    ]
    out = dict(device=torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu", rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "select_tourney.json").write_text(json.dumps(out, indent=1))
    for r in rows:
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r["median_us"].items())
        errors = r["errors"] or "none"
        shape = f"{r['batch']} x {r['length'] // 1024}K"
        print(f"{r['layout']} {shape}, top {r['tokens']}: {cells}; errors {errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
