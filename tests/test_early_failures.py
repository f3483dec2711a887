"""A study fails early, in one line naming its flag, or not at all: from any working folder, with inputs the
checks refuse before Ray starts, with a database kvtune creates private to its user.

Tests that need a Ray of their own (a study run from another folder) run it in a subprocess: the test run's
Ray is the one of ``tests/conftest.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import ray.exceptions
import sqlalchemy
from optuna.trial import TrialState
from sqlalchemy.engine import Engine

import kvtune
from kvtune.cache_impl.config import SHOWN_CHARS, shown
from kvtune.engine.traces import AZURE_HEADER, TraceError, read_trace
from kvtune.tests.cli_testlib import one_error_line
from kvtune.tuner import cli, preflight, resources
from kvtune.tuner.commands import tune as tune_command

PACKAGE_ROOT = Path(kvtune.__file__).resolve().parents[1]
TRACE = PACKAGE_ROOT / "examples" / "traces" / "mooncake_sample.jsonl"  # 200 requests

STUDY_FROM_HERE = """
import json, sys
import optuna
from kvtune.tests.tuner_fakes import tiny_job
from kvtune.tuner.job import tune
from kvtune.tuner.local_ray import start_local_ray

start_local_ray(num_cpus=2)
job = tiny_job(__import__("pathlib").Path(sys.argv[1]), trials=1, workers=1)
report = tune(job)
print(json.dumps({"finished": report.finished, "kvtune": __import__("kvtune").__file__}))
"""


def test_a_study_runs_from_a_folder_holding_another_kvtune(tmp_path: Path) -> None:
    """Run from the parent of a clone named ``kvtune`` (here: a decoy package of that name, which Ray puts
    first on each worker's path), the workers still import the kvtune the driver imported."""
    here = tmp_path / "parent"
    (here / "kvtune").mkdir(parents=True)
    (here / "kvtune" / "__init__.py").write_text("")  # no __version__, no tuner: any import of it fails
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env |= {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(PACKAGE_ROOT)}
    done = subprocess.run(
        [sys.executable, "-P", "-c", STUDY_FROM_HERE, str(tmp_path)],  # -P: cwd not on the driver's path
        cwd=here, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"finished": 1, "kvtune": kvtune.__file__}


# ---- one short line naming the file, the line and the key ------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("t.jsonl", '{"timestamp": 0, "input_length": "²", "output_length": 5}\n', ":1: input_length"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": "١٢"}\n', ":1: output_length"),
        ("t.csv", f"{AZURE_HEADER}\n2023-11-16 18:15:46.68,²,5\n", ":2: ContextTokens"),
    ],
)
def test_a_trace_value_that_is_no_integer_names_file_line_and_key(
    tmp_path: Path, name: str, text: str, where: str
) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceError, match=f"^{re.escape(str(path) + where)} must be an integer >= 1, got"):
        read_trace(path)


HUGE = 1_000_000  # items or characters: a value this long is echoed cut


@pytest.mark.parametrize(
    "config",
    [
        {"kv_cache_strategy": "hybrid_v2", "hot_tokens": 64, "block_size": list(range(HUGE))},
        {"kv_cache_strategy": "hybrid_v2", "hot_tokens": "x" * HUGE, "block_size": 64},
        {"kv_cache_strategy": "hybrid_v2", "hot_tokens": 64, "block_size": 64, "k" * HUGE: 1},
    ],
    ids=["list", "string", "key"],
)
def test_a_long_value_is_echoed_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]
) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"kvtune": config}))
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 10 * SHOWN_CHARS and "..." in err[0], err[0][:300]


@pytest.mark.parametrize(
    ("value", "text"),
    [(list(range(HUGE)), "[0, 1, 2"), ("é" * HUGE, '"éé'), ({"a": [1] * HUGE}, '{"a": [1, 1')],
)
def test_shown_is_json_cut_to_its_limit(value: Any, text: str) -> None:
    assert shown(value).startswith(text) and len(shown(value)) == SHOWN_CHARS + len("...")


@pytest.mark.parametrize("value", [0, 1.5, "abc", None, True, [1, 2], {"a": 1}])
def test_a_short_value_is_shown_whole(value: Any) -> None:
    assert shown(value) == json.dumps(value)


