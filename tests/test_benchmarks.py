"""The GPU benchmark scripts run end to end on tiny shapes (CPU, Triton interpreter), so a GPU call is not the
first place a mistake in them shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, out: Path, *extra: str) -> None:
    """Run a benchmark script's ``--smoke`` mode under the Triton interpreter, writing into ``out``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this tree's kvtune
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out), *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_decode_attention_refuses_a_top_k_that_is_not_whole_blocks(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--top", "100", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--top 100: a positive multiple of the block size, 64" in run.stderr


def test_decode_attention_smoke(tmp_path: Path) -> None:
    _smoke("decode_attention.py", tmp_path)
    table = (tmp_path / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 2 x") or line.startswith("| 1 x")]
    assert len(rows) == 2
    assert "Sparse step at 1 x 1K, its parts alone (ms): INT8 selection" in table
    (parts,) = [line for line in table.splitlines() if line.startswith("Sparse step")]
    assert parts.count("TB/s") == 6 and parts.count(" MB, ") == 6  # each part's bytes and bandwidth
    assert (tmp_path / "results.json").exists()


def test_decode_attention_mixed_smoke(tmp_path: Path) -> None:
    """``--mixed``: sparse INT8 both ways (the split kernel, ``gluon_mixed``: the split kernel here too, the
    Gluon kernel needing CUDA) checked on a pool with demoted blocks, beside sparse INT4, unquantized and
    SDPA."""
    _smoke("decode_attention.py", tmp_path, "--mixed")
    table = (tmp_path / "mixed.md").read_text()
    (row,) = [line for line in table.splitlines() if line.startswith("| 1 x 1K | launches |")]
    assert row.count("x SDPA") == 0 and row.count("x);") == 4 and row.count("TB/s") == 4
    assert "sparse8 " in table and "sparse8_gluon_mixed " in table
    assert (tmp_path / "mixed.json").exists()


def test_decode_attention_quest_smoke(tmp_path: Path) -> None:
    """``--quest``: the selection with the single-program kernel and every split variant, each checked against
    the single kernel's table first and timed, and both from the float8 summary with the share of the fp16
    selection they keep; the whole sparse INT8 step both ways."""
    _smoke("decode_attention.py", tmp_path, "--quest")
    table = (tmp_path / "quest.md").read_text()
    (row,) = [line for line in table.splitlines() if line.startswith("| 1 x 1K | launches |")]
    assert row.count(" µs") == 0 and row.count(") [") == 8 and "differ" not in row
    assert row.count("% kept") == 2  # the fp8 variants
    (step,) = [line for line in table.splitlines() if line.startswith("Sparse INT8 step at 1 x 1K")]
    assert "single " in step and "split " in step and step.count("x SDPA") == 2
    assert (tmp_path / "quest.json").exists()


@pytest.mark.slow  # ~40 s on a 2-core CPU: a diagnostic benchmark (the pool's read ceiling)
def test_pool_read_smoke(tmp_path: Path) -> None:
    """The read-ceiling pass checks each launch's XOR of the words it read before timing it."""
    _smoke("pool_read.py", tmp_path)
    rows = [
        line
        for line in (tmp_path / "pool_read.md").read_text().splitlines()
        if line.startswith("| 2 x 256 |")
    ]
    assert [row.split("|")[4].strip() for row in rows] == ["8", "4"]


def test_decode_step_smoke(tmp_path: Path) -> None:
    configs = ROOT / "examples" / "configs"
    out = tmp_path / "step.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_step.py"), "--model", "random:tiny",
         "--batch", "2", "--length", "400", "--steps", "2", "--json", str(out), str(configs / "q_int8.json"),
         str(configs / "q_int8_sparse512_fast.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "q_int8_sparse512_fast" in run.stdout and "speed-up" in run.stdout
    rows = {(r["config"], r["path"]): r for r in json.loads(out.read_text())["rows"]}
    # the sparse config is timed with at least all but the newest 1/8 of each sequence's blocks in L2 (its
    # own tier planning may have demoted more: on the tiny model attention mass falls unevenly)
    assert rows[("q_int8_sparse512_fast", "graph")]["l2_share"] > 0.5
    assert rows[("q_int8", "graph")]["l2_share"] == 0.0
    assert all("launches_by_op" in r for r in rows.values())


def test_replay_compare_smoke(tmp_path: Path) -> None:
    configs = ROOT / "examples" / "configs"
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "replay_compare.py"), "--workload",
         str(ROOT / "examples" / "traces" / "mooncake_sample.jsonl"), "--model", "random:tiny", "--requests",
         "6", "--budget-gb", "1", "--length-scale", "0.01", "--length-cap", "96", "--json", str(out),
         str(configs / "q_unquantized.json"), str(configs / "q_int8.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "time scale" in run.stdout and "q_int8 TPOT p50=" in run.stdout
    assert out.exists()


def test_engine_replay_and_capacity_compare_smoke(tmp_path: Path) -> None:
    """The replay benchmark (unmeasured first replay, repeats on the kept cache, on each clock) and the
    capacity comparison (the worker's probes without Ray) on the tiny model."""
    import json

    configs = ROOT / "examples" / "configs"
    trace = str(ROOT / "examples" / "traces" / "azure_conv_sample.csv")
    pair = [str(configs / "q_unquantized.json"), str(configs / "q_int4.json")]
    common = ["--model", "random:tiny", "--workload", trace, "--requests", "8", "--length-scale", "0.03",
              "--length-cap", "96", "--kv-budget", "2e8"]  # fmt: skip
    replay = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_replay.py"), *common, "--repeats", "2",
         "--clock", "wall,device", "--profile", str(tmp_path / "prof"), "--profile-stacks", "--forwards",
         "--piecewise",
         "--json", str(tmp_path / "replay.json"), *pair],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert "largest distance from the median" in replay.stdout
    assert "q_int4 @ 2e8, wall clock" in replay.stdout and "q_int4 @ 2e8, device clock" in replay.stdout
    rows = json.loads((tmp_path / "replay.json").read_text())["results"]
    clocks = [(r["config"], r["clock"], r["repeat"], r["metrics"]["clock"]) for r in rows]
    assert clocks[:5] == [("q_unquantized", "wall", -1, "wall"), ("q_unquantized", "wall", 0, "wall"),
                          ("q_unquantized", "wall", 1, "wall"), ("q_unquantized", "device", 0, "device"),
                          ("q_unquantized", "device", 1, "device")]  # fmt: skip
    assert len(rows) == 10
    profiled = (tmp_path / "prof" / "q_int4_2e8.txt").read_text()
    assert "profiled replay" in profiled and "the host's waits by where they are called" in profiled
    # each repeat's prompt forwards, and a line of those the host bound
    assert all(r["metrics"]["forwards"] and r["metrics"]["forwards"][0]["prompt_tokens"] > 0 for r in rows)
    assert replay.stdout.count("prompt forwards: ") == len(rows)
    assert all(r["metrics"]["gc"] == "paused" for r in rows)  # as a trial's probes replay
    assert all(r["metrics"]["piecewise_forwards"] > 0 for r in rows)  # --piecewise: prompts through pieces
    separate = subprocess.run(  # prompts in forwards of their own: no mixed iteration
        [sys.executable, str(ROOT / "benchmarks" / "engine_replay.py"), *common, "--repeats", "1",
         "--no-prime", "--no-mixed", "--json", str(tmp_path / "separate.json"), pair[1]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert separate.returncode == 0, separate.stderr[-2000:]
    run = json.loads((tmp_path / "separate.json").read_text())
    assert run["engine_options"]["mixed"] is False and run["results"][0]["metrics"]["mixed_iterations"] == 0
    capacity = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "capacity_compare.py"), *common, "--repeats", "1",
         "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--json", str(tmp_path / "capacity.json"), *pair],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert capacity.returncode == 0, capacity.stderr[-2000:]
    assert "median capacity" in capacity.stdout and "q_int4" in capacity.stdout
    assert (tmp_path / "capacity.json").exists()


def test_probe_drift_smoke(tmp_path: Path) -> None:
    """The repeated probe (the worker's replayer, whole replays) on the tiny model, on the device clock: every
    replay's statistics and per-request times kept, each statistic's spread over the repeats printed."""
    import json

    trace = str(ROOT / "examples" / "traces" / "azure_conv_sample.csv")
    out = tmp_path / "drift.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_drift.py"), "--model", "random:tiny", "--workload",
         trace, "--requests", "8", "--length-scale", "0.03", "--kv-budget", "2e8", "--rates", "20",
         "--order", "q_unquantized*2", "--clock", "device", "--slo-ttft-ms", "1e4", "--slo-tpot-ms", "1e3",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    assert all(len(r["requests"]) == 8 and r["statistics"]["ttft_p99_ms"] > 0 for r in rows)
    assert "q_unquantized ×20 (2): ttft_p90_ms" in run.stdout
    assert "q_unquantized ×20: P99 2/2" in run.stdout  # limits no replay of the tiny model comes near


