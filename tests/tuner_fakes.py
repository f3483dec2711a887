"""Workers for the tuner tests (the real worker with a fault injected) and the tiny CPU job they run.

Importable by Ray worker processes as ``kvtune.tests.tuner_fakes`` (the tests folder is part of the package).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.search_spaces.cards import resolve_gpu
from kvtune.studies.study import StudyOptions
from kvtune.tuner.driver import Bounds
from kvtune.tuner.job import TuneJob
from kvtune.tuner.protocol import QualitySettings, WorkerSpec
from kvtune.tuner.worker import TrialWorker
from kvtune.tuner.workload import WorkloadSample

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_sample.jsonl"
TEXT = ROOT / "examples" / "text" / "wikitext2_excerpt.txt"

CRASH_BITS = 4  # the config the crashing worker refuses


class CrashingWorker(TrialWorker):
    """The real worker, but every config with ``quantization_bits == 4`` raises (as a CUDA OOM would)."""

    def configure(
        self, config: HybridConfig, workload: Any, knobs: Any = None, quality: bool = False
    ) -> None:
        if config.quantization_bits == CRASH_BITS:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"
            )
        super().configure(config, workload, knobs, quality)


class BrokenWorker(TrialWorker):
    """A worker whose model never loads."""

    def __init__(self, spec: WorkerSpec) -> None:
        raise ValueError(f"model {spec.model!r}: weights are corrupt (injected by the test)")


def tiny_spec() -> WorkerSpec:
    """A CPU worker of the tiny random model with a 64 MiB KV budget and the smallest quality measurement."""
    quality = QualitySettings(model="random:tiny", text_path=str(TEXT), windows=1, prefill_tokens=24,
                              decode_tokens=4, passkey=False)  # fmt: skip
    return WorkerSpec(model="random:tiny", device="cpu", quality=quality, budget_bytes=1 << 26, threads=1)


def tiny_job(
    tmp: Path,
    worker_cls: type = TrialWorker,
    trace: Path = TRACE,
    trials: int = 2,
    resume: bool = False,
    **changes: Any,
) -> TuneJob:
    """A study job on the CPU small enough for a test: the tiny random model, 3 requests, one window."""
    base = TuneJob(
        options=StudyOptions(f"sqlite:///{tmp}/j.db", "j", "tpot_p99", False, seed=0, resume=resume),
        trials=trials,
        card=resolve_gpu("cpu"),
        sample=WorkloadSample(str(trace), requests=3, windows=1, seed=0, length_scale=0.01, length_cap=96),
        spec=tiny_spec(),
        bounds=Bounds(max_ppl_increase=2.0),
        time_scale=1.0,
        write_preset=False,
        presets_dir=str(tmp / "presets"),
        worker_cls=worker_cls,
    )
    return dataclasses.replace(base, **changes)
