"""One tuning run end to end: workers, study, trials, validation on held-out requests, preset.

:func:`tune` is what ``kvtune --gpu GPU --workload TRACE`` calls. In order: read the trace (a missing file
fails
before anything starts); check the cluster has the card and start one worker per GPU (or CPU workers); cut the
search windows; build the card's search space for the model and workload; calibrate the time scale once (new
studies); create the study, or load it for ``--resume`` after checking it was made with the same space and
settings; enqueue the defaults and existing presets (new studies); run trials until the study holds ``trials``
finished ones; re-measure the best config and its unquantized baseline on the held-out end of the trace; write
the preset.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
import ray.exceptions

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.traces import Request, Trace
from kvtune.search_spaces.cards import Card, match_card
from kvtune.search_spaces.space import SearchSpace, WorkloadStats
from kvtune.studies import names
from kvtune.studies.names import (
    ATTR_IDENTITY,
    ATTR_PARETO,
    ATTR_QUALITY_SETTINGS,
    ATTR_SAMPLE,
    ATTR_TIME_SCALE_SOURCE,
)
from kvtune.studies.records import file_sha256
from kvtune.studies.study import (
    SpaceId,
    StudyOptions,
    enqueue_known_good,
    finished_trials,
    open_study,
    recover_abandoned,
    stored_attrs,
)
from kvtune.tuner import export
from kvtune.tuner.driver import Bounds, Event, TrialLoop
from kvtune.tuner.pool import WorkerPool, _last_line, plan_placement, ray_accelerator_type
from kvtune.tuner.protocol import QualitySettings, WorkerInfo, WorkerSpec, Workload
from kvtune.tuner.validation import best_trial, validate
from kvtune.tuner.worker import TrialWorker
from kvtune.tuner.workload import SEARCH_FRACTION, WorkloadSample, load_trace

CALIBRATION_LOAD = 0.75  # the baseline runs at this share of its saturation throughput


@dataclass(frozen=True)
class TuneJob:
    """Everything one run needs (the CLI builds it from its arguments)."""

    options: StudyOptions
    trials: int  # finished trials (complete or pruned) the study should hold at the end
    card: Card
    sample: WorkloadSample
    spec: WorkerSpec
    bounds: Bounds
    workers: int | None = None  # None: one per GPU of the card (CPU: 1)
    cpus_per_worker: float = 1.0  # CPU workers only
    time_scale: float | None = None  # None: calibrated once per study
    repeats: int = 3
    time_budget_s: float | None = None  # stop starting trials after this long
    write_preset: bool = True
    out: str | None = None  # preset path (default presets/<card>/<model>-<workload>.json)
    presets_dir: str = str(export.PRESETS_DIR)
    worker_cls: type = TrialWorker

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"`trials >= 1` must hold, but got trials={self.trials}")


@dataclass(frozen=True)
class TuneReport:
    """What a run did."""

    study: str
    storage: str
    finished: int
    target: int
    best_trial: int | None
    validation: dict[str, Any] | None
    preset: str | None
    space: str
    time_scale: float
    workers: tuple[WorkerInfo, ...]
    budget_spent: bool = False  # the time budget ended the search before the target
    warnings: tuple[str, ...] = ()
    rate: dict[str, Any] | None = None  # how fast the search went (:func:`kvtune.tuner.export.search_rate`)


def tune(job: TuneJob, events: Callable[[Event], None] | None = None) -> TuneReport:
    """Run the study of ``job`` (see the module docstring) on the connected Ray cluster (``ray.init`` first).

    The study stays consistent on any exit, Ctrl-C included (:mod:`kvtune.tuner.driver`).
    """
    trace = load_trace(job.sample.path)
    if not ray.is_initialized():
        raise ValueError("Ray is not initialized: call ray.init() (or ray.init(address=...)) before tune()")
    accelerator = ray_accelerator_type(job.card) if job.card.is_gpu else None
    placement = plan_placement(accelerator, job.workers, job.cpus_per_worker)
    stored = stored_attrs(job.options.storage, job.options.name)
    if stored is not None and not job.options.resume:
        raise ValueError(
            f"study {job.options.name!r} already exists in {job.options.storage}; pass --resume to continue "
            "it, or --study NAME to start another"
        )
    spec = _spec_for(job, stored)
    pool = WorkerPool(spec, placement, job.worker_cls)
    infos = pool.start()
    try:
        _check_card(job.card, infos)
        return _run(job, trace, stored, pool, infos, events)
    finally:
        pool.stop()


def _run(
    job: TuneJob,
    trace: Trace,
    stored: dict[str, Any] | None,
    pool: WorkerPool,
    infos: list[WorkerInfo],
    events: Callable[[Event], None] | None,
) -> TuneReport:
    info = infos[0]
    windows = job.sample.search_windows(trace, info.max_context)
    space = build_space(job, info, windows)
    space_id = SpaceId(space.space_fingerprint(), space.describe())
    time_scale = _time_scale(job, stored, pool, job.sample.search_requests(trace, info.max_context))
    study = open_study(job.options, identity(job, info), space_id, _study_attrs(job, info, time_scale))
    if stored is None:
        enqueue_known_good(study, [space.params_for(c) for c in space.default_configs()], "defaults")
        enqueue_known_good(study, preset_params(space, Path(job.presets_dir) / job.card.id), "presets")
    else:
        recover_abandoned(study)
    suggest = lambda trial: space.suggest(trial).to_dict()
    loop = TrialLoop(study, job.options, pool, Workload(windows, time_scale), suggest, job.bounds, events)
    deadline = None if job.time_budget_s is None else time.monotonic() + job.time_budget_s
    loop.run(job.trials, deadline)
    validation, preset = None, None
    # The target reached, or the time budget spent: the best so far is validated and exported (the preset
    # records how many trials it is the best of). Ctrl-C raises out of the loop and exports nothing.
    finished = finished_trials(study)
    rate = export.search_rate(study.get_trials(deepcopy=False))
    cut_short = deadline is not None and time.monotonic() >= deadline and finished < job.trials
    if finished >= job.trials or (cut_short and finished > 0):
        validation = _validate(job, study, pool, trace, info, time_scale, finished)
        if validation is not None and job.write_preset:
            preset = str(export.export_from_study(job.options.storage, job.options.name, job.out))
    best = validation["trial"] if validation else None
    return TuneReport(
        job.options.name, job.options.storage, finished, job.trials, best, validation, preset,
        space.describe(), time_scale, tuple(infos), cut_short, quality_coverage(space, job.spec.quality),
        rate,
    )  # fmt: skip


def quality_coverage(space: SearchSpace, quality: QualitySettings) -> tuple[str, ...]:
    """A warning when some configs of the space keep every token of a quality window hot (their quality is
    then exact by construction, whatever their cold tier does to the longer contexts of the workload)."""
    window = quality.prefill_tokens + quality.decode_tokens
    need = space.hot_tokens[-1] + space.block_sizes[-1]
    if need < window:
        return ()
    return (
        f"quality windows are {window} tokens, but a config with hot_tokens + block_size >= {window} seals "
        f"no cold block in them (the space reaches {need}): its quality is exact by construction; pass "
        f"--quality-prefill {need - quality.decode_tokens + 1} or more to measure every config's cold tier",
    )


# ---- pieces ----------------------------------------------------------------------------------------------
def _spec_for(job: TuneJob, stored: dict[str, Any] | None) -> WorkerSpec:
    """The worker spec, with a resumed study's KV budget unless one is given (it must then match)."""
    budget = None if stored is None else stored.get(names.ATTR_BUDGET)
    if budget is None or job.spec.budget_bytes == budget:
        return job.spec if budget is None else dataclasses.replace(job.spec, budget_bytes=int(budget))
    if job.spec.budget_bytes is not None:
        raise ValueError(
            f"study {job.options.name!r} was made with --kv-budget {budget} bytes, "
            f"not {job.spec.budget_bytes}"
        )
    return dataclasses.replace(job.spec, budget_bytes=int(budget))


