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
