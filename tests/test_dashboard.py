"""``kvtune dashboard``: optuna-dashboard's HTTP API answers with the study; read-only; stops cleanly."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from kvtune.tuner.dashboard import DashboardServer, study_url

pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed")
optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def storage(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kvtune.db'}"
    study = optuna.create_study(study_name="cpu-tiny-sample", storage=url)
    study.optimize(lambda t: t.suggest_int("hot_tokens_log2", 4, 6), n_trials=2)
    return url


@pytest.fixture
def server(storage: str) -> Iterator[DashboardServer]:
    with DashboardServer(storage, port=0) as s:
        yield s


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_api_lists_the_study(server: DashboardServer) -> None:
    summaries = _get(f"{server.url}/api/studies")["study_summaries"]
    assert [s["study_name"] for s in summaries] == ["cpu-tiny-sample"]


def test_api_returns_the_trials(server: DashboardServer, storage: str) -> None:
    study_id = study_url(server.url, storage, "cpu-tiny-sample").rsplit("/", 1)[1]
    detail = _get(f"{server.url}/api/studies/{study_id}?after=0")
    assert len(detail["trials"]) == 2


def test_writes_are_refused(server: DashboardServer) -> None:
    request = urllib.request.Request(f"{server.url}/api/studies/1", method="DELETE")
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(request, timeout=10)


def test_stop_closes_the_port(storage: str) -> None:
    server = DashboardServer(storage, port=0).start()
    url = server.url
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/api/studies", timeout=2)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda s, p: DashboardServer(f"sqlite:///{p}/none.db", port=0),
            FileNotFoundError,
            "none.db does not exist",
        ),
        (lambda s, p: study_url("http://x", s, "nope"), ValueError, r"no study named 'nope'"),
    ],
)
def test_errors(storage: str, tmp_path: Path, make, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make(storage, tmp_path)


def test_busy_port_is_a_clear_error(server: DashboardServer, storage: str) -> None:
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        DashboardServer(storage, port=server.port)


# ---- what the preset says ----------------------------------------------------------------------------------
@pytest.fixture
def capacity_storage(tmp_path: Path) -> str:
    """A capacity study as the driver leaves it: its objective named, a trial better than the feasible best
    that fails the quality bound, a trial pruned before any probe passed, a validation and the note."""
    from kvtune.studies import names
    from kvtune.studies.study import StudyOptions
    from kvtune.tests.test_outcome import SOUND
    from kvtune.tuner.study_note import name_objectives, publish

    url = f"sqlite:///{tmp_path / 'kvtune.db'}"
    study = optuna.create_study(study_name="c", storage=url, direction="maximize")
    name_objectives(study, StudyOptions(url, "c", "capacity", False, 0, False))
    noise = {
        "capacities": [29.0, 30.0, 31.2],
        "median": 30.0,
        "spread": 0.073,
        "threshold": 0.073,
        "repeats": 3,
    }
    attrs = {names.ATTR_OBJECTIVE: "capacity", names.ATTR_NOISE: noise, names.ATTR_SLO: SOUND["slo"],
             names.ATTR_QUALITY_LIMITS: {"max_ppl_increase": 2.0, "max_kl": None},
             names.ATTR_VALIDATION: SOUND}  # fmt: skip
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    for capacity, ppl in ((40.0, 3.5), (34.0, -1.0)):  # the higher capacity fails the 2 % bound
        trial = study.ask()
        trial.set_constraint("ppl_increase_pct", ppl)
        study.tell(trial, capacity)
    study.tell(study.ask(), state=optuna.trial.TrialState.PRUNED)  # failed its first probe: no value
    assert publish(study)
    return url


def _detail(storage: str, name: str) -> dict:
    with DashboardServer(storage, port=0) as server:
        study_id = study_url(server.url, storage, name).rsplit("/", 1)[1]
        return _get(f"{server.url}/api/studies/{study_id}?after=0")


def test_the_dashboard_shows_what_the_preset_says(capacity_storage: str) -> None:
    detail = _detail(capacity_storage, "c")
    assert detail["objective_names"] == ["capacity"]  # not "Objective 0"
    assert [t["number"] for t in detail["best_trials"]] == [1]  # trial 0 fails the quality bound
    pruned = detail["trials"][2]
    assert pruned["state"] == "Pruned" and not pruned.get("values") and not pruned["intermediate_values"]
    note = detail["note"]["body"]
    for said in ("objective `capacity`", "P99 TTFT ≤ 400 ms", "perplexity +2 %",
                 "capacity 30x the trace's rate, searched 3 times", "spread 7 %", "**Validation** of trial 3",
                 "95 % interval", "**Recommended**: `best`"):  # fmt: skip
        assert said in note, said


def test_no_feasible_trial_is_no_best(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvtune.db'}"
    study = optuna.create_study(study_name="c", storage=url, direction="maximize")
    trial = study.ask()
    trial.set_constraint("ppl_increase_pct", 1.0)
    study.tell(trial, 40.0)
    assert _detail(url, "c")["best_trials"] == []


def test_an_inconclusive_validation_is_said_in_the_note() -> None:
    from kvtune.studies import names
    from kvtune.tests.test_outcome import MEANINGLESS
    from kvtune.tuner.study_note import study_note

    note = study_note({names.ATTR_OBJECTIVE: "capacity", names.ATTR_VALIDATION: MEANINGLESS})
    assert "- **Inconclusive**: 4 of 6 validation capacity searches did not converge" in note
    assert "**Recommended**: `baseline`: the unquantized baseline, without engine flags" in note
    assert "**Validation**: not yet (the study is running)" in study_note({names.ATTR_OBJECTIVE: "capacity"})
