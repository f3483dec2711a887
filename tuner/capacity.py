"""The capacity objective: the highest arrival rate a config carries within latency limits.

A trial's **capacity** is the highest arrival rate, as a multiple of the trace's own rate (a replay at rate
``r`` scales the trace's inter-arrival times by ``1 / r``), at which a replay of the trial's windows meets
both limits of :class:`Slo`: TTFT ≤ ``ttft_ms`` and TPOT ≤ ``tpot_ms`` on the limits' ``percentile`` of its
requests, every request served (a new study's percentile is 90, DistServe's 90 % attainment:
:data:`kvtune.studies.names.SLO_PERCENTILE`; 99 on request; a limit record without one is a P99 one).
The driver finds it with :class:`CapacitySearch`, one probe (one replay at one rate) per protocol call
(:data:`kvtune.tuner.protocol.Call.PROBE`):

- **warm start** at the unquantized baseline's capacity (measured when the study starts), or at the best
  capacity of the study's feasible trials once that is higher (:func:`warm_start`);
- **bracket**: double the rate after a pass, halve it after a failure, until a passing rate ``lo`` and a
  failing rate ``hi`` are known (a search started near its answer, :func:`near_search`, steps by
  :data:`NEAR_EXPAND` first, then by growing steps: the probes far below capacity, the slowest to replay,
  are skipped, and an answer within 5 % of the start is bracketed in two probes);
- **bisect** at the geometric midpoint ``sqrt(lo * hi)`` until ``hi / lo - 1 <= granularity`` (2.5 %);
- at most ``max_probes`` probes (8; the baseline's own, not warm-started, search gets 12);
- never above ``max_rate``, the **saturation rate** (:func:`saturation_rate`): there every window's requests
  arrive within one unloaded decode step, so a probe is a replay of the whole window at once and a higher
  rate cannot load the engine more. A search that passes there is **saturated**: the window cannot overload
  the config, its capacity (``max_rate``) is a lower bound, and every config that reaches it ties.

The capacity is ``lo``, the highest rate that passed (0 when none did): every probe lies strictly between
``lo`` and ``hi``, so ``lo`` only grows; it is what the driver reports to Optuna after each probe. A config
whose ``hi`` is at most the best capacity of the study's feasible trials cannot beat it and is pruned
(:func:`should_prune`).

A probe **fails early**: the engine asks :class:`ProbeStop` once per iteration and stops the replay as soon
as the P99 is certain to break a limit, i.e. when as many requests as the P99 tolerates no more of have
violated it (a request violates TTFT once it has waited longer than the limit without a first token, TPOT
once its tokens so far already average more than the limit over its whole output). Over ≤ 101 requests the
P99 is nearly the maximum (numpy's interpolation lands between the two slowest), so two violators end a
probe; over ``n`` requests it takes ``n - floor(0.99 (n - 1))`` (for the P90, ``n - floor(0.9 (n - 1))``: 11
of 96).

This module is pure Python (no engine, no Ray): the driver, the workers and the tests share it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.studies.names import (
    CAPACITY_GRANULARITY,
    CAPACITY_PROBES,
    SLO_TPOT_FACTOR,
    SLO_TTFT_FACTOR,
)

EXPAND = 2.0  # the rate's factor per bracketing step
# ... the first of a search started near its answer (:func:`near_search`: the baseline's searches after its
# first, validation's, each from a capacity already measured of that config; a trial's from the best one);
# each later step in the same direction squares the one before (5 %, 10 %, 22 %, 48 %, then EXPAND): an
# answer within 5 % is bracketed in two probes, one within 22 % in four, one 50 % away in five (a cold
# search's count). Against a fixed 25 % step: 3.2-5.1 probes a search within ±10 % instead of 6.0, at the
# same spread (simulated: a pass probability of scale 0.02 in log rate, the quieter gated clock's); the
# answer is pulled ~1 % towards the start when the start is 5-10 % off
NEAR_EXPAND = 1.05
# A trial's capacity against the baseline's grows about as this power of their ``max_num_seqs`` (the
# sequences its KV budget holds, times the trial's factor). H200 studies, Llama-3.1-8B shape, 1 GiB, lengths
# × 0.25, 11 complete trials of 7 studies on the gated and device clocks (INT8 and INT4 at 31-116 sequences
# against the baseline's 19): exponents 0.62-1.02, and at 0.75 the prediction fell within 0.88-1.22× of the
# capacity found (three more, started from it: 0.91-0.95×); 10 trials of older studies (28 and 20 baseline
# sequences) within 0.70-1.53×. A trial's search starts where it predicts (:func:`predicted_start`), near
# steps from there
CONCURRENCY_EXPONENT = 0.75
# A search with ``draws`` (:class:`CapacitySearch`) bisects only until its bracket is this wide (hi / lo − 1),
# then spends its draws at the estimate of the rate a replay passes half the time
DRAWS_BRACKET = 0.10
# The scale, in log rate, of a replay's pass probability near capacity, p(r) = 1 / (1 + (r / r50) ** (1 / s)):
# fitted by maximum likelihood to 39 probes of each of two unseen Azure windows on an H200 (Llama-3.1-8B
# shape, 1 GiB, 96-request windows, P90 limits): 0.045 and 0.055, each with 0.03-0.08 inside its likelihood
# interval
PASS_SCALE = 0.05


# ---- the limits ----------------------------------------------------------------------------------------
SLO_PERCENTILES = (99.0, 90.0)  # the percentiles a replay's metrics carry that a limit may apply to
# what a probe's verdict is decided on (see Slo): each limit on its percentile of the requests, or the share
# of requests within both limits (attainment) at least percentile %
STATISTICS = ("percentile", "attainment")


@dataclass(frozen=True)
class Slo:
    """The latency limits of a capacity probe, in milliseconds, on the ``percentile`` (over a window's
    requests) of TTFT and of per-request TPOT.

    ``statistic``: ``"percentile"`` (each limit on its own percentile of the requests) or ``"attainment"``
    (at least ``percentile`` % of the requests meet both limits: a count over every request, not one order
    statistic per limit). ``pooled``: a probe's windows are judged as one set of requests (their union)
    rather than each window on its own, so a probe of W windows decides on W times the requests."""

    ttft_ms: float
    tpot_ms: float
    percentile: float = 99.0
    statistic: str = "percentile"
    pooled: bool = False

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"`{name} > 0` must hold, but got {name}={value}")
        if self.percentile not in SLO_PERCENTILES:
            raise ValueError(
                f"percentile must be one of {[f'{p:g}' for p in SLO_PERCENTILES]}, but got "
                f"percentile={self.percentile:g}"
            )
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"statistic must be one of {list(STATISTICS)}, but got statistic={self.statistic!r}"
            )

    @property
    def needs_requests(self) -> bool:
        """Whether the verdict is taken from the per-request times rather than a window's percentiles."""
        return self.pooled or self.statistic != "percentile"

    @property
    def keys(self) -> tuple[str, str]:
        """The replay metrics the limits apply to (``ttft_p99_ms``, ``tpot_p99_ms`` for the P99)."""
        return f"ttft_p{self.percentile:g}_ms", f"tpot_p{self.percentile:g}_ms"

    def describe(self) -> str:
        pooled = ", windows pooled" if self.pooled else ""
        if self.statistic == "attainment":
            return (
                f"≥ {self.percentile:g} % of requests within TTFT ≤ {self.ttft_ms:.4g} ms and TPOT ≤ "
                f"{self.tpot_ms:.4g} ms{pooled}"
            )
        p = f"P{self.percentile:g}"
        return f"{p} TTFT ≤ {self.ttft_ms:.4g} ms and {p} TPOT ≤ {self.tpot_ms:.4g} ms{pooled}"

    def rule(self) -> dict[str, Any]:
        """What the record stores of the verdict's rule (absent from a record: percentile, not pooled)."""
        return {"statistic": self.statistic, "pooled": self.pooled}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Slo:
        """From a study's ``kvtune.slo`` (one stored before the percentile was recorded is a P99 one; one
        stored before the statistic was recorded decides on the percentile, each window on its own)."""
        return cls(
            float(record["ttft_ms"]), float(record["tpot_ms"]), float(record.get("percentile", 99.0)),
            str(record.get("statistic", "percentile")), bool(record.get("pooled", False)),
        )  # fmt: skip