def test_gpu_sampler_summarizes_what_nvidia_smi_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler reads nvidia-smi's lines while its block runs (an N/A line skipped) and reports the lowest
    and median SM clock, the highest power and the throttle reasons other than none; nothing without it."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '1980, 350.5, 41, 0x0000000000000000'\n"
        "echo '1755, 690.1, 55, 0x0000000000000004'\n"
        "echo '[N/A], [N/A], [N/A], [N/A]'\n"
        "echo '1980, 400.0, 44, 0x0000000000000000'\n"
        "exec sleep 30\n"
    )
    fake.chmod(0o755)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_state import GpuSampler

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with GpuSampler(period_ms=50) as sampler:
        time.sleep(0.5)
    summary = sampler.summary()
    assert summary == {"samples": 3, "sm_mhz_min": 1755.0, "sm_mhz_median": 1980.0, "power_w_max": 690.1,
                       "temperature_c_max": 55.0, "throttle_reasons": ["0x0000000000000004"]}  # fmt: skip
    assert "SM 1755-1980 MHz" in GpuSampler.describe(summary)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with GpuSampler() as sampler:
        pass
    assert sampler.summary() == {} and GpuSampler.describe({}) == ""


def test_capacity_noise_smoke(tmp_path: Path) -> None:
    """The baseline's capacity searched on an unseen window of the later Azure excerpt, two routes, two
    searches each: their lines, each route's spread and the JSON with every probe; under ``near`` the
    second search starts at the first's capacity, stepping by 1.25x."""
    import json

    out = tmp_path / "noise.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "capacity_noise.py"), "--model", "random:tiny",
         "--requests", "8", "--windows", "1", "--repeats", "2", "--routes", "attainment,near",
         "--length-scale", "0.03", "--kv-budget", "2e8", "--slo-ttft-ms", "1e5", "--slo-tpot-ms", "1e4",
         "--unloaded", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ROUTE attainment spread max   0.0 %" in run.stdout
    assert run.stdout.count("P99 TTFT") >= 2  # the two unloaded replays
    results = json.loads(out.read_text())
    assert len(results["slo"]["unloaded_repeats"]) == 2
    routes = results["routes"]
    runs = routes["attainment"]
    assert len(runs) == 2 and runs[0]["probes"] and runs[0]["capacity"] > 0
    near = routes["near"]
    assert "expand" not in near[0]["search"] and near[0]["search"]["start"] == 1.0
    assert near[1]["search"]["start"] == near[0]["capacity"]
    assert near[1]["search"]["expand"] == 1.05 and near[1]["search"]["escalate"]


