"""The workload of a study: replay windows cut from a trace, and a later window held out for validation.

The search uses ``windows × requests`` consecutive requests from the first :data:`SEARCH_FRACTION` of the
trace's duration (the seed picks where they start), split into ``windows`` windows that every trial replays in
the same order, so per-window results compare across trials and a pruner can stop a bad trial early.
Validation
uses ``requests`` requests from the rest of the trace, never seen by the search. Lengths are fitted to the
model's context (clipped, and counted) and, on a CPU, scaled by ``length_scale`` and capped at ``length_cap``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.cache_impl.traces import LengthPolicy, Request, Trace, read_trace

SEARCH_FRACTION = 0.75


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

    def search_requests(self, trace: Trace, max_context: int) -> tuple[Request, ...]:
        """The ``windows × requests`` requests of the search, fitted, in one run from 0 ms (calibration)."""
        cut = trace.sample(n=self.windows * self.requests, seed=self.seed, end_fraction=SEARCH_FRACTION)
        fitted, _ = self.policy(max_context).apply(cut.requests)
        return rebase(fitted)

    def search_windows(self, trace: Trace, max_context: int) -> tuple[tuple[Request, ...], ...]:
        """``windows`` windows of ``requests`` requests each, every window re-based to arrive from 0 ms."""
        fitted = self.search_requests(trace, max_context)
        chunks = [fitted[i * self.requests : (i + 1) * self.requests] for i in range(self.windows)]
        if any(len(c) < 2 for c in chunks):
            raise ValueError(
                f"{self.path}: the first {SEARCH_FRACTION:.0%} of the trace holds {len(fitted)} requests, "
                f"fewer than --windows {self.windows} x --requests {self.requests}; lower them"
            )
        return tuple(rebase(c) for c in chunks)

    def validation_requests(self, trace: Trace, max_context: int) -> tuple[Request, ...]:
        """``requests`` requests from the held-out end of the trace."""
        cut = trace.sample(n=self.requests, seed=self.seed, start_fraction=SEARCH_FRACTION)
        fitted, _ = self.policy(max_context).apply(cut.requests)
        if len(fitted) < 2:
            raise ValueError(f"{self.path}: the held-out end of the trace has fewer than 2 requests")
        return rebase(fitted)


def rebase(requests: list[Request] | tuple[Request, ...]) -> tuple[Request, ...]:
    first = requests[0].arrival_ms
    return tuple(dataclasses.replace(r, arrival_ms=r.arrival_ms - first) for r in requests)


def load_trace(path: str | Path) -> Trace:
    """Read the trace, with a one-line error when the file is missing."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--workload {p}: no such trace file")
    return read_trace(p)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
