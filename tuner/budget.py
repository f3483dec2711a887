"""The study's time budget: ``--time-budget`` bounds the whole run, and the driver plans its split.

The budget starts when the run starts, so it covers the baseline's measurements (the calibration, the unloaded
replay, the baseline's capacity searches), the search, validation and the export. Once the baseline is
measured the plan knows what a capacity search of it costs on one worker near its answer (its later searches)
and what setting up a config's cache again costs (its first probe's set-up), and from that what validation's
first repeats will cost: each repeat is a search per side, a round of repeats runs one repeat per worker,
every search starts near a capacity already measured (the baseline's first from the window prior, the others
near what the study or the first round found) and sets its config's cache up again, the best config's first
search takes :data:`FIRST_SEARCH` times a near one (its held-out capacity is only expected), a probe of the
best config costs what its trial's probes cost against the baseline's (``best_scale``, revised as the best
changes: a 4-bit config's took half the baseline's wall), and a probe of the held-out requests costs in
proportion to the root of their output tokens against the search windows'
(:func:`~kvtune.tuner.validation.probe_scale`). The search then starts no trial later than the budget's end
less that validation, one more trial (as long as the finished ones took), and a margin for the export. The
plan is revised as trials finish (:meth:`BudgetPlan.observed`). Where less is left when validation starts (the
budget was spent before the search, and one trial per worker ran past it), validation plans fewer first
repeats than ``--repeats`` asked, down to three, the fewest whose interval a user can act on
(:meth:`BudgetPlan.first_repeats`; two repeats give an interval 12.7 standard errors wide). It repeats towards
its interval goal only while a round fits (:class:`~kvtune.tuner.validation.RepeatPlan`). What the budget cut
is stored with the validation (``budget``) and shown in the preset.

A near search is priced at three probes of the baseline's near searches' median probe
(:func:`~kvtune.tuner.job.near_search_s`; with mixed graphs of its first search's,
:func:`~kvtune.tuner.job.priced_searches`), not at their mean wall: on an H100 one of them took five probes,
which priced every search of validation at 35 s where three probes took 25, and left the search no time.
On an H200 (Llama-3.1-8B shape, 1 GiB, 96 requests of an unseen Azure window, six studies, runs 32-36,
``lab/scripts/budget_retro.py``) this plan puts validation at 180-277 s where it took 135-225 s; on an H100
(run 39e) at 251 s where it took 233 (priced at the mean wall, 335). Pricing every search as the baseline's
(runs 32-36) put it at 198-270 s, 25-33 s more where the best config was 4-bit; the plan before that, which
priced the first search as the baseline's cold one, every search's set-up as a new config's and reserved
1.25x, at 251-381 s.

For the fixed-rate objectives, which measure no baseline search, the plan keeps :data:`FIXED_RESERVE` of the
budget for validation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from kvtune.studies.names import MIN_REPEATS

EXPORT_S = 5.0  # writing the preset, stopping the workers
FIXED_RESERVE = 0.2  # the fixed-rate objectives: the budget's share kept for validation
MARGIN = 1.25  # a trial's estimate is multiplied by this before it is reserved
VALIDATION_MARGIN = 1.15  # validation's (module docstring: seven studies)
# The best config's first validation search against a near one: it starts from an expected capacity and took
# 3-11 probes, 6 at the median, where near searches took 3 (H200, eight studies, runs 30d-36c)
FIRST_SEARCH = 2.0


@dataclass(frozen=True)
class BudgetPlan:
    """The split of ``budget_s`` seconds from ``started`` (a monotonic time): ``search_s`` is one capacity
    search of the baseline on one worker (None: not measured, a fixed-rate objective), ``sides`` the
    searches of one validation repeat in its first round (``later``: in the rounds after it; None: as many),
    ``first`` validation's first repeats over ``workers`` workers."""

    budget_s: float
    started: float
    search_s: float | None
    sides: int = 2
    first: int = 3
    workers: int = 1
    later: int | None = None
    switch_s: float = 0.0  # setting up a new config's cache (a trial's first probe)
    trial_s: float | None = None  # a trial's wall as the finished ones took it (None: none finished yet)
    revisit_s: float | None = None  # a config's cache set up again, each validation search (None: switch_s)
    scale: float = 1.0  # a validation probe's cost against a search probe's (their output tokens)
    best_scale: float = 1.0  # a probe of the best config so far against one of the baseline (their walls)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ValueError(f"`budget_s > 0` must hold, but got budget_s={self.budget_s}")

    @property
    def end(self) -> float:
        """When validation must be done (the export's margin left)."""
        return self.started + self.budget_s - EXPORT_S

    def validation_s(self, first: int | None = None) -> float:
        """Validation's first repeats (``first``; None: the plan's), as estimated: every search near its
        answer (as the baseline's later searches, the best config's at ``best_scale`` of their probes' cost)
        with its config's set-up, the best config's first one :data:`FIRST_SEARCH` times as many probes,
        every probe at ``scale``."""
        if self.search_s is None:
            return FIXED_RESERVE * self.budget_s
        rounds = math.ceil((self.first if first is None else first) / self.workers)
        later = self.sides if self.later is None else self.later
        probes = self.search_s * self.scale
        best = probes * self.best_scale
        setup = self.switch_s if self.revisit_s is None else self.revisit_s
        # a repeat searches the best config once (given more than one side) and the baseline on the rest
        total = self.sides + (rounds - 1) * later
        bests = rounds if self.sides > 1 else 0
        searches = (total - bests) * (probes + setup) + bests * (best + setup)
        return VALIDATION_MARGIN * (searches + (FIRST_SEARCH - 1.0) * (best if bests else probes))

    def first_repeats(self, now: float | None = None) -> int:
        """Validation's first repeats when it starts at ``now``: the plan's, or where they do not fit before
        :attr:`end` the most that do, at least ``MIN_REPEATS`` (which may then run past it)."""
        now = time.monotonic() if now is None else now
        fewest = min(self.first, MIN_REPEATS)
        fit = [k for k in range(self.first, fewest - 1, -1) if now + self.validation_s(k) <= self.end]
        return fit[0] if fit else fewest

    def search_deadline(self) -> float:
        """The time after which no trial starts: validation and one more trial still fit (a trial as the
        finished ones took, else a search with its set-up)."""
        if self.trial_s is not None:
            trial = MARGIN * self.trial_s
        else:
            trial = 0.0 if self.search_s is None else MARGIN * (self.search_s + self.switch_s)
        return self.end - self.validation_s() - trial

    def observed(self, switch_s: float | None, trial_s: float | None) -> BudgetPlan:
        """The plan with what the run measured since: a config's set-up (``switch_s``) and a trial's wall
        (``trial_s``); None keeps the plan's."""
        return dataclasses.replace(
            self,
            switch_s=self.switch_s if switch_s is None else max(0.0, float(switch_s)),
            trial_s=self.trial_s if trial_s is None else max(0.0, float(trial_s)),
        )

    def describe(self, now: float | None = None) -> str:
        """One console line: time spent, and what each phase left has (about)."""
        now = time.monotonic() if now is None else now
        search = max(0.0, self.search_deadline() - now)
        return (
            f"time budget {self.budget_s:.0f} s: {now - self.started:.0f} s spent; search about {search:.0f} "
            f"s, validation about {self.validation_s():.0f} s, export {EXPORT_S:.0f} s"
        )


def budget_record(
    plan: BudgetPlan,
    phases: dict[str, float],
    finished: int,
    target: int,
    interval: dict[str, Any] | None,
    overran: bool = False,
) -> dict[str, Any]:
    """What the validation stores of the budget: its seconds, each phase's, and what it cut (``cut``: one
    line each, empty when nothing was); ``overran``: the budget was spent before the search, which ran one
    trial per worker past it (the least that gives a preset)."""
    cut = []
    if overran:
        cut.append(
            f"the budget was spent before the search ({phases.get('baseline_s', 0.0):.0f} s of "
            f"{plan.budget_s:.0f} s on the baseline): one trial per worker and validation ran past it"
        )
    if finished < target:
        cut.append(f"search: {finished} of {target} trials finished when the time budget ended it")
    if interval is not None and interval.get("first", plan.first) < plan.first:
        cut.append(f"validation: {interval['first']} first repeats instead of {plan.first}, the time left")
    if interval is not None and not interval.get("reached") and "time budget" in str(interval.get("why")):
        cut.append(f"validation: {interval['repeats']} repeats, {interval['why']}")
    return {"budget_s": plan.budget_s, "phases_s": dict(phases), "cut": cut}