def _capacity_grid() -> Any:
    """``benchmarks/capacity_grid.py`` (the pure half of ``capacity_noise.py --grid``) as a module."""
    import importlib.util

    if "capacity_grid" in sys.modules:
        return sys.modules["capacity_grid"]
    spec = importlib.util.spec_from_file_location("capacity_grid", ROOT / "benchmarks" / "capacity_grid.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules["capacity_grid"] = importlib.util.module_from_spec(spec)  # dataclasses need it
    spec.loader.exec_module(module)
    return module


def test_capacity_noise_grid_smoke(tmp_path: Path) -> None:
    """``--grid``: two windows replayed twice at three rates, limits derived from the unloaded replay; the
    JSON keeps every replay and each rule's capacities, which are those the replays' times give."""
    import json

    out = tmp_path / "grid.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "capacity_noise.py"), "--grid", "--model", "random:tiny",
         "--requests", "6", "--windows", "2", "--repeats", "2", "--grid-rates", "3", "--grid-step", "0.5",
         "--grid-center", "1", "--length-scale", "0.03", "--kv-budget", "2e8", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "= 12 replays" in run.stdout and "planned: 12 replays ×" in run.stdout
    assert "GRID confirm" in run.stdout and "resolution: capacities are grid rates 50.0 % apart" in run.stdout
    data = json.loads(out.read_text())
    rates = data["grid"]["rates"]
    assert rates == pytest.approx([2 / 3, 1.0, 1.5]) and len(data["replays"]) == 12
    for r in data["replays"]:
        assert len(r["ttft_ms"]) == len(r["tpot_ms"]) == r["completed"] <= r["requests"] == 6
        assert r["stopped"] or r["completed"] == 6
        assert (
            1 <= r["counters"]["peak_running"] <= r["counters"]["max_num_seqs"]
            and r["counters"]["compiles"] == 0
        )
    assert "· slots " in run.stdout
    names = ["p90", "p99", "attainment", "pooled2", "attainment+pooled2", "confirm"]
    assert list(data["rules"]) == names
    grid = _capacity_grid()
    slo = grid.Slo.from_record(data["slo"])
    replays = [grid.replay_from_json(r) for r in data["replays"]]
    again = grid.rule_capacities(replays, slo, rates, 2)
    for name in names:
        caps = data["rules"][name]["capacities"]
        assert caps == again[name] and len(caps) == (2 if "pooled" in name else 4)
        assert all(c["capacity"] in (0.0, *rates) for c in caps)
        assert set(data["rules"][name]["windows"]) == ({"pooled"} if "pooled" in name else {"0", "1"})


def _window(grid: Any, slow: int, ttft: float = 50.0) -> tuple[Any, ...]:
    """20 requests' times: ``slow`` of them with a TTFT of 1 s, the others ``ttft`` ms; every TPOT 5 ms."""
    return tuple(grid.Times(1000.0 if i < slow else ttft, 5.0) for i in range(20))


# Under TTFT <= 100 ms, TPOT <= 10 ms over 20 requests, a replay with `slow` requests of 1 s passes: P90 while
# slow <= 1, P99 while slow == 0, attainment (>= 90 %) while slow <= 2. Per (window, repeat), slow per rate:
SLOW = {(0, 0): [0, 1, 2, 0], (0, 1): [0, 0, 3, 3], (1, 0): [0, 0, 0, 2], (1, 1): [1, 1, 1, 1]}
RATES = [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("rule", "expected", "non_monotone"),
    [
        ("p90", [2.0, 2.0, 3.0, 4.0], [[4.0], [], [], []]),
        ("p99", [1.0, 2.0, 3.0, 0.0], [[4.0], [], [], []]),
        ("attainment", [4.0, 2.0, 4.0, 4.0], [[], [], [], []]),
        ("confirm", [2.0, 2.0, 3.0, 4.0], [[4.0], [], [], []]),  # no margin near the limits: the P90's
        # pooled over both windows (40 requests): P90 fails from 4 slow ones, attainment from 5
        ("pooled2", [4.0, 2.0], [[], []]),
        ("attainment+pooled2", [4.0, 4.0], [[], []]),
    ],
)
def test_grid_rule_capacities(rule: str, expected: list[float], non_monotone: list[list[float]]) -> None:
    """Each rule's capacity per (window, repeat), or per repeat when pooled: the highest grid rate passing
    with every lower one passing; a pass above a failure is reported, never counted."""
    grid = _capacity_grid()
    slo = grid.Slo(100.0, 10.0, 90.0)
    replays = [
        grid.GridReplay(w, k, rate, 20, _window(grid, slow))
        for (w, k), row in SLOW.items()
        for rate, slow in zip(RATES, row, strict=True)
    ]
    caps = grid.rule_capacities(replays, slo, RATES, 2)[rule]
    assert [c["capacity"] for c in caps] == expected
    assert [c["non_monotone"] for c in caps] == non_monotone
    assert [c["above_grid"] for c in caps] == [c == 4.0 for c in expected]
    assert [c["below_grid"] for c in caps] == [c == 0.0 for c in expected]
    summary = grid.rule_summary(caps)
    assert summary["non_monotone"] == sum(1 for n in non_monotone if n)
    if "pooled" not in rule:  # a window with a capacity out of the grid has no spread (a bound)
        w0 = sorted(expected[:2])
        measured = (w0[1] - w0[0]) / (sum(w0) / 2) if not {0.0, 4.0} & set(w0) else None
        assert summary["windows"]["0"]["spread"] == pytest.approx(measured)


@pytest.mark.parametrize(
    ("third", "p90", "confirm"),
    [
        ((0, 50.0), [2.0, 1.0, 2.0], [2.0, 2.0, 2.0]),  # 2 of 3 pass at rate 2: the near pass
        ((2, 50.0), [2.0, 1.0, 1.0], [1.0, 1.0, 1.0]),  # 1 of 3: the near draws fail
    ],
)
def test_grid_confirm_majority(third: tuple[int, float], p90: list[float], confirm: list[float]) -> None:
    """``confirm``: a replay within 10 % of a limit takes the strict majority of the P90 verdicts of the
    repeats' replays of its window at its rate; one that is not near keeps its own."""
    grid = _capacity_grid()
    slo = grid.Slo(100.0, 10.0, 90.0)
    at_two = [_window(grid, 0, 95.0), _window(grid, 0, 105.0), _window(grid, *third)]  # near pass, near fail
    replays = [grid.GridReplay(0, k, 1.0, 20, _window(grid, 0)) for k in range(3)]
    replays += [grid.GridReplay(0, k, 2.0, 20, times) for k, times in enumerate(at_two)]
    caps = grid.rule_capacities(replays, slo, [1.0, 2.0], 1)
    assert [c["capacity"] for c in caps["p90"]] == p90
    assert [c["capacity"] for c in caps["confirm"]] == confirm


@pytest.mark.parametrize(
    ("violators", "prior", "fired"),
    [
        (2, "none", False),  # P99 failed, P90 (3 of 20) not yet
        (3, "none", False),  # every window rule failed, the pooled ones (5 of 40) not yet
        (5, "none", True),
        (3, "two slow", True),  # with the earlier window's two
        (3, "stopped", True),  # the earlier window failed every pooled rule
        (2, "stopped", False),
    ],
)
def test_grid_stop(violators: int, prior: str, fired: bool) -> None:
    """A grid replay stops only once every rule has certainly failed, the pooled ones counting the same
    repeat's earlier windows at the rate."""
    from types import SimpleNamespace

    grid = _capacity_grid()
    slo = grid.Slo(100.0, 10.0, 90.0)
    before = {
        "none": [],
        "two slow": [grid.GridReplay(0, 0, 1.0, 20, _window(grid, 2))],
        "stopped": [grid.GridReplay(0, 0, 1.0, 20, _window(grid, 0)[:5], stopped=True)],
    }[prior]
    seq = lambda late: SimpleNamespace(
        arrival_ms=0.0, token_ms=[] if late else [10.0, 15.0], request=SimpleNamespace(output_length=2)
    )
    seqs = [seq(i < violators) for i in range(20)]
    stop = grid.GridStop(slo, 20, 40, before)
    assert stop(500.0, seqs) is fired and stop.p90.fired is (violators >= 3)


def test_mixed_ops_times_the_host_and_profiles_an_iteration(tmp_path: Path) -> None:
    """``mixed_ops.py --host N``: N iterations' host launch time and wall, one more profiled (what a GPU
    call reads to see where a probe's host time goes); the tiny model on the CPU here."""
    out = tmp_path / "host.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mixed_ops.py"), "--host", "3", "--decode", "4",
         "--chunks", "2", "--chunk", "16", "--context", "48", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "4 decode rows + 2 chunks of 16 on cpu: host launch " in run.stdout and "tottime" in run.stdout
    host = json.loads(out.read_text())
    assert len(host["launch_ms"]) == len(host["wall_ms"]) == 3 and host["layers"] == 2
    assert all(0 < a <= b for a, b in zip(host["launch_ms"], host["wall_ms"]))