def _check_card(card: Card, infos: list[WorkerInfo]) -> None:
    """Each GPU worker's device must be the card asked for (Ray's type names H100 SXM and PCIe alike)."""
    for info in infos:
        if not card.is_gpu or info.device_memory_bytes == 0:
            continue
        found = match_card(info.device_name, info.device_memory_bytes)
        if found.id != card.id:
            raise ValueError(
                f"--gpu {card.id}: worker on {info.hostname} has {info.device_name} ({found.id})"
            )


def build_space(job: TuneJob, info: WorkerInfo, windows: tuple[tuple[Request, ...], ...]) -> SearchSpace:
    lengths = [r.input_length + r.output_length for w in windows for r in w]
    stats = WorkloadStats.from_lengths(lengths, concurrency=job.sample.requests)
    return SearchSpace.build(
        job.card, job.spec.model, info.kv_shape, stats, info.real_weights, kv_budget_bytes=info.budget_bytes
    )


def _time_scale(
    job: TuneJob, stored: dict[str, Any] | None, pool: WorkerPool, requests: tuple[Request, ...]
) -> float:
    """The stored time scale (resume), the given one, or a calibration on the search requests (new study)."""
    if stored is not None and names.ATTR_TIME_SCALE in stored:
        value = float(stored[names.ATTR_TIME_SCALE])
        if job.time_scale is not None and abs(job.time_scale - value) > 1e-12 * max(1.0, value):
            raise ValueError(
                f"study {job.options.name!r} was made with --time-scale {value}, not {job.time_scale}"
            )
        return value
    if job.time_scale is not None:
        return job.time_scale
    try:
        return float(ray.get(pool.actors[0].calibrate.remote(requests, CALIBRATION_LOAD)))
    except ray.exceptions.RayTaskError as e:
        raise ValueError(f"calibrating the time scale failed ({_last_line(e)}); pass --time-scale") from None


