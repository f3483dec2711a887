"""Where the sparse tier's selection spends its time: the table's kernels timed whole and with parts taken
away, beside Quest's bound alone over the same L2 blocks and a plain copy of the bytes it reads.

For the sparse rows of ``benchmarks/decode_attention.py`` (16 x 32K, 4 x 128K: L1 1/8 + top 2,048; the
8-bit pool with its L2 blocks demoted to 4 bits, as the cache leaves them), CUDA graph replays (median of
``do_bench_cudagraph``), µs:

* ``single`` / ``split``: the table with one program per row, and with the split selection (two launches);
* ``no select``: the single kernel with nothing to select (``k_blocks`` 0): the row split by tier, the
  table's L1 part and padding, the counts;
* ``bounds``: Quest's bound of every L2 block alone, one program per 64 of a row's L2 blocks
  (``_quest_score_kernel`` over the rows' L2 lists, fully parallel), and ``bounds + topk`` with
  ``torch.topk`` after it;
* ``copy``: ``torch.Tensor.copy_`` of as many bytes as the bound reads (key mins and scales of the L2
  blocks), and ``read``: their sum (read only), the card's contiguous floors for them;
* ``split, 4 per SM`` and ``split, 512 keys``: the split selection planned for 4 scoring programs per
  multiprocessor, and with up to 512 keys (16 spans at top 32) for its merge (``MERGE_KEYS``);
* ``bounds, ids in order`` / ``bounds, contiguous``: the bound alone over each row's L2 blocks sorted by id,
  and over contiguous blocks (what the gather's addresses cost).

``--ncu``: instead, run each kernel a few times eagerly for Nsight Compute to read (no timing).

    python lab/scripts/select_parts.py --out $OUT
    ncu --clock-control none --section SpeedOfLight ... python lab/scripts/select_parts.py --ncu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import sparse_table_choice as choice
from kvtune.kernels.sparse_table_choice import SelectOptions
from kvtune.kernels.sparse_table_ref import L2
from kvtune.kernels.triton_quest import quest_scores_triton, topk_blocks


def case_parts(b: int, length: int, ncu: bool) -> dict:
    l1 = (length - da.HOT) // da.BS // 8
    case = da.Case(b, length, 8, l1_blocks=l1)
    q, pool, blocks, tier = da.quest_inputs(case)
    k_blocks = da.SPARSE_TOKENS // da.BS
    count = da.zero_count()
    l2_mask = tier[blocks] == L2
    l2_count = l2_mask.sum(1).to(torch.int32)
    m2 = int(l2_count.max())
    l2_table = torch.full((b, m2), -1, dtype=torch.int32, device=da.DEVICE)
    sorted_table = l2_table.clone()
    for i in range(b):  # the rows' L2 blocks in order, and sorted by id (set-up, not timed)
        row = blocks[i][l2_mask[i]].to(torch.int32)
        l2_table[i, : row.numel()] = row
        sorted_table[i, : row.numel()] = row.sort().values
    contiguous = torch.arange(b * m2, dtype=torch.int32, device=da.DEVICE).view(b, m2)
    nbytes = int(l2_count.sum()) * da.H * 2 * 2 * da.D
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=da.DEVICE)
    dst = torch.empty_like(src)

    def bounds(table: torch.Tensor = l2_table) -> torch.Tensor:
        return quest_scores_triton(q, pool, table, l2_count)

    def select(split: bool, k: int = k_blocks, pps: int = 2, keys: int | None = None):
        def run():
            choice.MERGE_KEYS = keys or keys0
            try:
                opt = SelectOptions(split=split, programs_per_sm=pps)
                return da.select_table(q, pool, blocks, tier, k, count, opt)
            finally:
                choice.MERGE_KEYS = keys0

        return run

    keys0 = choice.MERGE_KEYS
    fns = {
        "single": select(False),
        "split": select(True),
        "no select": select(False, k=0),
        "bounds": bounds,
        "bounds + topk": lambda: topk_blocks(bounds(), l2_table, k_blocks),
        "copy": lambda: dst.copy_(src),
        "split, 4 per SM": select(True, pps=4),
        "split, 512 keys": select(True, keys=512),
        "split, 4 per SM, 512 keys": select(True, pps=4, keys=512),
        "bounds, ids in order": lambda: bounds(sorted_table),
        "bounds, contiguous": lambda: bounds(contiguous),
        "read": lambda: src.sum(),
    }
    if ncu:
        for fn in fns.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return {}
    row: dict = dict(batch=b, length=length, l2_blocks=m2, bound_bytes=nbytes)
    for name, fn in fns.items():
        row[name] = da.bench(fn) * 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--ncu", action="store_true", help="a few eager runs of each kernel for ncu; no timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    da.GRAPHS = True
    rows = []
    for b, length in da.SPARSE_SHAPES:
        rows.append(case_parts(b, length, args.ncu))
        if rows[-1]:
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.ncu:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "select_parts.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)
    )
    keys = [k for k in rows[0] if k not in ("batch", "length", "l2_blocks", "bound_bytes")]
    print("| B x L | L2 blocks a row | bound bytes | " + " | ".join(f"{k} (µs)" for k in keys) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.1f}" for k in keys]
        mb = r["bound_bytes"] / 1e6
        head = f"| {r['batch']} x {r['length'] // 1024}K | {r['l2_blocks']} | {mb:.1f} MB | "
        print(head + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
