"""The serving engine on CPU, tiny random model: replay, batching under the budget, metrics, command."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.engine.engine import Engine, calibrate_time_scale, load_workload
from kvtune.engine.metrics import (
    MIN_REQUESTS_FOR_PERCENTILES,
    EngineCounters,
    RequestTiming,
    json_safe,
    percentiles,
    summarize,
)
from kvtune.engine.scheduler import Scheduler, SchedulerConfig
from kvtune.engine.scheduler import Sequence as Seq
from kvtune.engine.traces import Request
from kvtune.tuner.cli import main

CPU = torch.device("cpu")
CONTRACT_KEYS = (
    "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
    "e2e_p90_ms", "e2e_p99_ms", "itl_p99_ms", "tokens_per_s", "attn_bandwidth_gbs", "attn_utilization",
    "bookkeeping_ms_per_step", "bookkeeping_share", "peak_kv_bytes", "preemptions", "prefix_hit_rate",
    "refused", "clipped", "completed", "warnings",
)  # fmt: skip


def _config(bits: int = 8, **kw) -> HybridConfig:
    return HybridConfig("hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=bits, **kw)


def _requests(
    n: int, input_length: int = 48, output_length: int = 8, gap_ms: float = 2.0, shared: bool = False
):
    """``n`` requests; ``shared``: all start with the same two 16-token prefix blocks (hash ids 0, 1)."""
    ids = lambda i: (0, 1, 1000 + i) if shared else (3 * i, 3 * i + 1, 3 * i + 2)
    return [Request(i, i * gap_ms, input_length, output_length, ids(i), block_tokens=16) for i in range(n)]


def _budget(config: HybridConfig, tiny, sequences: int, length: int) -> int:
    return kv_bytes_for(config, tiny.model.kv_shape, [length] * sequences)


def _replay(tiny, config, budget, requests, time_scale=1.0, **options):
    engine = Engine(tiny, config, budget, CPU, SchedulerConfig(**options))
    return engine.replay(requests, time_scale, warmup_requests=1).to_dict()


# ---------------------------------------------------------------------------------------------- replay


def test_replay_end_to_end_gives_finite_metrics(tiny):
    config = _config(8)
    m = _replay(tiny, config, _budget(config, tiny, 8, 64), _requests(6))
    assert set(CONTRACT_KEYS) <= set(m)
    assert m["completed"] == 6 and m["refused"] == 0
    finite = [k for k in CONTRACT_KEYS if k not in ("warnings",)]
    assert all(math.isfinite(m[k]) for k in finite), {k: m[k] for k in finite}
    assert m["tokens_per_s"] > 0 and m["attn_bandwidth_gbs"] > 0 and m["peak_kv_bytes"] > 0


def test_long_prompts_are_prefilled_in_chunks(tiny):
    """48-token prompts under a 20-token prefill budget (separate prefill forwards, the former engine): three
    chunks each, every request completes."""
    m = _replay(tiny, _config(), 1 << 24, _requests(6), max_num_batched_tokens=20, mixed=False, graphs=False)
    assert m["completed"] == 6 and m["refused"] == 0 and not m["mixed"] and not m["graphs"]
    assert m["prefill_chunks"] == 6 * 3 and math.isfinite(m["tpot_p99_ms"])
    assert _replay(tiny, _config(), 1 << 24, _requests(6))["prefill_chunks"] == 6


def test_mixed_iterations_share_the_token_budget_with_decode_tokens(tiny):
    """Mixed iterations under a 20-token budget: decode tokens and prompt chunks share it, so prompts take
    at least three chunks each and decode rows ride along with them; everything completes."""
    m = _replay(tiny, _config(), 1 << 24, _requests(6, gap_ms=0.5), max_num_batched_tokens=20)
    assert m["completed"] == 6 and m["refused"] == 0 and m["mixed"] and m["max_num_batched_tokens"] == 20
    assert m["prefill_chunks"] >= 6 * 3 and m["mixed_iterations"] > 0


@pytest.mark.parametrize(("graphs", "mixed"), [(True, True), (False, True), (False, False)])
def test_device_busy_is_the_forwards_time_over_the_replay(tiny, graphs, mixed):
    """All at once, on the wall clock: ``device_busy`` is the forwards' time over the replay's (in (0, 1]
    on a CPU, where the forward runs on the host), ``launch_ratio`` the host time of the op-by-op forwards
    over their device time (on a CPU both are the same span: about 1)."""
    m = _replay(tiny, _config(), 1 << 24, _requests(6), time_scale=0.0, graphs=graphs, mixed=mixed)
    assert 0 < m["device_busy"] <= 1 and m["completed"] == 6
    assert m["launch_ratio"] == pytest.approx(1.0, rel=0.1)


def test_a_replay_records_each_prompt_forward_it_launched_op_by_op(tiny):
    """``forwards`` receives one record per op-by-op forward with prompt tokens (mixed iterations included):
    together they carry every prompt token and chunk of the replay, each with its decode rows, its device
    time and the host's time launching it (on a CPU the same span)."""
    engine = Engine(tiny, _config(), 1 << 24, CPU, SchedulerConfig(max_num_batched_tokens=20))
    forwards: list[dict[str, float]] = []
    m = engine.replay(_requests(6, gap_ms=0.5), 1.0, warmup_requests=1, forwards=forwards).to_dict()
    assert sum(f["prompt_tokens"] for f in forwards) == 6 * 48
    assert sum(f["chunks"] for f in forwards) == m["prefill_chunks"]
    assert sum(f["decode_rows"] > 0 for f in forwards) == m["mixed_iterations"] > 0
    assert all(f["device_ms"] > 0 and f["launch_ms"] > 0 for f in forwards)
    forward_ms = m["device_busy"] * m["duration_s"] * 1e3  # every forward's device time: theirs a share
    assert sum(f["device_ms"] for f in forwards) == pytest.approx(m["prefill_share"] * forward_ms, rel=1e-6)