def identity(job: TuneJob, info: WorkerInfo) -> dict[str, Any]:
    """What a resumed run must repeat for its trials to compare with the stored ones."""
    return {
        "card": job.card.id,
        "model": job.spec.model,
        "workload_sha256": file_sha256(job.sample.path),
        "sample": job.sample.to_dict() | {"path": Path(job.sample.path).name},
        "objective": job.options.objective,
        "pareto": job.options.pareto,
        "quality_limits": dataclasses.asdict(job.bounds),
        "quality_settings": job.spec.quality.to_dict() | {"text_path": Path(job.spec.quality.text_path).name},
        "dtype": job.spec.dtype,
        "max_context": info.max_context,
    }


def _study_attrs(job: TuneJob, info: WorkerInfo, time_scale: float) -> dict[str, Any]:
    path = Path(job.sample.path)
    workload = {
        "name": path.stem,
        "path": str(path),
        "sha256": file_sha256(path),
        "requests": job.sample.requests,
    }
    return {
        names.ATTR_CARD: job.card.id,
        names.ATTR_MODEL: job.spec.model,
        names.ATTR_WORKLOAD: workload,
        names.ATTR_OBJECTIVE: job.options.objective,
        names.ATTR_BUDGET: info.budget_bytes,
        names.ATTR_TIME_SCALE: time_scale,
        names.ATTR_SEED: job.options.seed,
        names.ATTR_QUALITY_LIMITS: dataclasses.asdict(job.bounds),
        ATTR_TIME_SCALE_SOURCE: "given" if job.time_scale is not None else "calibrated",
        ATTR_PARETO: job.options.pareto,
        ATTR_SAMPLE: job.sample.to_dict(),
        ATTR_QUALITY_SETTINGS: job.spec.quality.to_dict(),
    }


def preset_params(space: SearchSpace, folder: Path) -> list[dict[str, Any]]:
    """Parameters of the presets in ``folder`` whose config lies in ``space`` (others are skipped)."""
    params = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            config = HybridConfig.from_dict(json.loads(path.read_text(encoding="utf-8"))["config"])
            params.append(space.params_for(config))
        except (ValueError, KeyError, TypeError):
            continue  # not a preset of this space
    return params


def _validate(
    job: TuneJob,
    study: optuna.Study,
    pool: WorkerPool,
    trace: Trace,
    info: WorkerInfo,
    time_scale: float,
    finished: int,
) -> dict[str, Any] | None:
    """Re-measure the best feasible trial and its baseline on held-out requests; stored as
    kvtune.validation."""
    best = best_trial(study, job.options)
    if best is None:
        return None
    requests = job.sample.validation_requests(trace, info.max_context)
    config = HybridConfig.from_dict(best.user_attrs[names.ATTR_CONFIG])
    best_runs, base_runs = validate(pool, config, requests, time_scale, job.repeats)
    record = {
        "trial": best.number,
        "config": config.to_dict(),
        "baseline_config": config.unquantized().to_dict(),
        "window": {
            "start_fraction": SEARCH_FRACTION,
            "end_fraction": 1.0,
            "requests": len(requests),
            "seed": job.sample.seed,
        },
        "repeats": job.repeats,
        "trials": {"finished": finished, "asked": job.trials},
        "best": best_runs,
        "baseline": base_runs,
        "quality": best.user_attrs.get(names.ATTR_QUALITY),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": info.versions,
        "device": info.device_name,
        "time_scale": time_scale,
    }
    study.set_user_attr(names.ATTR_VALIDATION, record)
    return record


__all__ = ["ATTR_IDENTITY", "TuneJob", "TuneReport", "build_space", "identity", "preset_params", "tune"]
