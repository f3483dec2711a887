"""The driver: the one process that asks the study for configs, runs them on workers and tells results.

A trial is ``configure → run_window(0..W-1) → finish → quality`` on one worker, in the order
:mod:`kvtune.tuner.protocol` gives (:func:`~kvtune.tuner.protocol.next_call`).
After each window the driver reports that window's objective and may prune (single-objective studies;
Pareto mode never prunes). Quality is a constraint, measured once per config and reused.

With the capacity objective a trial is ``configure → probe(rate)... → finish → quality``: the driver holds
the trial's :class:`~kvtune.tuner.capacity.CapacitySearch` (started where the trial's ``max_num_seqs``
against the baseline's predicts from the baseline's capacity, :func:`~kvtune.tuner.capacity.predicted_start`,
or at the best feasible capacity so far when higher: :func:`~kvtune.tuner.capacity.warm_start`), asks
it for each rate, reports the capacity found so far (the highest passing rate, which only grows) after each
probe, and prunes the trial as soon as it failed at a rate below the best capacity of the study's feasible
trials by more than the study's measured noise (:func:`~kvtune.tuner.capacity.should_prune`): it can
neither beat nor tie that any more. A failure within the noise of the best is measured on (the next probe is
at the noise's edge below the best), so a tie is reported as one, never ranked on one draw.

Outcomes, told by the driver alone:

- **COMPLETE** with the mean objective over windows and the constraints ``ran`` (0), ``ppl_increase_pct``
  and ``kl`` (the measured value minus the user's bound; a bound not given is not a constraint).
- **COMPLETE, infeasible** when the config crashed or ran out of memory on the worker: ``ran`` = 1 and the
  penalty value (1e9 ms for latencies, 0 tokens/s for throughput), so the sampler learns to avoid it.
- **COMPLETE, reused** when the sampler proposes a config the study already completed: that trial's result
  is told again without running (``reused_from``), which saves a run in a small discrete space.
- **PRUNED** when the pruner stops it after a window.
- **FAIL** when its worker process was lost (``lost_worker``): the params are re-enqueued once
  (``retry_of``) and the worker replaced. On Ctrl-C every running trial is told FAIL (``interrupted``) and its
  params re-enqueued (``resume_of``), so the study holds no RUNNING trial and ``--resume`` runs them first;
  nothing completed is lost, since each result is committed when it is told.

Constraints are set with ``trial.set_constraint`` (what Optuna 5's samplers read; ``constraints_func`` is
deprecated there), so ``study.best_trial`` and the TPE sampler both see them.

Trial user attributes (all prefixed ``kvtune.``): ``config`` (the resolved hybrid_v2 dict), ``seed``,
``versions`` (kvtune, python, torch, triton, ray, optuna), ``device`` (device name), ``host``, ``worker``
(index), ``metrics`` (mean over windows), ``window_metrics`` (list), ``quality`` (QualityResult dict),
``error`` (one line, when the config crashed), ``lost_worker`` (one line), ``interrupted``, ``abandoned``,
``retry_of`` / ``resume_of`` (the trial number a re-run repeats), ``reused_from``, ``enqueued_from``
(``defaults`` or ``presets``), ``engine`` (the engine knobs), ``probes`` (capacity: one summary per probe).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
import ray
import ray.exceptions
from optuna.trial import TrialState

from kvtune.cache_impl.config import HybridConfig
from kvtune.studies.names import (
    ATTR_CONFIG,
    ATTR_DEVICE,
    ATTR_ENGINE,
    ATTR_ERROR,
    ATTR_HOST,
    ATTR_INTERRUPTED,
    ATTR_LOST,
    ATTR_METRICS,
    ATTR_NOISE,
    ATTR_PROBES,
    ATTR_QUALITY,
    ATTR_QUALITY_S,
    ATTR_RESUME_OF,
    ATTR_RETRY_OF,
    ATTR_REUSED,
    ATTR_SEED,
    ATTR_VERSIONS,
    ATTR_WINDOW_METRICS,
    ATTR_WORKER,
)
from kvtune.studies.records import finite
from kvtune.studies.study import OBJECTIVES, PENALTY, StudyOptions, enqueue_rerun, finished_trials
from kvtune.tuner.capacity import CapacitySearch, predicted_start, probe_summary, should_prune, warm_start
from kvtune.tuner.pool import WorkerPool, _last_line
from kvtune.tuner.protocol import Call, EngineKnobs, TrialResult, WorkerInfo, Workload, next_call
from kvtune.tuner.validation import feasible

WAIT_S = 1.0  # the loop wakes this often (Ctrl-C, deadlines)
# the quality call's seconds (all; the model's load; Triton's compiler), apart from the quality it measured
QUALITY_TIMES = ("wall_s", "load_s", "compile_s", "measure_s")
Suggest = Callable[[optuna.Trial], dict[str, Any]]  # define-by-run: the trial's resolved hybrid_v2 dict
# define-by-run, after the config: the trial's engine knobs (EngineKnobs' fields, and how they were chosen)
SuggestKnobs = Callable[[optuna.Trial, HybridConfig], dict[str, Any] | None]


@dataclass(frozen=True)
class Bounds:
    """Quality bounds (None: not a constraint): perplexity increase in percent, mean KL in nats, and the
    share of the aggregation probe's pairs that the unquantized cache recalls which the config must recall
    too (``min_aggregation``, in (0, 1]: the constraint is ``min_aggregation x base rate - rate``)."""

    max_ppl_increase: float | None = None
    max_kl: float | None = None
    min_aggregation: float | None = None

    def __post_init__(self) -> None:
        if self.min_aggregation is not None and not 0 < self.min_aggregation <= 1:
            raise ValueError(
                f"`0 < min_aggregation <= 1` must hold, but got min_aggregation={self.min_aggregation}"
            )

    def constraints(self, quality: dict[str, Any]) -> dict[str, float]:
        out = {"ran": 0.0}
        if self.max_ppl_increase is not None:
            out["ppl_increase_pct"] = float(quality["ppl_change_pct"]) - self.max_ppl_increase
        if self.max_kl is not None:
            out["kl"] = float(quality["mean_kl"]) - self.max_kl
        if self.min_aggregation is not None:
            rate, base = quality.get("aggregation_rate"), quality.get("aggregation_base_rate")
            # a quality measured without the probe (rate None) is no evidence: infeasible
            out["aggregation"] = self.min_aggregation * float(base or 0) - float(-1 if rate is None else rate)
        return out

    def to_dict(self) -> dict[str, float | None]:
        """As stored with a study; ``min_aggregation`` only where set (so a study made before it compares
        equal)."""
        d = dataclasses.asdict(self)
        if d["min_aggregation"] is None:
            del d["min_aggregation"]
        return d

    def crashed(self) -> dict[str, float]:
        return {
            key: (1.0 if key == "ran" else 0.0)
            for key in self.constraints({"ppl_change_pct": 0, "mean_kl": 0})
        }


@dataclass(frozen=True)
class Event:
    """What happened (for progress displays): kind is one of start, window, probe (``value`` its rate,
    ``message`` pass or fail), pruned, complete, crash, lost, replaced, interrupted."""

    kind: str
    trial: int
    worker: int
    step: int = -1
    value: float = math.nan
    message: str = ""
    actor: Any = None


@dataclass
class _Running:
    """A trial in flight (driver-internal bookkeeping)."""

    trial: optuna.Trial
    config: HybridConfig
    worker: int
    step: int = 0
    stage: Call = Call.CONFIGURE
    result: TrialResult | None = None
    knobs: EngineKnobs | None = None
    search: CapacitySearch | None = None  # the capacity objective's search, after the last probe
    probes: list[dict[str, Any]] = field(default_factory=list)
    quality_s: dict[str, float] | None = None  # the quality call's seconds (None: an earlier trial's quality)


class TrialLoop:
    """Runs trials on every idle worker until the study holds ``target`` finished trials."""

    def __init__(
        self,
        study: optuna.Study,
        options: StudyOptions,
        pool: WorkerPool,
        workload: Workload,
        suggest: Suggest,
        bounds: Bounds,
        events: Callable[[Event], None] | None = None,
        knobs: SuggestKnobs | None = None,
        capacity: CapacitySearch | None = None,
    ) -> None:
        """``knobs``: asks each trial for its engine knobs (None: the workers' own). ``capacity``: the
        capacity objective's search as every trial starts it (its warm start, granularity and probe
        budget); None for the fixed-rate objectives."""
        self.study, self.options, self.pool, self.suggest, self.bounds = study, options, pool, suggest, bounds
        self.knobs, self.capacity = knobs, capacity
        self.windows = len(workload.windows)
        self.workload_ref = ray.put(workload)
        self.events = events or (lambda e: None)
        self.memo = quality_memo(study)
        self.inflight: dict[Any, _Running] = {}
        self.idle = list(range(len(pool.actors)))
        self._current: _Running | None = None
        # capacity: a trial is pruned only below the best by more than the study's measured noise
        self.noise = float((study.user_attrs.get(ATTR_NOISE) or {}).get("threshold", 0.0))
        # ... and starts where its max_num_seqs against the baseline's predicts (None: no knobs searched)
        self.base_seqs = ((study.user_attrs.get(ATTR_NOISE) or {}).get("engine") or {}).get("max_num_seqs")

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self, target: int, deadline: float | Callable[[], float | None] | None = None) -> None:
        """Keep every worker busy until ``target`` trials finished (or ``deadline``, a monotonic time, or a
        function asked for it before each trial starts: a plan revised as trials finish)."""
        try:
            while True:
                while self.idle and self._wants_more(target, deadline):
                    self._start(self.idle.pop(0))
                if not self.inflight:
                    return
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=WAIT_S)
                if ready:
                    self._current = self.inflight.pop(ready[0])
                    self._advance(ready[0], self._current)
                    self._current = None
        except KeyboardInterrupt:
            self.interrupt()
            raise

    def _wants_more(self, target: int, deadline: float | Callable[[], float | None] | None) -> bool:
        if callable(deadline):
            deadline = deadline()
        if deadline is not None and time.monotonic() >= deadline:
            return False
        return finished_trials(self.study) + len(self.inflight) < target

    def _start(self, worker: int) -> None:
        trial = self.study.ask()
        config = HybridConfig.from_dict(self.suggest(trial))  # validated once: it crosses in this form
        engine = self.knobs(trial, config) if self.knobs is not None else None
        info: WorkerInfo = self.pool.infos[worker]
        attrs = {ATTR_CONFIG: config.to_dict(), ATTR_SEED: self.options.seed, ATTR_VERSIONS: info.versions,
                 ATTR_DEVICE: info.device_name, ATTR_HOST: info.hostname, ATTR_WORKER: worker}  # fmt: skip
        if engine is not None:
            attrs[ATTR_ENGINE] = engine
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        earlier = self._measured(config, engine)
        if earlier is not None:
            self._reuse(trial, earlier, worker)
            self.idle.insert(0, worker)
            return
        knobs = EngineKnobs.from_dict(engine) if engine is not None else None
        best = self._best_capacity()
        search = None
        if self.capacity is not None:
            seqs = engine.get("max_num_seqs") if engine is not None else None
            search = warm_start(predicted_start(self.capacity, seqs, self.base_seqs), best, self.noise)
        run = _Running(trial, config, worker, knobs=knobs, search=search)
        quality = config_key(config) not in self.memo  # a worker may measure it beside the probes
        actor = self.pool.actors[worker]
        self._submit(run, actor.configure.remote(config, self.workload_ref, knobs, quality))
        self.events(Event("start", trial.number, worker, message=_short_config(config)))

    def _measured(
        self, config: HybridConfig, engine: dict[str, Any] | None = None
    ) -> optuna.trial.FrozenTrial | None:
        """A complete trial of the study that already ran ``config`` with the same engine knobs."""
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        stored = config.to_dict()
        same = lambda t: t.user_attrs.get(ATTR_CONFIG) == stored and t.user_attrs.get(ATTR_ENGINE) == engine
        return next((t for t in done if same(t)), None)

    def _reuse(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial, worker: int) -> None:
        """Tell ``trial`` the result of ``earlier``, which ran the same config (proposed again)."""
        for key in (ATTR_METRICS, ATTR_WINDOW_METRICS, ATTR_QUALITY, ATTR_ERROR, ATTR_PROBES):
            if key in earlier.user_attrs:
                trial.set_user_attr(key, earlier.user_attrs[key])
        trial.set_user_attr(ATTR_REUSED, earlier.number)
        for key, c in earlier.constraints.items():
            trial.set_constraint(key, c)
        self.study.tell(trial, earlier.values)
        message = f"same config as trial {earlier.number}: its result reused"
        self.events(Event("complete", trial.number, worker, value=earlier.values[0], message=message))

    def _submit(self, run: _Running, ref: Any) -> None:
        self.inflight[ref] = run

    # ---- one step of a trial -------------------------------------------------------------------------
    def _advance(self, ref: Any, run: _Running) -> None:
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._lost(run, e)
            return
        except ray.exceptions.RayTaskError as e:
            self._crash(run, _last_line(e))
            return
        if run.stage is Call.WINDOW:
            self._window_done(run, value)
            return
        if run.stage is Call.PROBE:
            self._probe_done(run, value)
            return
        if run.stage is Call.FINISH:
            run.result = value
        elif run.stage is Call.QUALITY:
            times = {k: float(value[k]) for k in QUALITY_TIMES if k in value}
            run.quality_s = times or None
            self.memo[config_key(run.config)] = {k: v for k, v in value.items() if k not in QUALITY_TIMES}
        self._next(run)

    def _next(self, run: _Running) -> None:
        """Submit the protocol's next call of ``run``, or complete it when it has everything."""
        quality = self.memo.get(config_key(run.config))
        following = next_call(run.stage, run.step, self.windows, quality is not None, run.search)
        if following is None:
            assert quality is not None, f"trial {run.trial.number}: the protocol ended without a quality"
            self._complete(run, quality)
            return
        run.stage, window = following
        actor = self.pool.actors[run.worker]
        if run.stage is Call.WINDOW:
            run.step = window
            self._submit(run, actor.run_window.remote(window))
        elif run.stage is Call.PROBE:
            assert run.search is not None
            run.step = window
            self._submit(run, actor.probe.remote(run.search.next_rate()))
        elif run.stage is Call.FINISH:
            capacity = None if run.search is None else run.search.capacity
            self._submit(run, actor.finish.remote(capacity))
        else:
            self._submit(run, actor.quality.remote(run.config))

    def _window_done(self, run: _Running, metrics: dict[str, Any]) -> None:
        value = float(metrics.get(self.options.metrics[0], math.nan))
        actor = self.pool.actors[run.worker]
        self.events(Event("window", run.trial.number, run.worker, run.step, value, actor=actor))
        last = run.step == self.windows - 1
        if not self.options.pareto and math.isfinite(value):
            run.trial.report(value, run.step)
            if not last and run.trial.should_prune():
                self.study.tell(run.trial, state=TrialState.PRUNED)
                self.events(Event("pruned", run.trial.number, run.worker, run.step, value))
                self.idle.append(run.worker)
                return
        self._next(run)

    def _probe_done(self, run: _Running, probe: dict[str, Any]) -> None:
        """Record one capacity probe, report the capacity found so far, and prune a trial that can no longer
        beat the study's best feasible capacity."""
        assert run.search is not None
        run.search = run.search.record(probe["rate"], probe["passed"], probe.get("margin"))
        run.probes.append(finite(probe_summary(probe)))
        verdict = "pass" if probe["passed"] else ("fail, stopped early" if probe["aborted"] else "fail")
        actor = self.pool.actors[run.worker]
        self.events(Event("probe", run.trial.number, run.worker, run.step, probe["rate"], verdict, actor))
        if not self.options.pareto:
            if run.search.lo is not None:  # a capacity found: none yet is no value (never drawn as 0)
                run.trial.report(run.search.capacity, run.step)
            if should_prune(run.search, self._best_capacity(), self.noise):
                run.trial.set_user_attr(ATTR_PROBES, run.probes)
                self.study.tell(run.trial, state=TrialState.PRUNED)
                message = (
                    f"failed at {run.search.hi:.3g}x, below the best capacity by more than the noise "
                    f"({100 * self.noise:.0f} %)"
                )
                self.events(Event("pruned", run.trial.number, run.worker, run.step, run.search.capacity,
                                  message))  # fmt: skip
                self.idle.append(run.worker)
                return
        self._next(run)

    def _best_capacity(self) -> float | None:
        """The best capacity of the study's feasible complete trials (None before the first)."""
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        values = [t.values[0] for t in done if feasible(t) and ATTR_ERROR not in t.user_attrs]
        return max(values, default=None)

    # ---- outcomes ------------------------------------------------------------------------------------
    def _complete(self, run: _Running, quality: dict[str, Any]) -> None:
        assert run.result is not None, f"trial {run.trial.number} completes without a result"
        values = [run.result.mean.get(m, math.nan) for m in self.options.metrics]
        if not all(math.isfinite(v) for v in values):
            self._crash(run, f"no finite {self.options.metrics} in the replay (every request refused?)")
            return
        t = run.trial
        t.set_user_attr(ATTR_METRICS, finite(run.result.mean))
        t.set_user_attr(ATTR_WINDOW_METRICS, [finite(w) for w in run.result.windows])
        t.set_user_attr(ATTR_QUALITY, finite(quality))
        if run.probes:
            t.set_user_attr(ATTR_PROBES, run.probes)
        if run.quality_s is not None:
            t.set_user_attr(ATTR_QUALITY_S, run.quality_s)
        for key, c in self.bounds.constraints(quality).items():
            t.set_constraint(key, c)
        self.study.tell(t, values)
        self.events(Event("complete", t.number, run.worker, value=values[0]))
        self.idle.append(run.worker)

    def _crash(self, run: _Running, message: str) -> None:
        t = run.trial
        t.set_user_attr(ATTR_ERROR, message)
        for key, c in self.bounds.crashed().items():
            t.set_constraint(key, c)
        self.study.tell(t, [PENALTY[OBJECTIVES[o][1]] for o in self.options.objectives])
        self.events(Event("crash", t.number, run.worker, message=message))
        self.idle.append(run.worker)

    def _lost(self, run: _Running, error: BaseException) -> None:
        t = run.trial
        t.set_user_attr(ATTR_LOST, _last_line(error))
        self.study.tell(t, state=TrialState.FAIL)
        if ATTR_RETRY_OF not in t.user_attrs:
            enqueue_rerun(self.study, t.params, t.number, ATTR_RETRY_OF)
        self.events(Event("lost", t.number, run.worker, message=_last_line(error)))
        self.pool.replace(run.worker)
        self.events(Event("replaced", t.number, run.worker, actor=self.pool.actors[run.worker]))
        self.idle.append(run.worker)

    def interrupt(self) -> None:
        """Tell every running trial FAIL (``interrupted``) and re-enqueue its params for ``--resume``."""
        runs = [*self.inflight.values(), *([self._current] if self._current else [])]
        for run in runs:
            t = run.trial
            if self.study._storage.get_trial(t._trial_id).state != TrialState.RUNNING:
                continue  # told before the interrupt arrived
            t.set_user_attr(ATTR_INTERRUPTED, True)
            self.study.tell(t, state=TrialState.FAIL)
            enqueue_rerun(self.study, t.params, t.number, ATTR_RESUME_OF)
            self.events(Event("interrupted", t.number, run.worker))
        self.inflight.clear()
        self._current = None


# ---- helpers -------------------------------------------------------------------------------------------
def config_key(config: HybridConfig | dict[str, Any]) -> str:
    stored = config.to_dict() if isinstance(config, HybridConfig) else config
    return json.dumps(stored, sort_keys=True)


def quality_memo(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Quality already measured in this study, by config (quality is a pure function of the config)."""
    return {
        config_key(t.user_attrs[ATTR_CONFIG]): t.user_attrs[ATTR_QUALITY]
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if ATTR_QUALITY in t.user_attrs and ATTR_CONFIG in t.user_attrs
    }


def _short_config(config: HybridConfig) -> str:
    keys = ("hot_tokens", "block_size", "quantization_bits", "sparse_top_k", "migration_throttling")
    return " ".join(f"{k}={getattr(config, k)}" for k in keys)
