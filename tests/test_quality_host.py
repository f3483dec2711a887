"""Quality measured in a CPU process of its own beside the probes (:mod:`kvtune.tuner.quality_host`): the
same result as in the worker's process, requests cancelled when their trial moves on, errors as one line,
and a study that uses it end to end (real child processes, the tiny random model)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.model import model_parameters
from kvtune.engine.quality import measure_quality
from kvtune.tuner import cli
from kvtune.tuner.protocol import QualitySettings
from kvtune.tuner.quality_host import QualityHost, quality_threads
from kvtune.tuner.worker import QUALITY_BESIDE_MAX_PARAMS, quality_beside

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
SETTINGS = QualitySettings(
    "random:tiny", str(TEXT), windows=2, prefill_tokens=64, decode_tokens=24, passkey=False, device="cpu"
)


def _config(bits: int, **kw: Any) -> HybridConfig:
    return HybridConfig("hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=bits, **kw)


@pytest.fixture(scope="module")
def host() -> Any:
    h = QualityHost(SETTINGS, threads=1)
    yield h
    h.close()


def test_the_child_measures_what_the_worker_would(host: QualityHost, tiny: Any) -> None:
    """Same model (the tiny shape's seeded weights), same text and settings, so the same quality; the first
    answer carries the child's load of the model, later ones none."""
    config = _config(8)
    host.submit(config.to_dict())
    got = host.result(config.to_dict(), timeout=120)
    want = measure_quality(tiny, config, TEXT.read_text(encoding="utf-8"), windows=2, prefill_tokens=64,
                           decode_tokens=24, passkey=False).to_dict()  # fmt: skip
    for key in ("mean_kl", "max_kl", "top1_agreement", "ppl", "ppl_base", "cold_attention_share"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), key
    assert got["config"] == config.to_dict() and got["measure_s"] > 0 and got["load_s"] > 0
    again = host.result(_config(4).to_dict(), timeout=120)  # not submitted before: submitted by result
    assert again["load_s"] == 0.0 and again["mean_kl"] > got["mean_kl"]


def test_a_request_no_trial_waits_for_is_cancelled(host: QualityHost) -> None:
    """A trial pruned before its quality call leaves its request behind: the next trial's submit cancels
    it, so the child moves on; asked for again later, it is measured again."""
    first, second = _config(4, sparse_top_k=32).to_dict(), _config(8, sparse_top_k=32).to_dict()
    host.submit(first)
    host.submit(second)  # cancels the first
    assert list(host._futures) == [cli_key(second)]
    assert host.result(second, timeout=120)["config"] == second
    assert host.result(first, timeout=120)["config"] == first


def test_a_wait_past_its_timeout_raises_and_a_later_one_gets_the_answer(host: QualityHost) -> None:
    """The trial's time limit bounds the quality call's wait (the worker turns the timeout into the trial's
    time-limit error); the same config asked for again is answered."""
    config = _config(0).to_dict()
    with pytest.raises(TimeoutError):
        host.result(config, timeout=0.0)
    assert host.result(config, timeout=120)["mean_kl"] == pytest.approx(0.0, abs=1e-9)


def cli_key(config: dict[str, Any]) -> str:
    from kvtune.tuner.quality_host import config_key

    return config_key(config)


def test_a_failed_measurement_is_one_line_and_the_child_goes_on(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short for two windows", encoding="utf-8")
    settings = QualitySettings("random:tiny", str(short), windows=2, prefill_tokens=64, decode_tokens=24,
                               passkey=False, device="cpu")  # fmt: skip
    h = QualityHost(settings, threads=1)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"^ValueError: the text has \d+ tokens, but windows") as e:
                h.result(_config(8).to_dict(), timeout=120)
            assert "\n" not in str(e.value)
    finally:
        h.close()


def test_a_child_that_cannot_start_fails_every_call_with_its_reason() -> None:
    h = QualityHost(QualitySettings("random:nope", str(TEXT), device="cpu"), threads=1)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="the quality process could not start: ValueError: model "):
                h.result(_config(8).to_dict(), timeout=120)
    finally:
        h.close()


def test_close_ends_the_child() -> None:
    h = QualityHost(SETTINGS, threads=1)
    h.submit(_config(8).to_dict())
    proc = h._proc
    assert proc is not None and proc.poll() is None
    h.close()
    assert proc.poll() is not None


