"""Hostile inputs, local services and outputs a user can act on: one line each, early, nothing exposed.

One test (or group) per row of the issue that asked for this: the local Ray is private (loopback listeners,
token authentication), every bad ``--storage`` is one line, inputs fail before Ray starts, absurd lengths are
refused or clipped and counted and a trial cannot run unbounded, big traces cost little memory, a preset never
recommends a loss, kvtune reads what it writes, a re-validation keeps the earlier one, and the README says how
to set up on any machine, what a study exposes and the RAM it needs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.traces import MAX_REQUEST_TOKENS, LengthPolicy, Request, TraceError, TraceFile, read_trace
from kvtune.studies import names
from kvtune.studies.study import store_validation
from kvtune.tests.cli_testlib import one_error_line
from kvtune.tests.tuner_fakes import tiny_job, tiny_spec
from kvtune.tuner import cli, local_ray
from kvtune.tuner import export as ex
from kvtune.tuner.commands import tune as tune_command
from kvtune.tuner.job import TuneJob, TuneReport, tune
from kvtune.tuner.pool import WorkerPool, plan_placement
from kvtune.tuner.preflight import preflight

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"
README = ROOT / "README.md"
SMALL = [
    "--model", "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows", "2",
    "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1", "--quality-prefill", "24",
    "--quality-decode", "4", "--kv-budget", "64MiB", "--seed", "0",
]  # fmt: skip
CONFIG = HybridConfig("hybrid_v2", 32, 64, 8, sparse_top_k=128)


def argv(storage: str, *extra: str, trace: Path = TRACE) -> list[str]:
    return ["--gpu", "cpu", "--workload", str(trace), "--storage", storage, "--study", "s", *SMALL, *extra]


def mooncake_lines(n: int, input_length: int = 700, output_length: int = 30) -> str:
    return "".join(
        json.dumps({"timestamp": 1000 * i, "input_length": input_length, "output_length": output_length,
                    "hash_ids": [i, i + 1]}) + "\n"
        for i in range(n)
    )  # fmt: skip


def job(tmp: Path, trace: Path = TRACE, **changes: Any) -> TuneJob:
    return tiny_job(tmp, trace=trace, **changes)


# ---- a study's local Ray is private ------------------------------------------------------------------------
def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def listening_sockets() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of this process and its descendants (the
    local Ray's GCS, raylet, agents and workers are), from the operating system's table."""
    psutil = pytest.importorskip("psutil")
    out = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return out


def test_the_local_ray_and_its_workers_listen_on_loopback_only(ray_cluster: Any) -> None:
    """The session's Ray is started as kvtune starts its own (tests/conftest.py); with a worker running, the
    OS lists no listener of any of its processes beyond 127.0.0.1."""
    pool = WorkerPool(tiny_spec(), plan_placement(None, 1, 1.0))
    pool.start()
    try:
        sockets = listening_sockets()
    finally:
        pool.stop()
    names_seen = {name for name, _, _ in sockets}
    assert any("gcs" in n for n in names_seen) and any("raylet" in n for n in names_seen), sockets
    exposed = [s for s in sockets if not _loopback(s[1])]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert local_ray.node_address() == local_ray.LOOPBACK


AUTH_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"kvtune-probe", None, timeout=20)
    print("ALLOWED")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""

AUTH_SESSION = """
import json, os, subprocess, sys
import ray
from kvtune.tuner.local_ray import auth_mode, node_address, start_local_ray

notes = start_local_ray(num_cpus=1)
gcs = ray.get_runtime_context().gcs_address
home, other, probe = sys.argv[1], sys.argv[2], sys.argv[3]
cases = {
    "no token": {"HOME": other, "RAY_AUTH_MODE": "disabled"},
    "wrong token": {"HOME": other, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 32},
    "the token": {"HOME": home, "RAY_AUTH_MODE": "token"},
}
seen = {}
for case, env in cases.items():
    out = subprocess.run([sys.executable, "-c", probe, gcs], env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=120).stdout.split()
    seen[case] = out[0] if out else "nothing"
token = os.path.join(home, ".ray", "auth_token")
print(json.dumps({"mode": auth_mode(), "node": node_address(), "notes": len(notes), "seen": seen,
                  "token_mode": oct(os.stat(token).st_mode & 0o777)}))
ray.shutdown()
"""


