"""Serving traces: read, sample, fit to a model, and turn into token ids.

Two formats are read, told apart by content:

- Mooncake / vLLM ``timed_trace`` JSON Lines: one request per line, ``{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}`` (``hash_ids`` optional; one id per 512-token prefix block; equal
  ids mean equal tokens).
- Azure LLM inference CSV: header ``TIMESTAMP,ContextTokens,GeneratedTokens``, absolute wall-clock timestamps
  with up to 7 fractional digits, CRLF or LF line endings.

Arrival times are re-based so that the first request of a trace (and of every sample) arrives at 0 ms. A
broken line raises :class:`TraceError` with ``file:line: reason``; an empty or unreadable file raises it with
``file: reason``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

TRACE_BLOCK_TOKENS = 512
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
Policy = Literal["clip", "drop"]
POLICIES: tuple[str, ...] = get_args(Policy)
TraceFormat = Literal["mooncake", "azure"]
_HASH_DOMAIN = 0x6B76_0001  # seeds of hash-id blocks
_UNIQUE_DOMAIN = 0x6B76_0002  # seeds of per-request unique tokens


class TraceError(ValueError):
    """A trace file is unreadable, empty, or has a broken line."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    ``arrival_ms`` is relative to the first request of its trace or sample. ``hash_ids[i]`` names the tokens
    of prefix block ``i`` (``block_tokens`` tokens each, the last block possibly partial); ``None`` when the
    trace has no prefix information (each such prompt gets tokens of its own).
    """

    rid: int
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class SampleInfo:
    """How a :class:`Trace` was cut from its file (recorded with the sample)."""

    n: int | None
    window_ms: float | None
    seed: int
    start_fraction: float
    end_fraction: float
    first_index: int
    offset_ms: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, the first at 0 ms."""

    path: str
    format: TraceFormat
    requests: tuple[Request, ...]
    sample_info: SampleInfo | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def duration_ms(self) -> float:
        """Arrival time of the last request (the first is at 0)."""
        return self.requests[-1].arrival_ms if self.requests else 0.0

    def sample(
        self,
        n: int | None = None,
        window_ms: float | None = None,
        seed: int = 0,
        start_fraction: float = 0.0,
        end_fraction: float = 1.0,
    ) -> Trace:
        """A contiguous run of requests, re-based to start at 0 ms.

        Only requests arriving in ``[start_fraction, end_fraction)`` of the trace's duration are eligible (a
        later range serves as a held-out validation window). Within it, ``seed`` picks where the run starts;
        the run spans ``window_ms`` of arrivals and/or ``n`` requests (both: the first ``n`` of the window).
        With neither, the whole range is returned. Contiguity keeps the arrival pattern and the prefix sharing
        of the trace.
        """
        _check_sample_args(n, window_ms, start_fraction, end_fraction)
        pool = self._eligible(start_fraction, end_fraction)
        first = _pick_start(pool, n, window_ms, seed)
        chosen = _take_run(pool[first:], n, window_ms)
        if not chosen:
            raise ValueError(
                f"{self.path}: no request arrives in [{start_fraction}, {end_fraction}) of the trace's "
                f"{self.duration_ms:.0f} ms"
            )
        offset = chosen[0].arrival_ms
        rebased = tuple(dataclasses.replace(r, arrival_ms=r.arrival_ms - offset) for r in chosen)
        first_index = self.requests.index(chosen[0])
        info = SampleInfo(n, window_ms, seed, start_fraction, end_fraction, first_index, offset)
        return Trace(self.path, self.format, rebased, info)

    def _eligible(self, start_fraction: float, end_fraction: float) -> list[Request]:
        lo, hi = start_fraction * self.duration_ms, end_fraction * self.duration_ms
        return [
            r
            for r in self.requests
            if lo <= r.arrival_ms < hi or (end_fraction == 1.0 and r.arrival_ms == hi)
        ]


def _check_sample_args(n: int | None, window_ms: float | None, start: float, end: float) -> None:
    if n is not None and n < 1:
        raise ValueError(f"`n >= 1` must hold, but got n={n}")
    if window_ms is not None and not window_ms > 0:
        raise ValueError(f"`window_ms > 0` must hold, but got window_ms={window_ms}")
    if not 0.0 <= start < end <= 1.0:
        raise ValueError(
            f"`0 <= start_fraction < end_fraction <= 1` must hold, but got start_fraction={start}, "
            f"end_fraction={end}"
        )


def _pick_start(pool: list[Request], n: int | None, window_ms: float | None, seed: int) -> int:
    """Index in ``pool`` where a seeded run starts, so that the run fits in the pool when it can."""
    if not pool or (n is None and window_ms is None):
        return 0
    if window_ms is not None:
        last_start = pool[-1].arrival_ms - window_ms
        candidates = [i for i, r in enumerate(pool) if r.arrival_ms <= last_start] or [0]
    else:
        candidates = list(range(max(1, len(pool) - (n or 0) + 1)))
    return candidates[int(np.random.default_rng(seed).integers(len(candidates)))]


