"""One tuning run end to end: workers, study, trials, validation on held-out requests, preset.

:func:`tune` is what ``kvtune --gpu GPU --workload TRACE`` calls. In order: check every input that needs no
Ray (:func:`~kvtune.tuner.preflight.preflight`: the trace read in one pass, the models found, the study not
already there unless resumed; the CLI runs it before Ray starts); take a resumed study's driver lease
(:mod:`kvtune.studies.lease`: a study a live driver runs is refused); check the cluster has the card and start
one worker per GPU (or CPU workers); cut the search windows; build the card's search space for the model and
workload; calibrate the time scale once (new studies); create the study, or load it for ``--resume`` after
checking it was made with the same space and settings (a new study's lease is taken as it is created); enqueue
the defaults and existing presets (new studies); run trials until the study holds ``trials`` finished ones;
re-measure the best config and its unquantized baseline on the held-out end of the trace; write the preset.

The capacity objective adds two measurements when a new study starts, both of the unquantized baseline
(hot 32, block 64) and both stored with the study: its **unloaded** latencies (the first search window at
1/1000 of its rate: one request at a time, but for the trace's own bursts of simultaneous arrivals), from
which the latency limits are derived unless given (``kvtune.slo``: 5 × its P99 TTFT and 10 × its median
TPOT), and its **capacity, searched** :data:`~kvtune.studies.names.NOISE_REPEATS` **times**
(``kvtune.noise``; on one worker the first from the calibrated rate, the others started near its answer,
:func:`~kvtune.tuner.capacity.near_search`): their median is every trial's warm start, their spread the
study's noise floor.
Validation then searches the capacity of the best config and of its baseline on the held-out requests.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
import ray.exceptions
from optuna.trial import TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.options import WARMUP_REQUESTS
from kvtune.engine.traces import Request, TraceFile
from kvtune.search_spaces.cards import Card, match_card
from kvtune.search_spaces.space import SearchSpace, WorkloadStats
from kvtune.studies import names
from kvtune.studies.lease import DriverLease
from kvtune.studies.names import (
    ATTR_ENGINE,
    ATTR_IDENTITY,
    ATTR_METRICS,
    ATTR_NOISE,
    ATTR_PARETO,
    ATTR_PROBES,
    ATTR_QUALITY_SETTINGS,
    ATTR_REUSED,
    ATTR_SAMPLE,
    ATTR_SLO,
    ATTR_TIME_SCALE_SOURCE,
    CAPACITY_GRANULARITY,
    CAPACITY_PROBES,
    CAPACITY_PROBES_COLD,
    MAX_REPEATS,
    NOISE_REPEATS,
    SLO_PERCENTILE,
)
from kvtune.studies.records import file_sha256
from kvtune.studies.storage import redact
from kvtune.studies.study import (
    SpaceId,
    StudyOptions,
    enqueue_known_good,
    finished_trials,
    open_study,
    recover_abandoned,
    store_validation,
    stored_attrs,
    stored_identity,
)
from kvtune.tuner import export
from kvtune.tuner.budget import BudgetPlan, budget_record
from kvtune.tuner.capacity import (
    DEFAULT_PROBE,
    CapacitySearch,
    ProbeRule,
    Slo,
    at_saturation,
    derive_slo,
    near_search,
    noise_record,
    saturation_rate,
)
from kvtune.tuner.driver import Bounds, Event, TrialLoop
from kvtune.tuner.pool import WorkerPool, _last_line, plan_placement, ray_accelerator_type
from kvtune.tuner.preflight import Preflight, preflight
from kvtune.tuner.protocol import BASELINE, EngineKnobs, QualitySettings, WorkerInfo, WorkerSpec, Workload
from kvtune.tuner.study_note import name_objectives, publish
from kvtune.tuner.validation import (
    RepeatPlan,
    SearchRun,
    best_trial,
    median_or,
    probe_scale,
    repeat_to_interval,
    run_searches,
    search_line,
    ties,
    validate,
    validate_capacity,
    window_prior,
)
from kvtune.tuner.worker import TrialWorker
from kvtune.tuner.workload import SEARCH_FRACTION, WorkloadSample

CALIBRATION_LOAD = 0.75  # the baseline runs at this share of its saturation throughput
# The baseline's capacity against the calibrated rate (at which it runs at CALIBRATION_LOAD of its saturation
# throughput): 1.54-1.65 in six H200 studies on the gated clock (Llama-3.1-8B shape, 1 GiB, lengths × 0.25,
# ``azure_conv_later.csv``, P90 limits derived), 1.89 in two on the device clock. The baseline's first search
# starts there by near steps: from the calibrated rate by doubling it took 7 probes (50-68 s) in each
COLD_START = 1.6
CAPACITY = "capacity"


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
    trial_time_limit_s: float | None = None  # a trial (and the calibration) running longer is infeasible
    slo_ttft_ms: float | None = None  # capacity's limits; None: derived from the unloaded baseline
    slo_tpot_ms: float | None = None
    slo_percentile: float | None = None  # the percentile the limits apply to; None: the stored one, or 90
    clock: str | None = None  # the clock asked for; None: the stored one, else spec.scheduler.clock
    granularity: float = CAPACITY_GRANULARITY  # capacity searches stop at hi / lo - 1 <= this
    probe: ProbeRule = (
        DEFAULT_PROBE  # capacity: how a new study's probes decide (a resumed one keeps its own)
    )

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"`trials >= 1` must hold, but got trials={self.trials}")
        if self.trial_time_limit_s is not None and not self.trial_time_limit_s > 0:
            raise ValueError(f"`trial_time_limit_s > 0` must hold, but got {self.trial_time_limit_s}")

    @property
    def capacity(self) -> bool:
        """The objective is capacity (probes, limits, a noise record) rather than a fixed-rate metric."""
        return self.options.objective == CAPACITY


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
    lengths: dict[str, dict[str, int]] | None = None  # what fitting did to each sample (LengthCounts dicts)
    validations: int = 0  # validation records the study holds (kvtune.validation_history), this one included


def tune(
    job: TuneJob, events: Callable[[Event], None] | None = None, checked: Preflight | None = None
) -> TuneReport:
    """Run the study of ``job`` (see the module docstring) on the connected Ray cluster (``ray.init`` first).

    ``checked``: the :func:`~kvtune.tuner.preflight.preflight` of ``job`` already made (the CLI makes it
    before starting Ray); without it the checks run here, before any worker starts. The study stays
    consistent on any exit, Ctrl-C included (:mod:`kvtune.tuner.driver`).
    """
    started = time.monotonic()  # the time budget covers everything from here
    trace = (checked or preflight(job)).trace
    if not ray.is_initialized():
        raise ValueError("Ray is not initialized: call ray.init() (or ray.init(address=...)) before tune()")
    accelerator = ray_accelerator_type(job.card) if job.card.is_gpu else None
    placement = plan_placement(accelerator, job.workers, job.cpus_per_worker)
    stored = stored_attrs(job.options.storage, job.options.name)
    if stored is not None and not job.options.resume:
        raise ValueError(
            f"study {job.options.name!r} already exists in {redact(job.options.storage)}; pass --resume to "
            "continue it, or --study NAME to start another"
        )
    job = dataclasses.replace(job, spec=_spec_for(job, stored))
    leases: list[DriverLease] = []  # this driver's lease of the study, released on any exit
    try:
        if stored is not None:  # a live driver's study is refused before any worker starts
            leases.append(_lease(job.options))
        pool = WorkerPool(job.spec, placement, job.worker_cls)
        infos = pool.start()
        try:
            _check_card(job.card, infos)
            return _run(job, trace, stored, pool, infos, events, leases, started)
        finally:
            pool.stop()
    finally:
        for lease in leases:
            lease.release()


def _lease(options: StudyOptions, study: optuna.Study | None = None) -> DriverLease:
    """The study's driver lease, taken (:class:`~kvtune.studies.lease.StudyLockedError` when a live driver
    holds it)."""
    study = study or optuna.load_study(study_name=options.name, storage=options.storage)
    return DriverLease(study, options.storage).acquire()


def _run(
    job: TuneJob,
    trace: TraceFile,
    stored: dict[str, Any] | None,
    pool: WorkerPool,
    infos: list[WorkerInfo],
    events: Callable[[Event], None] | None,
    leases: list[DriverLease] | None = None,
    started: float | None = None,
) -> TuneReport:
    started = time.monotonic() if started is None else started
    say = _phase_events(events)
    info = infos[0]
    parts = {"workers_s": time.monotonic() - started}  # the baseline phase's parts, for the console
    windows = job.sample.search_windows(trace, info.max_context)
    space = build_space(job, info, windows)
    space_id = SpaceId(space.space_fingerprint(), space.describe())
    warming = start_warm(pool, space)

    def say_warm() -> None:
        if warming:
            say(warm_line(ray.get(pool.actors[0].warm_report.remote())))

    t0 = time.monotonic()
    time_scale = _time_scale(job, stored, pool, job.sample.search_requests(trace, info.max_context))
    parts["calibration_s"] = time.monotonic() - t0
    attrs = _study_attrs(job, info, time_scale)
    if job.capacity:
        say("baseline: the unloaded replay and the baseline's capacity searches" if stored is None else "")
        t0 = time.monotonic()
        attrs |= _capacity_attrs(job, stored, pool, space, windows, time_scale)
        if stored is None:
            unloaded_s = attrs[ATTR_NOISE]["unloaded_s"]
            parts |= {"unloaded_s": unloaded_s, "searches_s": time.monotonic() - t0 - unloaded_s}
    phases = {"baseline_s": time.monotonic() - started}
    if stored is None:  # where the baseline phase went (the searches' own times are in kvtune.noise)
        line = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in parts.items())
        pieces = max(i.pieces_capture_s for i in infos)  # inside the workers' start
        if pieces:
            line += f" (pieces captured at the workers' start: {pieces:.1f} s)"
        say(f"baseline phase: {line}")
    say_warm()
    study = open_study(job.options, identity(job, info), space_id, attrs)
    if leases is not None and not leases:  # a new study: its lease is taken as it is created
        leases.append(_lease(job.options, study))
    name_objectives(study, job.options)  # the dashboard's labels and note (kvtune.tuner.study_note)
    publish(study)
    if stored is None:
        defaults = [space.params_for(c) | space.knob_params() for c in space.default_configs()]
        enqueue_known_good(study, defaults, "defaults")
        enqueue_known_good(study, preset_params(space, Path(job.presets_dir) / job.card.id), "presets")
    else:
        recover_abandoned(study)
    suggest = lambda trial: space.suggest(trial).to_dict()
    knobs = space.suggest_knobs if space.batched_tokens else None
    slo, search = _capacity_plan(job, study.user_attrs)
    workload = Workload(windows, time_scale, time_limit_s=job.trial_time_limit_s, slo=slo)
    loop = TrialLoop(study, job.options, pool, workload, suggest, job.bounds, events, knobs, search)
    held_out = job.sample.validation_requests(trace, info.max_context)
    scale = probe_scale(windows, held_out)
    plan = _budget_plan(job, study.user_attrs, started, len(pool.actors), bool(space.batched_tokens), scale)
    if plan is not None:
        plan = plan.observed(*observed_costs(study))  # a resumed study's trials already measured them
    say(f"baseline done in {phases['baseline_s']:.0f} s" + (f"; {plan.describe()}" if plan else ""))

    def deadline() -> float | None:
        """The search's deadline, from the plan as revised by the trials finished so far."""
        nonlocal plan
        if plan is None:
            return None
        plan = plan.observed(*observed_costs(study))
        if job.capacity:  # the searches validation's first repeat needs for the best so far, and their cost
            best = best_trial(study, job.options)
            sides = validation_sides(best, space)
            plan = dataclasses.replace(
                plan, sides=plan.sides if sides is None else sides,
                best_scale=best_probe_scale(best, study.user_attrs.get(ATTR_NOISE) or {}),
            )  # fmt: skip
        return plan.search_deadline()

    loop.run(job.trials, deadline)
    overran = plan is not None and finished_trials(study) == 0
    if overran:  # the budget left no time for a trial: the least that gives a preset, said so in it
        say("the time budget was spent before the search: one trial per worker runs past it")
        loop.run(min(job.trials, len(pool.actors)))
    phases["search_s"] = time.monotonic() - started - phases["baseline_s"]
    validation, preset, validations = None, None, 0
    # The target reached, or the time budget spent: the best so far is validated and exported (the preset
    # records how many trials it is the best of). Ctrl-C raises out of the loop and exports nothing.
    finished = finished_trials(study)
    rate = export.search_rate(study.get_trials(deepcopy=False))
    end = deadline()
    cut_short = end is not None and time.monotonic() >= end and finished < job.trials
    if finished >= job.trials or (cut_short and finished > 0):
        say(f"search done: {finished} trials in {phases['search_s']:.0f} s"
            + (f"; {plan.describe()}" if plan else ""))  # fmt: skip
        say_warm()
        validation = _validate(
            job, study, pool, (windows, held_out), info, time_scale, finished, space, plan, say
        )
        if validation is not None:
            if plan is not None:
                phases["validation_s"] = time.monotonic() - started - sum(phases.values())
                interval = validation.get("interval")
                validation["budget"] = budget_record(plan, phases, finished, job.trials, interval, overran)
            store_validation(study, validation)
            say(
                f"validation done: {validation['repeats']} repeats" + (f"; {plan.describe()}" if plan else "")
            )
        validations = len(study.user_attrs.get(names.ATTR_VALIDATION_HISTORY) or [])
        publish(study)
        if validation is not None and job.write_preset:
            preset = str(export.export_from_study(job.options.storage, job.options.name, job.out))
    best = validation["trial"] if validation else None
    counts = job.sample.length_counts(trace, info.max_context)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    capacities = [t.values[0] for t in complete if t.values] if job.capacity else []
    return TuneReport(
        job.options.name, job.options.storage, finished, job.trials, best, validation, preset,
        space.describe(), time_scale, tuple(infos), cut_short,
        (*quality_coverage(space, job.spec.quality), *capacity_warnings(study.user_attrs, capacities),
         *sparse_warnings(complete)), rate,
        {k: c.to_dict() for k, c in counts.items()}, validations,
    )  # fmt: skip


