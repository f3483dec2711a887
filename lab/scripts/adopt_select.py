"""Whether a split build of ``select_warps.py`` beats the single kernel, and if so make it the selection's
default in this working copy (for the tests and the kernel table of the same GPU call; nothing is committed).

A build ``sW:C:S[:R]`` wins where, at 16 x 32K and top 2,048, it is at least ``--gain`` faster than the single
kernel (``8w 64``) from both the fp16 bounds and the e4m3 summary, and at 4 x 128K no slower than the split as
planned today (``8w 64 split 0``) by more than 3 %. Of the winners the fastest at 16 x 32K (fp16 + fp8) is
written into ``kernels/sparse_table_choice.py`` as ``DEFAULT_SELECT`` (split always, its warps, chunk, spans
and register cap). Exit 0 if one was adopted, 1 if none won.

    python lab/scripts/adopt_select.py $OUT/51d/select_warps.json [--gain 0.10]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from kvtune.kernels.triton_common import next_pow2

TOPK = 32  # top 2,048 tokens in blocks of 64
CHOICE = Path(__file__).resolve().parents[2] / "kernels" / "sparse_table_choice.py"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("result", type=Path)
    ap.add_argument("--gain", type=float, default=0.10)
    args = ap.parse_args()
    rows = {(r["batch"], r["length"]): r["median_us"] for r in json.loads(args.result.read_text())["rows"]}
    near, far = rows[(16, 32768)], rows[(4, 131072)]
    pattern = re.compile(r"(\d+)w (\d+) split (\d+) regs (\w+)")
    best: tuple[float, str] | None = None
    for key in near:
        if not key.startswith("fp16 ") or not pattern.fullmatch(key[5:]):
            continue
        name = key[5:]
        both = [f"{b} {name}" for b in ("fp16", "fp8")]
        single = [f"{b} 8w 64" for b in ("fp16", "fp8")]
        planned = [f"{b} 8w 64 split 0 regs 128" for b in ("fp16", "fp8")]
        if not all(k in near and k in far for k in both):
            continue
        fast = all(near[k] <= (1 - args.gain) * near[s] for k, s in zip(both, single, strict=True))
        held = all(far[k] <= 1.03 * far[p] for k, p in zip(both, planned, strict=True) if p in far)
        total = sum(near[k] for k in both)
        print(f"{name}: 16 x 32K {near[both[0]]:.1f} / {near[both[1]]:.1f} µs, 4 x 128K {far[both[0]]:.1f} / "
              f"{far[both[1]]:.1f}; wins: {fast and held}")  # fmt: skip
        if fast and held and (best is None or total < best[0]):
            best = (total, name)
    if best is None:
        print("no split build won: the defaults stay")
        return 1
    w, c, s, r = pattern.fullmatch(best[1]).groups()  # type: ignore[union-attr]
    cap = "None" if r in ("0", "None") else r
    spans = "None" if s == "0" else s
    text = CHOICE.read_text()
    new = f"DEFAULT_SELECT = SelectOptions(split=True, warps={w}, chunk={c}, splits={spans}, maxnreg={cap})"
    text = text.replace("DEFAULT_SELECT = SelectOptions()", new, 1)
    if spans != "None" and int(s) * TOPK > 256:  # the wider merge select_warps.py timed it with
        text = text.replace("MERGE_KEYS = 256", f"MERGE_KEYS = {next_pow2(int(s) * TOPK)}", 1)
    CHOICE.write_text(text)
    print(f"adopted {best[1]}: {new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
