"""The workload of a study: replay windows cut from a trace, and a later window held out for validation.

The search uses ``windows × requests`` consecutive requests from the first :data:`SEARCH_FRACTION` of the
trace's duration (the seed picks where they start), split into ``windows`` windows that every trial replays in
the same order, so per-window results compare across trials and a pruner can stop a bad trial early.
Validation
uses ``requests`` requests from the rest of the trace, never seen by the search. Lengths are fitted to the
model's context and, on a CPU, scaled by ``length_scale`` and capped at ``length_cap``: a request cut by the
cap or the context is marked ``shortened``, counted (:meth:`WorkloadSample.length_counts`; every replay
reports it as ``clipped``), and a study warns when most of a sample is cut (:func:`length_warnings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.engine.traces import LengthCounts, LengthPolicy, Request, Trace, TraceFile, read_trace

SEARCH_FRACTION = 0.75
AnyTrace = Trace | TraceFile


@dataclass(frozen=True)
class WorkloadSample:
    """How requests are drawn from the trace at ``path``."""

    path: str
    requests: int
    windows: int
    seed: int
    length_scale: float = 1.0
    length_cap: int | None = None

    def __post_init__(self) -> None:
        if self.requests < 2:
            raise ValueError(f"`requests >= 2` must hold, but got requests={self.requests}")
        if self.windows < 1:
            raise ValueError(f"`windows >= 1` must hold, but got windows={self.windows}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "search_fraction": SEARCH_FRACTION}

    def policy(self, max_context: int) -> LengthPolicy:
        return LengthPolicy(max_context, "clip", self.length_scale, self.length_cap)

    def search_requests(self, trace: AnyTrace, max_context: int) -> tuple[Request, ...]:
        """The ``windows × requests`` requests of the search, fitted, in one run from 0 ms (calibration)."""
        fitted, _ = self.policy(max_context).apply(self._search_cut(trace).requests)
        return rebase(fitted)

    def _search_cut(self, trace: AnyTrace) -> Trace:
        return trace.sample(n=self.windows * self.requests, seed=self.seed, end_fraction=SEARCH_FRACTION)

    def _validation_cut(self, trace: AnyTrace) -> Trace:
        return trace.sample(n=self.requests, seed=self.seed, start_fraction=SEARCH_FRACTION)

    def length_counts(self, trace: AnyTrace, max_context: int) -> dict[str, LengthCounts]:
        """What fitting did to the search requests and to the held-out ones (``shortened`` of ``total``)."""
        policy = self.policy(max_context)
        return {
            "search": policy.apply(self._search_cut(trace).requests)[1],
            "validation": policy.apply(self._validation_cut(trace).requests)[1],
        }

    def search_windows(self, trace: AnyTrace, max_context: int) -> tuple[tuple[Request, ...], ...]:
        """``windows`` windows of ``requests`` requests each, every window re-based to arrive from 0 ms."""
        fitted = self.search_requests(trace, max_context)
        chunks = [fitted[i * self.requests : (i + 1) * self.requests] for i in range(self.windows)]
        if len(fitted) < self.windows * self.requests or any(len(c) < 2 for c in chunks):
            raise ValueError(
                f"{self.path}: the first {SEARCH_FRACTION:.0%} of the trace holds {len(fitted)} requests, "
                f"fewer than --windows {self.windows} x --requests {self.requests}; lower them"
            )
        return tuple(rebase(c) for c in chunks)

    def validation_requests(self, trace: AnyTrace, max_context: int) -> tuple[Request, ...]:
        """``requests`` requests from the held-out end of the trace."""
        fitted, _ = self.policy(max_context).apply(self._validation_cut(trace).requests)
        if len(fitted) < 2:
            raise ValueError(f"{self.path}: the held-out end of the trace has fewer than 2 requests")
        return rebase(fitted)


def rebase(requests: list[Request] | tuple[Request, ...]) -> tuple[Request, ...]:
    first = requests[0].arrival_ms
    return tuple(dataclasses.replace(r, arrival_ms=r.arrival_ms - first) for r in requests)


def length_warnings(counts: dict[str, LengthCounts], cap: int | None, max_context: int) -> tuple[str, ...]:
    """One warning per sample (search, validation) of which most requests were cut to fit."""
    return tuple(
        f"{name} sample: {c.describe(cap, max_context)}: most of it was cut, so the replay measures shorter "
        "requests than the trace's; raise --length-cap or lower --length-scale to keep their shape"
        for name, c in counts.items()
        if c.mostly_shortened
    )


def load_trace(path: str | Path) -> TraceFile:
    """Read the trace, with a one-line error when the file is missing."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"--workload {p}: a directory, not a trace file (name the file in it)")
    if not p.is_file():
        raise FileNotFoundError(f"--workload {p}: no such trace file")
    return read_trace(p)
