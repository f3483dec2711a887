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

Split variants ``sW:C:S[:R[:K]]`` time the split selection (:mod:`kvtune.kernels.triton_sparse_split`:
``S`` scoring programs a row, 0 = planned, then a merge launch) with its span programs at ``W`` warps (0:
the options' choice from the plan) and ``C`` blocks a step, capped at ``R`` registers a thread (0: no cap;
default the options'): at one warp a program meets no other warp until the merge. The merge ranks the
spans' keys rounded up to a power of two, 256 at least (the launcher's ``merge_width``), or ``K`` keys. A
trailing ``p`` (``s0:16:0p``): the merge also writes the table split by bits, as in the sparse INT8 step
(``sparse_block_table_parts``; the benchmark's "Quest alone" leaves it out); ``pa``: with its first step of
L1 ids and bits loaded before its top-k network (``SelectOptions.merge_l1_ahead``).

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
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import sparse_table_choice as choice
from kvtune.kernels import triton_sparse_split as tss
from kvtune.kernels import triton_sparse_table as tst
from kvtune.kernels.bits_partition_ref import empty_partition
from kvtune.kernels.quest_summary import summary8
from kvtune.kernels.sparse_table_choice import SelectOptions
from kvtune.kernels.triton_common import next_pow2

DEFAULT = (tst.NUM_WARPS, tst.CHUNK)
MERGE_KEYS = choice.MERGE_KEYS, choice.MERGE_KEYS_SUMMARY
MERGE_WIDTH = tss.merge_width


class Variant(NamedTuple):
    """A build to time: the single kernel (``splits`` None) or the split selection at ``warps`` (0: the
    options' choice from the plan) and ``chunk``; ``splits`` 0 = planned, ``cap`` the span kernel's
    register cap (0: none), ``keys`` the merge's width (0: the launcher's, ``merge_width``)."""

    warps: int
    chunk: int
    splits: int | None = None
    cap: int | None = SelectOptions().maxnreg
    keys: int = 0
    parts: bool = False
    ahead: bool = False

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``W:C`` (the single kernel) or ``sW:C:S[:R[:K]][p|pa]`` (the split selection; ``p``: with the
        split by bits, ``pa``: and the merge's L1 step ahead of its network)."""
        body = text.rstrip("pa")
        suffix = text[len(body) :]
        nums = [int(x) for x in body.removeprefix("s").split(":")]
        split = text.startswith("s")
        allowed = ("", "p", "pa") if split else ("",)
        if split != (len(nums) >= 3) or len(nums) > 5 or suffix not in allowed:
            raise SystemExit(f"--variants: {text!r} is neither W:C nor sW:C:S[:R[:K]][p|pa]")
        return cls(*nums, parts=bool(suffix), ahead=suffix == "pa")

    @property
    def name(self) -> str:
        if self.splits is None:
            return f"{self.warps}w {self.chunk}"
        keys = f" keys {self.keys}" if self.keys else ""
        parts = (" by bits" if self.parts else "") + (" L1 ahead" if self.ahead else "")
        return f"{self.warps or 'planned '}w {self.chunk} split {self.splits} regs {self.cap}{keys}{parts}"


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("triton_sparse_table_base", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_row(b: int, length: int, tokens: int, rounds: int, variants: list[Variant], base) -> dict:
    q, pool, blocks, tier = da.quest_inputs(da.sparse_rows(b, length, 8))
    summary = summary8(pool)
    k_blocks = tokens // da.BS

    def run(variant: Variant | None, summ, count):  # None: the baseline module's kernel
        def fn():
            if variant is None:
                return base.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summ)
            if variant.splits is not None:
                opts = SelectOptions(split=True, splits=variant.splits or None, maxnreg=variant.cap or None,
                                     warps=variant.warps or None, chunk=variant.chunk,
                                     merge_l1_ahead=variant.ahead)  # fmt: skip
                if variant.splits:  # forced spans past the planned cap (max_splits): the cap raised to them
                    keys = max(256, next_pow2(variant.splits * next_pow2(k_blocks)))
                    choice.MERGE_KEYS = choice.MERGE_KEYS_SUMMARY = keys
                if variant.keys:
                    tss.merge_width = lambda k, s: variant.keys
                parts = None
                if variant.parts:  # what the step's selection writes beside the table
                    rows, width = blocks.shape[0], blocks.shape[1] + k_blocks
                    parts = empty_partition(rows, pool.layout.num_kv_heads, width, q.device)
                try:
                    args = (q, pool, blocks, tier, k_blocks, count, opts, summ, parts)
                    return tss.sparse_block_table_split_triton(*args)
                finally:
                    choice.MERGE_KEYS, choice.MERGE_KEYS_SUMMARY = MERGE_KEYS
                    tss.merge_width = MERGE_WIDTH
            tst.NUM_WARPS, tst.CHUNK = variant.warps, variant.chunk
            try:
                return tst.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summ)
            finally:
                tst.NUM_WARPS, tst.CHUNK = DEFAULT

        return fn

    row: dict = dict(batch=b, length=length, tokens=tokens, times={}, errors={})
    timed: list[Variant | None] = variants + ([None] if base is not None else [])
    cases = [(v, bounds, summ) for bounds, summ in (("fp16", None), ("fp8", summary)) for v in timed]
    name = {v: "base" if v is None else v.name for v in timed}
    for v, bounds, summ in cases:
        want_count, got_count = da.zero_count(), da.zero_count()
        want = run(Variant(*DEFAULT), summ, want_count)()
        got = run(v, summ, got_count)()
        if not da.same_selection(got, got_count, want, want_count):
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
    variants = [Variant.parse(v) for v in args.variants.split(",")]
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
