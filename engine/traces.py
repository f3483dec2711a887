"""Serving traces: read, sample, fit to a model, and turn into token ids.

Two formats are read, told apart by content:

- Mooncake / vLLM ``timed_trace`` JSON Lines: one request per line, ``{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}`` (``hash_ids`` optional; one id per 512-token prefix block; equal
  ids mean equal tokens).
- Azure LLM inference CSV: header ``TIMESTAMP,ContextTokens,GeneratedTokens``, absolute wall-clock timestamps
  with up to 7 fractional digits, CRLF or LF line endings.

A trace file is read in one streaming pass into columns (:class:`TraceFile`: arrival times, lengths and, for
JSON Lines, where each line starts in the file, 32 bytes per request), every line checked; the requests of a
sample (:class:`Trace`) are made from their lines only when the sample is taken, so a trace of millions of
lines costs tens of MB, not one Python object per request. Arrival times are re-based so that the first
request of a trace (and of every sample) arrives at 0 ms. A broken line raises :class:`TraceError` with
``file:line: reason``; an empty or unreadable file raises it with ``file: reason``. A length above
:data:`MAX_REQUEST_TOKENS` (beyond any model's context) is a broken line, not a request to clip.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

import numpy as np

from kvtune.cache_impl.config import shown

TRACE_BLOCK_TOKENS = 512
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
# A request length above this is refused when the trace is read: no model's context comes near 16.8 M tokens,
# so such a line is a broken trace (bytes for tokens, a unit error), and clipping it would replay something
# the trace never held.
MAX_REQUEST_TOKENS = 1 << 24
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
    trace has no prefix information (each such prompt gets tokens of its own). ``shortened``: a
    :class:`LengthPolicy` cut this request (to its cap or to the model's context), so a replay counts it.
    """

    rid: int
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = TRACE_BLOCK_TOKENS
    shortened: bool = False


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
    """Requests sorted by arrival, the first at 0 ms (a sample of a :class:`TraceFile`, or requests given)."""

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
        """A contiguous run of requests, re-based to start at 0 ms (see :meth:`TraceFile.sample`)."""
        arrivals = np.fromiter((r.arrival_ms for r in self.requests), dtype=np.float64, count=len(self))
        first, stop = _sample_range(arrivals, n, window_ms, seed, start_fraction, end_fraction, self.path)
        info = SampleInfo(n, window_ms, seed, start_fraction, end_fraction, first, 0.0)
        return _rebased_sample(self.path, self.format, self.requests[first:stop], info)


