"""Presets: content, the vLLM section's limits, no silent overwrite, export from a real SQLite study."""

from __future__ import annotations

import json
import math
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest

from kvtune.cache_impl.config import HybridConfig
from kvtune.studies import names, records
from kvtune.tuner import export as ex
from kvtune.tuner.cli import main

optuna.logging.set_verbosity(optuna.logging.WARNING)
CONFIG = HybridConfig("hybrid_v2", 32, 64, 8, sparse_top_k=128, migration_throttling=True)
BASELINE = CONFIG.unquantized()


def _metrics(tpot: float, tps: float) -> dict[str, Any]:
    return {"tpot_p50_ms": tpot / 2, "tpot_p99_ms": tpot, "ttft_p99_ms": 3 * tpot, "e2e_p99_ms": 9 * tpot,
            "tokens_per_s": tps, "preemptions": 0, "warnings": []}  # fmt: skip


def _validation(repeats: int = 3) -> dict[str, Any]:
    return {
        "trial": 1,
        "config": CONFIG.to_dict(),
        "baseline_config": BASELINE.to_dict(),
        "window": {"start_fraction": 0.8, "end_fraction": 1.0, "requests": 64},
        "repeats": repeats,
        "best": [_metrics(t, 900.0 + t) for t in (10.0, 11.0, 12.0)[:repeats]],
        "baseline": [_metrics(t, 500.0 + t) for t in (20.0, 21.0, 25.0)[:repeats]],
        "quality": {"mean_kl": 1e-4, "ppl_change_pct": 0.1, "passkey_rate": 1.0},
        "date": "2026-11-29T09:00:00+00:00",
        "versions": records.versions(),
        "device": "cpu",
    }


PROVENANCE = {"card": "h200", "objective": "tpot_p99", "study": "s"}


# ---- vLLM section ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("card", "block", "backend", "exported"),
    [
        ("h200", 64, "KVTUNE", True),
        ("h100-sxm", 16, "KVTUNE", True),
        ("h100-sxm", 24, "KVTUNE", False),
        ("cpu", 64, "CPU_ATTN", True),
        ("cpu", 16, "CPU_ATTN", False),
    ],
)
def test_block_size_only_when_the_backend_accepts_it(
    card: str, block: int, backend: str, exported: bool
) -> None:
    section = ex.vllm_section(HybridConfig("hybrid_v2", 32, block, 4), card)
    assert section["backend"] == backend
    assert ("--block-size" in section["args"]) == exported
    assert backend in section["block_size"]
    assert section["block_size"].startswith("--block-size omitted") != exported


def test_vllm_section_carries_only_equivalent_flags() -> None:
    section = ex.vllm_section(CONFIG, "h200")
    args = section["args"]
    assert args[-3:-1] == ["--enable-prefix-caching", "--additional-config"]
    assert json.loads(args[-1]) == {"kvtune": CONFIG.to_dict()}
    assert HybridConfig.from_dict({"additional_config": json.loads(args[-1])}) == CONFIG
    assert not any("kv-cache-dtype" in a or "per_token_head" in a for a in args[:-1])
    assert "kvtune's vLLM plugin" in section["note"] and "without the plugin vLLM ignores" in section["note"]
    assert "not equivalents" in section["not_exported"]
    assert section["command"].startswith(
        "vllm serve <model> --attention-backend KVTUNE --block-size 64 --enable-prefix-caching"
    )


@pytest.mark.parametrize(
    ("card", "config", "why"),
    [
        ("cpu", HybridConfig("hybrid_v2", 32, 64, 8), None),
        ("cpu", HybridConfig("hybrid_v2", 32, 64, 8, sparse_top_k=128), "sparse_top_k=128 cannot be served"),
        ("cpu", HybridConfig("hybrid_v2", 32, 16, 8), "vLLM's backend cannot take this block_size"),
        ("h200", HybridConfig("hybrid_v2", 32, 64, 8), None),
        ("h200", HybridConfig("hybrid_v2", 32, 64, 4, sparse_top_k=128), "sparse_top_k=128 cannot be served"),
    ],
)
def test_vllm_section_says_whether_the_plugin_serves_the_config(
    card: str, config: HybridConfig, why: str | None
) -> None:
    plugin = ex.vllm_section(config, card)["plugin"]
    assert plugin["serves"] == (why is None)
    assert why is None or why in plugin["why"]
    assert plugin["tested_on"].startswith("vLLM 0.32.0") and "sparse tier" in plugin["not_applied"]