def _check_draws(confirm: int, draws: int) -> None:
    if confirm < 1 or confirm % 2 == 0:
        raise ValueError(f"`confirm` must be odd and >= 1, but got confirm={confirm}")
    if draws < 0:
        raise ValueError(f"`draws >= 0` must hold, but got draws={draws}")
    if draws and confirm > 1:
        raise ValueError(
            f"`confirm` and `draws` are two rules: give one, but got confirm={confirm}, draws={draws}"
        )


@dataclass(frozen=True)
class ProbeRule:
    """How a study's probes decide (its noise routes): the verdict's ``statistic`` and whether a probe's
    windows are ``pooled`` (:class:`Slo`), and the ``confirm`` draws of a rate near the decision
    (:class:`CapacitySearch`). The default is the rule of a study stored before these existed."""

    statistic: str = "percentile"
    pooled: bool = False
    confirm: int = 1
    draws: int = 0  # single draws at the estimated 50 % rate once the bracket is narrow (CapacitySearch)

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"statistic must be one of {list(STATISTICS)}, but got statistic={self.statistic!r}"
            )
        _check_draws(self.confirm, self.draws)

    def verdict(self) -> dict[str, Any]:
        """What ``kvtune.slo`` stores of it (:meth:`Slo.rule`)."""
        return {"statistic": self.statistic, "pooled": self.pooled}


