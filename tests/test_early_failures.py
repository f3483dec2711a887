"""A study fails early, in one line naming its flag, or not at all: from any working folder, with inputs the
checks refuse before Ray starts, with a database kvtune creates private to its user.

Tests that need a Ray of their own (a study run from another folder) run it in a subprocess: the test run's
Ray is the one of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvtune
from kvtune.cache_impl.config import SHOWN_CHARS, shown
from kvtune.engine.traces import AZURE_HEADER, TraceError, read_trace
from kvtune.tuner import cli

PACKAGE_ROOT = Path(kvtune.__file__).resolve().parents[1]

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