class TraceFile:
    """A trace as read from its file: one row per request, in columns (see the module docstring).

    ``arrival_ms``, ``input_length`` and ``output_length`` are numpy arrays (the first arrival is 0);
    ``offsets`` holds where each JSON line starts in the file, from which :meth:`take` re-reads only the
    requests a sample needs (their hash ids included). The file must not change while it is in use: a
    changed size or modification time is an error, not a silent mix of two traces.
    """

    def __init__(
        self,
        path: str,
        format: TraceFormat,
        arrival_ms: np.ndarray,
        input_length: np.ndarray,
        output_length: np.ndarray,
        offsets: np.ndarray | None,
        stamp: tuple[int, int],
    ) -> None:
        self.path, self.format = path, format
        self.arrival_ms, self.input_length, self.output_length = arrival_ms, input_length, output_length
        self.offsets, self._stamp = offsets, stamp

    def __len__(self) -> int:
        return len(self.arrival_ms)

    def __iter__(self) -> Iterator[Request]:
        for lo in range(0, len(self), 4096):
            yield from self.take(lo, min(lo + 4096, len(self)))

    def __repr__(self) -> str:
        return f"TraceFile({self.path!r}, {self.format}, {len(self)} requests)"

    @property
    def requests(self) -> tuple[Request, ...]:
        """Every request as an object (small traces; a sample takes only what it needs)."""
        return self.take(0, len(self))

    @property
    def duration_ms(self) -> float:
        return float(self.arrival_ms[-1]) if len(self) else 0.0

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
        first, stop = _sample_range(
            self.arrival_ms, n, window_ms, seed, start_fraction, end_fraction, self.path
        )
        info = SampleInfo(n, window_ms, seed, start_fraction, end_fraction, first, 0.0)
        return _rebased_sample(self.path, self.format, self.take(first, stop), info)

    def take(self, start: int, stop: int) -> tuple[Request, ...]:
        """Requests ``start`` to ``stop - 1`` as objects (JSON lines are read again for their hash ids)."""
        rows = range(max(0, start), min(stop, len(self)))
        if self.offsets is None:
            return tuple(
                Request(i, float(self.arrival_ms[i]), int(self.input_length[i]), int(self.output_length[i]))
                for i in rows
            )
        try:
            if _file_stamp(self.path) != self._stamp:
                raise TraceError(f"{self.path}: the trace file changed since it was read; read it again")
            with open(self.path, "rb") as f:
                return tuple(self._reread(f, i) for i in rows)
        except OSError as e:
            raise TraceError(f"{self.path}: cannot read the trace file again: {e.strerror or e}") from None

    def _reread(self, f: BinaryIO, i: int) -> Request:
        f.seek(int(self.offsets[i]))  # type: ignore[index]
        line = f.readline().split(b"\r", 1)[0].decode("utf-8")
        request = _mooncake_request(f"{self.path}:row {i + 1}", i, _json_object(self.path, line))
        return dataclasses.replace(request, arrival_ms=float(self.arrival_ms[i]))


def _file_stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _rebased_sample(path: str, fmt: TraceFormat, chosen: Sequence[Request], info: SampleInfo) -> Trace:
    offset = chosen[0].arrival_ms
    rebased = tuple(dataclasses.replace(r, arrival_ms=r.arrival_ms - offset) for r in chosen)
    return Trace(path, fmt, rebased, dataclasses.replace(info, offset_ms=offset))


def _sample_range(
    arrivals: np.ndarray,
    n: int | None,
    window_ms: float | None,
    seed: int,
    start: float,
    end: float,
    path: str,
) -> tuple[int, int]:
    """Rows ``[first, stop)`` of the sample (arrivals sorted, the first at 0): the requests arriving in
    ``[start, end)`` of the duration (the last one included when ``end`` is 1) are the pool; ``seed`` picks
    where the run starts so that it fits in the pool when it can."""
    _check_sample_args(n, window_ms, start, end)
    duration = float(arrivals[-1]) if len(arrivals) else 0.0
    lo, hi = start * duration, end * duration
    pool_lo = int(np.searchsorted(arrivals, lo, side="left"))
    pool_hi = int(np.searchsorted(arrivals, hi, side="right" if end == 1.0 else "left"))
    size = max(0, pool_hi - pool_lo)
    if size == 0:
        raise ValueError(f"{path}: no request arrives in [{start}, {end}) of the trace's {duration:.0f} ms")
    pool = arrivals[pool_lo:pool_hi]
    first = 0
    if window_ms is not None:
        last_start = float(pool[-1]) - window_ms
        count = int(np.searchsorted(pool, last_start, side="right")) or 1
        first = int(np.random.default_rng(seed).integers(count))
    elif n is not None:
        first = int(np.random.default_rng(seed).integers(max(1, size - n + 1)))
    stop = size
    if window_ms is not None:
        stop = first + int(np.searchsorted(pool[first:], float(pool[first]) + window_ms, side="left"))
    if n is not None:
        stop = min(stop, first + n)
    return pool_lo + first, pool_lo + stop


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


# ---------------------------------------------------------------------------------------------- reading