@pytest.mark.parametrize(("card", "on_gpu"), [("h200", True), ("cpu", False)])
def test_a_gpu_preset_names_the_kvtune_backend_and_says_it_is_untested(card: str, on_gpu: bool) -> None:
    section = ex.vllm_section(HybridConfig("hybrid_v2", 32, 64, 8), card)
    assert (section["args"][:2] == ["--attention-backend", "KVTUNE"]) == on_gpu
    assert ("--attention-backend" in section["command"]) == on_gpu
    assert section["plugin"]["serves"]
    assert ("the vLLM CUDA path is untested end to end" in section["plugin"]["tested_on"]) == on_gpu


# ---- content -------------------------------------------------------------------------------------------
def test_preset_content() -> None:
    preset = ex.build_preset(CONFIG, _validation(), {"mean_kl": 1e-4}, PROVENANCE)
    assert list(preset) == ["format", "recommendation", "config", "metrics", "quality", "provenance", "vllm"]
    assert preset["recommendation"]["use"] == "best"  # a gain shown: the best config is recommended
    assert HybridConfig.from_dict(preset["config"]) == CONFIG
    tpot = preset["metrics"]["best"]["tpot_p99_ms"]
    assert (tpot["median"], tpot["min"], tpot["max"], tpot["values"]) == (
        11.0,
        10.0,
        12.0,
        [10.0, 11.0, 12.0],
    )
    gain = preset["metrics"]["gain"]
    # per repeat, the two configs ran back to back: 20/10, 21/11, 25/12
    assert gain["per_repeat"] == pytest.approx([2.0, 21.0 / 11.0, 25.0 / 12.0])
    assert gain["ratio"] == pytest.approx(2.0)
    assert gain["range"] == pytest.approx([21.0 / 11.0, 25.0 / 12.0])
    assert gain["verdict"].startswith("better")
    lo, hi = gain["interval95"]
    assert lo > 1.0 and hi < 25.0 / 12.0 * 1.2
    assert "note" not in preset["metrics"]
    assert "warnings" not in preset["metrics"]["best"]


def test_an_unquantized_best_is_said_to_be_its_own_baseline() -> None:
    validation = _validation() | {"config": BASELINE.to_dict()}
    metrics = ex.build_preset(BASELINE, validation, None, PROVENANCE)["metrics"]
    assert metrics["note"] == ex.SELF_BASELINE
    assert metrics["gain"]["verdict"] == ex.SAME_CONFIG  # whatever the noise says


@pytest.mark.parametrize(
    ("ratios", "said"),
    [
        ([1.14, 1.16, 1.10], "better"),  # consistent: the interval clears 1
        ([0.9, 0.92, 0.88], "worse"),
        ([1.03, 0.68, 1.28], "no gain shown"),  # noisy
        ([1.5, 1.01, 1.3], "no gain shown"),  # every repeat above 1, but too spread for three repeats
    ],
)
def test_a_gain_is_claimed_only_when_its_interval_excludes_1(ratios: list[float], said: str) -> None:
    best = [{"tpot_p99_ms": 10.0} for _ in ratios]
    base = [{"tpot_p99_ms": 10.0 * r} for r in ratios]
    assert ex.gain("tpot_p99", best, base)["verdict"].startswith(said)


def test_a_capacity_gains_interval_is_never_narrower_than_the_searches_brackets() -> None:
    """Three repeats that find the same capacities (a deterministic replay) give a t interval of zero
    width; the interval then is what the searches' brackets allow (a capacity lies between the rate that
    passed and the lowest that failed above it), as an H200 validation read: 2.101x, 2.050-2.153."""
    run = lambda c, hi: {"capacity": c, "search": {"capacity": c, "hi": hi}}
    best = [run(10.916, 11.186)] * 3
    base = [run(5.196, 5.324)] * 3
    g = ex.gain("capacity", best, base)
    assert g["per_repeat"] == pytest.approx([10.916 / 5.196] * 3)
    assert g["resolution"] == pytest.approx([10.916 / 5.324, 11.186 / 5.196])
    assert g["interval95"] == pytest.approx(g["resolution"]) and g["verdict"].startswith("better")
    spread = [run(c, c * 1.025) for c in (10.0, 14.0, 12.0)]  # repeats wider than the brackets
    wide = ex.gain("capacity", spread, [run(5.0, 5.125)] * 3)
    assert wide["interval95"] == pytest.approx(ex.interval95(wide["per_repeat"]))  # wider: as it was
    open_ended = [{"capacity": 10.0, "search": {"capacity": 10.0, "hi": None}}] * 3
    assert "resolution" not in ex.gain("capacity", open_ended, base)
    assert "resolution" not in ex.gain("tpot_p99", [{"tpot_p99_ms": 1.0}] * 3, [{"tpot_p99_ms": 2.0}] * 3)