def test_piecewise_forwards_serve_the_same_replay(tiny):
    """With ``piecewise`` every forward with prompt tokens (at most 2,048 of them) runs its dense parts as
    pieces: the same iterations, chunks and completions as op by op, and the same token counts."""
    requests = _requests(6)
    eager, pieces = (
        _replay(tiny, _config(), 1 << 24, requests, 0.0, piecewise=p, max_num_batched_tokens=20)
        for p in (False, True)
    )
    for key in ("completed", "prefill_chunks", "mixed_iterations", "decode_steps"):
        assert pieces[key] == eager[key], key
    assert eager["piecewise_forwards"] == 0 and pieces["piecewise_forwards"] > 0
    assert SchedulerConfig(piecewise=True).to_dict()["piecewise"] is True
    assert "piecewise" not in SchedulerConfig().to_dict()  # a record made before the option compares equal


SPARSE_PLANNED = {"sparse_top_k": 16, "migration_interval": 4, "migration_threshold_ms": 1.0}


@pytest.mark.parametrize(
    "extra",
    [{"quantization_bits": 0}, {"quantization_bits": 4}, SPARSE_PLANNED],
    ids=["bf0", "int4", "sparse"],
)
def test_mixed_graph_forwards_serve_the_same_replay(tiny, extra, monkeypatch):
    """With ``mixed_graphs`` a forward with prompt tokens whose shapes fit runs as the mixed graphs'
    function (on a CPU uncaptured) from its shape's second use on, the first op by op: the same iterations,
    chunks and completions as eager, the same tokens out (the logits differ only by padding's float order),
    a sparse config's too. The shape is predicted before anything is staged as the staged iteration keys
    it. The option needs the static decode step."""
    from kvtune.engine.mixed_graphs import MixedGraphs
    from kvtune.engine.outputs import SlotOutputs

    requests = _requests(6)
    record, outputs = SlotOutputs.record, []
    prepare, keys = MixedGraphs.prepare, []

    def recorded(self, slots, tokens, now_ms):
        outputs.append((slots.tolist(), tokens.tolist()))
        return record(self, slots, tokens, now_ms)

    def prepared(self, slots, tokens, positions, chunks, *rest):
        predicted = self.key_for(slots, chunks)
        info = prepare(self, slots, tokens, positions, chunks, *rest)
        keys.append((predicted, info.key, self._uses.get(info.key, 0)))
        return info

    monkeypatch.setattr(SlotOutputs, "record", recorded)
    monkeypatch.setattr(MixedGraphs, "prepare", prepared)
    runs = []
    for option in (False, True):
        outputs.clear()
        options = SchedulerConfig(mixed_graphs=option, max_num_batched_tokens=20)
        config = HybridConfig.from_dict(_config().to_dict() | extra)
        m = Engine(tiny, config, 1 << 24, CPU, options).replay(requests, 0.0, warmup_requests=1)
        runs.append((m.to_dict(), list(outputs)))
    (eager, eager_out), (graph, graph_out) = runs
    for key in ("completed", "prefill_chunks", "mixed_iterations", "decode_steps"):
        assert graph[key] == eager[key], key
    assert eager["mixed_graph_forwards"] == 0 < graph["mixed_graph_forwards"] == len(keys)
    assert all(predicted == key and uses >= 2 for predicted, key, uses in keys), keys
    assert graph_out == eager_out
    assert SchedulerConfig(mixed_graphs=True).to_dict()["mixed_graphs"] is True
    assert "mixed_graphs" not in SchedulerConfig().to_dict()
    with pytest.raises(ValueError, match="needs `graphs`"):
        SchedulerConfig(mixed_graphs=True, graphs=False)