def _take_run(pool: list[Request], n: int | None, window_ms: float | None) -> list[Request]:
    if window_ms is not None and pool:
        end = pool[0].arrival_ms + window_ms
        pool = [r for r in pool if r.arrival_ms < end]
    return pool[:n] if n is not None else pool


# ---------------------------------------------------------------------------------------------- reading


def read_trace(path: str | Path) -> Trace:
    """Read a Mooncake/vLLM JSONL or an Azure CSV trace (told apart by the first line)."""
    name = str(path)
    lines = _read_lines(name)
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise TraceError(f"{name}: empty trace file (expected Mooncake JSON Lines or an Azure CSV)")
    if first.lstrip().startswith("{"):
        return _rebase(Trace(name, "mooncake", tuple(_parse_jsonl(name, lines))))
    if first.strip().upper().startswith("TIMESTAMP"):
        return _rebase(Trace(name, "azure", tuple(_parse_azure(name, lines))))
    raise TraceError(
        f"{name}:1: unrecognized trace format "
        f"(expected a JSON object per line or the CSV header {AZURE_HEADER!r})"
    )


def _read_lines(name: str) -> list[str]:
    try:
        with open(name, encoding="utf-8", newline="") as f:
            return [line.rstrip("\r\n") for line in f]
    except OSError as e:
        raise TraceError(f"{name}: cannot read the trace file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{name}: not a UTF-8 text file (byte {e.start}): expected a trace") from None


def _rebase(trace: Trace) -> Trace:
    if not trace.requests:
        raise TraceError(f"{trace.path}: the trace holds no request")
    t0 = trace.requests[0].arrival_ms
    return dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, arrival_ms=r.arrival_ms - t0) for r in trace.requests)
    )


def _numbered(lines: Sequence[str], skip: int = 0) -> Iterator[tuple[int, str]]:
    for i, line in enumerate(lines[skip:], start=skip + 1):
        if line.strip():
            yield i, line


def _parse_jsonl(name: str, lines: Sequence[str]) -> Iterator[Request]:
    previous = -math.inf
    for rid, (lineno, line) in enumerate(_numbered(lines)):
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        request = _mooncake_request(where, rid, obj)
        previous = _check_order(where, previous, request.arrival_ms)
        yield request


def _mooncake_request(where: str, rid: int, obj: dict[str, Any]) -> Request:
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
    if missing:
        raise TraceError(
            f"{where}: missing key(s) {missing} (expected timestamp, input_length, output_length)"
        )
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise TraceError(f"{where}: timestamp must be a finite number of milliseconds, got {ts!r}")
    inp = _positive_int(where, "input_length", obj["input_length"])
    out = _positive_int(where, "output_length", obj["output_length"])
    return Request(rid, float(ts), inp, out, _hash_ids(where, obj.get("hash_ids")))


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, str):
        value = value.strip()
        if value.isdigit():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _hash_ids(where: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in value)
    if not ok:
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {str(value)[:60]}")
    return tuple(value)


def _check_order(where: str, previous: float, current: float) -> float:
    if current < previous:
        raise TraceError(
            f"{where}: timestamp {current:g} is earlier than the previous line's {previous:g} "
            "(requests must be sorted by arrival)"
        )
    return current


def _parse_azure(name: str, lines: Sequence[str]) -> Iterator[Request]:
    header_line = next(i for i, line in enumerate(lines) if line.strip())
    header = lines[header_line].strip()
    if header.replace(" ", "") != AZURE_HEADER:
        raise TraceError(f"{name}:{header_line + 1}: expected the header {AZURE_HEADER!r}, got {header!r}")
    start: datetime | None = None
    previous = -math.inf
    for rid, (lineno, line) in enumerate(_numbered(lines, skip=header_line + 1)):
        where = f"{name}:{lineno}"
        stamp, inp, out = _azure_fields(where, line)
        start = start or stamp
        request = Request(rid, (stamp - start).total_seconds() * 1000.0, inp, out)
        previous = _check_order(where, previous, request.arrival_ms)
        yield request


def _azure_fields(where: str, line: str) -> tuple[datetime, int, int]:
    fields = line.split(",")
    if len(fields) != 3:
        raise TraceError(f"{where}: expected 3 comma-separated fields ({AZURE_HEADER}), got {len(fields)}")
    try:
        stamp = datetime.fromisoformat(fields[0].strip())
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP {fields[0]!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'"
        ) from None
    return (
        stamp,
        _positive_int(where, "ContextTokens", fields[1]),
        _positive_int(where, "GeneratedTokens", fields[2]),
    )