def test_a_capacity_of_0_in_a_repeat_is_a_loss_not_a_crash() -> None:
    """The best config's held-out search passed no rate in a repeat: its ratio is 0, which has no log, so
    no interval; the verdict names the repeats, and the preset recommends the baseline."""
    best = [{"capacity": c} for c in (0.0, 0.0, 3.0)]
    base = [{"capacity": 2.0} for _ in range(3)]
    g = ex.gain("capacity", best, base)
    assert g["per_repeat"] == [0.0, 0.0, 1.5] and g["ratio"] == 0.0 and g["interval95"] is None
    assert g["verdict"] == "worse: the preset scored 0 in 2 of 3 repeats"
    said = ex.recommendation({"gain": g})
    assert said["use"] == "baseline" and "(range 0.000-1.500)" in said["why"]
    assert "interval" not in said["why"]
    once = ex.gain("capacity", [{"capacity": c} for c in (0.0, 3.0, 3.0)], base)
    assert once["verdict"] == "no gain shown: the preset scored 0 in 1 of 3 repeats"
    none = ex.gain("capacity", base, [{"capacity": c} for c in (0.0, 2.0, 2.0)])  # no ratio to take
    assert none["ratio"] is None and none["why"] == "the baseline's capacity is 0 in a repeat"


def test_gain_needs_paired_repeats() -> None:
    validation = _validation()
    with pytest.raises(ValueError, match="3 repeats of the best config, 2 of the baseline"):
        ex.gain("tpot_p99", validation["best"], validation["baseline"][:2])
    with pytest.raises(ValueError, match="every repeat needs a number for 'tpot_p99_ms'"):
        ex.gain("tpot_p99", [{}] * 3, validation["baseline"])


def test_throughput_gain_is_preset_over_baseline() -> None:
    preset = ex.build_preset(CONFIG, _validation(), None, {**PROVENANCE, "objective": "throughput"})
    assert preset["metrics"]["gain"]["ratio"] == pytest.approx(911.0 / 521.0)


