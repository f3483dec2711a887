"""Read ``select_warps.json`` and, if a warps:chunk build of the single-program selection is at least
``--gain`` faster than the default at 16 x 32K (fp16 bounds, top 2,048), write it into
``kernels/triton_sparse_table.py`` (``NUM_WARPS``, ``CHUNK``) for the rest of a GPU call; exit 1 if none is.

    python lab/scripts/select_apply.py $OUT/select_warps.json [--gain 0.10]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "triton_sparse_table.py"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", type=Path)
    ap.add_argument("--gain", type=float, default=0.10)
    args = ap.parse_args()
    rows = json.loads(args.json.read_text())["rows"]
    (row,) = [r for r in rows if (r["batch"], r["length"], r["tokens"]) == (16, 32768, 2048)]
    times = {k.removeprefix("fp16 "): v for k, v in row["median_us"].items() if k.startswith("fp16 ")}
    src = KERNEL.read_text()
    found = dict(re.findall(r"^(NUM_WARPS|CHUNK) = (\d+)", src, re.M))
    warps, chunk = int(found["NUM_WARPS"]), int(found["CHUNK"])
    default = times[f"{warps}w {chunk}"]
    best = min((v, k) for k, v in times.items() if k != "base")
    print(f"default {warps}w {chunk}: {default:.1f} µs; fastest {best[1]}: {best[0]:.1f} µs")
    if best[0] > default * (1 - args.gain):
        print("no build is faster by the gain asked: nothing changed")
        return 1
    w, c = best[1].split("w ")
    src = re.sub(r"^NUM_WARPS = \d+", f"NUM_WARPS = {w}", src, flags=re.M)
    src = re.sub(r"^CHUNK = \d+", f"CHUNK = {c}", src, flags=re.M)
    KERNEL.write_text(src)
    print(f"kernels/triton_sparse_table.py: NUM_WARPS = {w}, CHUNK = {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
