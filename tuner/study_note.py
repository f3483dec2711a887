"""What the preset says, where ``kvtune dashboard`` shows it: the objective's name and the study's note.

The driver names the study's objectives (``study.set_metric_names``: ``capacity`` rather than "Objective
0") when it opens the study, and writes the study's note (markdown, rendered by optuna-dashboard on the
study's page) when it opens the study and after each validation: the objective, the quality limits, the
latency limits and the unquantized baseline's capacity with its noise (capacity), and the latest validation
with its 95 % interval, its verdict (inconclusive when it is) and the recommendation, all read from the
study's own attributes (:func:`study_note`), as :mod:`kvtune.tuner.export` reads them for the preset.
Without optuna-dashboard installed no note is written (nothing else could render it).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import optuna

from kvtune.studies.names import (
    ATTR_NOISE,
    ATTR_OBJECTIVE,
    ATTR_QUALITY_LIMITS,
    ATTR_SLO,
    ATTR_VALIDATION,
)
from kvtune.studies.study import StudyOptions
from kvtune.tuner.capacity import Slo
from kvtune.tuner.export import interval_text, recommendation, validated_metrics


def name_objectives(study: optuna.Study, options: StudyOptions) -> None:
    """Name the study's values after its objectives (``capacity``; ``tpot_p99``, ``throughput``...)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(options.objectives))


def publish(study: optuna.Study) -> bool:
    """Write :func:`study_note` as the study's dashboard note; False when optuna-dashboard is missing."""
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return False
    save_note(study, study_note(study.user_attrs))
    return True


def study_note(attrs: Mapping[str, Any]) -> str:
    """The study's note in markdown, from its user attributes."""
    lines = [f"## kvtune: objective `{attrs.get(ATTR_OBJECTIVE, '?')}`", ""]
    lines += _limits(attrs) + _baseline(attrs.get(ATTR_NOISE)) + [""]
    validation = attrs.get(ATTR_VALIDATION)
    lines += (
        _validation(attrs, validation) if validation else ["**Validation**: not yet (the study is running)"]
    )
    return "\n".join(lines) + "\n"


def _limits(attrs: Mapping[str, Any]) -> list[str]:
    out = []
    slo = attrs.get(ATTR_SLO)
    if slo:
        rule = f" ({slo['rule']})" if slo.get("rule") else ""
        out.append(f"- **Latency limits**: {Slo.from_record(slo).describe()}{rule}")
    quality = attrs.get(ATTR_QUALITY_LIMITS) or {}
    ppl, kl = quality.get("max_ppl_increase"), quality.get("max_kl")
    bounds = [
        f"perplexity +{ppl:g} %" if ppl is not None else "",
        f"mean KL {kl:g}" if kl is not None else "",
    ]
    shown = ", ".join(b for b in bounds if b) or "none"
    out.append(f"- **Quality bounds**: {shown}; a trial beyond them is infeasible and never the best")
    return out


def _baseline(noise: Mapping[str, Any] | None) -> list[str]:
    if not noise:
        return []
    capacities = ", ".join(f"{c:.3g}" for c in noise.get("capacities") or [])
    return [
        f"- **Unquantized baseline** (hot 32, block 64): capacity {noise['median']:.3g}x the trace's rate, "
        f"searched {noise['repeats']} times ({capacities}); spread {100 * noise['spread']:.0f} %, so "
        f"differences below {100 * noise['threshold']:.0f} % are noise"
    ]


def _validation(attrs: Mapping[str, Any], validation: Mapping[str, Any]) -> list[str]:
    objective = str(attrs.get(ATTR_OBJECTIVE))
    where = (f"**Validation** of trial {validation.get('trial')} on {validation['window']['requests']} "
             f"held-out requests x {validation['repeats']} repeats ({validation.get('date')})")  # fmt: skip
    try:
        metrics = validated_metrics(objective, validation)
    except (ValueError, KeyError) as e:
        return [where, "", f"- not readable: {e}"]
    g, out = metrics["gain"], [where, ""]
    if g.get("ratio") is not None:
        out.append(f"- **Gain** on {g['metric']}: {g['ratio']:.3f}x the unquantized baseline "
                   f"({interval_text(g, '.3f')}): {g['verdict']}")  # fmt: skip
    else:
        out.append(f"- **Gain**: none computed ({g.get('why')})")
    if metrics.get("claim"):
        out.append(f"- **Capacity**: {metrics['claim']}")
    for problem in metrics.get("inconclusive") or []:
        out.append(f"- **Inconclusive**: {problem}")
    advice = recommendation(metrics, validation.get("trial"))
    out.append(f"- **Recommended**: `{advice['use']}`: {advice['why']}")
    return out
