"""Read ``select_warps.json`` and, if a build beats today's selection by ``--gain``, write it into the working
copy for the rest of a GPU call (nothing is committed); exit 1 if none does.

* Default: a ``warps:chunk`` build of the single-program selection at least ``--gain`` faster than the
  default at 16 x 32K (fp16 bounds, top 2,048) goes into ``kernels/triton_sparse_table.py`` (``NUM_WARPS``,
  ``CHUNK``).
* ``--split``: a split build ``sW:C:S[:R]`` wins where at 16 x 32K it is at least ``--gain`` faster than the
  single kernel (``8w 64``) from both the fp16 bounds and the e4m3 summary, and at 4 x 128K no slower than the
  planned split (``8w 64 split 0 regs 128``) by more than 3 %. The fastest winner at 16 x 32K (fp16 + fp8)
  becomes ``DEFAULT_SELECT`` in ``kernels/sparse_table_choice.py`` (split always, its warps, chunk, spans and
  register cap; ``MERGE_KEYS`` widened as ``select_warps.py`` timed it). Run 52b (as ``adopt_select.py``).

    python lab/scripts/select_apply.py $OUT/select_warps.json [--gain 0.10] [--split]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from kvtune.kernels.triton_common import next_pow2

ROOT = Path(__file__).resolve().parents[2] / "kernels"
KERNEL = ROOT / "triton_sparse_table.py"
CHOICE = ROOT / "sparse_table_choice.py"
TOPK = 32  # top 2,048 tokens in blocks of 64
SPLIT_NAME = re.compile(r"(\d+)w (\d+) split (\d+) regs (\w+)")


def apply_single(rows: dict[tuple[int, int], dict[str, float]], gain: float) -> int:
    times = {k.removeprefix("fp16 "): v for k, v in rows[(16, 32768)].items() if k.startswith("fp16 ")}
    src = KERNEL.read_text()
    found = dict(re.findall(r"^(NUM_WARPS|CHUNK) = (\d+)", src, re.M))
    warps, chunk = int(found["NUM_WARPS"]), int(found["CHUNK"])
    default = times[f"{warps}w {chunk}"]
    best = min((v, k) for k, v in times.items() if k != "base" and not SPLIT_NAME.fullmatch(k))
    print(f"default {warps}w {chunk}: {default:.1f} µs; fastest {best[1]}: {best[0]:.1f} µs")
    if best[0] > default * (1 - gain):
        print("no build is faster by the gain asked: nothing changed")
        return 1
    w, c = best[1].split("w ")
    src = re.sub(r"^NUM_WARPS = \d+", f"NUM_WARPS = {w}", src, flags=re.M)
    src = re.sub(r"^CHUNK = \d+", f"CHUNK = {c}", src, flags=re.M)
    KERNEL.write_text(src)
    print(f"kernels/triton_sparse_table.py: NUM_WARPS = {w}, CHUNK = {c}")
    return 0


def apply_split(rows: dict[tuple[int, int], dict[str, float]], gain: float) -> int:
    near, far = rows[(16, 32768)], rows[(4, 131072)]
    best: tuple[float, str] | None = None
    for key in near:
        name = key.removeprefix("fp16 ")
        if not key.startswith("fp16 ") or not SPLIT_NAME.fullmatch(name):
            continue
        bounds = ("fp16", "fp8")
        both = [f"{b} {name}" for b in bounds]
        if not all(k in near and k in far for k in both):
            continue
        fast = all(near[f"{b} {name}"] <= (1 - gain) * near[f"{b} 8w 64"] for b in bounds)
        planned = [(f"{b} {name}", f"{b} 8w 64 split 0 regs 128") for b in bounds]
        held = all(far[k] <= 1.03 * far[p] for k, p in planned if p in far)
        print(f"{name}: 16 x 32K {near[both[0]]:.1f} / {near[both[1]]:.1f} µs, 4 x 128K {far[both[0]]:.1f} / "
              f"{far[both[1]]:.1f}; wins: {fast and held}")  # fmt: skip
        total = sum(near[k] for k in both)
        if fast and held and (best is None or total < best[0]):
            best = (total, name)
    if best is None:
        print("no split build won: the defaults stay")
        return 1
    match = SPLIT_NAME.fullmatch(best[1])
    assert match is not None
    w, c, s, r = match.groups()
    cap = "None" if r in ("0", "None") else r
    spans = "None" if s == "0" else s
    new = f"DEFAULT_SELECT = SelectOptions(split=True, warps={w}, chunk={c}, splits={spans}, maxnreg={cap})"
    text = re.sub(r"^DEFAULT_SELECT = SelectOptions\(.*\)$", new, CHOICE.read_text(), count=1, flags=re.M)
    if spans != "None":  # the merge as wide as select_warps.py timed it
        keys = max(int(m) for m in re.findall(r"^MERGE_KEYS = (\d+)", text, re.M))
        text = re.sub(r"^MERGE_KEYS = \d+", f"MERGE_KEYS = {max(keys, next_pow2(int(s) * TOPK))}", text,
                      count=1, flags=re.M)  # fmt: skip
    CHOICE.write_text(text)
    print(f"adopted {best[1]}: {new}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", type=Path)
    ap.add_argument("--gain", type=float, default=0.10)
    ap.add_argument("--split", action="store_true", help="the split selection's builds (sW:C:S[:R])")
    args = ap.parse_args()
    rows = {(r["batch"], r["length"]): r["median_us"]
            for r in json.loads(args.json.read_text())["rows"] if r["tokens"] == 2048}  # fmt: skip
    return (apply_split if args.split else apply_single)(rows, args.gain)


if __name__ == "__main__":
    raise SystemExit(main())