DEFAULT_PROBE = ProbeRule()


def derive_slo(
    unloaded: Mapping[str, Any] | None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    ttft_factor: float = SLO_TTFT_FACTOR,
    tpot_factor: float = SLO_TPOT_FACTOR,
    percentile: float = 99.0,
    verdict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The study's ``kvtune.slo`` record: the limits given, else ``factor ×`` the unloaded baseline's P99
    TTFT and median TPOT (its decode step; the mean decode step when no request has two output tokens),
    applied to the ``percentile`` of a probe's requests (the derivation is the same for every percentile);
    ``verdict``: the statistic and pooling of :class:`Slo` (:meth:`Slo.rule`; None: percentile, per
    window)."""
    rule = f"{ttft_factor:g} x the unloaded baseline's P99 TTFT, {tpot_factor:g} x its median TPOT"
    record: dict[str, Any] = {"rule": rule, "unloaded": None, "percentile": float(percentile)}
    record |= dict(verdict or {})
    if unloaded is not None:
        keys = (
            "ttft_p99_ms",
            "tpot_p50_ms",
            "step_ms",
            "completed",
            "unprimed_ttft_p99_ms",
            "ttft_p99_repeats",
        )
        record["unloaded"] = {k: unloaded.get(k) for k in keys}
    derived: dict[str, float] = {}
    if unloaded is not None:
        ttft = _positive(unloaded.get("ttft_p99_ms"))
        step = _decode_step(unloaded) or ttft
        if ttft is None or step is None:
            raise ValueError(
                "the unloaded baseline replay measured no TTFT: pass --slo-ttft-ms and --slo-tpot-ms"
            )
        derived = {"ttft_ms": ttft_factor * ttft, "tpot_ms": tpot_factor * step}
    given = {k: v for k, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)) if v is not None}
    record.update(derived | given)
    record["source"] = {k: ("given" if k in given else "derived") for k in ("ttft_ms", "tpot_ms")}
    Slo.from_record(record)  # both limits present and positive
    return record


def _decode_step(unloaded: Mapping[str, Any]) -> float | None:
    """The unloaded baseline's decode step: its median TPOT, else its mean step (None: neither measured)."""
    return _positive(unloaded.get("tpot_p50_ms")) or _positive(unloaded.get("step_ms"))


def _positive(value: Any) -> float | None:
    ok = isinstance(value, int | float) and math.isfinite(value) and value > 0
    return float(value) if ok else None


# ---- the search ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CapacitySearch:
    """A bracketed search for the highest passing rate (see the module docstring); a value: :meth:`record`
    returns the next state.

    With ``draws`` > 0 the capacity is instead **the rate a replay passes half the time**. Near capacity a
    replay's verdict is a draw: the same window at the same rate passes or collapses from one replay to the
    next, so the highest rate that passed once lands anywhere in a band some 20 % wide. The search then
    bisects only until its bracket is :data:`DRAWS_BRACKET` wide, and spends ``draws`` more probes, each at
    the current maximum-likelihood estimate of that rate under a logistic pass probability of fixed
    ``scale`` in log rate (:func:`pass_rate_estimate`); its capacity is that estimate over every probe. Each
    draw lands where a verdict says most, and the estimate's error falls as one over the root of the
    draws."""

    start: float
    granularity: float = CAPACITY_GRANULARITY
    max_probes: int = CAPACITY_PROBES
    probes: tuple[tuple[float, bool], ...] = ()  # (rate, passed), in order
    max_rate: float | None = None  # the saturation rate (None: unbounded)
    confirm: int = 1  # draws a rate takes when one was near the decision (its verdict: their majority)
    near: float = 0.1  # a draw is near the decision when its margin's magnitude is below this
    close: tuple[float, ...] = ()  # the rates with a draw near the decision
    step_down: float | None = None  # the rate after a first failure instead of halving (warm_start's)
    draws: int = 0  # probes at the estimated 50 % rate once the bracket is DRAWS_BRACKET wide
    scale: float = PASS_SCALE  # the pass probability's assumed scale in log rate (draws only)
    bracketed: int | None = None  # the probes of the bracketing phase, once it ended and draws began
    expand: float = EXPAND  # the rate's factor per bracketing step (NEAR_EXPAND: started near the answer)
    escalate: bool = False  # each later step in one direction squares the factor (up to EXPAND): near_search

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and self.start > 0):
            raise ValueError(f"`start > 0` must hold, but got start={self.start}")
        if self.max_rate is not None and not (math.isfinite(self.max_rate) and self.max_rate > 0):
            raise ValueError(f"`max_rate > 0` must hold, but got max_rate={self.max_rate}")
        if not self.granularity > 0:
            raise ValueError(f"`granularity > 0` must hold, but got granularity={self.granularity}")
        if self.max_probes < 1:
            raise ValueError(f"`max_probes >= 1` must hold, but got max_probes={self.max_probes}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"`scale > 0` must hold, but got scale={self.scale}")
        if not (math.isfinite(self.expand) and self.expand > 1):
            raise ValueError(f"`expand > 1` must hold, but got expand={self.expand}")
        _check_draws(self.confirm, self.draws)

    @property
    def _bracketing(self) -> tuple[tuple[float, bool], ...]:
        """The probes of the bracketing phase (all of them while it lasts)."""
        return self.probes if self.bracketed is None else self.probes[: self.bracketed]

    def verdicts(self) -> dict[float, bool | None]:
        """Each rate the bracketing probed, in order, with its verdict: its one draw, or, for a rate with a
        draw near the decision (``close``), the majority of its ``confirm`` draws once one side has it
        (None before)."""
        draws: dict[float, list[bool]] = {}
        for rate, passed in self._bracketing:
            draws.setdefault(rate, []).append(passed)
        need = self.confirm // 2 + 1
        out: dict[float, bool | None] = {}
        for rate, ds in draws.items():
            if self.confirm == 1 or rate not in self.close:
                out[rate] = ds[0]
            else:
                yes = sum(ds)
                out[rate] = True if yes >= need else (False if len(ds) - yes >= need else None)
        return out

    @property
    def lo(self) -> float | None:
        """The highest rate that passed (of the bracketing phase)."""
        return max((r for r, ok in self.verdicts().items() if ok), default=None)

    @property
    def hi(self) -> float | None:
        """The lowest rate that failed (of the bracketing phase)."""
        return min((r for r, ok in self.verdicts().items() if ok is False), default=None)

    @property
    def capacity(self) -> float:
        """The capacity found so far: the highest passing rate, 0 when none passed (a lower bound); with
        draws, once they began, the estimated rate a replay passes half the time."""
        if self.bracketed is not None:
            estimate = self.estimate()
            if estimate is not None:
                return estimate
        return self.lo or 0.0

    def estimate(self) -> float | None:
        """The rate a replay passes half the time, estimated from every probe (:func:`pass_rate_estimate`),
        never above the saturation rate; None before a probe passed and one failed."""
        found = self._found
        if found is None:
            return None
        return found[0] if self.max_rate is None else min(found[0], self.max_rate)

    @functools.cached_property
    def _found(self) -> tuple[float, float] | None:
        """:func:`pass_rate_estimate` over the probes, once per state (a state never changes)."""
        return pass_rate_estimate(self.probes, self.scale)

    @property
    def width(self) -> float:
        """How narrow the bracketing goes (hi / lo − 1): the granularity, or DRAWS_BRACKET with draws."""
        return max(self.granularity, DRAWS_BRACKET) if self.draws else self.granularity

    @property
    def converged(self) -> bool:
        lo, hi = self.lo, self.hi
        return lo is not None and hi is not None and hi / lo - 1.0 <= self.width

    @property
    def saturated(self) -> bool:
        """Whether a probe passed at the saturation rate: the window cannot overload this config."""
        lo = self.lo
        return lo is not None and at_saturation(lo, self.max_rate)

    @property
    def near_saturation(self) -> bool:
        """Whether the search passed at the saturation rate or converged within one step (``width``) below
        it: no config can show a capacity above this one by more than the search resolves."""
        lo = self.lo
        return self.saturated or (
            self.converged and lo is not None and at_saturation(lo * (1.0 + self.width), self.max_rate)
        )

    def next_rate(self) -> float | None:
        """The next rate to probe; None when the search is done (converged, saturated, or out of
        probes; with draws, once they are spent)."""
        if self.bracketed is not None:
            if len(self.probes) - self.bracketed >= self.draws:
                return None
            return self.estimate()
        return self._bracket_rate()

    def _bracket_rate(self) -> float | None:
        verdicts = self.verdicts()
        pending = [r for r, ok in verdicts.items() if ok is None]
        if pending:  # a draw near the decision: the same rate again
            return pending[0]
        lo, hi = self.lo, self.hi
        if len(verdicts) >= self.max_probes or self.converged or self.saturated:
            return None
        top = math.inf if self.max_rate is None else self.max_rate
        if lo is None and hi is None:
            return min(self.start, top)
        if lo is None:
            assert hi is not None
            down = self.step_down
            if down is not None and down < hi and down not in verdicts:
                return down
            return hi / self._step(len(verdicts))
        if hi is None:
            return min(lo * self._step(len(verdicts)), top)
        if lo >= hi:  # a pass above a failure: cannot happen while probes stay inside (lo, hi)
            return None
        return math.sqrt(lo * hi)

    def _step(self, verdicts: int) -> float:
        """The factor of the next bracketing step after ``verdicts`` rates, all on one side of the answer:
        ``expand``, or escalating, ``expand`` squared at each step after the first, at most :data:`EXPAND`
        (never below ``expand``)."""
        if not self.escalate:
            return self.expand
        return max(self.expand, min(EXPAND, self.expand ** (2 ** min(verdicts - 1, 16))))

    def record(self, rate: float, passed: bool, margin: float | None = None) -> CapacitySearch:
        """The search after a probe at ``rate``; ``margin``: its :func:`decision_margin`, which marks the
        rate for ``confirm`` draws when its magnitude is below ``near`` (None: a probe that stopped early,
        or one recorded without: never near). With draws, the bracketing ends (and the draws begin) once it
        has nothing left to probe, a pass below a failure and no saturation."""
        close = self.close
        if margin is not None and abs(margin) < self.near and float(rate) not in close:
            close = (*close, float(rate))
        after = dataclasses.replace(self, probes=(*self.probes, (float(rate), bool(passed))), close=close)
        if self.draws and after.bracketed is None and after._bracket_rate() is None:
            lo, hi = after.lo, after.hi
            if lo is not None and hi is not None and lo < hi and not after.saturated:
                after = dataclasses.replace(after, bracketed=len(after.probes))
        return after

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capacity": self.capacity,
            "lo": self.lo,
            "hi": self.hi,
            "converged": self.converged,
            "saturated": self.saturated,
            "max_rate": self.max_rate,
            "probes": len(self.probes),
            "start": self.start,
            "granularity": self.granularity,
            "max_probes": self.max_probes,
        }
        if self.expand != EXPAND:
            out["expand"] = self.expand
        if self.escalate:
            out["escalate"] = True
        if self.confirm > 1:
            out |= {"confirm": self.confirm, "near": self.near, "confirmed": list(self.close)}
        if self.draws:
            found = self._found if self.bracketed is not None else None
            out |= {"draws": self.draws, "scale": self.scale, "bracketed": self.bracketed,
                    "stderr": None if found is None else found[1]}  # fmt: skip
        return out


