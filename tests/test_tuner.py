"""The tuner on a CPU: a short real study (tiny random model, real Ray workers, real SQLite) that writes a
preset,
its resume, the seed contract, and bad inputs that must fail clearly and leave the study as it was.

The Ray session is the one of ``tests/conftest.py`` (a fake 4-GPU H200 node with 2 CPUs); CPU workers use
them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState

from kvtune.cache_impl.layout import ModelKVShape
from kvtune.search_spaces.cards import resolve_gpu
from kvtune.search_spaces.space import SearchSpace, WorkloadStats
from kvtune.studies.names import ATTR_RESUME_OF, ATTR_SPACE
from kvtune.studies.study import SpaceId, StudyOptions, open_study
from kvtune.tests.tuner_fakes import CRASH_BITS, BrokenWorker, CrashingWorker, tiny_job
from kvtune.tuner import cli
from kvtune.tuner.driver import Event
from kvtune.tuner.job import TuneJob, quality_coverage, tune
from kvtune.tuner.pool import WorkerStartError
from kvtune.tuner.protocol import QualitySettings, WorkerSpec
from kvtune.tuner.worker import TrialWorker

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"
TRIALS = 3
SMALL = [
    "--model", "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows", "2",
    "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1", "--quality-prefill", "24",
    "--quality-decode", "4", "--kv-budget", "64MiB", "--seed", "0", "--objective", "tpot_p99",
]  # fmt: skip
# SMALL names a fixed-rate objective: the capacity objective (the default) has its own study in
# test_capacity_search.py.


def argv(storage: str, *extra: str, gpu: str = "cpu", trace: Path = TRACE) -> list[str]:
    return ["--gpu", gpu, "--workload", str(trace), "--storage", storage, "--study", "s", *SMALL, *extra]


def snapshot(storage: str, name: str = "s") -> tuple[Any, ...]:
    study = optuna.load_study(study_name=name, storage=storage)
    return tuple((t.number, t.state, t.values, t.params) for t in study.trials), dict(study.user_attrs)


@pytest.fixture(scope="module")
def study_dir(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished real study of ``TRIALS`` trials and its preset (working directory: a temporary folder)."""
    tmp = tmp_path_factory.mktemp("study")
    storage = f"sqlite:///{tmp}/studies.db"
    out = tmp / "preset.json"
    assert cli.main(argv(storage, "--trials", str(TRIALS), "--out", str(out))) == 0
    return tmp, storage


def test_study_writes_a_preset(study_dir: tuple[Path, str]) -> None:
    tmp, storage = study_dir
    preset = json.loads((tmp / "preset.json").read_text())
    assert preset["config"]["kv_cache_strategy"] == "hybrid_v2"
    assert preset["metrics"]["repeats"] >= 3
    assert preset["metrics"]["workers"] and all("/" in w for w in preset["metrics"]["workers"])
    assert preset["vllm"]["additional_config"]["kvtune"] == preset["config"]
    study = optuna.load_study(study_name="s", storage=storage)
    assert len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == TRIALS
    validation = study.user_attrs["kvtune.validation"]
    use = preset["recommendation"]["use"]  # the baseline unless validation showed a gain
    assert preset["config"] == validation["config" if use == "best" else "baseline_config"]


@pytest.mark.parametrize("attr", ["kvtune.config", "kvtune.seed", "kvtune.versions", "kvtune.device"])
def test_every_trial_records(study_dir: tuple[Path, str], attr: str) -> None:
    study = optuna.load_study(study_name="s", storage=study_dir[1])
    assert all(attr in t.user_attrs for t in study.trials)


def test_the_quality_calls_seconds_are_kept_apart_from_the_quality(study_dir: tuple[Path, str]) -> None:
    """Each trial that measured its quality records the call's seconds (the model's load in the first
    one's) beside it, never in it: the quality a later trial of the same config reuses is the measurement
    alone."""
    trials = optuna.load_study(study_name="s", storage=study_dir[1]).get_trials(states=(TrialState.COMPLETE,))
    timed = [t.user_attrs["kvtune.quality_s"] for t in trials if "kvtune.quality_s" in t.user_attrs]
    assert timed and all(0.0 <= t["load_s"] < t["wall_s"] for t in timed)
    assert all(0.0 <= t["compile_s"] < t["wall_s"] for t in timed)  # no Triton on a CPU: 0
    assert all("wall_s" not in t.user_attrs["kvtune.quality"] for t in trials)


