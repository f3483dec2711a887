"""A result that means nothing says so: an inconclusive capacity validation (console, preset, export) claims
no gain and recommends nothing unmeasured; a study without a feasible trial exits non-zero, each reason
counted with its flag; engine knobs tuned on shrunk requests are not offered as vLLM flags."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from rich.console import Console

from kvtune.cache_impl.config import HybridConfig
from kvtune.studies import names, records
from kvtune.tuner import cli
from kvtune.tuner import export as ex
from kvtune.tuner.capacity import CapacitySearch
from kvtune.tuner.commands.tune import _print_outcome
from kvtune.tuner.job import TuneReport
from kvtune.tuner.outcome import no_feasible_reasons, search_problem, validation_problems

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT / "examples" / "traces" / "azure_conv_sample.csv"
CONFIG = HybridConfig("hybrid_v2", 32, 64, 8)
ENGINE = {"max_num_batched_tokens": 256, "max_num_seqs": 256, "max_num_seqs_factor": 1.0}
X1 = {"length_scale": 1.0, "length_cap": None}  # the workload's own lengths


def _search(start: float, truth: float, probes: int = 12, top: float | None = None) -> dict[str, Any]:
    """A capacity search from ``start`` against a config whose capacity is ``truth``, to its end."""
    search = CapacitySearch(start, 0.025, probes, max_rate=top)
    while (rate := search.next_rate()) is not None:
        search = search.record(rate, rate <= truth)
    return search.to_dict()


def _run(search: dict[str, Any]) -> dict[str, Any]:
    return {"capacity": search["capacity"], "capacity_tokens_per_s": 10 * search["capacity"],
            "worker": "h/cpu", "search": search}  # fmt: skip


def _validation(best: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "trial": 3, "config": CONFIG.to_dict(), "baseline_config": CONFIG.unquantized().to_dict(),
        "window": {"start_fraction": 0.8, "end_fraction": 1.0, "requests": 40}, "repeats": len(best),
        "best": [_run(s) for s in best], "baseline": [_run(s) for s in baseline],
        "date": "2026-12-01T00:00:00+00:00", "versions": records.versions(), "engine": ENGINE,
        "baseline_engine": ENGINE, "slo": {"ttft_ms": 400.0, "tpot_ms": 60.0, "source": {}, "rule": "5 x"},
        "noise": {"threshold": 0.08, "spread": 0.08, "median": 30.0},
    }  # fmt: skip


# The Azure row: 4 of 6 searches never converged, ending 140-200x below the search's capacity, 70x apart.
SOUND = _validation([_search(34, t) for t in (34.5, 35.0, 34.8)], [_search(30, t) for t in (30.0, 30.4, 31)])
MEANINGLESS = _validation(
    [_search(34, t, probes=8) for t in (0.17, 12.0, 0.24)],
    [_search(30, t, probes=8) for t in (30, 0.2, 0.15)],
)
PROVENANCE = {"card": "cpu", "objective": "capacity", "sample": X1, "kv_budget_bytes": 1 << 26}


@pytest.mark.parametrize(
    ("search", "said"),
    [
        (_search(30, 31), None),
        (_search(30, 40, top=35), None),  # saturated: a lower bound every config ties on
        (_search(30, 0.001, probes=6), "no rate passed in 6 probes"),
        (_search(1, 1e9, probes=4), "no rate failed in 4 probes"),
        (_search(30, 0.9, probes=8), "8 probes left it between"),
        (_search(30, 0.2, probes=30), "152x below where it started (30x, the study's)"),
    ],
)
def test_a_search_that_did_not_converge_is_named(search: dict[str, Any], said: str | None) -> None:
    why = search_problem(search)
    assert why is None if said is None else said in (why or ""), why


def test_a_validation_whose_searches_mean_nothing_is_inconclusive() -> None:
    assert validation_problems(SOUND) == []
    problems = validation_problems(MEANINGLESS)
    assert problems[0].startswith("4 of 6 validation capacity searches did not converge (the best's: ")
    assert any(p.startswith("the best's repeats disagree without bound") for p in problems)
    assert validation_problems({k: v for k, v in MEANINGLESS.items() if k != "slo"}) == []  # fixed-rate


def test_an_inconclusive_preset_claims_nothing_and_recommends_nothing_unmeasured() -> None:
    sound = ex.build_preset(CONFIG, SOUND, None, PROVENANCE)
    assert sound["recommendation"]["use"] == "best" and "inconclusive" not in sound["metrics"]
    preset = ex.build_preset(CONFIG, MEANINGLESS, None, PROVENANCE)
    metrics = preset["metrics"]
    assert metrics["inconclusive"] == validation_problems(MEANINGLESS)
    assert metrics["claim"].startswith("inconclusive: 4 of 6")
    assert "no capacity gain is claimed" in metrics["claim"]
    assert metrics["gain"]["verdict"].startswith("inconclusive: ")  # the ratio kept, no verdict drawn from it
    advice = preset["recommendation"]
    assert advice["use"] == "baseline" and "inconclusive" in advice["why"]
    assert preset["config"] == CONFIG.unquantized().to_dict() and preset["measured_best"]["trial"] == 3
    assert "--max-num-seqs" not in preset["vllm"]["args"] and "inconclusive" in preset["vllm"]["engine"]


def _report(validation: dict[str, Any] | None, finished: int = 3) -> TuneReport:
    return TuneReport("c", "sqlite://", finished, 3, None, validation, None, "", 1.0, ())


def test_the_console_says_inconclusive() -> None:
    console = Console(record=True, width=300)
    job = SimpleNamespace(options=SimpleNamespace(objective="capacity"), capacity=True)
    _print_outcome(console, _report(MEANINGLESS), job)  # type: ignore[arg-type]
    text = console.export_text()
    assert "capacity: inconclusive: 4 of 6" in text and "inconclusive: the best's repeats disagree" in text
    assert "recommended: the unquantized baseline, without engine flags: validation was inconclusive" in text


def test_export_says_inconclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = f"sqlite:///{tmp_path / 'kvtune.db'}"
    study = optuna.create_study(study_name="c", storage=storage, direction="maximize")
    workload = {"name": "azure", "path": "azure.csv", "sha256": "ab" * 32, "requests": 12}
    attrs = {names.ATTR_CARD: "cpu", names.ATTR_MODEL: "random:tiny", names.ATTR_OBJECTIVE: "capacity",
             names.ATTR_WORKLOAD: workload, names.ATTR_VALIDATION: MEANINGLESS,
             names.ATTR_SAMPLE: {"length_scale": 1 / 32, "length_cap": 192}}  # fmt: skip
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    out = tmp_path / "p.json"
    assert cli.main(["export", "--study", "c", "--storage", storage, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "  inconclusive: 4 of 6 validation capacity searches did not converge" in printed
    assert "recommended: the unquantized baseline, without engine flags" in printed
    assert json.loads(out.read_text())["recommendation"]["use"] == "baseline"


# ---- engine knobs and the lengths they were tuned on ----------------------------------------------------
@pytest.mark.parametrize(
    ("sample", "withheld"),
    [
        (X1, None),
        ({"length_scale": 1 / 32, "length_cap": 192}, "lengths x0.03125, capped at 192 tokens"),
        ({"length_scale": 1.0, "length_cap": 4096}, "lengths x1, capped at 4096 tokens"),
        ({"length_scale": 0.5, "length_cap": None}, "lengths x0.5)"),
        (None, "did not record the request lengths"),
    ],
)
def test_engine_knobs_are_flags_only_for_the_workloads_own_lengths(
    sample: dict[str, Any] | None, withheld: str | None
) -> None:
    preset = ex.build_preset(CONFIG, SOUND, None, PROVENANCE | {"sample": sample})
    args, note = preset["vllm"]["args"], preset["vllm"]["engine"]
    assert preset["engine"] == ENGINE  # the values tuned, always recorded
    assert preset["engine_tuned_on"] == {"length_scale": (sample or {}).get("length_scale"),
                                         "length_cap": (sample or {}).get("length_cap"),
                                         "kv_budget_bytes": 1 << 26}  # fmt: skip
    if withheld is None:
        assert args[args.index("--max-num-seqs") + 1] == "256" and "--max-num-batched-tokens" in args
    else:
        assert "--max-num-seqs" not in args and "--max-num-batched-tokens" not in args
        assert "--max-num-seqs" not in preset["vllm"]["command"]
        assert note.startswith("--max-num-batched-tokens and --max-num-seqs are not exported")
        assert withheld in note


# ---- no feasible trial ----------------------------------------------------------------------------------
def _trial(state: str = "COMPLETE", error: str | None = None, **constraints: float) -> Any:
    """A finished trial as the driver tells it (its state, error and constraints)."""
    attrs = {names.ATTR_ERROR: error} if error else {}
    return SimpleNamespace(state=TrialState[state], user_attrs=attrs, constraints=constraints)


def test_no_feasible_trial_counts_each_reason_with_its_flag() -> None:
    timeout = "the trial ran past its time limit of 300 s (--trial-timeout): infeasible here"
    trials = [_trial(error=timeout)] * 3 + [_trial(error="CUDA out of memory"), _trial(ppl_increase_pct=1.5),
              _trial(ppl_increase_pct=-1, kl=0.2), _trial("PRUNED"), _trial("FAIL"),
              _trial(ran=0.0)]  # fmt: skip
    lines = no_feasible_reasons(trials, 5.0)
    assert lines[0].startswith("3 ran past the 5-min time limit: give them longer (--trial-timeout)")
    assert [line.split(" ", 1)[0] for line in lines] == ["3", "1", "1", "1", "1", "1"]
    flags = ("--trial-timeout", "--kv-budget", "--max-ppl-increase", "--max-kl", "--trials", "--resume")
    assert all(flag in line for flag, line in zip(flags, lines))


def test_a_study_without_a_feasible_trial_exits_non_zero(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every trial runs past a limit of 0.01 s: the study says so, names the flag, and exits 1 (was 0)."""
    argv = ["--gpu", "cpu", "--workload", str(AZURE), "--storage", f"sqlite:///{tmp_path}/s.db", "--study",
            "s", "--model", "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows",
            "1", "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1",
            "--quality-prefill", "24", "--quality-decode", "4", "--kv-budget", "64MiB", "--objective",
            "tpot_p99", "--time-scale", "1", "--trials", "2", "--trial-timeout", "0.0002",
            "--out", str(tmp_path / "p.json")]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "no feasible trial among 2: nothing validated, no preset written" in err
    assert "2 ran past the 0.0002-min time limit: give them longer (--trial-timeout)" in err
    assert not (tmp_path / "p.json").exists()
