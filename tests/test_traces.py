"""Trace reading, sampling, length policy and deterministic token ids (on the excerpts in examples/traces)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvtune.engine.traces import (
    LengthPolicy,
    Request,
    Trace,
    TraceError,
    prompt_token_ids,
    read_trace,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "traces"
MOONCAKE = EXAMPLES / "mooncake_sample.jsonl"
AZURE = EXAMPLES / "azure_conv_sample.csv"
MOONCAKE_LINE = '{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [0, 1]}\n'
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return read_trace(MOONCAKE)


@pytest.fixture(scope="module")
def azure() -> Trace:
    return read_trace(AZURE)


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", newline="")
    return path


# ---------------------------------------------------------------------------------------------- reading


def test_mooncake_sample_is_read_and_rebased(mooncake: Trace) -> None:
    first = mooncake.requests[0]
    assert (mooncake.format, len(mooncake), first.arrival_ms) == ("mooncake", 200, 0.0)
    assert mooncake.duration_ms == 731999 - 669000
    assert (first.input_length, first.output_length, len(first.hash_ids or ())) == (10677, 328, 21)


def test_azure_sample_is_read_with_crlf_and_7_digit_fractions(azure: Trace) -> None:
    r0, r1 = azure.requests[:2]
    assert (azure.format, len(azure), r0.arrival_ms, r0.hash_ids) == ("azure", 200, 0.0, None)
    assert (r0.input_length, r0.output_length) == (374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900 (datetime keeps microseconds)
    assert r1.arrival_ms == pytest.approx(4314.579, abs=1e-3)


@pytest.mark.parametrize(
    ("name", "text", "length"),
    [
        pytest.param(
            "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10", 1, id="azure-no-final-newline"
        ),
        pytest.param(
            "a.csv", AZURE_HEADER.replace("\r\n", "\n") + "2023-11-16 18:17:03,4,1\n", 1, id="azure-lf"
        ),
        pytest.param("m.jsonl", MOONCAKE_LINE + "\n" + MOONCAKE_LINE, 2, id="mooncake-blank-line"),
        pytest.param(
            "m.jsonl", '{"timestamp": 1.5, "input_length": 3, "output_length": 1}', 1, id="no-hash-ids"
        ),
    ],
)
def test_small_variants_are_read(tmp_path: Path, name: str, text: str, length: int) -> None:
    assert len(read_trace(_write(tmp_path, name, text))) == length


BROKEN = [
    pytest.param("m.jsonl", MOONCAKE_LINE + "{not json\n", 2, "invalid JSON", id="bad-json"),
    pytest.param("m.jsonl", MOONCAKE_LINE + "[1, 2]\n", 2, "expected a JSON object", id="not-object"),
    pytest.param("m.jsonl", '{"timestamp": 0, "input_length": 5}\n', 1, "missing key", id="missing-key"),
    pytest.param(
        "m.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 1}', 1, "input_length", id="len0"
    ),
    pytest.param(
        "m.jsonl", '{"timestamp": 0, "input_length": 2.5, "output_length": 1}', 1, "integer", id="float"
    ),
    pytest.param(
        "m.jsonl", '{"timestamp": "x", "input_length": 2, "output_length": 1}', 1, "timestamp", id="ts"
    ),
    pytest.param(
        "m.jsonl",
        '{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": 3}',
        1,
        "hash_ids",
        id="ids",
    ),
    pytest.param(
        "m.jsonl",
        MOONCAKE_LINE + MOONCAKE_LINE.replace('"timestamp": 5', '"timestamp": 4'),
        2,
        "sorted",
        id="order",
    ),
    pytest.param(
        "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.9,4808\r\n", 2, "3 comma-separated", id="fields"
    ),
    pytest.param("a.csv", AZURE_HEADER + "yesterday,4808,10\r\n", 2, "TIMESTAMP", id="timestamp"),
    pytest.param("a.csv", AZURE_HEADER + "2023-11-16 18:17:03,-4,10\r\n", 2, "ContextTokens", id="negative"),
    pytest.param("a.csv", "TIMESTAMP,Context,Generated\r\n", 1, "expected the header", id="header"),
    pytest.param("x.txt", "hello\n", 1, "unrecognized trace format", id="format"),
]


@pytest.mark.parametrize(("name", "text", "line", "reason"), BROKEN)
def test_broken_line_names_file_line_and_reason(
    tmp_path: Path, name: str, text: str, line: int, reason: str
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:{line}: .*{re.escape(reason)}") as info:
        read_trace(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        pytest.param("empty.jsonl", "", "empty trace file", id="empty"),
        pytest.param("blank.jsonl", "\n \r\n", "empty trace file", id="blank"),
        pytest.param("header.csv", AZURE_HEADER, "no request", id="header-only"),
        pytest.param("bin.jsonl", b"\xff\xfe\x00garbage", "not a UTF-8", id="binary"),
        pytest.param("missing.jsonl", None, "cannot read", id="missing"),
    ],
)
def test_unreadable_file_gives_one_line(
    tmp_path: Path, name: str, content: str | bytes | None, reason: str
) -> None:
    path = tmp_path / name if content is None else _write(tmp_path, name, content)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}: .*{reason}"):
        read_trace(path)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path)


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("n", [1, 7, 200])
def test_sample_of_n_is_a_contiguous_rebased_run(mooncake: Trace, n: int) -> None:
    s = mooncake.sample(n=n, seed=3)
    rids = [r.rid for r in s]
    assert (len(s), s.requests[0].arrival_ms, rids) == (n, 0.0, list(range(rids[0], rids[0] + n)))
    assert s.sample_info is not None and s.sample_info.first_index == rids[0]


def test_sample_is_deterministic_per_seed(mooncake: Trace) -> None:
    assert mooncake.sample(n=20, seed=5) == mooncake.sample(n=20, seed=5)
    assert {mooncake.sample(n=20, seed=s).requests[0].rid for s in range(8)} != {0}


@pytest.mark.parametrize("window_ms", [1.0, 3000.0, 20000.5])
def test_window_sample_spans_less_than_the_window(azure: Trace, window_ms: float) -> None:
    s = azure.sample(window_ms=window_ms, seed=1)
    assert len(s) >= 1 and s.duration_ms < window_ms


def test_validation_window_is_disjoint_and_later(mooncake: Trace) -> None:
    tune = mooncake.sample(seed=0, end_fraction=0.7)
    held = mooncake.sample(seed=0, start_fraction=0.7)
    assert tune.sample_info is not None and held.sample_info is not None
    assert {r.rid for r in tune}.isdisjoint({r.rid for r in held})
    assert len(tune) + len(held) == len(mooncake)
    assert (
        held.sample_info.offset_ms
        >= 0.7 * mooncake.duration_ms
        > tune.sample_info.offset_ms + tune.duration_ms
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 0}, {"window_ms": 0.0}, {"start_fraction": 0.5, "end_fraction": 0.5}, {"end_fraction": 1.5}],
    ids=["n=0", "window=0", "empty-range", "end>1"],
)
def test_bad_sample_arguments(mooncake: Trace, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must hold"):
        mooncake.sample(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- lengths


def _req(inp: int, out: int, hash_ids: tuple[int, ...] | None = None) -> Request:
    return Request(0, 0.0, inp, out, hash_ids)


@pytest.mark.parametrize(
    ("policy", "request_", "expected", "counts"),
    [
        pytest.param(LengthPolicy(100), _req(50, 50), (50, 50), (1, 0, 0, 0), id="fits-exactly"),
        pytest.param(LengthPolicy(100), _req(95, 10), (90, 10), (1, 0, 1, 0), id="clip-prompt"),
        pytest.param(LengthPolicy(100), _req(5, 300), (1, 99), (1, 0, 1, 0), id="clip-output"),
        pytest.param(LengthPolicy(100, "drop"), _req(95, 10), None, (1, 0, 0, 1), id="drop"),
        pytest.param(LengthPolicy(8192, scale=0.25), _req(1000, 10), (250, 2), (1, 0, 0, 0), id="scale"),
        pytest.param(LengthPolicy(8192, cap=64), _req(100, 10), (54, 10), (1, 1, 0, 0), id="cap"),
    ],
)
def test_length_policy(
    policy: LengthPolicy, request_: Request, expected: tuple[int, int] | None, counts: tuple[int, ...]
) -> None:
    kept, c = policy.apply([request_])
    assert [(r.input_length, r.output_length) for r in kept] == ([] if expected is None else [expected])
    assert (c.total, c.capped, c.clipped, c.dropped) == counts


def test_clipping_cuts_hash_ids_and_scaling_scales_blocks() -> None:
    kept, _ = LengthPolicy(1100, scale=0.5).apply([_req(4000, 100, tuple(range(8)))])
    assert (kept[0].input_length, kept[0].block_tokens, kept[0].hash_ids) == (1050, 256, tuple(range(5)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_context": 1},
        {"max_context": 10, "policy": "trim"},
        {"max_context": 10, "scale": 0.0},
        {"max_context": 10, "cap": 1},
    ],
    ids=["context", "policy", "scale", "cap"],
)
def test_bad_length_policy(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must"):
        LengthPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_on_real_trace_counts_every_request(mooncake: Trace) -> None:
    kept, c = LengthPolicy(8192).apply(mooncake.requests)
    assert c.total == len(kept) == 200 and c.clipped > 0
    assert max(r.input_length + r.output_length for r in kept) == 8192


# ---------------------------------------------------------------------------------------------- token ids


def test_equal_hash_ids_give_equal_tokens() -> None:
    a = prompt_token_ids(Request(1, 0.0, 1200, 1, (7, 8, 9)), 1000)
    b = prompt_token_ids(Request(2, 0.0, 1100, 1, (7, 8, 4)), 1000)
    assert (len(a), len(b)) == (1200, 1100)
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]


def test_requests_without_hash_ids_get_unique_deterministic_tokens() -> None:
    a, b = Request(1, 0.0, 300, 1), Request(2, 0.0, 300, 1)
    assert prompt_token_ids(a, 1000) == prompt_token_ids(a, 1000) != prompt_token_ids(b, 1000)


@pytest.mark.parametrize(("vocab_size", "low"), [(2, 0), (512, 128), (49152, 256)])
def test_token_ids_stay_in_range(vocab_size: int, low: int) -> None:
    ids = prompt_token_ids(Request(0, 0.0, 2000, 1, (1, 2)), vocab_size)
    assert min(ids) >= low and max(ids) < vocab_size


def test_sharing_survives_scaling(mooncake: Trace) -> None:
    kept, _ = LengthPolicy(4096, scale=1 / 16).apply(mooncake.requests[:2])
    a, b = (prompt_token_ids(r, 512) for r in kept)
    shared = kept[0].block_tokens  # both start with hash id 0 and differ afterwards
    assert kept[0].hash_ids[:1] == kept[1].hash_ids[:1] == (0,)  # type: ignore[index]
    assert a[:shared] == b[:shared] and a[shared : 2 * shared] != b[shared : 2 * shared]


def test_short_hash_ids_are_filled_with_unique_tokens() -> None:
    r = dataclasses.replace(_req(1000, 1, (5,)), rid=9)
    ids = prompt_token_ids(r, 1000)
    assert len(ids) == 1000 and ids[:512] == prompt_token_ids(_req(512, 1, (5,)), 1000)