def test_study_records_reduced_quality_and_time_scale(study_dir: tuple[Path, str]) -> None:
    attrs = optuna.load_study(study_name="s", storage=study_dir[1]).user_attrs
    assert attrs["kvtune.quality_settings"]["windows"] == 1
    assert attrs["kvtune.time_scale_source"] == "calibrated" and attrs["kvtune.time_scale"] > 0


def test_resume_adds_trials_and_keeps_the_old(study_dir: tuple[Path, str]) -> None:
    _, storage = study_dir
    before, _ = snapshot(storage)
    assert cli.main(argv(storage, "--trials", str(TRIALS + 1), "--resume", "--no-export")) == 0
    after, _ = snapshot(storage)
    assert after[: len(before)] == before
    finished = [t for t in after if t[1] in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == TRIALS + 1


def test_resume_on_another_clock_is_refused(
    study_dir: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's clock is part of a study's identity: resuming a wall-clock study on the device clock is a
    one-line error naming it, and the study is untouched."""
    _, storage = study_dir
    before, _ = snapshot(storage)
    assert cli.main(argv(storage, "--trials", str(TRIALS + 5), "--resume", "--clock", "device")) == 2
    assert "clock" in capsys.readouterr().err
    assert snapshot(storage)[0] == before


def test_a_study_stored_before_the_clock_option_resumes_on_the_wall_clock() -> None:
    """An identity stored without ``clock`` (made before the option existed) matches the wall clock only."""
    from kvtune.studies.study import StudyMismatchError, check_identity

    study = optuna.create_study()
    space = SpaceId("f", "space")
    study.set_user_attr("kvtune.space", "f")
    study.set_user_attr("kvtune.identity", {"card": "cpu"})
    check_identity(study, {"card": "cpu", "clock": "wall"}, space)
    with pytest.raises(StudyMismatchError, match="clock"):
        check_identity(study, {"card": "cpu", "clock": "device"}, space)


def test_a_resumed_study_keeps_its_clock_unless_one_is_given(tmp_path: Path) -> None:
    """Without --clock a resumed study runs on the clock it was made with (one stored before the option: the
    wall's); a clock given is kept, for the identity check to refuse when it differs; a new study takes the
    job's."""
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.studies.names import ATTR_IDENTITY
    from kvtune.tuner.job import _spec_for

    job = tiny_job(tmp_path, resume=True)
    spec = dataclasses.replace(job.spec, scheduler=SchedulerConfig(clock="device"))
    job = dataclasses.replace(job, spec=spec)
    clock = lambda j, stored: _spec_for(j, stored).scheduler.clock
    assert clock(job, {ATTR_IDENTITY: {"clock": "wall"}}) == "wall"
    assert clock(job, {ATTR_IDENTITY: {"card": "cpu"}}) == "wall"  # stored before the option existed
    assert clock(dataclasses.replace(job, clock="device"), {ATTR_IDENTITY: {"clock": "wall"}}) == "device"
    assert clock(job, None) == "device"


def test_resuming_a_finished_study_adds_a_validation_and_keeps_the_earlier(
    study_dir: tuple[Path, str],
) -> None:
    """--resume of a study that already holds its trials validates again: a new record, none overwritten."""
    _, storage = study_dir
    before = optuna.load_study(study_name="s", storage=storage).user_attrs
    history = before.get("kvtune.validation_history") or [before["kvtune.validation"]]
    finished = len(snapshot(storage)[0])
    assert cli.main(argv(storage, "--trials", str(TRIALS), "--resume", "--no-export")) == 0
    after = optuna.load_study(study_name="s", storage=storage).user_attrs
    assert len(snapshot(storage)[0]) == finished  # no trial ran
    assert after["kvtune.validation_history"][: len(history)] == history
    assert len(after["kvtune.validation_history"]) == len(history) + 1
    assert after["kvtune.validation"] == after["kvtune.validation_history"][-1] != history[-1]


def test_a_spent_time_budget_validates_and_exports_the_best_so_far(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget of a few milliseconds stops the search after the first trials: the best of those is validated
    and its preset says of how many trials it is the best; --resume could go on."""
    storage, out = f"sqlite:///{tmp_path}/s.db", tmp_path / "preset.json"
    assert cli.main(argv(storage, "--trials", "50", "--time-budget", "0.0001", "--out", str(out))) == 0
    printed = capsys.readouterr()
    assert "the time budget ended the search" in " ".join((printed.out + printed.err).split())
    study = optuna.load_study(study_name="s", storage=storage)
    finished = len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)))
    assert 1 <= finished < 50
    preset = json.loads(out.read_text())
    assert preset["provenance"]["trials"] == {"finished": finished, "asked": 50}
    assert preset["metrics"]["repeats"] >= 3


BAD: dict[str, tuple[Callable[[str, Path], list[str]], str]] = {
    "unknown gpu": (lambda s, tmp: argv(s, gpu="b300"), "unknown GPU"),
    "missing trace": (lambda s, tmp: argv(s, trace=tmp / "nope.jsonl"), "no such trace file"),
    "no such gpu in the cluster": (  # --resume: a new study of that name would already be refused before Ray
        lambda s, tmp: argv(s, "--resume", gpu="l4"),
        "no L4 GPU in the Ray cluster",
    ),
    "exists, no resume": (lambda s, tmp: argv(s), "already exists"),
    "another sample": (  # a setting of the identity is named, though the space differs too
        lambda s, tmp: argv(s, "--resume", "--length-cap", "400"),
        'was made with sample={"length_cap": 96',
    ),
    "another objective": (lambda s, tmp: argv(s, "--resume", "--objective", "throughput"), "objective"),
    "two repeats": (lambda s, tmp: argv(s, "--repeats", "2"), "--repeats 2: must be >= 3"),
    "negative prefill": (
        lambda s, tmp: argv(s, "--quality-prefill", "-5"),
        "--quality-prefill -5: must be >= 1",
    ),
    "no decode": (lambda s, tmp: argv(s, "--quality-decode", "0"), "--quality-decode 0: must be >= 1"),
    "no time": (lambda s, tmp: argv(s, "--time-budget", "-1"), "--time-budget -1: must be > 0"),
    "nan time scale": (lambda s, tmp: argv(s, "--time-scale", "nan"), "--time-scale nan: must be > 0"),
    "no aggregation": (lambda s, tmp: argv(s, "--min-aggregation", "0"), "--min-aggregation 0: must be > 0"),
    "aggregation past 1": (
        lambda s, tmp: argv(s, "--min-aggregation", "1.5"),
        "`0 < min_aggregation <= 1` must hold, but got min_aggregation=1.5",
    ),
    "another aggregation bound": (  # the study was made without it
        lambda s, tmp: argv(s, "--resume", "--min-aggregation", "0.9"),
        "was made with quality_limits=",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_line_and_the_study_is_intact(
    study_dir: tuple[Path, str], capsys: pytest.CaptureFixture[str], case: str
) -> None:
    tmp, storage = study_dir
    make, message = BAD[case]
    before = snapshot(storage)
    assert cli.main(make(storage, tmp)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: ") and message in err[-1], err
    assert snapshot(storage) == before


def test_a_study_from_another_space_is_refused_untouched(
    study_dir: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same settings, another search space (what a study made by a kvtune whose space differs holds): a copy
    of the study with its stored space changed is refused on --resume, and nothing in it changes."""
    _, storage = study_dir
    copy = tmp_path / "copy.db"
    shutil.copy(storage.removeprefix("sqlite:///"), copy)
    other = f"sqlite:///{copy}"
    optuna.load_study(study_name="s", storage=other).set_user_attr(ATTR_SPACE, "0000000000000000")
    before = snapshot(other)
    assert cli.main(argv(other, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: study 's' exists with another search space (0000000000"), err
    assert snapshot(other) == before


# ---- jobs without the CLI ----------------------------------------------------------------------------------
def job(tmp: Path, worker_cls: type, trials: int = 2, resume: bool = False, **changes: Any) -> TuneJob:
    return tiny_job(tmp, worker_cls, trials=trials, resume=resume, **changes)


def test_a_config_that_crashes_is_an_infeasible_trial(ray_cluster: Any, tmp_path: Path) -> None:
    j = job(tmp_path, CrashingWorker, trials=3)
    tune(j)
    study = optuna.load_study(study_name="j", storage=j.options.storage)
    crashed = [t for t in study.trials if t.params.get("quantization_bits") == CRASH_BITS]
    assert crashed, "the defaults enqueue a 4-bit config"
    assert all(t.state == TrialState.COMPLETE and t.constraints["ran"] == 1.0 for t in crashed)
    assert all("out of memory" in t.user_attrs["kvtune.error"] for t in crashed)
    assert study.best_trial.params["quantization_bits"] != CRASH_BITS


def test_a_worker_that_cannot_start_is_a_clear_error(ray_cluster: Any, tmp_path: Path) -> None:
    with pytest.raises(WorkerStartError, match=r"failed to start: .*corrupt"):
        tune(job(tmp_path, BrokenWorker))
    assert optuna.get_all_study_names(f"sqlite:///{tmp_path}/j.db") == []


class Interrupt:
    """Raises KeyboardInterrupt (as Ctrl-C does) at the first finished window."""

    def __call__(self, e: Event) -> None:
        if e.kind == "window":
            raise KeyboardInterrupt


def test_ctrl_c_leaves_the_study_consistent_and_resume_reruns(ray_cluster: Any, tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        tune(job(tmp_path, TrialWorker, trials=2), Interrupt())
    j = job(tmp_path, TrialWorker, trials=2, resume=True)
    study = optuna.load_study(study_name="j", storage=j.options.storage)
    states = [t.state for t in study.trials]
    assert TrialState.RUNNING not in states
    interrupted = [t for t in study.trials if t.user_attrs.get("kvtune.interrupted")]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    tune(j)
    study = optuna.load_study(study_name="j", storage=j.options.storage)
    reruns = [t for t in study.trials if t.user_attrs.get(ATTR_RESUME_OF) == interrupted[0].number]
    assert len(reruns) == 1 and reruns[0].state == TrialState.COMPLETE
    assert reruns[0].params == interrupted[0].params


def test_pareto_mode_has_two_objectives_and_never_prunes(ray_cluster: Any, tmp_path: Path) -> None:
    j = job(tmp_path, TrialWorker, trials=4)
    j = dataclasses.replace(j, sample=dataclasses.replace(j.sample, windows=2))
    report = tune(dataclasses.replace(j, options=dataclasses.replace(j.options, pareto=True)))
    study = optuna.load_study(study_name="j", storage=j.options.storage)
    assert [d.name for d in study.directions] == ["MINIMIZE", "MAXIMIZE"]
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert report.validation is not None and report.validation["trial"] in {
        t.number for t in study.best_trials
    }


def test_presets_are_enqueued_and_abandoned_trials_rerun(ray_cluster: Any, tmp_path: Path) -> None:
    preset = {"kv_cache_strategy": "hybrid_v2", "hot_tokens": 16, "block_size": 32, "quantization_bits": 8}
    (tmp_path / "presets" / "cpu").mkdir(parents=True)
    (tmp_path / "presets" / "cpu" / "old.json").write_text(json.dumps({"config": preset}))
    tune(job(tmp_path, TrialWorker, trials=3))
    study = optuna.load_study(study_name="j", storage=job(tmp_path, TrialWorker).options.storage)
    from_presets = [t for t in study.trials if t.user_attrs.get("kvtune.enqueued_from") == "presets"]
    assert [t.user_attrs["kvtune.config"]["block_size"] for t in from_presets] == [32]
    left = study.ask()  # as if a driver had been killed with this trial running
    tune(job(tmp_path, TrialWorker, trials=4, resume=True))
    study = optuna.load_study(study_name="j", storage=job(tmp_path, TrialWorker).options.storage)
    assert study.trials[left.number].state == TrialState.FAIL
    assert study.trials[left.number].user_attrs["kvtune.abandoned"] is True
    assert [t.user_attrs.get(ATTR_RESUME_OF) for t in study.trials].count(left.number) == 1


# ---- the seed contract -------------------------------------------------------------------------------------
def proposals(tmp: Path, seed: int, n: int = 8) -> list[dict[str, Any]]:
    shape = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, dtype=torch.float32)
    space = SearchSpace.build(
        resolve_gpu("cpu"), "random:tiny", shape, WorkloadStats(512, 256, 99.0, 4), True
    )
    options = StudyOptions(
        f"sqlite:///{tmp}/seed.db", f"seed-{seed}", "tpot_p99", False, seed=seed, resume=False
    )
    tmp.mkdir()
    study = open_study(options, {}, SpaceId(space.space_fingerprint(), ""), {})
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append(space.suggest(trial).to_dict())
        study.tell(trial, float(len(out)))
    return out


def test_same_seed_proposes_the_same_configs(tmp_path: Path) -> None:
    first = proposals(tmp_path / "a", 7)
    assert proposals(tmp_path / "b", 7) == first
    assert proposals(tmp_path / "c", 8) != first


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quality_runs_in_float32_whatever_the_replay_dtype(dtype: str) -> None:
    """In bfloat16 any change to the cache flips roundings, and that noise would be charged to the config."""
    quality = QualitySettings(model="random:tiny", text_path=str(TEXT))
    spec = WorkerSpec(model="random:tiny", device="cpu", quality=quality, dtype=dtype, threads=1)
    worker = TrialWorker(spec)
    loaded = worker._quality_loaded()
    assert loaded.model.dtype == torch.float32
    assert (loaded is worker.loaded) == (dtype == "float32")


def test_a_quality_window_that_some_configs_keep_all_hot_is_warned_about() -> None:
    space = SimpleNamespace(hot_tokens=(16, 32, 64), block_sizes=(16, 64))
    short = QualitySettings(model="random:tiny", text_path=str(TEXT), prefill_tokens=96, decode_tokens=32)
    (warning,) = quality_coverage(space, short)  # type: ignore[arg-type]
    assert "quality windows are 128 tokens" in warning and "--quality-prefill 97 or more" in warning
    long = dataclasses.replace(short, prefill_tokens=97)
    assert quality_coverage(space, long) == ()  # type: ignore[arg-type]


@pytest.mark.parametrize(("rate", "feasible"), [(0.75, True), (0.7, True), (0.5, False), (None, False)])
def test_the_aggregation_bound_is_a_share_of_the_base_rate(rate: float | None, feasible: bool) -> None:
    from kvtune.tuner.driver import Bounds

    quality = {"ppl_change_pct": 0.0, "mean_kl": 0.0, "aggregation_rate": rate, "aggregation_base_rate": 0.75}
    c = Bounds(max_ppl_increase=2.0, min_aggregation=0.9).constraints(quality)
    assert set(c) == {"ran", "ppl_increase_pct", "aggregation"} and (c["aggregation"] <= 0) == feasible


def test_settings_without_the_probe_are_stored_as_before() -> None:
    """A study made before the aggregation bound existed resumes: its identity has neither key."""
    from kvtune.tuner.driver import Bounds

    assert Bounds(2.0).to_dict() == {"max_ppl_increase": 2.0, "max_kl": None}
    assert Bounds(2.0, None, 0.9).to_dict()["min_aggregation"] == 0.9
    off = QualitySettings(model="random:tiny", text_path=str(TEXT))
    assert "aggregation" not in off.to_dict()
    assert dataclasses.replace(off, aggregation=True).to_dict()["aggregation"] is True


@pytest.mark.parametrize(
    ("change", "message"),
    [({"windows": 0}, "windows >= 1"), ({"decode_tokens": -1}, "decode_tokens >= 1"),
     ({"step_ms": 0.0}, "step_ms > 0"), ({"dtype": "int8"}, "dtype must be one of")],
)  # fmt: skip
def test_quality_settings_refuse_what_cannot_be_measured(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QualitySettings(model="random:tiny", text_path=str(TEXT), **change)