def pass_rate_estimate(probes: Sequence[tuple[float, bool]], scale: float) -> tuple[float, float] | None:
    """The rate ``r50`` at which a replay passes half the time, by maximum likelihood over ``probes``
    ((rate, passed) draws) under p(pass at r) = 1 / (1 + exp((ln r − ln r50) / scale)), and the standard
    error of ``ln r50`` (about the relative error of ``r50``): ``scale / sqrt(Σ p (1 − p))``. With the
    scale fixed the log-likelihood is concave in ``ln r50`` and has one maximum as soon as one draw passed
    and one failed (None before), also when every pass lies below every failure."""
    if not any(ok for _, ok in probes) or all(ok for _, ok in probes):
        return None
    logs = [(math.log(r), ok) for r, ok in probes]
    p = lambda m, x: 1.0 / (1.0 + math.exp(max(-700.0, min(700.0, (x - m) / scale))))
    score = lambda m: sum((1.0 if ok else 0.0) - p(m, x) for x, ok in logs)  # decreasing in m
    low = min(x for x, _ in logs) - 40 * scale
    high = max(x for x, _ in logs) + 40 * scale
    for _ in range(200):
        mid = 0.5 * (low + high)
        if score(mid) > 0:
            low = mid
        else:
            high = mid
    m = 0.5 * (low + high)
    information = sum(p(m, x) * (1.0 - p(m, x)) for x, _ in logs)
    return math.exp(m), scale / math.sqrt(information) if information > 0 else math.inf


