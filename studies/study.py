"""The Optuna study of a tuning run: storage, identity, objectives, known-good points, leftovers.

Every study and trial attribute it sets is named, with what it holds, in :mod:`kvtune.studies.names`;
``kvtune.identity`` and ``kvtune.space`` are compared on ``--resume``.
"""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

import kvtune
from kvtune.studies.names import (
    ATTR_ABANDONED,
    ATTR_CREATED,
    ATTR_ENQUEUED_FROM,
    ATTR_IDENTITY,
    ATTR_RESUME_OF,
    ATTR_SPACE,
    ATTR_SPACE_TEXT,
    ATTR_VALIDATION,
    ATTR_VALIDATION_HISTORY,
    ATTR_VERSION,
    OBJECTIVE_METRICS,
)
from kvtune.studies.storage import redact

OBJECTIVES: dict[str, tuple[str, str]] = OBJECTIVE_METRICS  # name -> (metric key, direction)
PARETO_PARTNER: dict[str, str] = {
    "tpot_p99": "throughput",
    "ttft_p99": "throughput",
    "e2e_p99": "throughput",
    "throughput": "tpot_p99",
}  # capacity has none: it already is the load carried within latency limits (StudyOptions refuses it)
PARETO_REFUSED = (
    "--pareto is for the fixed-rate objectives (tpot_p99, ttft_p99, e2e_p99, throughput): capacity already "
    "is the throughput carried within the latency limits"
)
PENALTY: dict[str, float] = {"minimize": 1e9, "maximize": 0.0}  # the value told for a config that crashed
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class StudyMismatchError(ValueError):
    """An existing study was made with other settings (search space, workload, objective, ...)."""


@dataclass(frozen=True)
class StudyOptions:
    """How the study is found and what it optimizes."""

    storage: str
    name: str
    objective: str
    pareto: bool
    seed: int
    resume: bool

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective must be one of {list(OBJECTIVES)}, but got objective={self.objective!r}"
            )
        if self.pareto and self.objective not in PARETO_PARTNER:
            raise ValueError(PARETO_REFUSED)

    @property
    def objectives(self) -> tuple[str, ...]:
        """Objective names, in the order of the study's values (Pareto mode adds a partner)."""
        return (self.objective, PARETO_PARTNER[self.objective]) if self.pareto else (self.objective,)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(OBJECTIVES[o][0] for o in self.objectives)

    @property
    def directions(self) -> list[optuna.study.StudyDirection]:
        return [optuna.study.StudyDirection[OBJECTIVES[o][1].upper()] for o in self.objectives]


@dataclass(frozen=True)
class SpaceId:
    """A search space as the study stores it: its fingerprint (compared on resume) and its description."""

    fingerprint: str
    description: str

    def to_dict(self) -> dict[str, str]:
        return {"fingerprint": self.fingerprint, "description": self.description}


def study_name(card: str, model: str, workload: str | Path) -> str:
    """Default study name: ``<card>-<model>-<workload file stem>`` (e.g.
    ``h200-smollm2-conversation_trace``)."""
    model_part = Path(model).name if ("/" in model or model.endswith(".gguf")) else model
    return f"{card}-{model_part.replace(':', '-')}-{Path(workload).stem}"


def _sampler(options: StudyOptions, existing: int) -> optuna.samplers.BaseSampler:
    """TPE seeded by ``seed + trials already in the study``: a resumed study does not replay its first
    points."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate TPE
        return optuna.samplers.TPESampler(seed=options.seed + existing, multivariate=True, n_startup_trials=6)


def _pruner(options: StudyOptions, startup_trials: int) -> optuna.pruners.BasePruner:
    if options.pareto:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)


def _existing_trials(storage: str, name: str) -> int | None:
    """How many trials study ``name`` holds, or None when it does not exist."""
    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    return next((s.n_trials for s in summaries if s.study_name == name), None)


def open_study(
    options: StudyOptions,
    identity: Mapping[str, Any],
    space: SpaceId,
    attrs: Mapping[str, Any],
    pruner_startup: int = 4,
) -> optuna.Study:
    """Create the study, or load it for ``--resume`` after checking it was made with the same settings.

    Nothing is written to an existing study before the checks pass.
    """
    existing = _existing_trials(options.storage, options.name)
    if existing is not None and not options.resume:
        raise ValueError(
            f"study {options.name!r} already exists in {redact(options.storage)} with {existing} trial(s); "
            "pass --resume to continue it, or --study NAME to start another"
        )
    sampler, pruner = _sampler(options, existing or 0), _pruner(options, pruner_startup)
    if existing is not None:
        study = optuna.load_study(
            study_name=options.name, storage=options.storage, sampler=sampler, pruner=pruner
        )
        check_identity(study, identity, space)
        return study
    study = optuna.create_study(
        storage=options.storage, study_name=options.name, directions=options.directions, sampler=sampler,
        pruner=pruner,
    )  # fmt: skip
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    own = {ATTR_IDENTITY: dict(identity), ATTR_SPACE: space.fingerprint, ATTR_SPACE_TEXT: space.description,
           ATTR_VERSION: kvtune.__version__, ATTR_CREATED: created}  # fmt: skip
    for key, value in {**attrs, **own}.items():
        study.set_user_attr(key, _jsonable(value))
    return study


# Identity keys added after studies were stored, and the value a study made before them had.
IDENTITY_BEFORE: dict[str, Any] = {"clock": "wall"}


def stored_identity(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A study's ``kvtune.identity`` from its attributes, with the value of every key it predates."""
    return IDENTITY_BEFORE | dict(attrs.get(ATTR_IDENTITY) or {})