def test_device_busy_of_counters():
    c = EngineCounters(duration_ms=200.0, forward_ms=150.0, eager_forward_ms=50.0, eager_launch_ms=60.0)
    m = summarize([RequestTiming(0, 0.0, (1.0, 2.0))], c)
    assert (m.device_busy, m.launch_ratio) == (0.75, 1.2)
    assert math.isnan(summarize([], EngineCounters()).device_busy)


@pytest.mark.parametrize("bounds", [[0, 13, 40, 70], [0, 1, 70], [0, 69, 70]])
def test_chunked_model_prefill_gives_the_same_logits(tiny, bounds):
    """The model prefilled in chunks through an unquantized cache: the same last logits as in one call."""
    from kvtune.cache_impl.hybrid_cache import HybridCache

    config = _config(bits=0)
    ids = torch.randint(0, tiny.spec.vocab_size, (70,), generator=torch.Generator().manual_seed(len(bounds)))
    caches = [HybridCache(config, tiny.model.kv_shape, 1 << 24, CPU, max_seqs=1) for _ in range(2)]
    for cache in caches:
        cache.add_sequence(0, ids.tolist())
    whole = tiny.model.prefill(caches[0], 0, ids, 0, last_only=True)
    for a, b in itertools.pairwise(bounds):
        chunked = tiny.model.prefill(caches[1], 0, ids[a:b], a, last_only=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    caches[1].check_integrity()


@pytest.mark.parametrize("mixed", [True, False])
def test_small_budget_preempts_and_still_completes(tiny, mixed):
    """More hot-zone slots than the blocks of the budget can fill (max_num_seqs given, as the former default
    did; the layout grants 3 of the 5): the growing batch preempts, recomputes and still completes."""
    config = _config(0)
    budget = _budget(config, tiny, 2, 80)
    m = _replay(tiny, config, budget, _requests(5, 40, 40), time_scale=0.0, max_num_seqs=5, mixed=mixed)
    assert m["preemptions"] > 0 and m["max_num_seqs"] == 3
    assert m["completed"] == 5 and m["refused"] == 0


def test_default_max_num_seqs_follows_the_budget_and_does_not_preempt(tiny):
    """The derived max_num_seqs: as many sequences of the mean length as the budget holds (2 here), so the
    same replay runs without a preemption; a 4-bit cache on the same budget runs more at once."""
    budget = _budget(_config(0), tiny, 2, 80)
    m = {bits: _replay(tiny, _config(bits), budget, _requests(5, 40, 40), time_scale=0.0) for bits in (0, 4)}
    assert m[0]["preemptions"] == 0 and m[0]["max_num_seqs"] == 2 and m[0]["completed"] == 5
    assert m[4]["max_num_seqs"] > m[0]["max_num_seqs"] and m[4]["peak_running"] > m[0]["peak_running"]


@pytest.mark.parametrize(("shared", "hits"), [(True, True), (False, False)])
def test_prefix_hits_follow_repeated_hash_ids(tiny, shared, hits):
    config = _config(8)
    m = _replay(tiny, config, _budget(config, tiny, 8, 64), _requests(4, 40, 4, gap_ms=50.0, shared=shared))
    assert (m["prefix_hit_rate"] > 0) is hits


def test_no_preemption_below_nine_tenths_of_the_budget(tiny, monkeypatch):
    """Saturation with prompts of 40 and 240 tokens over a budget for ten mean-length sequences: with the
    derived max_num_seqs no sequence is preempted while less than 90 % of the budget holds data. The former
    default (256 slots, the layout then reserving half the budget for hot zones) preempted at ~83 %: slots
    that no sequence used kept bytes the blocks needed."""
    config = _config(8)
    usage: list[float] = []
    preempt = Scheduler.preempt_newest

    def recording(self):
        usage.append(self.cache.kv_bytes_in_use() / self.cache.layout.budget_bytes)
        return preempt(self)

    monkeypatch.setattr(Scheduler, "preempt_newest", recording)
    requests = [Request(i, 0.0, 40 if i % 2 else 240, 60) for i in range(24)]
    budget = kv_bytes_for(config, tiny.model.kv_shape, [200] * 10)
    m = _replay(tiny, config, budget, requests, time_scale=0.0)
    assert m["completed"] == 24 and all(u >= 0.9 for u in usage), usage
    assert m["peak_kv_bytes"] >= 0.9 * budget
    usage.clear()
    m = _replay(tiny, config, budget, requests, time_scale=0.0, max_num_seqs=256)
    assert m["preemptions"] > 0 and min(usage) < 0.9


def test_four_bits_run_more_sequences_than_unquantized_on_one_budget(tiny):
    budget = _budget(_config(0), tiny, 3, 190)
    peak = {
        bits: _replay(tiny, _config(bits), budget, _requests(8, 180, 8), 0.0)["peak_running"]
        for bits in (0, 4)
    }
    assert peak[4] > peak[0] >= 1, peak


@pytest.mark.timeout(60)
def test_request_that_never_fits_is_refused_not_looped(tiny):
    config = _config(8)
    requests = [*_requests(2), Request(7, 1.0, 3000, 8, None)]
    m = _replay(tiny, config, _budget(config, tiny, 2, 64), requests)
    assert m["refused"] == 1 and m["completed"] == 2


def test_too_long_request_is_clipped_to_the_context(tiny):
    short = dataclasses.replace(tiny, spec=dataclasses.replace(tiny.spec, max_context=128))
    config = _config(8)
    requests = [*_requests(1), Request(5, 0.0, 128, 4, None)]
    m = _replay(short, config, _budget(config, tiny, 2, 128), requests)
    assert m["clipped"] == 1 and m["completed"] == 2


def test_calibrated_time_scale_is_positive(tiny):
    config = _config(0)
    scale = calibrate_time_scale(
        tiny,
        _requests(4, 32, 4, gap_ms=1.0),
        _budget(config, tiny, 4, 64),
        CPU,
        0.5,
        config,
        warmup_requests=0,
    )
    assert math.isfinite(scale) and scale > 0


# ---------------------------------------------------------------------------------------------- scheduler


class _StubCache:
    """Every running sequence needs one block per step; ``free`` blocks; sequences up to ``limit`` tokens."""

    def __init__(self, free: int, limit: int = 100, allocatable: bool = True) -> None:
        self.free, self.limit, self.allocatable, self.freed = free, limit, allocatable, []

    def fits_ever(self, n):
        return n <= self.limit

    def can_allocate(self, n, token_ids=None, reserved_blocks=0):
        return self.allocatable

    def add_sequence(self, seq_id, token_ids, now_ms=None):
        return 0

    def blocks_needed_for_step(self, ids):
        return len(ids)

    def blocks_free(self):
        return self.free

    def free_sequence(self, seq_id):
        self.freed.append(seq_id)


def _seq(rid: int, arrival_ms: float, input_length: int = 8) -> Seq:
    return Seq(Request(rid, arrival_ms, input_length, 4), [1] * input_length, arrival_ms)


def _prefill_all(scheduler: Scheduler) -> None:
    """What the engine does with this iteration's prefill work."""
    for seq, n in scheduler.prefill_chunks():
        seq.prefilled += n


def test_scheduler_preempts_the_newest_arrivals_first():
    scheduler = Scheduler(_StubCache(free=1))
    for rid, arrival in ((0, 0.0), (1, 5.0), (2, 1.0)):
        scheduler.add(_seq(rid, arrival))
    assert len(scheduler.admit()) == 3
    _prefill_all(scheduler)
    assert [s.seq_id for s in scheduler.schedule_decode()] == [0]
    assert [s.seq_id for s in scheduler.waiting] == [2, 1] and scheduler.preemptions == 2


@pytest.mark.parametrize(
    "cache",
    [
        _StubCache(free=9, limit=10),  # longer than an empty cache holds
        _StubCache(free=9, allocatable=False),  # an empty cache cannot take it
        _StubCache(free=0),  # running alone, its step still finds no block
    ],
)
def test_scheduler_refuses_what_cannot_run_instead_of_waiting(cache):
    scheduler = Scheduler(cache)
    scheduler.add(_seq(0, 0.0))
    scheduler.admit()
    _prefill_all(scheduler)
    scheduler.schedule_decode()
    assert [s.seq_id for s in scheduler.refused] == [0] and not scheduler.has_work()


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps():
    """A 25-token prompt under a 10-token prefill budget: chunks of 10, 10, 5 over three iterations while a
    sequence already decoding keeps decoding; a later arrival is admitted once its prompt fits the budget
    left."""
    scheduler = Scheduler(_StubCache(free=9), SchedulerConfig(max_num_batched_tokens=10))
    scheduler.add(_seq(0, 0.0, input_length=4))
    scheduler.admit()
    _prefill_all(scheduler)
    scheduler.add(_seq(1, 1.0, input_length=25))
    scheduler.add(_seq(2, 2.0, input_length=6))
    chunks, decoding = [], []
    for _ in range(4):
        scheduler.admit()
        work = scheduler.prefill_chunks()
        chunks.append([(s.seq_id, n) for s, n in work])
        for seq, n in work:
            seq.prefilled += n
        decoding.append([s.seq_id for s in scheduler.schedule_decode()])
    assert chunks == [[(1, 10)], [(1, 10)], [(1, 5)], [(2, 6)]]
    assert decoding == [[0], [0], [0, 1], [0, 1, 2]]


# ---------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], (math.nan,) * 3), ([5.0], (5.0, 5.0, 5.0)), (list(range(101)), (50.0, 90.0, 99.0))],
)
def test_percentiles(values, expected):
    assert percentiles(values) == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize(("n", "warned"), [(1, True), (MIN_REQUESTS_FOR_PERCENTILES, False)])