def near_search(search: CapacitySearch, rate: float) -> CapacitySearch:
    """``search`` (before its first probe) started at ``rate``, a capacity already measured of the same
    config (on the same window, or another of the same trace), stepping by :data:`NEAR_EXPAND` first and
    by larger steps while the verdicts stay on one side, rather than doubling: it brackets the answer in a
    probe or two around ``rate`` instead of climbing to it from a low rate, whose replays (small batches,
    many iterations) are the slowest of a search. A ``rate`` that is not positive and finite (no capacity
    was found) leaves ``search`` as it is."""
    if not (math.isfinite(rate) and rate > 0):
        return search
    return dataclasses.replace(search, start=float(rate), expand=NEAR_EXPAND, escalate=True)


def predicted_start(search: CapacitySearch, seqs: float | None, base_seqs: float | None) -> CapacitySearch:
    """A trial's ``search`` (started at the baseline's capacity) started instead where its ``max_num_seqs``
    against the baseline's (``base_seqs``) predicts, ``start × (seqs / base_seqs) ** CONCURRENCY_EXPONENT``,
    by :func:`near_search`'s steps. Where the KV budget binds, a cache that holds more sequences carries
    more, but less than in proportion: on an H200 INT8's 31 sequences against 19 carried 1.35-1.41× and
    INT4's 116 3.2×, where a start at the baseline's capacity took 7 probes to find INT8's, 3-4 of them
    below it. The prediction only places the first probe: the search brackets the capacity as from any
    start. Either count unknown (the space searches no engine knobs) leaves ``search`` as it is."""
    if not seqs or not base_seqs or seqs <= 0 or base_seqs <= 0:
        return search
    return near_search(search, search.start * (seqs / base_seqs) ** CONCURRENCY_EXPONENT)