LIGHT = {"windows": 2, "prefill_tokens": 1024, "decode_tokens": 64, "passkey": False}  # the H200 studies'


@pytest.mark.parametrize(
    ("device", "model", "worker", "settings", "beside"),
    [
        ("auto", "smollm2", "cuda", LIGHT, True),
        ("auto", "smollm2", "cpu", LIGHT, False),  # a CPU worker measures in its process, after its probes
        ("auto", "random:llama-3.1-8b", "cuda", LIGHT, False),  # 8 B parameters in float32: too slow there
        ("auto", "smollm2", "cuda", {}, False),  # the GPU default, 8 × (2,048 + 512) and the passkey check
        ("auto", "smollm2", "cuda", LIGHT | {"passkey": True}, False),
        ("auto", "smollm2", "cuda", LIGHT | {"aggregation": True}, False),
        ("auto", "smollm2", "cuda", LIGHT | {"windows": 8}, False),  # 8,704 window tokens
        ("cpu", "random:llama-3.1-8b", "cuda", {}, True),
        ("cpu", "random:tiny", "cpu", LIGHT, True),
        ("worker", "smollm2", "cuda", LIGHT, False),
    ],
)
def test_where_quality_is_measured(
    device: str, model: str, worker: str, settings: dict[str, Any], beside: bool
) -> None:
    quality = QualitySettings(model, str(TEXT), device=device, **settings)
    assert quality_beside(quality, worker) is beside


def test_the_default_leaves_the_stored_settings_as_they_were() -> None:
    """``device`` is stored only where not "auto": a study made before it resumes with the default."""
    assert "device" not in QualitySettings("smollm2", str(TEXT)).to_dict()
    assert QualitySettings("smollm2", str(TEXT), device="worker").to_dict()["device"] == "worker"
    with pytest.raises(
        ValueError, match=r"quality device must be one of \['auto', 'cpu', 'worker'\], but got 'gpu'"
    ):
        QualitySettings("smollm2", str(TEXT), device="gpu")


def test_model_sizes_and_threads() -> None:
    assert model_parameters("smollm2") == 134_515_008 < QUALITY_BESIDE_MAX_PARAMS
    assert model_parameters("random:llama-3.1-8b") == 8_030_261_248
    assert model_parameters("no/such/model") is None
    assert [quality_threads(n) for n in (1, 2, 4, 16, 64)] == [1, 1, 1, 7, 8]


def test_a_study_with_quality_beside_the_probes(ray_cluster: Any, tmp_path: Path) -> None:
    """A real study whose workers measure quality in a CPU process each: every trial that measured its
    quality records the child's seconds (``measure_s``) beside the call's wait (``wall_s``), the quality is
    stored as the worker's own would be, and a resume that asks for another place is refused."""
    storage = f"sqlite:///{tmp_path}/studies.db"
    argv = ["--gpu", "cpu", "--workload", str(TRACE), "--storage", storage, "--study", "q", "--model",
            "random:tiny", "--quality-model", "random:tiny", "--requests", "3", "--windows", "1",
            "--length-scale", "0.01", "--length-cap", "96", "--quality-windows", "1", "--quality-prefill",
            "24", "--quality-decode", "4", "--kv-budget", "64MiB", "--seed", "0", "--objective", "tpot_p99",
            "--quality-device", "cpu"]  # fmt: skip
    started = time.monotonic()
    assert cli.main([*argv, "--trials", "2", "--no-export"]) == 0
    assert time.monotonic() - started < 300
    study = optuna.load_study(study_name="q", storage=storage)
    assert study.user_attrs["kvtune.quality_settings"]["device"] == "cpu"
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    timed = [t.user_attrs["kvtune.quality_s"] for t in trials if "kvtune.quality_s" in t.user_attrs]
    assert timed and all(t["measure_s"] > 0 and t["wall_s"] >= 0 for t in timed)
    assert all("measure_s" not in t.user_attrs["kvtune.quality"] for t in trials)
    assert all(t.user_attrs["kvtune.quality"]["windows"] == 1 for t in trials)
    argv[-1] = "worker"
    assert cli.main([*argv, "--trials", "3", "--resume", "--no-export"]) == 2