def test_a_local_ray_keeps_token_authentication(tmp_path: Path) -> None:
    """In a Ray of its own (this test checks auth, so not the session's, which runs without it): started with
    RAY_AUTH_MODE unset, it requires Ray's token; a client without it, or with another, is refused."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["HOME"] = str(home)  # Ray writes its token under HOME: the user's own stays untouched
    done = subprocess.run(
        [sys.executable, "-c", AUTH_SESSION, str(home), str(other), AUTH_PROBE],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["mode"], found["node"], found["token_mode"]) == ("token", "127.0.0.1", "0o600")
    assert found["notes"] <= 1  # Ray wrote its token readable by others (umask 022): fixed, and said
    assert found["seen"] == {"no token": "REFUSED", "wrong token": "REFUSED", "the token": "ALLOWED"}


@pytest.mark.parametrize("how", ["flag", "RAY_ADDRESS"])
def test_a_named_cluster_keeps_the_users_settings(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    import ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if how == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    started, notes = local_ray.init_ray("10.1.2.3:6379" if how == "flag" else None)
    assert started and calls == [{"address": "10.1.2.3:6379", "logging_level": 40, "log_to_driver": False}]
    assert os.environ["RAY_AUTH_MODE"] == "token" and "its own network and authentication" in notes[0]


# ---- every bad --storage is one line, exit 2, before Ray ---------------------------------------------------
def _storage_case(tmp: Path, case: str) -> str:
    if case == "not a url":
        return "not-a-url"
    if case == "unknown kind":
        return "nosuchdb://host/db"
    if case == "no driver":
        if importlib.util.find_spec("psycopg2") is not None:
            pytest.skip("psycopg2 is installed here")
        return "postgresql+psycopg2://kv:s3cret@localhost/studies"
    if case == "read-only file":
        db = tmp / "ro.db"
        db.touch()
        db.chmod(0o444)
        return f"sqlite:///{db}"
    if case == "parent is a file":
        (tmp / "afile").write_text("x")
        return f"sqlite:///{tmp}/afile/studies.db"
    if case == "not sqlite":
        (tmp / "notes.db").write_text("these are notes, not a database\n")
        return f"sqlite:///{tmp}/notes.db"
    raise AssertionError(case)


STORAGE = {
    "not a url": "not a database URL",
    "unknown kind": "unknown database kind 'nosuchdb'",
    "no driver": "driver 'psycopg2' is not installed (pip install psycopg2-binary)",
    "read-only file": "is read-only (mode 0444)",
    "parent is a file": "afile is a file, not a directory",
    "not sqlite": "is not an SQLite database",
}


@pytest.mark.parametrize("case", list(STORAGE))
def test_a_bad_storage_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, case: str
) -> None:
    storage = _storage_case(tmp_path, case)
    start = time.monotonic()
    assert cli.main(argv(storage)) == 2
    line = one_error_line(capsys)
    assert line.startswith("kvtune: error: --storage ") and STORAGE[case] in line, line
    assert "s3cret" not in line  # a password is never printed
    assert time.monotonic() - start < 10


# ---- fail fast: trace, model, study before Ray -------------------------------------------------------------
def test_inputs_are_checked_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    storage = f"sqlite:///{tmp_path}/s.db"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(mooncake_lines(2) + "{not json\n")
    cases = [
        (argv(storage, trace=broken), f"{broken}:3: invalid JSON"),
        (argv(storage, "--model", str(tmp_path)), f"--model {tmp_path}: {tmp_path}/config.json: missing"),
        (
            argv(storage, "--quality-model", "random:nope"),
            "--quality-model random:nope: unknown random shape",
        ),
        (argv(storage, "--requests", "200"), "fewer than --windows 2 x --requests 200"),
    ]
    for args, message in cases:
        start = time.monotonic()
        assert cli.main(args) == 2
        line = one_error_line(capsys)
        assert message in line, line
        assert time.monotonic() - start < 10


def test_a_bad_number_of_planning_processes_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTUNE_WARM_PROCESSES", "0")
    assert cli.main(argv(f"sqlite:///{tmp_path}/s.db")) == 2
    line = one_error_line(capsys)
    assert "KVTUNE_WARM_PROCESSES='0': expected a positive number of processes" in line, line
    assert not (tmp_path / "s.db").exists()


def test_a_gguf_model_without_the_gguf_package_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real weights found but the package that reads them missing: one line before Ray starts, not a
    crash of every trial after its probes."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    assert cli.main(argv(f"sqlite:///{tmp_path}/s.db", "--quality-model", "smollm2")) == 2
    line = one_error_line(capsys)
    assert "--quality-model smollm2" in line and "pip install gguf" in line, line


# ---- absurd lengths: refused, or clipped and counted; a trial cannot run unbounded -------------------------
@pytest.mark.parametrize("key", ["input_length", "output_length"])
def test_a_length_beyond_any_context_is_refused_at_its_line(tmp_path: Path, key: str) -> None:
    path = tmp_path / "absurd.jsonl"
    path.write_text(
        mooncake_lines(3).replace(f'"{key}": {700 if key == "input_length" else 30}', f'"{key}": 1000000000')
    )
    with pytest.raises(TraceError, match=rf"absurd.jsonl:1: {key} 1000000000 is beyond any model's context"):
        read_trace(path)
    path.write_text(mooncake_lines(1, input_length=MAX_REQUEST_TOKENS))
    assert len(read_trace(path)) == 1  # the bound itself is a length


def test_clipping_by_the_cap_is_counted_in_the_replay(tiny: Any) -> None:
    """The `clipped 0` of a CPU study whose every prompt was cut to its cap: the count travels with the
    requests, so the replay that gets them already fitted reports them."""
    from kvtune.engine.options import ReplayOptions
    from kvtune.engine.replay import Replayer

    requests = [Request(i, 10.0 * i, 100_000, 40) for i in range(4)]
    fitted, counts = LengthPolicy(tiny.spec.max_context, cap=64).apply(requests)
    assert (counts.capped, counts.shortened) == (4, 4)
    replayer = Replayer(tiny, tiny.model.device, ReplayOptions(budget_bytes=1 << 26, warmup_requests=0))
    metrics = replayer.replay(HybridConfig("hybrid_v2", 16, 16, 0), fitted, 0.0)
    assert metrics.clipped == 4
    assert any("4 request(s) clipped" in w and "most of the replay" in w for w in metrics.warnings)


def test_a_sample_mostly_clipped_is_counted_and_warned_about_before_ray(tmp_path: Path) -> None:
    trace = tmp_path / "long.jsonl"
    trace.write_text(mooncake_lines(40, input_length=100_000, output_length=20))
    checked = preflight(job(tmp_path, trace))
    search = checked.lengths["search"]
    assert (search.total, search.shortened, search.capped) == (3, 3, 3)
    assert any("search sample: 3 of 3 shortened" in w and "most of it was cut" in w for w in checked.warnings)


def test_a_trial_past_its_time_limit_is_infeasible_with_the_reason(ray_cluster: Any, tmp_path: Path) -> None:
    report = tune(job(tmp_path, trials=2, trial_time_limit_s=1e-3))
    study = optuna.load_study(study_name="j", storage=f"sqlite:///{tmp_path}/j.db")
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) == 2 and report.validation is None  # nothing feasible, nothing validated
    assert all(t.constraints["ran"] == 1.0 for t in done)
    assert all(
        "ran past its time limit of 0.001 s (--trial-timeout)" in t.user_attrs[names.ATTR_ERROR] for t in done
    )


# ---- big traces in bounded memory --------------------------------------------------------------------------
def test_a_trace_is_held_as_columns_and_a_sample_reads_only_its_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = read_trace(TRACE)
    assert isinstance(trace, TraceFile)
    per_request = sum(
        a.nbytes for a in (trace.arrival_ms, trace.input_length, trace.output_length, trace.offsets)
    )
    assert per_request == 32 * len(trace)
    lines = TRACE.read_text().splitlines()
    reread = []
    original = TraceFile._reread
    monkeypatch.setattr(TraceFile, "_reread", lambda self, f, i: reread.append(i) or original(self, f, i))
    sample = trace.sample(n=5, seed=3)
    first = sample.sample_info.first_index  # type: ignore[union-attr]
    assert reread == list(range(first, first + 5))
    assert [r.hash_ids for r in sample] == [tuple(json.loads(lines[i])["hash_ids"]) for i in reread]


BIG_TRACE_PROBE = """
import resource, sys, time
import kvtune.tuner.commands.tune  # what the driver imports anyway
from kvtune.tuner.workload import WorkloadSample, load_trace