@pytest.mark.parametrize(
    ("validation", "match"),
    [
        (_validation(repeats=2), r"needs >= 3 repeats of each side, got \(2, 2, 2\)"),
        ({"trial": 0}, r"kvtune.validation: missing keys \['config'"),
    ],
)
def test_bad_validation_is_refused(validation: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ex.build_preset(CONFIG, validation, None, PROVENANCE)


@pytest.mark.parametrize(
    ("model", "workload", "name"),
    [
        ("random:llama-3-8b", "traces/mooncake.jsonl", "random-llama-3-8b-mooncake.json"),
        ("/models/Llama-3-8B/", "azure 2024.csv", "llama-3-8b-azure-2024.json"),
    ],
)
def test_preset_path(model: str, workload: str, name: str, tmp_path: Path) -> None:
    assert ex.preset_path("h200", model, workload, tmp_path) == tmp_path / "h200" / name


# ---- no silent overwrite -----------------------------------------------------------------------------------
def test_existing_preset_is_never_silently_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "cpu" / "m-w.json"
    first = ex.write_preset({"n": 1}, path)
    second = ex.write_preset({"n": 2}, path)
    third = ex.write_preset({"n": 3}, path)
    assert (first, second, third) == (path, path.with_name("m-w-2.json"), path.with_name("m-w-3.json"))
    assert json.loads(path.read_text()) == {"n": 1}
    assert ex.write_preset({"n": 4}, path, overwrite=True) == path
    assert json.loads(path.read_text()) == {"n": 4}
    assert sorted(p.name for p in path.parent.iterdir()) == ["m-w-2.json", "m-w-3.json", "m-w.json"]


# ---- from a real SQLite study ----------------------------------------------------------------------
def _study(tmp_path: Path, validated: bool = True) -> str:
    storage = f"sqlite:///{tmp_path / 'kvtune.db'}"
    study = optuna.create_study(study_name="cpu-tiny-sample", storage=storage)
    workload = {"name": "sample", "path": "t/sample.jsonl", "sha256": "ab" * 32, "requests": 32}
    attrs = {
        names.ATTR_CARD: "cpu",
        names.ATTR_MODEL: "random:tiny",
        names.ATTR_OBJECTIVE: "tpot_p99",
        names.ATTR_WORKLOAD: workload,
        names.ATTR_SPACE: "0123456789abcdef",
        names.ATTR_BUDGET: 2**26,
        names.ATTR_TIME_SCALE: 3.5,
        names.ATTR_SEED: 0,
        names.ATTR_QUALITY_LIMITS: {"max_ppl_increase": 1.0, "max_kl": None},
    }
    if validated:
        attrs[names.ATTR_VALIDATION] = _validation()
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    for value in (20.0, 11.0):
        trial = study.ask()
        trial.set_user_attr(names.ATTR_CONFIG, CONFIG.to_dict())
        trial.set_user_attr(names.ATTR_SEED, 7)
        trial.set_user_attr(names.ATTR_DEVICE, "cpu")
        study.tell(trial, value)
    return storage


def test_export_from_study(tmp_path: Path) -> None:
    storage = _study(tmp_path)
    path = ex.export_from_study(storage, "cpu-tiny-sample", root=tmp_path / "presets")
    assert path == tmp_path / "presets" / "cpu" / "random-tiny-sample.json"
    preset = json.loads(path.read_text())
    assert HybridConfig.from_dict(preset["config"]) == CONFIG
    prov = preset["provenance"]
    assert (prov["study"], prov["trial"], prov["card"], prov["model"], prov["seed"]) == (
        "cpu-tiny-sample", 1, "cpu", "random:tiny", 7)  # fmt: skip
    assert prov["workload"]["sha256"] == "ab" * 32 and set(prov["versions"]) >= {"kvtune", "torch", "triton"}
    assert preset["quality"]["limits"] == {"max_ppl_increase": 1.0, "max_kl": None}
    assert "--block-size" in preset["vllm"]["args"]  # 64 is a multiple of 32 (CPU_ATTN)
    again = ex.export_from_study(storage, "cpu-tiny-sample", root=tmp_path / "presets")
    assert again == path.with_name("random-tiny-sample-2.json")
    strip = lambda p: {**p, "provenance": {**p["provenance"], "exported": None}}
    assert strip(json.loads(again.read_text())) == strip(preset)


@pytest.mark.parametrize(
    ("study", "validated", "error", "match"),
    [
        ("nope", True, ValueError, r"no study named 'nope'; studies there: \['cpu-tiny-sample'\]"),
        ("cpu-tiny-sample", False, ValueError, r"missing attributes \['kvtune.validation'\]"),
    ],
)
def test_export_errors(tmp_path: Path, study: str, validated: bool, error: type, match: str) -> None:
    storage = _study(tmp_path, validated)
    with pytest.raises(error, match=match):
        ex.export_from_study(storage, study, root=tmp_path)


def test_export_missing_database_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ex.export_from_study(f"sqlite:///{tmp_path / 'none.db'}", "s", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage, out = _study(tmp_path), tmp_path / "config.json"
    assert main(["export", "--study", "cpu-tiny-sample", "--storage", storage, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    gain = json.loads(out.read_text())["metrics"]["gain"]
    assert f"tpot_p99_ms: {gain['ratio']:.3f}x against the unquantized baseline (95 % interval" in printed
    assert gain["verdict"] in printed
    assert "  search: 2 trials in " in printed and " on ? worker(s): " in printed
    vllm = json.loads(out.read_text())["vllm"]
    assert f"  vLLM ({vllm['plugin']['tested_on']}; " in printed and f"\n    {vllm['command']}\n" in printed
    assert main(["export", "--study", "x", "--storage", storage, "--out", str(out)]) == 2
    assert "kvtune: error: storage" in capsys.readouterr().err


def test_the_interval_is_a_t_interval_on_log_ratios() -> None:
    ratios = [1.138, 1.159, 1.103]
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    lo, hi = ex.interval95(ratios)  # type: ignore[misc]
    assert (lo, hi) == pytest.approx(
        (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    )
    assert ex.interval95([1.2]) is None
    assert ex.interval95([1.0] * 200) == pytest.approx([1.0, 1.0])


def _timed(start_s: float, length_s: float, worker: int, state: str = "COMPLETE") -> optuna.trial.FrozenTrial:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    trial = optuna.trial.create_trial(
        state=optuna.trial.TrialState[state],
        value=1.0 if state == "COMPLETE" else None,
        user_attrs={names.ATTR_WORKER: worker},
    )
    trial.datetime_start = t0 + timedelta(seconds=start_s)
    trial.datetime_complete = t0 + timedelta(seconds=start_s + length_s)
    return trial


def test_search_rate_counts_busy_time_and_complete_trials() -> None:
    # two workers side by side for 100 s (one trial failed, one pruned), then a resumed run 1000 s later
    trials = [_timed(0, 40, 0), _timed(0, 10, 1, "FAIL"), _timed(12, 88, 1), _timed(40, 60, 0, "PRUNED"),
              _timed(1100, 30, 0)]  # fmt: skip
    rate = ex.search_rate(trials)
    assert rate is not None
    assert (rate["finished"], rate["pruned"], rate["failed"], rate["workers"]) == (4, 1, 1, 2)
    assert rate["busy_s"] == pytest.approx(130.0)  # the 1000 s gap between the runs is not search time
    assert rate["per_hour"] == pytest.approx(3600 * 4 / 130)
    assert rate["mean_trial_s"] == pytest.approx((40 + 10 + 88 + 60 + 30) / 5)
    line = ex.describe_rate(rate)
    assert line.startswith("4 trials (1 pruned, 1 failed) in 130 s of search on 2 worker(s): 111 trials per")
    assert ex.search_rate([optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING)]) is None
    assert rate["parts_s"] is None  # no trial probed: not a capacity study


def test_search_rate_says_where_a_capacity_trials_time_went() -> None:
    """A trial's wall split into its replays, its new cache's set-up (in the first probe), its quality call
    (none where an earlier trial's quality was reused) and the rest; a study stored before the quality call
    was timed has it in the rest, said so."""
    first, second = _timed(0, 60, 0), _timed(60, 30, 0)
    first.user_attrs.update({names.ATTR_PROBES: [{"wall_s": 20.0, "prime_s": 8.0}, {"wall_s": 10.0}],
                             names.ATTR_QUALITY_S: {"wall_s": 22.0, "load_s": 7.0}})  # fmt: skip
    second.user_attrs[names.ATTR_PROBES] = [{"wall_s": 12.0, "prime_s": 4.0}, {"wall_s": 9.0}]
    rate = ex.search_rate([first, second])
    assert rate is not None
    assert rate["parts_s"] == pytest.approx({"probes": (22 + 17) / 2, "set_up": 6.0, "quality": 11.0,
                                             "other": (8 + 9) / 2, "compile": None,
                                             "probes_clock": 0.0, "quality_beside": None})  # fmt: skip
    assert "(probes 19.5, a new cache's set-up 6.0, quality 11.0, other 8.5 s:" in ex.describe_rate(rate)
    # the worker times Triton's compilations inside the set-up and the quality call
    first.user_attrs[names.ATTR_PROBES][0]["compile_s"] = 5.0
    first.user_attrs[names.ATTR_QUALITY_S]["compile_s"] = 3.0
    second.user_attrs[names.ATTR_PROBES][0]["compile_s"] = 0.0
    compiled = ex.search_rate([first, second])
    assert compiled is not None and compiled["parts_s"]["compile"] == pytest.approx(4.0)
    assert "other 8.5 s; compiling 4.0 s of them:" in ex.describe_rate(compiled)
    # what the replays measured on their clock, beside their wall (the rest the host's)
    for p in (*first.user_attrs[names.ATTR_PROBES], *second.user_attrs[names.ATTR_PROBES]):
        p["duration_s"] = 2.5
    clocked = ex.search_rate([first, second])
    assert clocked is not None and clocked["parts_s"]["probes_clock"] == pytest.approx(5.0)
    assert "(probes 19.5 measuring 5.0 on their clock, a new cache's set-up 6.0" in ex.describe_rate(clocked)
    # quality measured by a CPU process while the probes ran: the call waits, the process measures
    first.user_attrs[names.ATTR_QUALITY_S] = {"wall_s": 0.4, "measure_s": 5.2, "load_s": 2.0}
    beside = ex.search_rate([first, second])
    assert beside is not None and beside["parts_s"]["quality_beside"] == pytest.approx(2.6)
    assert "quality 0.2 (measured 2.6 beside the probes), other" in ex.describe_rate(beside)
    del first.user_attrs[names.ATTR_QUALITY_S]
    older = ex.search_rate([first, second])
    assert older is not None and older["parts_s"]["quality"] is None
    assert "set-up 6.0, other (quality included) 19.5 s" in ex.describe_rate(older)