# ---------------------------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class LengthCounts:
    """What :meth:`LengthPolicy.apply` did: requests seen, shortened by ``cap``, clipped, dropped."""

    total: int
    capped: int
    clipped: int
    dropped: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LengthPolicy:
    """Fit request lengths to a model (and to a CPU's patience).

    Applied per request, in order: (1) ``scale``: input, output and the trace's prefix block size are
    multiplied by ``scale`` and rounded (at least 1 token), so prefix sharing survives; (2) ``cap``: a
    sequence longer than ``cap`` tokens (prompt + output) is shortened to ``cap``; (3) the model's context
    ``max_context``: a longer sequence is clipped (``"clip"``) or dropped (``"drop"``). Shortening keeps the
    output, ``min(output, limit - 1)`` tokens, and cuts the prompt's tail (and its ``hash_ids``) to ``limit -
    output``.
    """

    max_context: int
    policy: Policy = "clip"
    scale: float = 1.0
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError(f"`max_context >= 2` must hold, but got max_context={self.max_context}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, but got policy={self.policy!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"`scale > 0` must hold, but got scale={self.scale}")
        if self.cap is not None and self.cap < 2:
            raise ValueError(f"`cap is None or cap >= 2` must hold, but got cap={self.cap}")

    def apply(self, requests: Iterable[Request]) -> tuple[list[Request], LengthCounts]:
        """Requests fitted to this policy (dropped ones removed) and the counts of what changed."""
        kept: list[Request] = []
        total = capped = clipped = dropped = 0
        for request in requests:
            total += 1
            r = self._scaled(request)
            if self.cap is not None and _length(r) > self.cap:
                r, capped = _shorten(r, self.cap), capped + 1
            if _length(r) > self.max_context:
                if self.policy == "drop":
                    dropped += 1
                    continue
                r, clipped = _shorten(r, self.max_context), clipped + 1
            kept.append(r)
        return kept, LengthCounts(total, capped, clipped, dropped)

    def _scaled(self, r: Request) -> Request:
        if self.scale == 1.0:
            return r
        scale = lambda n: max(1, round(n * self.scale))
        return dataclasses.replace(
            r,
            input_length=scale(r.input_length),
            output_length=scale(r.output_length),
            block_tokens=scale(r.block_tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _length(r: Request) -> int:
    return r.input_length + r.output_length


def _shorten(r: Request, limit: int) -> Request:
    out = min(r.output_length, limit - 1)
    inp = min(r.input_length, limit - out)
    ids = None if r.hash_ids is None else r.hash_ids[: math.ceil(inp / r.block_tokens)]
    return dataclasses.replace(r, input_length=inp, output_length=out, hash_ids=ids)


# ---------------------------------------------------------------------------------------------- token ids


def prompt_token_ids(request: Request, vocab_size: int, block_tokens: int | None = None) -> list[int]:
    """Deterministic prompt token ids, ``input_length`` of them.

    Block ``i`` (``block_tokens`` tokens, default ``request.block_tokens``) is drawn from an RNG seeded by
    ``hash_ids[i]`` alone, so equal hash ids give equal tokens and shared prefixes are really shared. Tokens
    not covered by ``hash_ids`` (or all of them, without hash ids) come from an RNG seeded by the request id:
    unique per request. Ids are drawn from ``[low, vocab_size)`` with ``low = min(256, vocab_size // 4)``,
    clear of the low ids where tokenizers keep special tokens.
    """
    bt = request.block_tokens if block_tokens is None else block_tokens
    if bt < 1 or vocab_size < 2:
        raise ValueError(f"`block_tokens >= 1 and vocab_size >= 2` must hold, got {bt}, {vocab_size}")
    low = min(256, vocab_size // 4)
    n = request.input_length
    parts = [_block_tokens((_HASH_DOMAIN, h), bt, low, vocab_size) for h in (request.hash_ids or ())]
    ids = np.concatenate([*parts, np.empty(0, dtype=np.int64)])[:n]
    if len(ids) < n:
        rest = _block_tokens((_UNIQUE_DOMAIN, request.rid), n - len(ids), low, vocab_size)
        ids = np.concatenate([ids, rest])
    return [int(t) for t in ids]


def _block_tokens(seed: tuple[int, int], count: int, low: int, high: int) -> np.ndarray:
    """``count`` int64 ids in ``[low, high)`` from an RNG seeded by ``seed`` (hash ids may be negative)."""
    words = [seed[0], seed[1] & 0xFFFF_FFFF_FFFF_FFFF]
    return np.random.default_rng(words).integers(low, high, size=count, dtype=np.int64)