def read_trace(path: str | Path) -> TraceFile:
    """Read a Mooncake/vLLM JSONL or an Azure CSV trace (told apart by the first line) in one pass."""
    name = str(path)
    try:
        with open(name, "rb") as f:
            stamp = _file_stamp(name)
            lines = _lines(name, f)
            first = next(lines, None)
            if first is None:
                raise TraceError(f"{name}: empty trace file (expected Mooncake JSON Lines or an Azure CSV)")
            if first[2].lstrip().startswith("{"):
                return _read_jsonl(name, first, lines, stamp)
            if first[2].strip().upper().startswith("TIMESTAMP"):
                return _read_azure(name, first, lines, stamp)
    except OSError as e:
        raise TraceError(f"{name}: cannot read the trace file: {e.strerror or e}") from None
    raise TraceError(
        f"{name}:1: unrecognized trace format "
        f"(expected a JSON object per line or the CSV header {AZURE_HEADER!r})"
    )


def _lines(name: str, f: BinaryIO) -> Iterator[tuple[int, int, str]]:
    """``(line number, byte offset, text)`` of every non-blank line; lines end with LF, CRLF or CR (as
    Python's universal newlines count them)."""
    lineno, offset = 0, 0
    for raw in f:
        body = raw[:-1] if raw.endswith(b"\n") else raw
        parts = body.split(b"\r")
        if len(parts) > 1 and not parts[-1]:
            parts.pop()  # a CRLF ending
        position, offset = offset, offset + len(raw)
        for part in parts:
            lineno += 1
            if part.strip():
                try:
                    text = part.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TraceError(
                        f"{name}: not a UTF-8 text file (byte {position + e.start}): expected a trace"
                    ) from None
                yield lineno, position, text
            position += len(part) + 1


class _Columns:
    """Growing typed columns (8 bytes a value): what one request of a trace costs while it is read."""

    def __init__(self, offsets: bool) -> None:
        self.arrival, self.inp, self.out = array("d"), array("q"), array("q")
        self.offsets = array("q") if offsets else None

    def add(self, arrival: float, inp: int, out: int, offset: int = 0) -> None:
        self.arrival.append(arrival)
        self.inp.append(inp)
        self.out.append(out)
        if self.offsets is not None:
            self.offsets.append(offset)

    def trace(self, name: str, fmt: TraceFormat, stamp: tuple[int, int]) -> TraceFile:
        if not self.arrival:
            raise TraceError(f"{name}: the trace holds no request")
        arrival = np.frombuffer(self.arrival, dtype=np.float64).copy()
        arrival -= arrival[0]
        offsets = None if self.offsets is None else np.frombuffer(self.offsets, dtype=np.int64).copy()
        inp, out = (np.frombuffer(c, dtype=np.int64).copy() for c in (self.inp, self.out))
        return TraceFile(name, fmt, arrival, inp, out, offsets, stamp)


def _read_jsonl(
    name: str, first: tuple[int, int, str], lines: Iterator[tuple[int, int, str]], stamp: tuple[int, int]
) -> TraceFile:
    columns, previous = _Columns(offsets=True), -math.inf
    for rid, (lineno, offset, line) in enumerate(itertools.chain([first], lines)):
        where = f"{name}:{lineno}"
        request = _mooncake_request(where, rid, _json_object(where, line))
        previous = _check_order(where, previous, request.arrival_ms)
        columns.add(request.arrival_ms, request.input_length, request.output_length, offset)
    return columns.trace(name, "mooncake", stamp)


def _json_object(where: str, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: invalid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _mooncake_request(where: str, rid: int, obj: dict[str, Any]) -> Request:
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
    if missing:
        raise TraceError(
            f"{where}: missing key(s) {missing} (expected timestamp, input_length, output_length)"
        )
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise TraceError(f"{where}: timestamp must be a finite number of milliseconds, got {shown(ts)}")
    inp = _positive_int(where, "input_length", obj["input_length"])
    out = _positive_int(where, "output_length", obj["output_length"])
    return Request(rid, float(ts), inp, out, _hash_ids(where, obj.get("hash_ids")))


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, str):
        value = value.strip()
        if value.isascii() and value.isdigit():  # "²" is a digit to str.isdigit, not to int()
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key} must be an integer >= 1, got {shown(value)}")
    if value > MAX_REQUEST_TOKENS:
        raise TraceError(
            f"{where}: {key} {value} is beyond any model's context (at most {MAX_REQUEST_TOKENS} tokens are "
            "read): not a request length; is the trace in tokens?"
        )
    return value