def warm_start(search: CapacitySearch, best_known: float | None, noise: float = 0.0) -> CapacitySearch:
    """The search a new trial starts: ``search`` (started at the baseline's capacity or where the trial's
    sequences predict, :func:`predicted_start`), started at the best capacity of the study's feasible
    trials instead when that is higher. A config that cannot beat the best then fails its first probe; its
    next probe is at the edge of the study's ``noise`` below the best (``best × (1 − noise)``, the noise
    record's threshold), where a failure prunes it at once (two probes where a start at the baseline's
    capacity spends three or four) and a pass keeps it as a possible tie; one that can beat the best goes up
    from there as a search near its answer does (:func:`near_search`'s steps: a config that beats the best
    mostly does so by a little). A search started above the best keeps its start, and a first failure
    there probes that edge next too (a prediction too high prunes as fast as a start at the best)."""
    if best_known is None or not (math.isfinite(best_known) and best_known > 0):  # 0: no rate passed yet
        return search
    down = best_known * (1.0 - noise) if 0.0 < noise < 1.0 else None
    if best_known <= search.start:
        return search if down is None else dataclasses.replace(search, step_down=down)
    return dataclasses.replace(
        search, start=float(best_known), step_down=down, expand=NEAR_EXPAND, escalate=True
    )


def should_prune(search: CapacitySearch, best_known: float | None, noise: float = 0.0) -> bool:
    """Whether the trial of ``search`` can stop: it already failed at a rate clearly below the best
    capacity of the study's feasible trials, by more than the study's ``noise`` (the noise record's
    threshold: a failure at ``best × (1 − noise)`` or lower), so its capacity cannot beat or tie it. A
    failure within the noise of the best goes on to be measured: a tie is reported, never ranked."""
    hi = search.hi
    if best_known is None or best_known <= 0 or hi is None:
        return False
    return hi <= best_known * (1.0 - max(0.0, min(noise, 1.0))) * (1.0 + 1e-9)


def saturation_rate(windows: Sequence[Sequence[Any]], slo_record: Mapping[str, Any]) -> float | None:
    """The rate (× the trace's) at which every window's requests (objects with ``arrival_ms``, in order)
    arrive within one decode step of the unloaded baseline (its median TPOT, else its mean step, from the
    study's ``kvtune.slo``): above it a probe replays the window at once whatever the rate. None when the
    limits were given rather than derived (no unloaded replay) or no window spans any time."""
    step = _decode_step(slo_record.get("unloaded") or {})
    span = max((float(w[-1].arrival_ms) - float(w[0].arrival_ms) for w in windows if len(w)), default=0.0)
    if step is None or span <= 0:
        return None
    return span / step


def at_saturation(capacity: float, max_rate: float | None) -> bool:
    """Whether ``capacity`` is the saturation rate ``max_rate`` (None: a search without one), i.e. a lower
    bound."""
    return max_rate is not None and capacity >= max_rate * (1.0 - 1e-9)


# ---- one probe -----------------------------------------------------------------------------------------
def violations_to_fail(requests: int, percentile: float = 99.0, statistic: str = "percentile") -> int:
    """How many of ``requests`` latencies above a limit make their ``percentile`` (numpy's linear
    interpolation) certainly exceed it: for the P99, 2 for up to 101 requests, about 1 % + 1 beyond. For
    the ``attainment`` statistic, how many requests outside a limit leave fewer than ``percentile`` % within
    both (10 of 96 at 90 %)."""
    if requests < 1:
        raise ValueError(f"`requests >= 1` must hold, but got requests={requests}")
    if statistic == "attainment":
        return requests - math.ceil(percentile / 100.0 * requests - 1e-9) + 1
    return requests - math.floor(percentile / 100.0 * (requests - 1))