# ---- refused before Ray starts, naming the flag, leaving no database behind -------------------------------
SMALL = [
    "--model", "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows", "2",
    "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1", "--quality-prefill", "24",
    "--quality-decode", "4", "--kv-budget", "64MiB", "--objective", "tpot_p99",
]  # fmt: skip


def argv(tmp: Path, *extra: str, trace: Path = TRACE) -> list[str]:
    return ["--gpu", "cpu", "--workload", str(trace), "--storage", f"sqlite:///{tmp}/s.db", "--study", "s",
            *SMALL, *extra]  # fmt: skip


def read_only_folder(tmp: Path) -> Path:
    folder = tmp / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


# case -> (extra arguments, made in tmp; what the line says)
REFUSED: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "seed too big": (lambda tmp: ["--seed", str(10**20)], f"--seed {10**20}: must be in [0, 2**32 - 1]"),
    "negative seed": (lambda tmp: ["--seed", "-1"], "--seed -1: must be in [0, 2**32 - 1]"),
    "requests beyond the trace": (
        lambda tmp: ["--requests", "1000000000", "--windows", "1"],
        "holds 144 requests, fewer than --windows 1 x --requests 1000000000",
    ),
    "budget below one request": (
        lambda tmp: ["--kv-budget", "1"],
        "--kv-budget 1 bytes: cannot hold one request",
    ),
    "out in a read-only folder": (
        lambda tmp: ["--out", str(read_only_folder(tmp) / "p.json")],
        "is read-only; pick another --out",
    ),
    "out a directory": (lambda tmp: ["--out", str(tmp)], "--out {tmp}: a directory"),
    "workload a directory": (lambda tmp: ["--workload", str(tmp)], "--workload {tmp}: a directory"),
}


@pytest.fixture
def immutable_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may write, root included (``chattr +i``; skipped where the file system or the user's
    capabilities do not allow it)."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not allowed here: {done.stderr.strip()}")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_preset_into_an_immutable_folder_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, immutable_folder: Path
) -> None:
    out = immutable_folder / "sub" / "p.json"
    assert cli.main(argv(tmp_path, "--out", str(out))) == 2
    line = one_error_line(capsys)
    assert f"--out {out}: the folder {immutable_folder} is not writable" in line, line
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_option_is_refused_before_ray_naming_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, case: str
) -> None:
    make, message = REFUSED[case]
    assert cli.main(argv(tmp_path, *make(tmp_path))) == 2
    line = one_error_line(capsys)
    assert message.replace("{tmp}", str(tmp_path)) in line, line
    assert not (tmp_path / "s.db").exists()  # refused before the study's database is made