@pytest.mark.parametrize(("pieces", "most"), [(False, 47), (True, 32)])
def test_a_mixed_iteration_packs_its_chunks_in_a_fixed_number_of_launches(pieces: bool, most: int) -> None:
    """``mixed_ops.py`` (tiny model, 2 layers, INT8, 16 decode rows beside 4 chunks of 64, half of them with a
    cached prefix): per layer one packing of every chunk's keys and values, one attention, one seal, one
    hot-zone write for the chunks and one for the decode rows, and no gather or index write around them (the
    count before the packing kernel: 61 op by op, 46 in pieces). A change that adds launches to a mixed
    iteration fails here first."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mixed_ops.py"), "--decode", "16", "--chunks", "4",
         "--chunk", "64", "--top", "40", *(["--piecewise"] if pieces else [])],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    counts = {line.split()[0]: int(line.split()[1]) for line in run.stdout.splitlines()[1:] if line.strip()}
    total = int(run.stdout.split(" launches per mixed iteration")[0].rsplit(" ", 1)[1])
    assert total <= most, run.stdout
    per_layer = ("kernel::pack_kv", "kernel::chunks_attention", "kernel::seal_blocks")
    assert [counts[name] for name in per_layer] == [2, 2, 2], run.stdout
    assert counts["kernel::hot_write"] == 4 and "aten::index_put_" not in counts, run.stdout


def test_prompt_forward_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/prompt_forward.py end to end on a tiny model (pieces uncaptured, host wall): its lines and
    its JSON, one time per repeat and side."""
    out = tmp_path / "pf.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prompt_forward.py"), "--device", "cpu", "--model",
         "random:tiny", "--dtype", "float32", "--lengths", "5,17", "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "N     5 (bucket 16" in run.stdout and "N    17 (bucket 32" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["bucket"], len(r["eager"]), len(r["direct"]), len(r["pieces"])) for r in rows] == [
        (5, 16, 2, 2, 2),
        (17, 32, 2, 2, 2),
    ]