start = time.monotonic()
trace = load_trace(sys.argv[1])
sample = WorkloadSample(sys.argv[1], requests=4, windows=2, seed=0, length_scale=1 / 32, length_cap=192)
sample.search_windows(trace, 8192), sample.validation_requests(trace, 8192), sample.length_counts(trace, 8192)
print(len(trace), time.monotonic() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _write_big_trace(path: Path, lines: int) -> None:
    """A Mooncake-like trace: about 280 bytes a line (24 hash ids), as the 279 MB, 10^6-line one."""

    def line(i: int) -> str:
        ids = ", ".join(str(400_000 + i + k) for k in range(24))
        lengths = f'"input_length": {6000 + i % 4000}, "output_length": {100 + i % 500}'
        return f'{{"timestamp": {i * 7}, {lengths}, "hash_ids": [{ids}]}}\n'

    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, lines, 10_000):
            f.write("".join(line(i) for i in range(start, min(start + 10_000, lines))))


def _probe(path: Path) -> tuple[int, float, int]:
    out = subprocess.run([sys.executable, "-c", BIG_TRACE_PROBE, str(path)], capture_output=True, text=True,
                         check=True, timeout=600).stdout.split()  # fmt: skip
    return int(out[0]), float(out[1]), int(out[2])


@pytest.mark.slow
def test_a_million_line_trace_costs_the_driver_little_memory(tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    _write_big_trace(big, 1_000_000)
    assert big.stat().st_size > 250e6
    n_small, _, small_rss = _probe(TRACE)
    n_big, seconds, big_rss = _probe(big)
    assert (n_small, n_big) == (200, 1_000_000)
    extra_mb = (big_rss - small_rss) / 1e6
    print(f"10^6 lines: {seconds:.1f} s, peak RSS {big_rss / 1e6:.0f} MB, {extra_mb:.0f} MB over 200 lines")
    assert extra_mb < 200, f"a 10^6-line trace cost {extra_mb:.0f} MB more than a small one"


def test_kvtune_gpus_shows_the_cpu_budget_the_tuner_uses(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtune.engine.options import CPU_BUDGET_CAP_BYTES
    from kvtune.search_spaces.cards import host_memory_bytes

    assert cli.main(["gpus", "--space", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    weights = 135e6 * 4  # SmolLM2-135M in float32, about
    expected = min(0.9 * (host_memory_bytes() - weights), CPU_BUDGET_CAP_BYTES) / 2**30
    assert f"KV budget {expected:.2f} GiB" in out


def test_a_cpu_study_states_the_ram_it_needs(tmp_path: Path) -> None:
    j = job(tmp_path, workers=2, spec=dataclasses.replace(job(tmp_path).spec, budget_bytes=None))
    assert "RAM: about 10.0 GiB (2 worker(s) x (KV budget 4 GiB + ~1 GiB)" in tune_command._cpu_memory(j)


# ---- a preset never recommends a loss ----------------------------------------------------------------------
def _validation(ratios: list[float]) -> dict[str, Any]:
    best = [{"tpot_p99_ms": 10.0, "tokens_per_s": 100.0} for _ in ratios]
    baseline = [{"tpot_p99_ms": 10.0 * r, "tokens_per_s": 100.0} for r in ratios]
    return {
        "trial": 7, "config": CONFIG.to_dict(), "baseline_config": CONFIG.unquantized().to_dict(),
        "window": {"start_fraction": 0.75, "end_fraction": 1.0, "requests": 4}, "repeats": len(ratios),
        "best": best, "baseline": baseline, "quality": {"ppl_change_pct": 0.1},
        "date": "2026-12-01T00:00:00+00:00",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("ratios", "use"),
    [([0.81, 0.82, 0.817], "baseline"), ([1.03, 0.68, 1.28], "baseline"), ([1.14, 1.16, 1.10], "best")],
    ids=["a loss", "no gain shown", "a gain"],
)
def test_a_preset_recommends_the_best_config_only_for_a_shown_gain(ratios: list[float], use: str) -> None:
    preset = ex.build_preset(CONFIG, _validation(ratios), {"ppl_change_pct": 0.1}, {"card": "h200",
                             "objective": "tpot_p99"})  # fmt: skip
    assert list(preset)[:3] == ["format", "recommendation", "config"]
    assert preset["recommendation"]["use"] == use
    chosen = CONFIG if use == "best" else CONFIG.unquantized()
    assert preset["config"] == chosen.to_dict()
    assert preset["vllm"]["additional_config"] == {"kvtune": chosen.to_dict()}
    if use == "baseline":
        assert preset["recommendation"]["why"].startswith("the unquantized baseline: validation showed")
        assert preset["measured_best"]["config"] == CONFIG.to_dict()
        assert preset["measured_best"]["quality"] == {"ppl_change_pct": 0.1}
    else:
        assert "measured_best" not in preset and preset["quality"] == {"ppl_change_pct": 0.1}


def test_the_console_says_which_config_is_recommended(tmp_path: Path) -> None:
    from rich.console import Console

    validation = _validation([0.81, 0.82, 0.817])
    report = TuneReport("s", "sqlite://", 3, 3, 7, validation, None, "", 1.0, ())
    out = io.StringIO()
    tune_command._print_outcome(Console(file=out, width=300), report, job(tmp_path))
    assert (
        "recommended: the unquantized baseline: validation showed a loss for the best config (trial 7), "
        "0.817x" in out.getvalue()
    )


# ---- kvtune reads what it writes ---------------------------------------------------------------------------
def _forms() -> dict[str, Any]:
    preset = ex.build_preset(
        CONFIG, _validation([1.14, 1.16, 1.10]), None, {"card": "h200", "objective": "tpot_p99"}
    )
    return {
        "preset": preset,
        "exported --additional-config block": json.loads(preset["vllm"]["args"][-1]),
        "additional_config": {"additional_config": preset["vllm"]["additional_config"]},
        "bare": CONFIG.to_dict(),
    }


@pytest.mark.parametrize(
    "form", ["preset", "exported --additional-config block", "additional_config", "bare"]
)
def test_check_reads_every_form_kvtune_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_forms()[form], indent=2))
    assert cli.main(["check", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == CONFIG.to_dict()
    assert HybridConfig.from_json_file(path) == CONFIG  # what --config of replay and quality reads


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"kv_cache_strategy": "hybrid_v2", "hot_tokens": 32, "hot_tokens": 64}',
            "key 'hot_tokens' appears twice",
        ),
        ('{"kvtune": {"block_size": 64, "block_size": 64}}', "key 'block_size' appears twice"),
        ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested more than 32 levels deep"),
    ],
    ids=["duplicate", "duplicate-nested", "deep-array", "deep-object"],
)
def test_duplicates_and_deep_nesting_are_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "hostile.json"
    path.write_text(text)
    assert cli.main(["check", str(path)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and message in line, line


# ---- a re-validation keeps the earlier ones ----------------------------------------------------------------
def test_storing_a_validation_appends_to_the_history() -> None:
    study = optuna.create_study()
    first, second, third = ({"trial": n, "date": f"d{n}"} for n in range(3))
    study.set_user_attr(names.ATTR_VALIDATION, first)  # a study validated before the history existed
    assert store_validation(study, second) == 2
    assert store_validation(study, third) == 3
    assert study.user_attrs[names.ATTR_VALIDATION_HISTORY] == [first, second, third]
    assert study.user_attrs[names.ATTR_VALIDATION] == third  # the latest: what export reads


# ---- the README is true on any machine ---------------------------------------------------------------------
def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end > 0 else None]


def test_the_readme_says_how_to_set_up_what_a_study_exposes_and_the_ram_it_needs() -> None:
    text = README.read_text(encoding="utf-8")
    setup = _section(text, "## Set-up")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in setup
    assert "pins the CPU build" not in setup
    exposes = " ".join(_section(text, "### What a study exposes").split())
    assert "127.0.0.1" in exposes and "token authentication stays on" in exposes and "--address" in exposes
    memory = " ".join(_section(text, "### Memory").split())
    assert "GB of RAM" in memory and "--kv-budget" in memory
    assert "`--trial-timeout`" in text and "never recommends a loss" in text