def test_a_cpu_study_needing_more_ram_than_is_free_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's free RAM is read from the system: here it is said to be 2 GiB, which two workers of a
    1 GiB KV budget (+ ~1 GiB each) do not fit in."""
    monkeypatch.setattr(resources, "available_ram", lambda: 2 << 30)
    assert cli.main(argv(tmp_path, "--kv-budget", "1GiB", "--workers", "2")) == 2
    line = one_error_line(capsys)
    assert "--kv-budget / --workers: the study needs about 4.0 GiB of RAM" in line, line
    assert line.endswith("2.0 GiB is available; pass fewer --workers, or free memory first"), line


@pytest.mark.parametrize(
    ("workers", "budget", "have", "fits"),
    [(1, 1 << 30, 2 << 30, True), (2, 1 << 30, 4 << 30, True), (2, 1 << 30, (4 << 30) - 1, False),
     (1, None, 2 << 30, False), (1, None, 16 << 30, True), (2, None, 10 << 30, True),
     (2, None, (10 << 30) - 1, False)],
)  # fmt: skip
def test_the_ram_check_counts_each_workers_budget_and_overhead(
    workers: int, budget: int | None, have: int, fits: bool
) -> None:
    if fits:
        resources.check_ram(workers, budget, have)
    else:
        with pytest.raises(resources.ResourceError, match="--kv-budget / --workers"):
            resources.check_ram(workers, budget, have)


# ---- the study's database ---------------------------------------------------------------------------------
def test_a_new_study_database_is_private_to_its_owner(tmp_path: Path) -> None:
    """Created by kvtune: 0600 whatever the umask, as presets are; an existing file keeps its mode."""
    storage = f"sqlite:///{tmp_path}/new.db"
    assert preflight.new_study_attrs(storage, "s") is None
    assert stat.S_IMODE((tmp_path / "new.db").stat().st_mode) == 0o600
    assert optuna.get_all_study_names(storage) == []  # a database Optuna reads
    (tmp_path / "old.db").touch(mode=0o640)
    (tmp_path / "old.db").chmod(0o640)
    preflight.new_study_attrs(f"sqlite:///{tmp_path}/old.db", "s")
    assert stat.S_IMODE((tmp_path / "old.db").stat().st_mode) == 0o640


@pytest.fixture
def full_sqlite() -> Iterator[None]:
    """Every new SQLite connection may hold one page: SQLite then answers SQLITE_FULL ("database or disk is
    full"), as it does when the disk is full."""

    def one_page(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.execute("PRAGMA max_page_count = 1")

    sqlalchemy.event.listen(Engine, "connect", one_page)
    yield
    sqlalchemy.event.remove(Engine, "connect", one_page)


def test_a_full_disk_at_the_start_is_one_line_and_leaves_no_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, full_sqlite: None
) -> None:
    assert cli.main(argv(tmp_path)) == 2
    line = one_error_line(capsys)
    assert line == f"kvtune: error: --storage sqlite:///{tmp_path}/s.db: the disk is full; free space first"
    assert not (tmp_path / "s.db").exists()


# ---- a resource that runs out while the study runs: one line -----------------------------------------------
def ray_oom() -> BaseException:
    """What Ray raises when its memory monitor kills a worker (its message is a long report)."""
    report = "\n".join(
        ["Task was killed due to the node running low on memory."] + ["Memory on the node: ..."] * 99
    )
    return ray.exceptions.OutOfMemoryError(report)


def disk_full_in_a_commit() -> BaseException:
    """What Optuna raises when a commit hits a full disk: its error, raised from SQLite's."""
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as e:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit. This typically happens due to invalid data in the "
                "commit, e.g. exceeding max length."
            ) from e
    except optuna.exceptions.StorageInternalError as e:
        return e


RUN_OUT = {
    "ray oom": (ray_oom, "--kv-budget / --workers: Ray killed a worker for lack of memory (Task was killed"),
    "disk full": (disk_full_in_a_commit, "the disk is full; the study keeps every finished trial"),
}


@pytest.mark.parametrize("case", list(RUN_OUT))
def test_a_resource_running_out_during_the_study_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The run (baseline, trials or validation: whatever ``tune`` runs) raises what Ray or Optuna raise when
    memory or disk runs out; the CLI says it in one line naming what to change."""
    make, message = RUN_OUT[case]

    def run_out(*args: Any, **kwargs: Any) -> Any:
        raise make()

    monkeypatch.setattr(tune_command, "init_ray", lambda address: (False, []))
    monkeypatch.setattr(tune_command, "tune", run_out)
    assert cli.main(argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the study's settings, then the error
    assert [line for line in err if "error" in line.lower() or "Traceback" in line] == [err[-1]], err
    assert err[-1].startswith("kvtune: error: ") and message in err[-1], err[-1]


def test_a_full_disk_during_the_study_is_one_line_and_keeps_the_finished_trials(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real study whose second finished trial cannot be stored (its commit raises what Optuna raises on a
    full disk, and writes nothing, as SQLite's rollback leaves it): one line, and the first trial intact."""
    real = optuna.storages.RDBStorage.set_trial_state_values
    told: list[int] = []

    def full_on_the_second(self: Any, trial_id: int, state: TrialState, values: Any = None) -> bool:
        if state.is_finished():
            told.append(trial_id)
            if len(told) == 2:
                raise disk_full_in_a_commit()
        return real(self, trial_id, state, values)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", full_on_the_second)
    assert cli.main(argv(tmp_path, "--trials", "3", "--workers", "1", "--no-export")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: --storage ") and "the disk is full" in err[-1], err[-3:]
    assert not any("Traceback" in line for line in err)
    monkeypatch.undo()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 1 and finished[0]._trial_id == told[0] and finished[0].user_attrs
    with sqlite3.connect(tmp_path / "s.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_disk_too_full_to_create_the_database_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating the file itself fails (``os.open`` answers ENOSPC, as a disk without a free inode does)."""
    real_open = os.open

    def no_space(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if str(path).endswith("s.db"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", no_space)
    assert cli.main(argv(tmp_path)) == 2
    assert one_error_line(capsys).endswith("s.db: the disk is full; free space first")
    assert not (tmp_path / "s.db").exists()