class ProbeStop:
    """The engine's stop predicate for one probe window (see the module docstring): ``fired`` once the P99
    TTFT or the P99 TPOT of the window is certain to break its limit.

    Called with the engine clock (ms) and every sequence of the replay in arrival order (objects with
    ``arrival_ms``, ``token_ms`` and ``request.output_length``); each call looks only at sequences that have
    arrived and are not yet decided.
    """

    def __init__(self, slo: Slo, requests: int) -> None:
        """``requests``: of the window, or of all the probe's windows when ``slo.pooled`` (the same stop
        then serves each window in turn: :meth:`next_window`)."""
        self.slo = slo
        self.allowed = violations_to_fail(requests, slo.percentile, slo.statistic)
        self.ttft_violations = 0
        self.tpot_violations = 0
        self.fired = False
        self._seen = 0
        self._open: list[Any] = []

    def __call__(self, now_ms: float, seqs: Sequence[Any]) -> bool:
        if self.fired:
            return True
        while self._seen < len(seqs) and seqs[self._seen].arrival_ms <= now_ms:
            self._open.append(seqs[self._seen])
            self._seen += 1
        self._open = [s for s in self._open if not self._decided(s, now_ms)]
        self.fired = self.violations >= self.allowed
        return self.fired

    @property
    def violations(self) -> int:
        """The count the limit applies to: per limit for a percentile, requests outside either limit (each
        is counted once, by the first limit it breaks) for attainment."""
        if self.slo.statistic == "attainment":
            return self.ttft_violations + self.tpot_violations
        return max(self.ttft_violations, self.tpot_violations)

    def next_window(self) -> None:
        """Start the next window of a pooled probe: its violations so far stay counted."""
        self._seen, self._open = 0, []

    def _decided(self, seq: Any, now_ms: float) -> bool:
        """Count ``seq``'s violations once they are certain; True when nothing more can change about it."""
        tokens, out = seq.token_ms, seq.request.output_length
        if not tokens:
            if now_ms - seq.arrival_ms > self.slo.ttft_ms:
                self.ttft_violations += 1
                return True  # counted for TTFT only (its TPOT may never be known): the count stays safe
            return False
        if tokens[0] - seq.arrival_ms > self.slo.ttft_ms:
            self.ttft_violations += 1
            return True
        done = len(tokens) >= out
        if out < 2:
            return done
        last = tokens[-1] if done else max(tokens[-1], now_ms)
        if (last - tokens[0]) / (out - 1) > self.slo.tpot_ms:  # a lower bound until it is done
            self.tpot_violations += 1
            return True
        return done


def probe_passes(metrics: Mapping[str, Any], slo: Slo) -> bool:
    """One window at one rate meets both limits, every request served (a refused one never does)."""
    ttft, tpot = (metrics.get(key) for key in slo.keys)
    if metrics.get("refused", 0) or not metrics.get("completed", 0):
        return False
    if not isinstance(ttft, int | float) or not math.isfinite(ttft) or ttft > slo.ttft_ms:
        return False
    # no request with two output tokens has no TPOT: nothing to violate
    return not (isinstance(tpot, int | float) and math.isfinite(tpot) and tpot > slo.tpot_ms)


def requests_pass(timings: Sequence[Any], slo: Slo, expected: int) -> bool:
    """The verdict over the requests' own times (objects with ``ttft_ms`` and ``tpot_ms``, None for a
    single token), all of a probe's windows when pooled: every one of ``expected`` requests served, and
    :func:`decision_margin` not negative."""
    return len(timings) >= expected and decision_margin(timings, slo) >= 0.0


def decision_margin(timings: Sequence[Any], slo: Slo) -> float:
    """How far the requests' statistic is from failing, relative to the limit: for a percentile the
    smaller of ``1 - P/limit`` over TTFT and TPOT; for attainment the share of requests within both limits
    minus the share required. Negative: it fails; near 0: a draw of the same rate may decide otherwise."""
    if not timings:
        return -math.inf
    if slo.statistic == "attainment":
        within = sum(1 for t in timings if _within(t, slo))
        return within / len(timings) - slo.percentile / 100.0
    ttft = _quantile([t.ttft_ms for t in timings], slo.percentile)
    tpots = [t.tpot_ms for t in timings if t.tpot_ms is not None]
    tpot = _quantile(tpots, slo.percentile) if tpots else 0.0
    return min(1.0 - ttft / slo.ttft_ms, 1.0 - tpot / slo.tpot_ms)


def windows_margin(windows: Sequence[Mapping[str, Any]], slo: Slo) -> float:
    """:func:`decision_margin` of a probe decided on each window's percentiles: its worst window's."""
    ttft_key, tpot_key = slo.keys
    margins = []
    for w in windows:
        tpot, ttft = w.get(tpot_key, math.nan), w.get(ttft_key, math.nan)
        tpot_margin = 1.0 - float(tpot) / slo.tpot_ms if _finite(tpot) else math.inf
        margins.append(min(1.0 - float(ttft) / slo.ttft_ms if _finite(ttft) else -math.inf, tpot_margin))
    return min(margins, default=-math.inf)


def _within(timing: Any, slo: Slo) -> bool:
    tpot = timing.tpot_ms
    return timing.ttft_ms <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)


