"""Which Triton kernels build the sparse tier's table, and the split selection's plan (plain Python)."""

from __future__ import annotations

import pytest

from kvtune.kernels.sparse_table_choice import (
    CHUNK,
    DEFAULT_SELECT,
    MERGE_KEYS_MIN,
    ONE_WARP_SPANS,
    SelectOptions,
    SplitPlan,
    build_spans,
    max_splits,
    merge_width,
    select_kernel,
    split_plan,
)
from kvtune.kernels.triton_common import next_pow2

SPLIT = SelectOptions(split=True)


@pytest.mark.parametrize(
    ("k_blocks", "head_dim", "options", "kernel"),
    [
        (32, 128, None, "single"),  # rows unknown: the single kernel
        (32, 128, DEFAULT_SELECT, "single"),
        (32, 128, SPLIT, "split"),
        (1, 64, SPLIT, "split"),
        (0, 128, SPLIT, "single"),  # nothing to select: the single kernel writes the L1 table
        (32, 48, SPLIT, None),  # a head dim the kernels do not tile: the reference
        (32, 48, None, None),
    ],
)
def test_select_kernel(
    k_blocks: int, head_dim: int, options: SelectOptions | None, kernel: str | None
) -> None:
    assert select_kernel(k_blocks, head_dim, options) == kernel


@pytest.mark.parametrize(
    ("rows", "sms", "options", "kernel"),
    [
        (32, 132, None, "split"),  # 4 x 128K, 8 KV heads, on an H200: the split selection was faster
        (66, 132, None, "split"),
        (67, 132, None, "single"),
        (128, 132, None, "single"),  # 16 x 32K: the single kernel was faster
        (32, 132, SelectOptions(split=False), "single"),
        (128, 132, SPLIT, "split"),
        (0, 132, None, "single"),
    ],
)
def test_the_default_splits_where_rows_are_few(
    rows: int, sms: int, options: SelectOptions | None, kernel: str
) -> None:
    assert select_kernel(32, 128, options, rows, sms) == kernel


@pytest.mark.parametrize(
    ("rows", "kernel"),
    [(32, "split"), (128, "split"), (132, "split"), (133, "single"), (512, "single"), (0, "single")],
)
def test_from_the_summary_the_default_splits_up_to_a_row_a_multiprocessor(rows: int, kernel: str) -> None:
    """From the e4m3 summary the split selection also takes 16 x 32K (128 rows on 132 multiprocessors)."""
    assert select_kernel(32, 128, None, rows, 132, summary=True) == kernel


def test_from_the_summary_spans_have_two_warps_and_at_most_512_keys() -> None:
    assert DEFAULT_SELECT.span_warps(False) == 1 and DEFAULT_SELECT.span_warps(True) == 2
    assert SelectOptions(warps=4).span_warps(True) == 4
    assert max_splits(32) == 32 and max_splits(32, summary=True) == 16
    assert split_plan(32, 2047, 32, 132, SPLIT, summary=True) == SplitPlan(16, 2 * CHUNK)  # 4 x 128K
    assert split_plan(128, 511, 32, 132, SPLIT, summary=True) == SplitPlan(8, CHUNK)  # 16 x 32K


def test_from_the_summary_rows_of_few_spans_get_one_warp_spans() -> None:
    """16 x 32K plans 8 spans a row (one warp each), 4 x 128K 16 (two); from fp16 always one; warps as set."""
    assert DEFAULT_SELECT.span_warps(True, ONE_WARP_SPANS) == 1
    assert DEFAULT_SELECT.span_warps(True, 1) == 1
    assert DEFAULT_SELECT.span_warps(True, ONE_WARP_SPANS + 1) == 2
    assert DEFAULT_SELECT.span_warps(True) == 2  # the plan not known
    assert DEFAULT_SELECT.span_warps(False, 32) == 1 and DEFAULT_SELECT.span_warps(False, 4) == 1
    assert SelectOptions(warps=4).span_warps(True, 2) == 4