def check_identity(study: optuna.Study, identity: Mapping[str, Any], space: SpaceId) -> None:
    """Raise :class:`StudyMismatchError` when ``study`` was made with other settings (checked first: the
    message names the setting) or another search space."""
    stored = stored_identity(study.user_attrs)
    for key, value in _jsonable(dict(identity)).items():
        was = stored.get(key)
        if was != value:
            raise StudyMismatchError(
                f"study {study.study_name!r} was made with {key}={_short(was)}, not "
                f"{_short(value)}; use the same settings with --resume, or --study NAME for a new study"
            )
    stored_space = study.user_attrs.get(ATTR_SPACE)
    if stored_space != space.fingerprint:
        raise StudyMismatchError(
            f"study {study.study_name!r} exists with another search space ({stored_space}, "
            f"now {space.fingerprint}: card, model, workload or KV budget differ); use --study NAME for a "
            "new study"
        )


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    """``value`` as it comes back from the storage (JSON round trip: tuples become lists)."""
    return json.loads(json.dumps(value))


def enqueue_known_good(study: optuna.Study, params: Iterable[Mapping[str, Any]], source: str) -> int:
    """Enqueue each parameter set once (``skip_if_exists``), marked ``enqueued_from=source``; how many were
    new."""
    before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    for p in params:
        study.enqueue_trial(dict(p), user_attrs={ATTR_ENQUEUED_FROM: source}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) - before


def recover_abandoned(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a driver that was killed: told FAIL (``abandoned``) and their params
    re-enqueued.

    Only the study's one driver runs trials, so at start any RUNNING trial is a leftover.
    """
    numbers = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_user_attr(t._trial_id, ATTR_ABANDONED, True)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        enqueue_rerun(study, t.params, t.number, ATTR_RESUME_OF)
        numbers.append(t.number)
    return numbers


def enqueue_rerun(study: optuna.Study, params: Mapping[str, Any], number: int, key: str) -> bool:
    """Enqueue ``params`` again, marked ``{key: number}``, unless a trial already carries that mark."""
    if any(t.user_attrs.get(key) == number for t in study.get_trials(deepcopy=False)):
        return False
    study.enqueue_trial(dict(params), user_attrs={key: number})
    return True


def finished_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def stored_attrs(storage: str, name: str) -> dict[str, Any] | None:
    """The user attributes of study ``name`` (read only), or None when it does not exist."""
    if _existing_trials(storage, name) is None:
        return None
    return dict(optuna.load_study(study_name=name, storage=storage).user_attrs)


def store_validation(study: optuna.Study, record: Mapping[str, Any]) -> int:
    """Store ``record`` as the study's latest validation and append it to its history; how many validations
    the study now holds. Nothing earlier is overwritten: a study validated before the history existed has its
    one record moved into it first."""
    attrs = study.user_attrs
    earlier = [attrs[ATTR_VALIDATION]] if ATTR_VALIDATION in attrs else []
    history = list(attrs.get(ATTR_VALIDATION_HISTORY) or earlier)
    history.append(_jsonable(dict(record)))
    study.set_user_attr(ATTR_VALIDATION_HISTORY, history)
    study.set_user_attr(ATTR_VALIDATION, history[-1])
    return len(history)