def _quantile(values: Sequence[float], percentile: float) -> float:
    """numpy's default (linear interpolation between the closest ranks) percentile."""
    ordered = sorted(values)
    at = percentile / 100.0 * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def probe_record(
    rate: float,
    passed: bool,
    aborted: bool,
    windows: Sequence[Mapping[str, Any]],
    mean: Mapping[str, Any],
    margin: float | None = None,
) -> dict[str, Any]:
    """What a probe returns: its verdict, the windows it replayed (it stops at the first that fails) and
    their mean, and the worst window's P99s and P90s; ``margin``: the verdict's :func:`decision_margin`
    (absent when the probe stopped early or decided on the windows' percentiles)."""
    worst = lambda key: max((float(w[key]) for w in windows if _finite(w.get(key))), default=math.nan)
    return {
        "rate": float(rate),
        "passed": bool(passed),
        "aborted": bool(aborted),
        **({"margin": float(margin)} if margin is not None and math.isfinite(margin) else {}),
        "ttft_p99_ms": worst("ttft_p99_ms"),
        "tpot_p99_ms": worst("tpot_p99_ms"),
        "ttft_p90_ms": worst("ttft_p90_ms"),
        "tpot_p90_ms": worst("tpot_p90_ms"),
        "tokens_per_s": float(mean.get("tokens_per_s", math.nan)),
        "windows": [dict(w) for w in windows],
        "mean": dict(mean),
    }


PROBE_DETAILS = ("completed", "duration_s", "step_ms", "decode_steps", "mixed_iterations", "peak_running",
                 "preemptions")  # fmt: skip


def probe_summary(probe: Mapping[str, Any]) -> dict[str, Any]:
    """The probe as a study stores it (a trial's ``kvtune.probes``, the baseline's searches in
    ``kvtune.noise``): its verdict, P99s and P90s, its host seconds (``wall_s``, of them ``prime_s`` setting
    up a new cache, and of those ``compile_s`` in Triton's compiler or its disk cache: ``compiles`` kernels,
    ``compile_loads`` of them loaded from the disk) where the worker measured them, and from its windows'
    mean what explains them (requests finished, replay time, decode step, iterations, peak batch,
    preemptions); no per-window metrics."""
    verdict = ("rate", "passed", "aborted", "margin", "ttft_p99_ms", "tpot_p99_ms", "ttft_p90_ms",
               "tpot_p90_ms", "tokens_per_s", "wall_s", "prime_s", "compile_s", "compiles",
               "compile_loads")  # fmt: skip
    summary = {k: probe[k] for k in verdict if k in probe}
    mean = probe.get("mean", {})
    return summary | {k: mean[k] for k in PROBE_DETAILS if _finite(mean.get(k))}


def capacity_metrics(
    probes: Sequence[Mapping[str, Any]], capacity: float | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The windows and mean metrics of a capacity search: those of its highest passing probe (of its
    lowest-rate probe when none passed), with ``capacity`` (that rate, or 0), ``capacity_tokens_per_s``
    (output tokens/s there, or 0), ``capacity_probes`` and ``capacity_failed_rate`` (the lowest failing
    rate). ``capacity``: the search's own (:attr:`CapacitySearch.capacity`, which a majority of draws or
    an estimate decides); the metrics are then those of the highest passing probe at or below it (the
    lowest passing one when none is)."""
    if not probes:
        raise ValueError("a capacity search without a probe")
    passing = [p for p in probes if p["passed"]]
    failed = [float(p["rate"]) for p in probes if not p["passed"]]
    if capacity is not None and capacity <= 0:
        passing = []
    elif capacity is not None and passing:
        below = [p for p in passing if float(p["rate"]) <= capacity * (1.0 + 1e-9)]
        passing = below or [min(passing, key=lambda p: p["rate"])]
    at = max(passing, key=lambda p: p["rate"]) if passing else min(probes, key=lambda p: p["rate"])
    tokens = float(at["mean"].get("tokens_per_s", math.nan)) if passing else 0.0
    found = float(at["rate"]) if passing else 0.0
    mean = {
        **at["mean"],
        "capacity": found if capacity is None else float(capacity),
        "capacity_tokens_per_s": tokens,
        "capacity_probes": len(probes),
        "capacity_failed_rate": min(failed, default=math.nan),
    }
    return [dict(w) for w in at["windows"]], mean


# ---- noise -----------------------------------------------------------------------------------------------
def noise_record(
    capacities: Sequence[float], tokens_per_s: Sequence[float], config: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """The study's ``kvtune.noise``: the baseline's capacity measured ``len(capacities)`` times; ``spread``
    is (max − min) / median, and ``threshold`` (the larger of the spread and the search granularity) is the
    relative difference below which two capacities are called equal ("within noise")."""
    median = statistics.median(capacities)
    spread = (max(capacities) - min(capacities)) / median if median > 0 else math.inf
    granularity = float(extra.get("granularity", CAPACITY_GRANULARITY))
    return {
        "capacities": [float(c) for c in capacities],
        "tokens_per_s": [float(t) for t in tokens_per_s],
        "median": median,
        "spread": spread,
        "threshold": max(spread, granularity),
        "repeats": len(capacities),
        "config": dict(config),
        **extra,
    }


def within_noise(a: float, b: float, threshold: float) -> bool:
    """Whether two capacities differ by less than ``threshold`` of the larger (noise's ``threshold``)."""
    top = max(abs(a), abs(b))
    return top == 0 or abs(a - b) / top < threshold


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
