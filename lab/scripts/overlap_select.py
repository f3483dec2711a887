"""Would the sparse step gain from running Quest's selection beside the attention over the L1 blocks?

The sparse step runs its launches in one order: the selection (Quest's bound, top-k, the table of L1 then
selected L2 blocks), then the attention over that table. Only the L2 part of the table depends on the
selection: the L1 blocks are known before it. Neither reads at the card's bandwidth alone (run 26b at 16 x
32K: selection 1.6 TB/s, INT8 attention 2.7 TB/s), so the two may share the card. This measures, in one
process, as CUDA graph replays (median of ``do_bench_cudagraph``), at the sparse rows of
``benchmarks/decode_attention.py`` (L1 1/8 + top 2,048) for INT8, INT4 and unquantized pools:

* ``step``: the step as the cache runs it, ``attend(select())``;
* ``select`` and ``attend`` alone (the attention over a table selected once);
* ``serial``: both, independent, on one stream (their sum, as a check of the timing);
* ``overlap``: both, independent, on two streams forked and joined inside the graph: the most that running
  them side by side can give;
* ``l1_beside``: what a cache could run: the selection beside the attention over the L1 blocks only, then the
  attention over the selected L2 blocks alone (two merges where the step has one, and no combination of
  their outputs, which would add one small kernel).

``overlap_split`` and ``l1_beside_split``: the same with the split selection (``SelectOptions(split=True)``:
several smaller programs a row, 128 registers a thread), whose programs may fit beside the attention's on a
multiprocessor where the single kernel's 8 warps of ~200 registers do not; ``select_split`` alone.

SDPA (bf16) in the same process. Writes ``overlap_select.json`` under ``--out`` and prints a table.

    python lab/scripts/overlap_select.py --out $OUT [--rounds 2] [--smoke]
    (--smoke: tiny shapes under TRITON_INTERPRET=1, one stream: checks that it runs)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels.sparse_table_choice import SelectOptions
from kvtune.kernels.triton_decode import default_options, hybrid_decode_attention_triton


def split_table(table: torch.Tensor, num: torch.Tensor, n1: torch.Tensor) -> tuple:
    """The table's L1 entries (its first ``n1`` a row) and its selected L2 entries (the rest, moved to the
    row's front), each -1 padded to the table's width, with their counts."""
    width = table.shape[-1]
    pos = torch.arange(width, device=table.device)
    l1 = torch.where(pos < n1[..., None], table, -1)
    src = (pos + n1[..., None]).clamp(max=width - 1)
    l2 = torch.where(pos < (num - n1)[..., None], table.gather(-1, src.long()), -1)
    return (l1.contiguous(), n1.clone()), (l2.contiguous(), (num - n1).contiguous())


def one_case(batch: int, length: int, bits: int, side: torch.cuda.Stream | None) -> dict:
    case = da.sparse_rows(batch, length, bits)
    inp, blocks, tier, count = da.sparse_setup(case)
    pool, q = inp["pool"], inp["q"]
    k_blocks = da.SPARSE_TOKENS // da.BS
    opts = default_options(bits)

    def select(selection: SelectOptions | None = None):
        return da.select_table(q, pool, blocks, tier, k_blocks, count, selection)

    split = SelectOptions(split=True)

    def attend(tab):
        table, num = tab
        return hybrid_decode_attention_triton(
            q, inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], pool, table, num,
            1 / math.sqrt(da.D), options=opts,
        )  # fmt: skip

    table, num, n1 = select()
    full = (table, num)
    l1, l2 = split_table(table, num, n1)

    def beside(first, second):
        """``first()`` on the side stream while ``second()`` runs on the capture's stream; joined."""
        if side is None:
            first()
            return second()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            first()
        out = second()
        main.wait_stream(side)
        return out

    ways = {
        "step": lambda: attend(select()[:2]),
        "select": select,
        "attend": lambda: attend(full),
        "serial": lambda: (select(), attend(full)),
        "overlap": lambda: beside(select, lambda: attend(full)),
        "l1_beside": lambda: (beside(select, lambda: attend(l1)), attend(l2)),
        "select_split": lambda: select(split),
        "overlap_split": lambda: beside(lambda: select(split), lambda: attend(full)),
        "l1_beside_split": lambda: (beside(lambda: select(split), lambda: attend(l1)), attend(l2)),
    }
    row = {way: da.bench(fn) for way, fn in ways.items()}
    # the outputs: attention over the split halves must cover the same blocks as over the whole table
    assert int((l1[1] + l2[1] - num).abs().max()) == 0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = da.SPARSE_SHAPES
    if args.smoke:
        da.SPARSE_TOKENS, shapes = 128, [(1, 1024)]
    else:
        da.GRAPHS = True
    side = torch.cuda.Stream() if da.DEVICE == "cuda" else None
    name = torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu (interpreter)"
    res: dict = dict(device=name, torch=torch.__version__, rows=[])
    for r in range(args.rounds):
        for batch, length in shapes:
            sdpa = da.sdpa_case(batch, length)[0] if da.DEVICE == "cuda" else float("nan")
            for bits in (8, 4, 0):
                row = dict(round=r, batch=batch, length=length, bits=bits, sdpa=sdpa)
                row.update(one_case(batch, length, bits, side))
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    (args.out / "overlap_select.json").write_text(json.dumps(res, indent=1))
    ways = [key for key in res["rows"][0] if key not in ("round", "batch", "length", "bits", "sdpa")]
    print(f"{name}; ms, median over {args.rounds} rounds (× SDPA bf16 of the same round)")
    print("| B x L | bits | SDPA | " + " | ".join(ways) + " |")
    print("|" + " --- |" * (3 + len(ways)))
    for batch, length in shapes:
        for bits in (8, 4, 0):
            rows = [x for x in res["rows"] if (x["batch"], x["length"], x["bits"]) == (batch, length, bits)]
            sdpa = statistics.median(x["sdpa"] for x in rows)
            cells = []
            for way in ways:
                ms = statistics.median(x[way] for x in rows)
                cells.append(f"{ms:.4f} ({ms / sdpa:.3f}×)")
            print(f"| {batch} x {length // 1024}K | {bits} | {sdpa:.4f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