def test_percentiles_under_100_requests_warn(n, warned):
    timings = [RequestTiming(i, 0.0, (10.0, 12.0, 14.0)) for i in range(n)]
    m = summarize(timings, EngineCounters(duration_ms=100.0, decode_steps=2, decode_ms=4.0))
    assert any("percentiles over" in w for w in m.warnings) is warned
    assert m.ttft_ms[2] == 10.0 and m.tpot_ms[0] == 2.0 and m.itl_ms[1] == 2.0 and m.e2e_ms[0] == 14.0


def test_json_safe_replaces_non_finite_numbers():
    assert json_safe({"a": math.nan, "b": (1.0, math.inf), "c": "x"}) == {
        "a": None,
        "b": [1.0, None],
        "c": "x",
    }


# ---------------------------------------------------------------------------------------------- command


def _write_trace(path: Path, n: int) -> Path:
    rows = [
        {"timestamp": 1000 + 5 * i, "input_length": 40, "output_length": 4, "hash_ids": [0, i + 1]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_workload_samples_and_scales(tmp_path):
    requests, counts, record = load_workload(
        str(_write_trace(tmp_path / "t.jsonl", 6)), 4096, 4, 0, 0.5, None
    )
    assert len(requests) == 4 and requests[0].arrival_ms == 0.0
    assert requests[0].input_length == 20 and counts.total == 4
    assert record["length_policy"]["scale"] == 0.5


def test_replay_command_prints_and_writes_json(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(_config(4).to_json(), encoding="utf-8")
    out = tmp_path / "m.json"
    argv = [
        "replay",
        "--config",
        str(config),
        "--workload",
        str(_write_trace(tmp_path / "t.jsonl", 5)),
        "--model",
        "random:tiny",
        "--requests",
        "5",
        "--device",
        "cpu",
        "--budget-gb",
        "0.001",
        "--time-scale",
        "1",
        "--length-scale",
        "1",
        "--warmup",
        "0",
        "--piecewise",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["metrics"]["completed"] == 5 and record["config"]["quantization_bits"] == 4
    assert record["metrics"]["piecewise_forwards"] > 0
    printed = capsys.readouterr().out
    assert "TPOT" in printed and "prompt forwards in pieces" in printed


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--max-prefill-tokens", "0", "`max_num_batched_tokens >= 1`"),
     ("--max-batch", "0", "`max_num_seqs >= 1`"),
     ("--max-num-batched-tokens", "0", "`max_num_batched_tokens >= 1`"),
     ("--max-num-seqs", "0", "`max_num_seqs >= 1`"),
     ("--requests", "0", "--requests 0: must be >= 1"),
     ("--time-scale", "-1", "--time-scale -1: must be >= 0"), ("--load", "0", "--load 0: must be > 0"),
     ("--budget-gb", "nan", "--budget-gb nan: must be > 0")],
)  # fmt: skip
def test_replay_command_refuses_bad_limits_before_loading(tmp_path, capsys, option, value, message):
    config = tmp_path / "c.json"
    config.write_text(_config(4).to_json(), encoding="utf-8")
    argv = ["replay", "--config", str(config), "--workload", str(_write_trace(tmp_path / "t.jsonl", 5)),
            "--model", "no-such-model", option, value]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtune: error: ") and message in err[0]


# ---------------------------------------------------------------------------------------- the sparse tier


def test_a_replay_reports_how_much_of_the_cache_the_sparse_tier_held(tiny):
    """A sparse config reports the largest share of its in-use (layer, block) pairs in L2 and the
    migrations applied; a config without the tier reports neither (NaN, 0)."""
    sparse = _config(8, sparse_top_k=32, migration_interval=2, migration_threshold_ms=0.001)
    requests = _requests(4, input_length=96, output_length=24)
    m = _replay(tiny, sparse, _budget(sparse, tiny, 8, 160), requests)
    assert 0 < m["l2_peak_share"] <= 1 and m["migrations"] > 0
    assert not any("sparse tier held no block" in w for w in m["warnings"])
    dense = _replay(tiny, _config(8), _budget(_config(8), tiny, 8, 160), requests)
    assert math.isnan(dense["l2_peak_share"]) and dense["migrations"] == 0


@pytest.mark.parametrize(("share", "warned"), [(0.0, True), (0.25, False), (math.nan, False)])
def test_a_sparse_tier_that_never_held_a_block_is_said(share, warned):
    timings = [RequestTiming(i, 0.0, (10.0, 12.0)) for i in range(MIN_REQUESTS_FOR_PERCENTILES)]
    m = summarize(timings, EngineCounters(duration_ms=100.0, decode_steps=2, l2_peak_share=share))
    assert any("sparse tier held no block" in w for w in m.warnings) is warned