@pytest.mark.parametrize(
    ("k_blocks", "splits", "width"),
    [(32, 8, 256), (32, 16, 512), (32, 32, 1024), (32, 1, 256), (32, 3, 256), (32, 9, 512), (100, 8, 1024),
     (300, 2, 1024), (2000, 1, 2048), (8, 4, 256)],
)  # fmt: skip
def test_the_merge_ranks_the_spans_keys_rounded_up(k_blocks: int, splits: int, width: int) -> None:
    """As many keys as the spans hold, a power of two, 256 at least; never more than before (the most
    spans a row may have times their keys), so a plan's merge never grows."""
    got = merge_width(k_blocks, splits)
    assert got == width and got >= splits * next_pow2(k_blocks)
    if splits <= max_splits(k_blocks):
        assert got <= max(MERGE_KEYS_MIN, max_splits(k_blocks) * next_pow2(k_blocks))


# (rows, row width, k_blocks, multiprocessors, options) -> plan
PLANS = [
    ((128, 511, 32, 132, SPLIT), SplitPlan(8, CHUNK)),  # 16 x 32K, 8 KV heads: 9 wanted, one per chunk
    ((32, 2047, 32, 132, SPLIT), SplitPlan(32, CHUNK)),  # 4 x 128K: 33 wanted, 32 at most (1,024 keys)
    ((8, 2047, 32, 132, SPLIT), SplitPlan(32, CHUNK)),
    ((128, 9, 32, 132, SPLIT), SplitPlan(1, CHUNK)),  # one chunk per row: one span
    ((1024, 511, 32, 132, SPLIT), SplitPlan(2, 4 * CHUNK)),  # rows enough for the card
    ((4, 2047, 100, 132, SPLIT), SplitPlan(8, 256)),  # top 100 (128 keys per span): 8 spans at most
    ((4, 2047, 300, 132, SPLIT), SplitPlan(2, 1024)),
    (
        (128, 511, 32, 132, SelectOptions(split=True, programs_per_sm=4)),
        SplitPlan(4, 128),
    ),  # 5 wanted: 2 chunks each
    ((128, 511, 32, 132, SelectOptions(split=True, splits=2)), SplitPlan(2, 256)),
    ((6, 70, 8, 4, SPLIT), SplitPlan(2, CHUNK)),  # a CPU plans with 4 multiprocessors
    ((0, 0, 8, 4, SPLIT), SplitPlan(1, CHUNK)),
]


@pytest.mark.parametrize(("args", "plan"), PLANS, ids=str)
def test_split_plan(args: tuple, plan: SplitPlan) -> None:
    got = split_plan(*args)
    assert got == plan
    width, k_blocks = args[1:3]
    assert got.span % CHUNK == 0 and (got.splits - 1) * got.span < max(width, 1) <= got.splits * got.span
    assert got.splits <= max_splits(k_blocks)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [("programs_per_sm", 0, "programs_per_sm >= 1"), ("splits", 0, "splits >= 1"),
     ("maxnreg", 16, "32 <= maxnreg <= 255"), ("maxnreg", 300, "32 <= maxnreg <= 255"),
     ("warps", 3, r"warps in \(1, 2, 4, 8, 16\)"), ("chunk", 128, r"chunk in \(16, 32, 64\)")],
)  # fmt: skip
def test_select_options_are_checked(field: str, value: int, rule: str) -> None:
    with pytest.raises(ValueError, match=f"`{rule}`.*{field}={value}"):
        SelectOptions(**{field: value})


@pytest.mark.parametrize(
    ("k_blocks", "summary", "spans"),
    [(32, True, [1, 9]), (32, False, [1, 9, 17]), (8, True, [1, 9, 33]), (300, False, [1, 2]),
     (100, False, [1, 3, 5])],
)  # fmt: skip
def test_a_warm_up_launches_every_build_a_plan_may_give(k_blocks: int, summary: bool, spans: list) -> None:
    """Every span count a plan may give (1 .. max_splits) maps to a build one of these counts launches."""
    got = build_spans(k_blocks, summary)
    assert got == spans
    builds = {(DEFAULT_SELECT.span_warps(summary, s), merge_width(k_blocks, s)) for s in got}
    assert len(builds) == len(got)
    for s in range(1, max_splits(k_blocks, summary) + 1):
        assert (DEFAULT_SELECT.span_warps(summary, s), merge_width(k_blocks, s)) in builds
