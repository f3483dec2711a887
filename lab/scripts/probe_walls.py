"""A capacity study's probes: their wall against the clock they measured, from the study's database.

Counts every probe on a cache already set up (``prime_s`` under half a second: no new cache's set-up inside
its wall), the trials' and the baseline's searches alike, and charges the wall beyond the clock to the mixed
iterations (launched op by op; the decode steps are graph replays kept in flight).

    python lab/scripts/probe_walls.py lab/logs/run33/33a/s/h200_capacity_llama31_8b.db ...
"""

from __future__ import annotations

import argparse
from typing import Any

import optuna


def probes(study: optuna.Study) -> list[dict[str, Any]]:
    out = [p for t in study.get_trials(deepcopy=False) for p in t.user_attrs.get("kvtune.probes", [])]
    for search in (study.user_attrs.get("kvtune.noise") or {}).get("searches") or []:
        out.extend(search.get("probes") or [])
    return [p for p in out if float(p.get("prime_s") or 0.0) < 0.5 and "duration_s" in p and "wall_s" in p]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("databases", nargs="+")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    head = (
        "study",
        "probes",
        "wall",
        "clock",
        "wall / clock",
        "mixed iterations",
        "decode steps",
        "excess a mixed",
    )
    print("| " + " | ".join(head) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for db in args.databases:
        storage = f"sqlite:///{db}"
        for name in optuna.get_all_study_names(storage):
            rows = probes(optuna.load_study(study_name=name, storage=storage))
            if not rows:
                continue
            wall = sum(float(r["wall_s"]) for r in rows)
            clock = sum(float(r["duration_s"]) for r in rows)
            mixed = sum(int(r.get("mixed_iterations") or 0) for r in rows)
            steps = sum(int(r.get("decode_steps") or 0) for r in rows)
            excess = f"{1e3 * (wall - clock) / mixed:.0f} ms" if mixed else "-"
            print(
                f"| {db} | {len(rows)} | {wall:.1f} s | {clock:.1f} s | {wall / clock:.2f}x | {mixed:,} | "
                f"{steps:,} | {excess} |"
            )


if __name__ == "__main__":
    main()
