"""One driver per study: a lease with a heartbeat, stored in the study itself (no other service).

A driver that runs a study holds its lease, the study user attribute ``kvtune.driver``
(``{"host", "pid", "since", "heartbeat", "token"}``; ``null`` once released). A heartbeat thread rewrites
``heartbeat`` every :data:`HEARTBEAT_S` seconds. A second driver (``--resume`` included) is refused with one
line naming the holder while the lease is **live**; it takes the lease over when it is **stale**:

- released (``null``), or
- its heartbeat is older than :data:`STALE_S` seconds (the holder stopped beating: killed, host down), or
- its holder ran on this host and its process no longer exists.

Taking a lease writes it, waits :data:`SETTLE_S` and reads it back: of two drivers that write at once the
last one wins, and the other sees a token not its own and is refused. Only then does the new driver tell
the trials left RUNNING by the dead one FAIL (:func:`kvtune.studies.study.recover_abandoned`).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import optuna

from kvtune.studies.names import ATTR_DRIVER
from kvtune.studies.storage import redact

HEARTBEAT_S = 10.0  # the holder rewrites its heartbeat this often
STALE_S = 120.0  # a heartbeat older than this is a dead holder's
SETTLE_S = 0.5  # between writing a lease and reading it back


class StudyLockedError(ValueError):
    """The study is being run by another live driver."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _iso(when: datetime.datetime) -> str:
    return when.isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def stale_reason(lease: Mapping[str, Any] | None, now: datetime.datetime | None = None,
                 stale_s: float = STALE_S) -> str | None:  # fmt: skip
    """Why ``lease`` (a ``kvtune.driver`` record) no longer holds the study, or None while it is live."""
    if not lease:
        return "released"
    now = now or _now()
    age = (now - datetime.datetime.fromisoformat(str(lease["heartbeat"]))).total_seconds()
    if age > stale_s:
        return f"its last heartbeat was {age:.0f} s ago (stale after {stale_s:g} s)"
    if lease.get("host") == socket.gethostname() and not _pid_alive(int(lease["pid"])):
        return f"process {lease['pid']} on {lease['host']} has ended"
    return None


def describe(lease: Mapping[str, Any]) -> str:
    return f"host {lease['host']}, pid {lease['pid']}, since {lease['since']}"


def check_free(storage: str, name: str, stale_s: float = STALE_S) -> None:
    """Raise :class:`StudyLockedError` (one line, naming the holder) when study ``name`` exists and a live
    driver holds it; read only."""
    names = optuna.get_all_study_names(storage)
    if name not in names:
        return
    lease = optuna.load_study(study_name=name, storage=storage).user_attrs.get(ATTR_DRIVER)
    if stale_reason(lease, stale_s=stale_s) is None:
        raise StudyLockedError(_refusal(name, storage, lease))


def _refusal(name: str, storage: str, lease: Mapping[str, Any] | None) -> str:
    assert lease, "a refusal needs a live lease"
    return (
        f"study {name!r} in {redact(storage)} is being run by another driver ({describe(lease)}, last "
        f"heartbeat {lease['heartbeat']}); wait for it to end, or stop it (Ctrl-C) before --resume"
    )


class DriverLease:
    """The lease of one study held by this process (see the module docstring): :meth:`acquire`, then
    :meth:`release` (idempotent); a daemon thread beats while it is held."""

    def __init__(self, study: optuna.Study, storage: str, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, settle_s: float = SETTLE_S) -> None:  # fmt: skip
        self.study, self.storage = study, storage
        self.heartbeat_s, self.stale_s, self.settle_s = heartbeat_s, stale_s, settle_s
        self.token = uuid.uuid4().hex
        self.record: dict[str, Any] | None = None
        self.lost = False  # another driver took the lease over while this one held it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self.record is not None

    def _stored(self) -> Any:
        return self.study._storage.get_study_user_attrs(self.study._study_id).get(ATTR_DRIVER)

    def _write(self, value: Any) -> None:
        self.study._storage.set_study_user_attr(self.study._study_id, ATTR_DRIVER, value)

    def acquire(self) -> DriverLease:
        """Take the study's lease, or raise :class:`StudyLockedError` naming its live holder."""
        if self.held:
            return self
        storage = self.storage
        current = self._stored()
        if stale_reason(current, stale_s=self.stale_s) is None:
            raise StudyLockedError(_refusal(self.study.study_name, storage, current))
        now = _iso(_now())
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "heartbeat": now,
                  "token": self.token}  # fmt: skip
        self._write(record)
        time.sleep(self.settle_s)
        won = self._stored()
        if not won or won.get("token") != self.token:
            raise StudyLockedError(_refusal(self.study.study_name, storage, won))
        self.record = record
        self._thread = threading.Thread(target=self._beat, name="kvtune-lease", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> bool:
        """Rewrite the heartbeat; False (and ``lost``) when another driver holds the lease now. The storage
        has no compare-and-set: a takeover written between this read and this write is overwritten, and the
        taker finds the lease held at its own next beat (one holder either way)."""
        with self._lock:
            if self.record is None:
                return False
            stored = self._stored()
            if not stored or stored.get("token") != self.token:
                self.lost = True
                return False
            self.record = {**self.record, "heartbeat": _iso(_now())}
            self._write(self.record)
            return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.beat():
                return

    def release(self) -> None:
        """Stop beating and clear the lease (unless another driver took it over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self.record is None:
                return
            stored = self._stored()
            if stored and stored.get("token") == self.token:
                self._write(None)
            self.record = None

    def __enter__(self) -> DriverLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
