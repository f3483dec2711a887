"""``kvtune dashboard``: optuna-dashboard over a study storage, on localhost only.

The driver is the only writer of a study, so the dashboard is read-only by default: requests other than
GET/HEAD are answered 403 (``writable=True`` lifts that, e.g. to write notes from the web page).

It shows what the preset says: the driver names the objective and writes the study's note (baseline, noise,
limits, validation, recommendation: :mod:`kvtune.tuner.study_note`); the **best** trial it marks is the best
*feasible* one (optuna-dashboard asks the storage for the best value whatever the quality bound says, so
:class:`FeasibleBestStorage` answers with the best feasible trial, and :func:`_feasible_best` drops from a
study's best trials any that is not feasible, e.g. when none is). A capacity trial pruned before any probe
passed has no value (the driver reports none), so it is not drawn at 0.
:class:`DashboardServer` runs it in a background thread (``start()`` / ``stop()``, or ``with``);
:func:`serve` blocks until Ctrl-C.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvtune.tuner.export import check_storage

HOST = "127.0.0.1"
DEFAULT_PORT = 8080
READ_METHODS = ("GET", "HEAD")
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return


def _read_only(app: WSGIApp) -> WSGIApp:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") in READ_METHODS:
            return app(environ, start_response)
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"kvtune dashboard is read-only: the tuner's driver is the study's only writer\n"]

    return guarded


def feasible(trial: FrozenTrial) -> bool:
    """Complete, and within every constraint (quality bounds; ``ran``: it did not crash)."""
    return trial.state == TrialState.COMPLETE and all(c <= 0 for c in trial.constraints.values())


class FeasibleBestStorage(optuna.storages.RDBStorage):
    """The study database, whose best trial is the best feasible one (the best of all when none is)."""

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        done = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
        pool = [t for t in done if feasible(t)]
        if not pool:
            return super().get_best_trial(study_id)
        sign = 1.0 if self.get_study_directions(study_id)[0] == optuna.study.StudyDirection.MINIMIZE else -1.0
        return min(pool, key=lambda t: (sign * t.values[0], t.number))


STUDY_DETAIL = re.compile(r"^/api/studies/(\d+)$")


def _feasible_best(app: WSGIApp, storage: optuna.storages.BaseStorage) -> WSGIApp:
    """Drop the infeasible trials from a study's ``best_trials`` in the dashboard's study API."""

    def filtered(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not STUDY_DETAIL.match(environ.get("PATH_INFO", "")):
            return app(environ, start_response)
        held: dict[str, Any] = {}
        body = b"".join(
            app(environ, lambda status, headers, *exc: held.update(status=status, headers=headers))
        )
        if held["status"].startswith("200"):
            detail = json.loads(body)
            keep = lambda b: feasible(storage.get_trial(int(b["trial_id"])))
            detail["best_trials"] = [b for b in detail.get("best_trials", []) if keep(b)]
            body = json.dumps(detail).encode()
        headers = [(k, v) for k, v in held["headers"] if k.lower() != "content-length"]
        start_response(held["status"], [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return filtered


def dashboard_app(storage: str, writable: bool = False) -> WSGIApp:
    """The optuna-dashboard WSGI application for ``storage`` (read-only unless ``writable``), whose best
    trials are feasible ones."""
    try:
        import optuna_dashboard
    except ImportError:
        raise ValueError("kvtune dashboard needs optuna-dashboard: pip install 'kvtune[dashboard]'") from None
    check_storage(storage)
    database = FeasibleBestStorage(storage, skip_compatibility_check=True, skip_table_creation=True)
    app: WSGIApp = _feasible_best(optuna_dashboard.wsgi(database), database)
    return app if writable else _read_only(app)


class DashboardServer:
    """optuna-dashboard on ``http://127.0.0.1:<port>`` in a background thread; port 0 picks a free one."""

    def __init__(self, storage: str, port: int = DEFAULT_PORT, writable: bool = False) -> None:
        app = dashboard_app(storage, writable)
        try:
            self._server = make_server(HOST, port, app, _ThreadingServer, handler_class=_QuietHandler)
        except OSError as e:
            raise ValueError(
                f"dashboard: cannot listen on {HOST}:{port} ({e.strerror}); choose another --port"
            ) from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> DashboardServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="kvtune-dashboard", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread (idempotent)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def serve_forever(self) -> None:
        """Serve in the calling thread until Ctrl-C."""
        try:
            self._server.serve_forever()
        finally:
            self._server.server_close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def study_url(server_url: str, storage: str, study_name: str) -> str:
    """The dashboard page of ``study_name`` (``ValueError`` listing the studies when it is not there)."""
    import optuna

    check_storage(storage)
    names = optuna.get_all_study_names(storage)
    if study_name not in names:
        raise ValueError(f"storage {storage}: no study named {study_name!r}; studies there: {names}")
    study_id = optuna.storages.get_storage(storage).get_study_id_from_name(study_name)
    return f"{server_url}/dashboard/studies/{study_id}"