def _hash_ids(where: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in value)
    if not ok:
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {shown(value)}")
    return tuple(value)


def _check_order(where: str, previous: float, current: float) -> float:
    if current < previous:
        raise TraceError(
            f"{where}: timestamp {current:g} is earlier than the previous line's {previous:g} "
            "(requests must be sorted by arrival)"
        )
    return current


def _read_azure(
    name: str, first: tuple[int, int, str], lines: Iterator[tuple[int, int, str]], stamp: tuple[int, int]
) -> TraceFile:
    header_line, _, header = first
    if header.strip().replace(" ", "") != AZURE_HEADER:
        raise TraceError(
            f"{name}:{header_line}: expected the header {AZURE_HEADER!r}, got {header.strip()!r}"
        )
    columns, start, previous = _Columns(offsets=False), None, -math.inf
    for lineno, _, line in lines:
        where = f"{name}:{lineno}"
        stamp_, inp, out = _azure_fields(where, line)
        start = start or stamp_
        arrival = (stamp_ - start).total_seconds() * 1000.0
        previous = _check_order(where, previous, arrival)
        columns.add(arrival, inp, out)
    return columns.trace(name, "azure", stamp)


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


MOSTLY_SHORTENED = 0.5  # above this share of a sample shortened, a study or a replay warns


@dataclass(frozen=True)
class LengthCounts:
    """What :meth:`LengthPolicy.apply` did: requests seen, shortened by ``cap``, clipped to the context,
    dropped; ``shortened``: requests kept that a length policy cut (this one, or one applied before, such as
    a study's cap before the engine's own fit), each counted once: what a replay reports as ``clipped``."""

    total: int
    capped: int
    clipped: int
    dropped: int
    shortened: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def mostly_shortened(self) -> bool:
        return self.total > 0 and self.shortened > MOSTLY_SHORTENED * self.total

    def describe(self, cap: int | None, max_context: int) -> str:
        """``"5 of 8 shortened (3 to the cap of 192 tokens, 2 to the context of 8192)"``."""
        why = [f"{self.capped} to the cap of {cap} tokens"] if self.capped else []
        why += [f"{self.clipped} to the model's context of {max_context}"] if self.clipped else []
        why += [f"{self.dropped} dropped"] if self.dropped else []
        return f"{self.shortened} of {self.total} shortened" + (f" ({', '.join(why)})" if why else "")


@dataclass(frozen=True)
class LengthPolicy:
    """Fit request lengths to a model (and to a CPU's patience).

    Applied per request, in order: (1) ``scale``: input, output and the trace's prefix block size are
    multiplied by ``scale`` and rounded (at least 1 token), so prefix sharing survives; (2) ``cap``: a
    sequence longer than ``cap`` tokens (prompt + output) is shortened to ``cap``; (3) the model's context
    ``max_context``: a longer sequence is clipped (``"clip"``) or dropped (``"drop"``). Shortening keeps the
    output, ``min(output, limit - 1)`` tokens, and cuts the prompt's tail (and its ``hash_ids``) to ``limit -
    output``; the request is marked ``shortened`` and counted (a replay reports it as ``clipped``). Lengths
    beyond any context never get here: the trace reader refuses them (:data:`MAX_REQUEST_TOKENS`).
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
        shortened = sum(1 for r in kept if r.shortened)
        return kept, LengthCounts(total, capped, clipped, dropped, shortened)

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
    return dataclasses.replace(r, input_length=inp, output_length=out, hash_ids=ids, shortened=True)


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