def start_warm(pool: WorkerPool, space: SearchSpace) -> bool:
    """Every worker compiles the space's kernels ahead on its host's spare cores
    (:meth:`SearchSpace.warm_configs`, :mod:`kvtune.engine.warm`), each from another place in the list, so
    that workers of one host share the work through Triton's disk cache. Whether any started."""
    configs = [c.to_dict() for c in space.warm_configs()]
    n = len(pool.actors)
    turns = [configs[i * len(configs) // n :] + configs[: i * len(configs) // n] for i in range(n)]
    return any(ray.get([a.warm_kernels.remote(t, n) for a, t in zip(pool.actors, turns, strict=True)]))


def warm_line(report: dict[str, Any] | None) -> str:
    """One console line of a worker's ``warm_report``."""
    if report is None:
        return "kernels compiled ahead: not started"
    state = "still compiling" if report["running"] else "done"
    failed = f", {report['failed']} failed ({report['errors'][0]})" if report["failed"] else ""
    return (
        f"kernels compiled ahead: {report['warmed']} of {report['configs']} configs in "
        f"{report['seconds']:.0f} s on {report['processes']} processes ({report['compiled']} compiled, "
        f"{report['loaded']} already on disk{failed}; {state})"
    )


def observed_costs(study: optuna.Study) -> tuple[float | None, float | None]:
    """What the study's finished trials measured for the time budget: the median set-up of a new config's
    cache (each trial's longest ``prime_s``: its first probe's) and the median wall of a trial that ran (one
    that reused an earlier trial's result took none); None where nothing was measured."""
    trials = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if ATTR_REUSED not in t.user_attrs
    ]
    # a trial sets its cache up once, in its first probe; the others only ask whether it is still there
    # (a trial stored before the worker timed it has none)
    probed = [t.user_attrs.get(ATTR_PROBES) or () for t in trials]
    primes = [
        max(float(p.get("prime_s") or 0.0) for p in ps) for ps in probed if any("prime_s" in p for p in ps)
    ]
    walls = [
        (t.datetime_complete - t.datetime_start).total_seconds()
        for t in trials
        if t.datetime_complete is not None and t.datetime_start is not None
    ]
    return (statistics.median(primes) if primes else None), (statistics.median(walls) if walls else None)


def _phase_events(events: Callable[[Event], None] | None) -> Callable[[str], None]:
    """``say(line)``: a ``phase`` event for the console (an empty line says nothing)."""

    def say(message: str) -> None:
        if events is not None and message:
            events(Event("phase", -1, -1, message=message))

    return say


def _budget_plan(
    job: TuneJob,
    attrs: dict[str, Any],
    started: float,
    workers: int,
    knobs: bool = False,
    scale: float = 1.0,
) -> BudgetPlan | None:
    """The split of the time budget (None: no budget), from the baseline's search times when measured.
    ``knobs``: the space searches engine knobs, so validation's baseline may be searched at two in its
    first round (three searches a repeat there, two after it:
    :func:`~kvtune.tuner.validation.validate_capacity`); ``scale``: a validation probe's cost against a
    search probe's (:func:`~kvtune.tuner.validation.probe_scale`)."""
    if job.time_budget_s is None:
        return None
    noise = attrs.get(ATTR_NOISE) or {}
    search_s = noise.get("search_s") if job.capacity else None
    sides = (3 if knobs else 2) if job.capacity else 1
    later = 2 if job.capacity else 1
    return BudgetPlan(
        job.time_budget_s, started, search_s, sides, job.repeats, workers, later,
        revisit_s=revisit_s(noise) if job.capacity else None, scale=scale,
    )  # fmt: skip


def best_probe_scale(best: Any, noise: dict[str, Any]) -> float:
    """What a probe of the best trial ``best`` costs against one of the baseline's searches (``noise``):
    their median walls less their set-ups, within [0.25, 2]; 1 where either was not measured. The best
    config's validation searches are priced from it (``BudgetPlan.best_scale``): on an H200 a 4-bit best
    config's held-out searches took 14-20 s where the baseline's took 23-32 s (runs 35c, 36c), and its
    search probes 0.51-0.56 of the baseline's wall."""
    walls = lambda probes: [
        float(p["wall_s"]) - float(p.get("prime_s") or 0.0) for p in probes or () if "wall_s" in p
    ]  # fmt: skip
    mine = walls(best.user_attrs.get(names.ATTR_PROBES)) if best is not None else []
    base = [w for search in noise.get("searches") or () for w in walls(search.get("probes"))]
    if not mine or not base or statistics.median(base) <= 0:
        return 1.0
    return min(2.0, max(0.25, statistics.median(mine) / statistics.median(base)))


def revisit_s(noise: dict[str, Any]) -> float | None:
    """Setting a config's cache up again, as the baseline's first probe did (the calibration and the
    unloaded replay had met the config before it); None where the record has no probe times. Validation
    pays it once per search: 2.8-3.6 s a search on an H200 where the baseline's first probe took 3.8-5.0
    s and a trial's first probe, a config met anew, 3-12 s."""
    searches = noise.get("searches") or []
    probes = (searches[0].get("probes") or []) if searches else []
    prime = probes[0].get("prime_s") if probes else None
    return None if prime is None else float(prime)


def capacity_warnings(attrs: dict[str, Any], capacities: Sequence[float] = ()) -> tuple[str, ...]:
    """What a capacity study's noise record says about its measurement: a window too small to overload the
    engine (the baseline passed at every rate probed, or at the saturation rate), trials that reached the
    saturation rate (``capacities``: the complete trials' values), and a spread above the 5 % goal."""
    noise = attrs.get(ATTR_NOISE)
    if not noise:
        return ()
    out = []
    searches = noise.get("searches") or []
    open_ended = [s for s in searches if s.get("hi") is None and s.get("capacity")]
    top = noise.get("max_rate")
    if open_ended:
        most = max(float(s["capacity"]) for s in open_ended)
        cut = any(s.get("saturated") for s in open_ended)
        where = "at the saturation rate" if cut else "at every rate probed"
        out.append(
            f"the baseline passed {where} in {len(open_ended)} of {len(searches)} capacity searches (up to "
            f"{most:.3g}x the trace's rate): a window this small never overloads the engine, so capacities "
            "are lower bounds; raise --requests"
        )
    saturated = [c for c in capacities if at_saturation(c, top)]
    if saturated:
        out.append(
            f"{len(saturated)} trial(s) passed at the saturation rate ({top:.3g}x the trace's: the whole "
            "window within one decode step): their capacities are lower bounds and tie; raise --requests"
        )
    if noise["spread"] > CAPACITY_GRANULARITY:
        out.append(
            f"the baseline's capacity varied by {100 * noise['spread']:.0f} % over {noise['repeats']} "
            f"searches (the goal is 5 %): differences below {100 * noise['threshold']:.0f} % are within "
            "noise (windows of 3x the requests were measured no quieter on an H200: docs/RESULTS.md)"
        )
    return tuple(out)


def sparse_warnings(trials: Sequence[Any]) -> tuple[str, ...]:
    """Complete trials of sparse configs whose replays never moved a block to L2 (``l2_peak_share`` 0 in
    their metrics): their objective timed the sparse tier's selection and none of its savings."""
    idle = [t.number for t in trials if (t.user_attrs.get(ATTR_METRICS) or {}).get("l2_peak_share") == 0.0]
    if not idle:
        return ()
    shown = ", ".join(str(n) for n in idle[:8]) + (", ..." if len(idle) > 8 else "")
    return (
        f"{len(idle)} sparse trial(s) ({shown}) never moved a block to L2: attention stayed spread over "
        "every block (random weights do that), so they measured the sparse tier's cost and none of its "
        "savings; weigh sparse_top_k on real weights",
    )


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
    """The worker spec, with a resumed study's KV budget unless one is given (it must then match), and its
    clock unless one is given (:func:`identity` then checks it)."""
    if stored is not None and job.clock is None:
        scheduler = dataclasses.replace(job.spec.scheduler, clock=stored_identity(stored)["clock"])
        job = dataclasses.replace(job, spec=dataclasses.replace(job.spec, scheduler=scheduler))
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
    """The card's space for the model and the windows. The memory rule asks the budget to hold a window's
    requests at once (at the percentile length) for the fixed-rate objectives, but only one (of the longest)
    for capacity, which measures how much load the budget carries rather than assuming it."""
    lengths = [r.input_length + r.output_length for w in windows for r in w]
    stats = WorkloadStats.from_lengths(lengths, concurrency=1 if job.capacity else job.sample.requests)
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
        limit = job.trial_time_limit_s
        return float(ray.get(pool.actors[0].calibrate.remote(requests, CALIBRATION_LOAD, limit)))
    except ray.exceptions.RayTaskError as e:
        raise ValueError(f"calibrating the time scale failed ({_last_line(e)}); pass --time-scale") from None


def _capacity_attrs(
    job: TuneJob,
    stored: dict[str, Any] | None,
    pool: WorkerPool,
    space: SearchSpace,
    windows: tuple[tuple[Request, ...], ...],
    time_scale: float,
) -> dict[str, Any]:
    """``kvtune.slo`` and ``kvtune.noise``: a resumed study's (a limit given again must equal the stored
    one), or measured now on the unquantized baseline (see the module docstring)."""
    given = {"ttft_ms": job.slo_ttft_ms, "tpot_ms": job.slo_tpot_ms, "percentile": job.slo_percentile}
    if stored is not None:  # open_study checks the objective; a capacity study has both records
        slo = stored.get(ATTR_SLO)
        limits = dataclasses.asdict(Slo.from_record(slo)) if slo is not None else {}
        for key, value in given.items():
            was = limits.get(key)
            if was is not None and value is not None and abs(was - value) > 1e-9 * value:
                flag = "--slo-" + key.replace("_ms", "-ms")
                name = job.options.name
                raise ValueError(f"study {name!r} was made with {flag} {was:g}, not {value:g}")
        return {}
    unloaded, t0 = None, time.monotonic()
    if job.slo_ttft_ms is None or job.slo_tpot_ms is None:
        try:
            ref = pool.actors[0].unloaded.remote(BASELINE, windows[0], WARMUP_REQUESTS)
            unloaded = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            raise ValueError(f"the unloaded baseline replay failed ({_last_line(e)})") from None
    percentile = SLO_PERCENTILE if job.slo_percentile is None else job.slo_percentile
    slo_record = derive_slo(
        unloaded, job.slo_ttft_ms, job.slo_tpot_ms, percentile=percentile, verdict=job.probe.verdict()
    )
    engine = space.knobs_for(BASELINE, *_default_knobs(space)) if space.batched_tokens else None
    knobs = EngineKnobs.from_dict(engine) if engine is not None else None
    top = saturation_rate(windows, slo_record)
    start = COLD_START / time_scale  # 1 / time_scale: the baseline at CALIBRATION_LOAD of its saturation
    cold = near_search(CapacitySearch(start, job.granularity, CAPACITY_PROBES_COLD, max_rate=top,
                                      confirm=job.probe.confirm, draws=job.probe.draws), start)  # fmt: skip
    t1 = time.monotonic()
    try:
        mixed = job.spec.scheduler.mixed_graphs
        runs, times = _baseline_searches(pool, cold, knobs, windows, Slo.from_record(slo_record), mixed)
    except ray.exceptions.RayTaskError as e:
        raise ValueError(f"searching the baseline's capacity failed ({_last_line(e)})") from None
    times["unloaded_s"] = t1 - t0  # the unloaded replay and the limits (none when both are given)
    results = [r.result() for r in runs]
    capped = [r for r in runs if r.search.near_saturation]  # one step short: a probe slowed by the host
    if 2 * len(capped) > len(runs):  # the baseline's median capacity is only a lower bound
        raise ValueError(
            f"--requests {len(windows[0])}: the unquantized baseline met the limits with the whole window "
            f"arriving at once ({len(capped)} of {len(runs)} capacity searches reached the saturation rate, "
            f"{top:.3g}x the trace's, or stopped one step below it), so no config can show more capacity on "
            "it; replay more requests (--requests), longer ones (--length-scale, --length-cap), or give "
            "tighter --slo-ttft-ms / --slo-tpot-ms"
        )
    noise = noise_record(
        [r["capacity"] for r in results], [r["capacity_tokens_per_s"] or 0.0 for r in results],
        BASELINE.to_dict(), granularity=job.granularity, max_probes=CAPACITY_PROBES, start=start,
        max_rate=top, engine=engine, searches=[r["search"] for r in results], **times,
        confirm=job.probe.confirm, draws=job.probe.draws,
    )  # fmt: skip
    return {ATTR_SLO: slo_record, ATTR_NOISE: noise}


def _baseline_searches(
    pool: WorkerPool,
    cold: CapacitySearch,
    knobs: EngineKnobs | None,
    windows: tuple[tuple[Request, ...], ...],
    slo: Slo,
    mixed_graphs: bool,
) -> tuple[list[SearchRun], dict[str, float]]:
    """The baseline's :data:`NOISE_REPEATS` capacity searches: with fewer workers than searches, the first
    from ``cold``'s start, then the others :func:`~kvtune.tuner.capacity.near_search` its capacity (a
    search from a low rate spends most of its time on the replays far below capacity; the later searches
    skip them and still draw every verdict anew); with enough workers, all at once from the start. The
    times: ``search_s`` is one search as validation's and the trials' warm-started ones will cost (priced
    by :func:`near_search_s` from the probes :func:`priced_searches` picks), ``cold_search_s`` the
    first's."""
    workers = len(pool.actors)
    run = lambda r, search: SearchRun(r % workers, BASELINE, knobs, windows, search)
    t0 = time.monotonic()
    if workers >= NOISE_REPEATS:
        runs = run_searches(pool, [run(r, cold) for r in range(NOISE_REPEATS)], slo)
        return runs, {"search_s": time.monotonic() - t0}
    first = run_searches(pool, [run(0, cold)], slo)
    t1 = time.monotonic()
    at = first[0].search.capacity if first[0].search.converged else 0.0
    later = [run(r, near_search(cold, at)) for r in range(1, NOISE_REPEATS)]
    later = run_searches(pool, later, slo, interleave=False)
    near_s = (time.monotonic() - t1) / math.ceil((NOISE_REPEATS - 1) / workers)
    priced = priced_searches([r.probes for r in first], [r.probes for r in later], mixed_graphs)
    times = {"search_s": near_search_s(near_s, priced), "cold_search_s": t1 - t0}
    return first + later, times | {"near_searches_s": near_s}


def priced_searches(
    first: list[list[dict[str, Any]]], near: list[list[dict[str, Any]]], mixed_graphs: bool
) -> list[list[dict[str, Any]]]:
    """The baseline's searches whose probes price a search of validation or of a trial: the near ones, or
    with mixed graphs the first. A mixed forward's graph is captured on its shape's second use, so the near
    searches, which replay the first's window at nearly its rates, meet their shapes captured and probe in
    about two thirds of the wall (3.1-4.3 s against 4.5-5.4 s, an H100, run 42a); validation's held-out
    window and a trial's config meet theirs anew. Priced from the near searches, validation in runs 41c and
    42a was planned at 116 and 118 s and took 136 and 167 (``lab/scripts/budget_retro.py``)."""
    return first if mixed_graphs and first else near


# the probes a search started near its answer takes at the median: 3 in every near search of runs 31-36 (H200)
NEAR_PROBES = 3


def near_search_s(measured_s: float, searches: list[list[dict[str, Any]]]) -> float:
    """What one search near its answer costs, from the baseline's near searches (``measured_s``: their wall,
    a round's worth; ``searches``: their probes): :data:`NEAR_PROBES` probes at their median wall (set-ups
    left out), where walls were recorded. One near search that needed more probes (on an H100 a third
    search's capacity 9 % below the first's took 5) otherwise prices every search of validation as long
    (35 s where three probes took 25)."""
    walls = [
        float(p["wall_s"]) - float(p.get("prime_s") or 0.0) for ps in searches for p in ps if "wall_s" in p
    ]
    return NEAR_PROBES * statistics.median(walls) if walls else measured_s


def _baseline_engines(runs: list[dict[str, Any]], engines: list[dict[str, Any]]) -> dict[str, Any]:
    """``baseline_engine``: of the baseline's knobs searched in the first round (the best trial's resolved
    for it, the defaults), those with the higher median capacity there; ``baseline_engines``: both, with
    it."""
    both = [r for r in runs if len(r.get("alternatives") or ()) == len(engines)]
    medians = [
        statistics.median((r["alternatives"][i].get("capacity") or 0.0) for r in both) if both else 0.0
        for i in range(len(engines))
    ]
    chosen = max(range(len(engines)), key=lambda i: (medians[i], -i))
    listed = [{**e, "median_capacity": m} for e, m in zip(engines, medians)]
    return {"baseline_engine": engines[chosen], "baseline_engines": listed}


def baseline_engines(
    best: optuna.trial.FrozenTrial, space: SearchSpace | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The engine knobs validation runs the baseline of ``best`` at: the best trial's batched tokens and
    factor resolved for the unquantized cache, and the space's default knobs where they resolve otherwise
    (None: not searched)."""
    engine = best.user_attrs.get(ATTR_ENGINE)
    if engine is None or space is None or not space.batched_tokens:
        return None, None
    base = HybridConfig.from_dict(best.user_attrs[names.ATTR_CONFIG]).unquantized()
    tokens, factor = int(engine["max_num_batched_tokens"]), float(engine["max_num_seqs_factor"])
    own = space.knobs_for(base, tokens, factor)
    default = space.knobs_for(base, *_default_knobs(space))
    return own, (None if EngineKnobs.from_dict(default) == EngineKnobs.from_dict(own) else default)


def validation_sides(best: optuna.trial.FrozenTrial | None, space: SearchSpace | None) -> int | None:
    """The searches of a capacity validation's first repeat if ``best`` were validated: the best config
    and the baseline at its knobs, and the baseline at the default knobs where those differ (None: no best
    yet, so not known)."""
    return None if best is None else 2 + (baseline_engines(best, space)[1] is not None)


def _default_knobs(space: SearchSpace) -> tuple[int, float]:
    params = space.knob_params()
    return int(params["max_num_batched_tokens"]), float(params["max_num_seqs_factor"])


def _capacity_plan(job: TuneJob, attrs: dict[str, Any]) -> tuple[Slo | None, CapacitySearch | None]:
    """The limits and the search every trial starts from (warm start: the baseline's median capacity)."""
    if not job.capacity:
        return None, None
    if ATTR_SLO not in attrs or ATTR_NOISE not in attrs:
        name = job.options.name
        raise ValueError(f"study {name!r} has no {ATTR_SLO} or {ATTR_NOISE}: not a capacity study")
    noise = attrs[ATTR_NOISE]
    start = float(noise["median"]) if noise["median"] > 0 else float(noise["start"])
    top = noise.get("max_rate")  # a study stored before the saturation rate has none
    search = CapacitySearch(start, float(noise["granularity"]), int(noise["max_probes"]), max_rate=top,
                            confirm=int(noise.get("confirm", 1)),
                            draws=int(noise.get("draws", 0)))  # fmt: skip
    return Slo.from_record(attrs[ATTR_SLO]), search


def identity(job: TuneJob, info: WorkerInfo) -> dict[str, Any]:
    """What a resumed run must repeat for its trials to compare with the stored ones."""
    return {
        "card": job.card.id,
        "model": job.spec.model,
        "workload_sha256": file_sha256(job.sample.path),
        "sample": job.sample.to_dict() | {"path": Path(job.sample.path).name},
        "objective": job.options.objective,
        "pareto": job.options.pareto,
        "quality_limits": job.bounds.to_dict(),
        "quality_settings": job.spec.quality.to_dict() | {"text_path": Path(job.spec.quality.text_path).name},
        "dtype": job.spec.dtype,
        "max_context": info.max_context,
        "clock": job.spec.scheduler.clock,
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
        names.ATTR_QUALITY_LIMITS: job.bounds.to_dict(),
        ATTR_TIME_SCALE_SOURCE: "given" if job.time_scale is not None else "calibrated",
        ATTR_PARETO: job.options.pareto,
        ATTR_SAMPLE: job.sample.to_dict(),
        ATTR_QUALITY_SETTINGS: job.spec.quality.to_dict(),
    }


def preset_params(space: SearchSpace, folder: Path) -> list[dict[str, Any]]:
    """Parameters of the presets in ``folder`` whose config lies in ``space`` (others are skipped), with
    their engine knobs where they carry some of this space (else the default knobs)."""
    params = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            preset = json.loads(path.read_text(encoding="utf-8"))
            config = HybridConfig.from_dict(preset["config"])
            point = space.params_for(config)
        except (ValueError, KeyError, TypeError):
            continue  # not a preset of this space
        try:
            point |= space.knob_params(preset.get("engine"))
        except (ValueError, TypeError, AttributeError):
            point |= space.knob_params()
        params.append(point)
    return params


def _validate(
    job: TuneJob,
    study: optuna.Study,
    pool: WorkerPool,
    samples: tuple[tuple[tuple[Request, ...], ...], tuple[Request, ...]],
    info: WorkerInfo,
    time_scale: float,
    finished: int,
    space: SearchSpace | None = None,
    budget: BudgetPlan | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Re-measure the best feasible trial and its baseline on held-out requests: the record the caller
    stores as kvtune.validation and appends to kvtune.validation_history (a re-validation keeps the earlier
    ones). The repeats go on past ``job.repeats`` towards an interval on the gain within ±15 % while a round
    of them fits in the time ``budget`` (:func:`~kvtune.tuner.validation.repeat_to_interval`).
    The baseline runs with the best trial's engine knobs resolved for it (the same batched tokens and
    factor of what its budget holds), so the gain is the cache's; on capacity it also runs with the space's
    default knobs, and each repeat takes the better of its two capacities. ``samples``: the search windows
    and the held-out requests; ``say``: a console line as each capacity search ends."""
    best = best_trial(study, job.options)
    if best is None:
        return None
    windows, requests = samples
    config = HybridConfig.from_dict(best.user_attrs[names.ATTR_CONFIG])
    engine = best.user_attrs.get(ATTR_ENGINE)
    base_engine, default = baseline_engines(best, space)
    knobs = tuple(EngineKnobs.from_dict(e) if e is not None else None for e in (engine, base_engine))
    extra: dict[str, Any] = {"engine": engine, "baseline_engine": base_engine}
    engines: list[dict[str, Any]] = []
    if job.capacity:
        attrs = study.user_attrs
        noise = attrs[ATTR_NOISE]
        # the first searches start at the study's capacities × what the held-out requests are expected to
        # carry against the search's
        prior = window_prior(windows, requests)
        study_at = (best.values[0] or noise["median"] or noise["start"], noise["median"] or noise["start"])
        starts = (study_at[0] * prior, study_at[1] * prior)
        alternative = None  # the baseline at the default knobs too, where they differ
        if base_engine is not None and default is not None:
            alternative, engines = EngineKnobs.from_dict(default), [base_engine, default]
        top = saturation_rate((requests,), attrs[ATTR_SLO])  # the held-out window's own
        slo, granularity = Slo.from_record(attrs[ATTR_SLO]), float(noise["granularity"])
        measured: list[list[dict[str, Any]]] = [[], []]  # both sides' repeats so far

        started = time.monotonic()

        def done(run: SearchRun) -> None:
            if say is not None:
                say(f"validation: {search_line(run)} ({time.monotonic() - started:.0f} s in)")

        def measure(k: int, first: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            # later calls start near the median of what the repeats so far found
            at = tuple(median_or([r.get("capacity") or 0.0 for r in m], s) for m, s in zip(measured, starts))
            base_knobs, other = knobs[1], alternative
            if other is not None and measured[1]:  # after the first call: the baseline's better knobs only
                won = _baseline_engines(measured[1], engines)["baseline_engine"] is engines[1]
                base_knobs, other = (other if won else base_knobs), None
            b, u = validate_capacity(
                pool, config, (knobs[0], base_knobs), requests, slo, (at[0], at[1]), granularity, k,
                other, max_rate=top, first=first, confirm=int(noise.get("confirm", 1)),
                draws=int(noise.get("draws", 0)), done=done,
            )  # fmt: skip
            measured[0].extend(b)
            measured[1].extend(u)
            return b, u

        extra |= {"slo": attrs[ATTR_SLO], "noise": noise, "max_rate": top, "prior": prior,
                  "ties": ties(study, best, float(noise.get("threshold", 0.0)))}  # fmt: skip
    else:
        measure = lambda k, first: validate(
            pool, config, requests, time_scale, k, (knobs[0], knobs[1]), first=first
        )
    same = config == config.unquantized()  # its own baseline: more repeats narrow nothing worth having
    first = job.repeats if budget is None else budget.first_repeats()  # fewer where the time left is short
    plan = RepeatPlan(first, most=job.repeats if same else max(job.repeats, MAX_REPEATS),
                      workers=len(pool.actors), deadline=None if budget is None else budget.end)  # fmt: skip
    ratios_of = lambda b, u: export.gain(job.options.objective, b, u, same).get("per_repeat")
    best_runs, base_runs, interval = repeat_to_interval(measure, ratios_of, plan)
    extra["interval"] = interval
    if engines:
        extra |= _baseline_engines(base_runs, engines)
    record = {
        "trial": best.number,
        "config": config.to_dict(),
        "baseline_config": config.unquantized().to_dict(),
        "window": {
            "start_fraction": SEARCH_FRACTION,
            "end_fraction": 1.0,
            "requests": len(requests),
            "seed": job.sample.seed,
            "clipped": sum(1 for r in requests if r.shortened),
        },
        "repeats": len(best_runs),
        "trials": {"finished": finished, "asked": job.trials},
        "best": best_runs,
        "baseline": base_runs,
        "quality": best.user_attrs.get(names.ATTR_QUALITY),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": info.versions,
        "device": info.device_name,
        "time_scale": time_scale,
        **extra,
    }
    return record


__all__ = ["ATTR_IDENTITY", "TuneJob", "TuneReport", "build_space", "identity", "preset_params", "tune"]
