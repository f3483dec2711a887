"""When a study's result means nothing, why: an inconclusive validation, or no feasible trial.

**Inconclusive validation** (capacity objective; :func:`validation_problems`). Each side of a validation
repeat is a capacity search on the held-out window (:func:`kvtune.tuner.validation.validate_capacity`); its
result means something only when the search bracketed the capacity and bisected it to the granularity (or
passed at the window's saturation rate: a lower bound every config ties on). The validation is inconclusive
when

- a search did **not converge**: no rate passed, no rate failed below the saturation rate, or its probes ran
  out before ``hi / lo - 1 <= granularity``;
- a search ended more than :data:`FAR_BELOW` × below its start, the capacity the study measured for that
  config (the best trial's, the baseline's median): the held-out window then measured something else;
- a side's repeats disagree beyond the study's noise: the spread of its capacities, (max − min) / median,
  exceeds :data:`DISAGREE` × ``kvtune.noise``'s threshold (the noise itself is estimated from three searches,
  so a sound validation's spread can reach it by chance).

An inconclusive preset claims no gain and recommends the unquantized baseline without engine flags
(:mod:`kvtune.tuner.export`).

**No feasible trial** (:func:`no_feasible_reasons`): the finished trials counted by why each is not
feasible, each with the flag that would change it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvtune.studies.names import ATTR_ERROR

FAR_BELOW = 10.0  # a validation search ending this many times below its start measured something else
DISAGREE = 2.0  # a side's spread over this many times the study's noise threshold is disagreement
TIMED_OUT = "ran past its time limit"  # in a trial's kvtune.error (kvtune.tuner.worker.trial_deadline)
SIDES = ("best", "baseline")


# ---- an inconclusive validation ----------------------------------------------------------------------
def search_problem(search: Mapping[str, Any]) -> str | None:
    """Why one capacity search (:meth:`~kvtune.tuner.capacity.CapacitySearch.to_dict`) means nothing, or
    None when it converged (or saturated) near where it started."""
    lo, hi, probes = search.get("lo"), search.get("hi"), search.get("probes")
    if not search.get("converged") and not search.get("saturated"):
        if lo is None:
            return f"no rate passed in {probes} probes (the lowest failed at {_x(hi)})"
        if hi is None:
            return f"no rate failed in {probes} probes (the highest passed at {_x(lo)})"
        return f"{probes} probes left it between {_x(lo)} and {_x(hi)}, {100 * (hi / lo - 1):.0f} % apart"
    start, capacity = search.get("start"), search.get("capacity") or 0.0
    if isinstance(start, int | float) and start > 0 and capacity * FAR_BELOW < start:
        below = f"{start / capacity:.0f}x" if capacity > 0 else "infinitely far"
        return f"it ended at {_x(capacity)}, {below} below where it started ({_x(start)}, the study's)"
    return None


def validation_problems(validation: Mapping[str, Any]) -> list[str]:
    """Why a capacity ``kvtune.validation`` record is inconclusive (see the module docstring); [] when it is
    sound, and for fixed-rate records (no searches to judge)."""
    if "slo" not in validation:
        return []
    out = []
    searches = [(side, r.get("search")) for side in SIDES for r in validation.get(side) or []]
    judged = [(side, s) for side, s in searches if isinstance(s, Mapping)]
    bad = [(side, why) for side, s in judged if (why := search_problem(s)) is not None]
    if bad:
        side, why = bad[0]
        count = f"{len(bad)} of {len(judged)}"
        out.append(f"{count} validation capacity searches did not converge (the {side}'s: {why})")
    threshold = float((validation.get("noise") or {}).get("threshold") or 0.0)
    for side in SIDES:
        spread = _spread([float(r.get("capacity") or 0.0) for r in validation.get(side) or []])
        if spread is not None and threshold > 0 and spread > DISAGREE * threshold:
            shown = "without bound" if math.isinf(spread) else f"by {100 * spread:.0f} %"
            out.append(f"the {side}'s repeats disagree {shown}, beyond the study's noise "
                       f"({DISAGREE:g} x {100 * threshold:.0f} %)")  # fmt: skip
    return out


def _spread(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median > 0 else math.inf


def _x(rate: Any) -> str:
    return "-" if not isinstance(rate, int | float) else f"{rate:.3g}x"


# ---- no feasible trial -------------------------------------------------------------------------------
def no_feasible_reasons(trials: Sequence[Any], timeout_min: float | None = None) -> list[str]:
    """One line per reason the finished or failed ``trials`` (FrozenTrials) are not feasible: how many, and
    the flag that would change it."""
    counts: dict[str, int] = {}
    for t in trials:
        key = _reason(t)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    limit = f"the {timeout_min:g}-min time limit" if timeout_min else "the time limit"
    advice = {
        "timeout": f"ran past {limit}: give them longer (--trial-timeout) or less to replay (--requests, "
        "--length-scale, --length-cap)",
        "crash": "crashed (each trial's kvtune.error says why; out of memory: a smaller --kv-budget)",
        "ppl": "failed the perplexity bound: a looser --max-ppl-increase",
        "kl": "failed the KL bound: a looser --max-kl",
        "pruned": "were pruned before completing: more --trials",
        "lost": "failed (a lost worker, or Ctrl-C): --resume runs them again",
    }
    return [f"{counts[k]} {advice[k]}" for k in advice if counts.get(k)]


def _reason(t: Any) -> str | None:
    state = t.state.name
    if state == "PRUNED":
        return "pruned"
    if state == "FAIL":
        return "lost"
    if state != "COMPLETE":
        return None
    error = t.user_attrs.get(ATTR_ERROR)
    if error is not None:
        return "timeout" if TIMED_OUT in str(error) else "crash"
    constraints = t.constraints if isinstance(t.constraints, Mapping) else {}
    if constraints.get("ppl_increase_pct", 0.0) > 0:
        return "ppl"
    if constraints.get("kl", 0.0) > 0:
        return "kl"
    return None
