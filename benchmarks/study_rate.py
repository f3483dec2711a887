"""How fast studies searched, side by side: ``python benchmarks/study_rate.py DB[:STUDY] ...``.

For each study (the only one in the database when STUDY is left out): finished (complete or pruned), pruned
and failed trials, busy time (the union of the trials' intervals), trials per hour, mean trial, workers,
re-runs of failed trials (``kvtune.retry_of``) and the best trial, with each study's trials per hour against
the first one's. This is how the one-GPU and several-GPU runs of one study are compared
(docs/RESULTS.md).
"""

from __future__ import annotations

import argparse

import optuna

from kvtune.studies.names import ATTR_CONFIG, ATTR_RETRY_OF
from kvtune.tuner.export import check_storage, describe_rate, load_study, search_rate

FIELDS = ("quantization_bits", "hot_tokens", "block_size", "sparse_top_k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="+", help="path/to/study.db or path/to/study.db:NAME")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    first = None
    for spec in args.studies:
        path, _, name = spec.partition(":")
        storage = f"sqlite:///{path}"
        check_storage(storage)  # a missing file is an error, not a new empty database
        name = name or optuna.get_all_study_names(storage)[0]
        trials = load_study(storage, name).get_trials(deepcopy=False)
        rate = search_rate(trials)
        if rate is None:
            print(f"{name}: no finished trial")
            continue
        first = first or rate
        retries = {t.number: t.user_attrs[ATTR_RETRY_OF] for t in trials if ATTR_RETRY_OF in t.user_attrs}
        failed = [t.number for t in trials if t.state.name == "FAIL"]
        done = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None]
        best = min(done, key=lambda t: t.value) if done else None
        ratio = rate["per_hour"] / first["per_hour"] if rate["per_hour"] and first["per_hour"] else None
        print(f"{name}: {describe_rate(rate)}" + (f"; {ratio:.2f}x the first" if ratio else ""))
        print(f"  failed trials {failed or '-'}; re-runs (trial: of) {retries or '-'}")
        if best is not None:
            config = best.user_attrs.get(ATTR_CONFIG, {})
            shown = ", ".join(f"{k} {config.get(k)}" for k in FIELDS)
            print(f"  best: trial {best.number}, objective {best.value:.2f} ({shown})")


if __name__ == "__main__":
    main()
