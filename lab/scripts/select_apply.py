"""Read ``select_warps.json`` and, if a build beats today's selection by ``--gain``, write it into the working
copy for the rest of a GPU call (nothing is committed); exit 1 if none does.

* Default: a ``warps:chunk`` build of the single-program selection at least ``--gain`` faster than the
  default at 16 x 32K (fp16 bounds, top 2,048) goes into ``kernels/triton_sparse_table.py`` (``NUM_WARPS``,
  ``CHUNK``).
* ``--split``: a split build ``sW:C:S[:R]`` wins where at 16 x 32K it is at least ``--gain`` faster than the
  single kernel (``8w 64``) from both the fp16 bounds and the e4m3 summary, and at 4 x 128K no slower than the
  planned split (``--planned``, 52a's ``8w 64 split 0 regs 128``) by more than 3 %. The fastest winner at
  16 x 32K (fp16 + fp8) becomes ``DEFAULT_SELECT`` in ``kernels/sparse_table_choice.py`` (split always, its
  warps, chunk, spans and register cap; ``MERGE_KEYS`` as ``select_warps.py`` timed it). Run 52b (as
  ``adopt_select.py``).

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


def apply_split(rows: dict[tuple[int, int], dict[str, float]], gain: float, planned: str) -> int:
    near, far = rows[(16, 32768)], rows[(4, 131072)]
    bounds = ("fp16", "fp8")
    if not all(f"{b} {planned}" in far for b in bounds):
        raise SystemExit(f"select_apply.py: no build {planned!r} at 4 x 128K to compare with (--planned)")
    best: tuple[float, str] | None = None
    names = [k.removeprefix("fp16 ") for k in near if k.startswith("fp16 ")]
    for name in (n for n in names if SPLIT_NAME.fullmatch(n)):
        if not all(f"{b} {name}" in near and f"{b} {name}" in far for b in bounds):
            continue
        t16, t128 = ([t[f"{b} {name}"] for b in bounds] for t in (near, far))
        fast = all(t <= (1 - gain) * near[f"{b} 8w 64"] for t, b in zip(t16, bounds, strict=True))
        held = all(t <= 1.03 * far[f"{b} {planned}"] for t, b in zip(t128, bounds, strict=True))
        print(f"{name}: 16 x 32K {t16[0]:.1f} / {t16[1]:.1f} µs, 4 x 128K {t128[0]:.1f} / {t128[1]:.1f}; "
              f"wins: {fast and held}")  # fmt: skip
        if fast and held and (best is None or sum(t16) < best[0]):
            best = (sum(t16), name)
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
        keys = max(256, next_pow2(int(s) * TOPK))
        text = re.sub(r"^MERGE_KEYS = \d+", f"MERGE_KEYS = {keys}", text, count=1, flags=re.M)
    CHOICE.write_text(text)
    print(f"adopted {best[1]}: {new}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", type=Path)
    ap.add_argument("--gain", type=float, default=0.10)
    ap.add_argument("--split", action="store_true", help="the split selection's builds (sW:C:S[:R])")
    ap.add_argument("--planned", default="8w 64 split 0 regs 128",
                    help="--split: the build to hold at 4 x 128K (52a's planned split)")  # fmt: skip
    args = ap.parse_args()
    rows = {(r["batch"], r["length"]): r["median_us"]
            for r in json.loads(args.json.read_text())["rows"] if r["tokens"] == 2048}  # fmt: skip
    return apply_split(rows, args.gain, args.planned) if args.split else apply_single(rows, args.gain)


if __name__ == "__main__":
    raise SystemExit(main())
