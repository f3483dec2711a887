"""The sparse step (selection + attention, as ``benchmarks/decode_attention.py`` times it) with the
attention's programs per multiprocessor changed, beside SDPA in the same process.

For each ``--bits`` (0, 4, 8) and each ``--pps`` value, at 16 x 32K and 4 x 128K (L1 1/8 + top 2,048), CUDA
graph replays: the whole step's ms and its ratio to SDPA; the launcher's default options with
``programs_per_sm`` (the split kernel's target) set to the value (0: the default options as they are; the
Gluon builds plan their split count by their occupancy, not by this).

    python lab/scripts/sparse_options.py --bits 0 --pps 0,3,4,6 --out $OUT
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

from kvtune.kernels.decode_choice import default_options


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="0")
    ap.add_argument("--pps", default="0,4")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    torch.manual_seed(0)
    da.GRAPHS = True
    rows = []
    for b, length in da.SPARSE_SHAPES:
        sdpa_ms, _ = da.sdpa_case(b, length)
        for bits in (int(x) for x in args.bits.split(",")):
            case = da.sparse_rows(b, length, bits)
            for pps in (int(x) for x in args.pps.split(",")):
                opt = default_options(bits)
                if pps:
                    opt = replace(opt, programs_per_sm=pps)
                r = da.sparse_case(case, opt)
                row = dict(batch=b, length=length, bits=bits, pps=pps, sdpa_ms=sdpa_ms, ms=r["ms"],
                           ratio=r["ms"] / sdpa_ms, splits=r["splits"], kernel=r["kernel"],
                           selection_ms=r["selection_ms"], attention_ms=r["attention_ms"])  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_options.json").write_text(json.dumps(rows, indent=1))
    print("| B x L | bits | programs per SM | splits | kernel | ms | x SDPA | selection | attention |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        shape = f"{r['batch']} x {r['length'] // 1024}K"
        print(
            f"| {shape} | {r['bits']} | {r['pps'] or 'default'} | {r['splits']} | {r['kernel']} | "
            f"{r['ms']:.4f} | {r['ratio']:.3f} | {r['selection_ms']:.4f} | {r['attention_ms']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
