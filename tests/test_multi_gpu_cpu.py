"""Several GPUs at once, on a CPU: a Ray session that fakes a 4-GPU H200 node (``tests/conftest.py``).

One study runs on four real workers (the tiny random model, one CPU thread each, on the session's 2 CPUs)
placed with ``num_gpus=1`` and ``accelerator_type="H200"``; while it runs, the worker of one trial is killed
(``ray.kill``) between that trial's last window and its final result. The checks are about placement,
concurrency and bookkeeping: one worker per GPU, trials overlapping, the killed trial told FAIL and re-run
once, the worker replaced, no trial lost or run twice, validation repeats spread over the workers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from kvtune.search_spaces.cards import resolve_gpu
from kvtune.studies.names import ATTR_RETRY_OF
from kvtune.studies.study import StudyOptions
from kvtune.tests.tuner_fakes import tiny_job
from kvtune.tuner.driver import Event
from kvtune.tuner.job import TuneJob, TuneReport, tune
from kvtune.tuner.workload import WorkloadSample

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
TRIALS = 10
# The first trial from this one that reaches its last window gets its worker killed. A trial of the first wave
# (0-3, one per worker) always reaches it: none is reused (no trial is complete when they start) and none is
# pruned (the pruner waits for 4 finished trials). A later trial may be pruned at window 0 or reuse an earlier
# result, so a later threshold could pass the whole study without a kill.
FIRST_KILLABLE = 2


def fake_job(tmp_path: Path, trials: int, card: str = "h200", name: str = "multi") -> TuneJob:
    """:func:`tuner_fakes.tiny_job` on a card of several GPUs: 2 windows of 4 requests, seed 3."""
    job = tiny_job(tmp_path, trials=trials, card=resolve_gpu(card))
    quality = dataclasses.replace(job.spec.quality, prefill_tokens=8, decode_tokens=2)
    return dataclasses.replace(
        job,
        options=StudyOptions(f"sqlite:///{tmp_path}/s.db", name, "tpot_p99", False, seed=3, resume=False),
        sample=WorkloadSample(str(TRACE), requests=4, windows=2, seed=0, length_scale=0.01, length_cap=64),
        spec=dataclasses.replace(job.spec, quality=quality),
    )


class KillOnce:
    """Kills the worker of one trial after its last window (never pruned there, so the trial still needs the
    worker for its final result); records every event and the trial whose worker it killed."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.killed: int | None = None

    def __call__(self, e: Event) -> None:
        import ray

        self.events.append(e)
        if self.killed is None and e.kind == "window" and e.trial >= FIRST_KILLABLE and e.step == 1:
            self.killed = e.trial
            ray.kill(e.actor, no_restart=True)


@pytest.fixture(scope="module")
def killed_run(
    ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TuneReport, Any, KillOnce]:
    tmp = tmp_path_factory.mktemp("multi")
    job = fake_job(tmp, TRIALS)
    events = KillOnce()
    report = tune(job, events)
    study = optuna.load_study(study_name=job.options.name, storage=job.options.storage)
    return report, study, events


def test_one_worker_per_gpu(killed_run: tuple[TuneReport, Any, KillOnce]) -> None:
    report, _, _ = killed_run
    assert sorted(info.gpu_ids for info in report.workers) == [("0",), ("1",), ("2",), ("3",)]


def test_trials_run_concurrently(killed_run: tuple[TuneReport, Any, KillOnce]) -> None:
    _, study, _ = killed_run
    spans = [(t.datetime_start, t.datetime_complete) for t in study.trials if t.datetime_complete]
    most = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert most == 4, spans


def test_killed_trial_fails_and_runs_once_more(killed_run: tuple[TuneReport, Any, KillOnce]) -> None:
    _, study, events = killed_run
    assert events.killed is not None
    failed = study.trials[events.killed]
    assert failed.state == TrialState.FAIL
    assert "kvtune.lost_worker" in failed.user_attrs
    reruns = [t for t in study.trials if t.user_attrs.get(ATTR_RETRY_OF) == events.killed]
    assert len(reruns) == 1
    assert reruns[0].params == failed.params
    assert reruns[0].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert [e.kind for e in events.events].count("replaced") == 1


def test_no_trial_lost_or_duplicated(killed_run: tuple[TuneReport, Any, KillOnce]) -> None:
    report, study, _ = killed_run
    states = Counter(t.state for t in study.trials)
    assert states[TrialState.COMPLETE] + states[TrialState.PRUNED] == TRIALS == report.finished
    assert states[TrialState.FAIL] == 1
    assert states[TrialState.RUNNING] == states[TrialState.WAITING] == 0
    starts = Counter(e.trial for e in killed_run[2].events if e.kind == "start")
    assert set(starts.values()) == {1}  # every trial number started exactly once
    assert len(study.trials) == TRIALS + 1
    rate = report.rate  # what the console prints after "trials finished"
    assert rate is not None and (rate["finished"], rate["failed"]) == (TRIALS, 1)
    assert rate["workers"] >= 2 and rate["per_hour"] > 0


def test_validation_spreads_over_workers(killed_run: tuple[TuneReport, Any, KillOnce]) -> None:
    report, study, _ = killed_run
    v = report.validation
    # 3 repeats, then more while the gain's interval is wider than its goal (validation.repeat_to_interval)
    assert v is not None and v["repeats"] >= 3 and len(v["best"]) == v["repeats"]
    assert len({run["worker"] for run in v["best"][:3]}) == 3  # the first round: one repeat per worker
    assert [run["worker"] for run in v["best"]] == [run["worker"] for run in v["baseline"]]
    assert study.user_attrs["kvtune.validation"]["trial"] == v["trial"]
