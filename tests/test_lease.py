"""One driver per study: a live driver's lease refuses a second one (``--resume`` included) with one line
naming the holder; a stale lease (released, silent heartbeat, ended process) is taken over."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from kvtune.studies.lease import ATTR_DRIVER, DriverLease, StudyLockedError, check_free, stale_reason
from kvtune.tuner import cli

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"


@pytest.fixture
def storage(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kvtune.db'}"
    optuna.create_study(study_name="s", storage=url)
    return url


def _study(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=storage)


def _lease(storage: str, **kw: Any) -> DriverLease:
    return DriverLease(_study(storage), storage, settle_s=kw.pop("settle_s", 0.0), **kw)


def _ago(seconds: float) -> str:
    when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    return when.isoformat(timespec="seconds")


def _ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_lease_refuses_a_second_driver_naming_the_holder(storage: str) -> None:
    with _lease(storage) as first:
        held = _study(storage).user_attrs[ATTR_DRIVER]
        assert (held["host"], held["pid"]) == (socket.gethostname(), first.record["pid"])  # type: ignore[index]
        for refuse in (lambda: _lease(storage).acquire(), lambda: check_free(storage, "s")):
            with pytest.raises(StudyLockedError, match=r"being run by another driver \(host ") as e:
                refuse()
            assert f"pid {held['pid']}, since {held['since']}" in str(e.value) and "\n" not in str(e.value)
    assert _study(storage).user_attrs[ATTR_DRIVER] is None  # released
    _lease(storage).acquire().release()  # free again
    check_free(storage, "nope")  # no such study: nothing to hold


@pytest.mark.parametrize(
    ("lease", "why"),
    [
        (None, "released"),
        ({"host": "elsewhere", "pid": 1, "since": _ago(900), "heartbeat": _ago(600)}, "last heartbeat"),
        ({"host": socket.gethostname(), "pid": "ENDED", "since": _ago(5), "heartbeat": _ago(1)}, "has ended"),
    ],
)  # fmt: skip
def test_a_stale_lease_is_taken_over(storage: str, lease: dict[str, Any] | None, why: str) -> None:
    if lease is not None and lease["pid"] == "ENDED":  # made now: by the time the test runs, a pid ended at
        # collection may be a new process's and a heartbeat taken then may be stale
        lease = {**lease, "pid": _ended_pid(), "since": _ago(5), "heartbeat": _ago(1)}
    _study(storage).set_user_attr(ATTR_DRIVER, lease)
    assert why in (stale_reason(lease) or "")
    check_free(storage, "s")
    with _lease(storage) as taken:
        assert _study(storage).user_attrs[ATTR_DRIVER]["token"] == taken.token


def test_a_live_lease_on_another_host_is_not_judged_by_its_pid(storage: str) -> None:
    lease = {"host": "elsewhere", "pid": _ended_pid(), "since": _ago(5), "heartbeat": _ago(1)}
    assert stale_reason(lease) is None
    _study(storage).set_user_attr(ATTR_DRIVER, lease)
    with pytest.raises(StudyLockedError, match="host elsewhere"):
        _lease(storage).acquire()


def test_the_holder_beats_and_a_taken_lease_is_lost(storage: str) -> None:
    lease = _lease(storage, heartbeat_s=0.05).acquire()
    first = lease.record["heartbeat"]  # type: ignore[index]
    time.sleep(1.2)  # heartbeats are stored to the second
    assert _study(storage).user_attrs[ATTR_DRIVER]["heartbeat"] > first
    with lease._lock:  # the takeover between two heartbeats (a beat's read and write are not atomic)
        _study(storage).set_user_attr(ATTR_DRIVER, {**lease.record, "token": "other"})  # type: ignore[dict-item]
    assert not lease.beat() and lease.lost
    lease.release()
    assert _study(storage).user_attrs[ATTR_DRIVER]["token"] == "other"  # not ours to clear


def test_of_two_drivers_starting_at_once_one_wins(storage: str) -> None:
    won: list[DriverLease] = []
    refused: list[str] = []
    gate = threading.Barrier(2)

    def start() -> None:
        lease = _lease(storage, settle_s=0.3)
        gate.wait()
        try:
            won.append(lease.acquire())
        except StudyLockedError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 1
    won[0].release()


def test_resume_of_a_study_a_live_driver_runs_is_one_line_and_touches_nothing(
    storage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the resumer told the live driver's running trial FAIL and that driver crashed."""
    study = _study(storage)
    running = study.ask()
    argv = ["--gpu", "cpu", "--workload", str(TRACE), "--storage", storage, "--study", "s", "--model",
            "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows", "1", "--resume",
            "--objective", "tpot_p99"]  # fmt: skip
    with _lease(storage) as live:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvtune: error: study 's' in sqlite:///"), err
        assert f"pid {live.record['pid']}" in err[0]  # type: ignore[index]
    assert _study(storage).trials[running.number].state == TrialState.RUNNING
