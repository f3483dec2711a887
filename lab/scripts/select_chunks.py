"""The single-program Quest selection at several chunk sizes, from the pool's fp16 key bounds and from the
float8 summary: is its time set by the bytes it reads or by how many chunks it walks?

For the sparse rows of ``benchmarks/decode_attention.py`` (16 x 32K, 4 x 128K: L1 1/8 + top 2,048; the 8-bit
pool with its L2 blocks demoted to 4 bits), CUDA graph replays (median of ``do_bench_cudagraph``), µs, for
each chunk size of :mod:`kvtune.kernels.triton_sparse_table` (``CHUNK`` for fp16 bounds, ``CHUNK8`` for the
summary: 32 KB a chunk at 64 and 128 rows respectively), ``--rounds`` times in turn. Each variant's table,
counts and bytes are checked against the same bounds at the first chunk size first (they must be equal: the
chunk size changes the order of the work, not the result). Run 49c timed it on the tree of 4e51171, whose
kernel scored a float8 summary 128 blocks a step (``CHUNK8``) and merged 64 candidates at a time whatever the
chunk; on other trees the fp8 rows take ``CHUNK`` (the attribute set here) as the fp16 ones do.

    python lab/scripts/select_chunks.py --out $OUT [--chunks 64,128] [--rounds 2] [--smoke]
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

SINGLE = SelectOptions(split=False)


def case_chunks(b: int, length: int, chunks: list[int], rounds: int) -> dict:
    q, pool, blocks, tier = da.quest_inputs(da.sparse_rows(b, length, 8))
    summary = summary8(pool)
    k_blocks = da.SPARSE_TOKENS // da.BS

    def run(chunk: int, summ):
        def fn():
            count = da.zero_count()
            tst.CHUNK, tst.CHUNK8 = chunk, chunk
            return da.select_table(q, pool, blocks, tier, k_blocks, count, SINGLE, summ), count

        return fn

    kinds = (("fp16", None), ("fp8", summary))
    row: dict = dict(batch=b, length=length, times={}, errors={})
    for kind, summ in kinds:
        want, want_count = run(chunks[0], summ)()
        for chunk in chunks:
            got, got_count = run(chunk, summ)()
            if not da.same_selection(got, got_count, want, want_count):
                row["errors"][f"{kind} {chunk}"] = "table, counts or bytes differ from the first chunk size's"
    names = [(kind, summ, chunk) for kind, summ in kinds for chunk in chunks]
    for _ in range(rounds):
        for kind, summ, chunk in names:
            key = f"{kind} {chunk}"
            if key not in row["errors"]:
                row["times"].setdefault(key, []).append(da.bench(lambda s=summ, c=chunk: run(c, s)()) * 1e3)
    row["median_us"] = {k: statistics.median(v) for k, v in row["times"].items()}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--chunks", default="64,128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one tiny shape (CPU, TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        da.SPARSE_TOKENS, da.SPARSE_SHAPES = 128, [(1, 1024 * 12)]
    da.GRAPHS = da.DEVICE == "cuda"
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = [case_chunks(b, n, chunks, args.rounds) for b, n in da.SPARSE_SHAPES]
    out = dict(device=torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu", rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "select_chunks.json").write_text(json.dumps(out, indent=1))
    for r in rows:
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r["median_us"].items())
        print(f"{r['batch']} x {r['length'] // 1024}K: {cells}; errors {r['errors'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
