"""A study fails early, in one line naming its flag, or not at all: from any working folder, with inputs the
checks refuse before Ray starts, with a database kvtune creates private to its user.

Tests that need a Ray of their own (a study run from another folder) run it in a subprocess: the test run's
Ray is the one of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvtune

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
