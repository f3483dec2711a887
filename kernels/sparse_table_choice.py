"""Which Triton kernels build the sparse tier's table, and how the split Quest selection is planned.

Plain Python (no Triton import), like :mod:`kvtune.kernels.decode_choice`: the dispatcher
(:func:`kvtune.kernels.sparse_table.sparse_block_table`) asks :func:`select_kernel`, and the split launcher
(:func:`kvtune.kernels.triton_sparse_split.sparse_block_table_split_triton`) plans with :func:`split_plan`.

* ``"single"``: one launch, one program per (sequence, KV head) that splits the row, scores every L2 block
  of it and keeps the top-k (:mod:`kvtune.kernels.triton_sparse_table`).
* ``"split"``: the row's positions are cut into ``splits`` spans of ``span`` positions; one program per
  (span, sequence, KV head) scores the span's L2 blocks and keeps its own top-k keys, one more per (sequence,
  KV head) writes the L1 blocks, the counts and the padding; a second launch merges the spans' keys into
  the row's top-k (:mod:`kvtune.kernels.triton_sparse_split`). Same table, same order, same ties.

Both order the selected blocks by decreasing bound; of blocks with equal bounds the one later in the row
(newer) comes first, and is kept where the k-th place falls among them
(:func:`kvtune.kernels.quest_ref.quest_topk_ref`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvtune.kernels.triton_common import cdiv, next_pow2, tileable_head_dim

SelectKernel = Literal["single", "split"]
CHUNK = 64  # L2 positions a program scores at a time (the kernels' ``MB``)
MERGE_KEYS = 1024  # the most spans a row may have, as keys: splits x next_pow2(k_blocks) (32 spans at top 32)
MERGE_KEYS_SUMMARY = 512  # the same from the e4m3 summary (16 spans at top 32: two-warp spans)
MERGE_KEYS_MIN = 256  # the merge's narrowest build (merge_width)
SPAN_WARPS = 1  # a span program's warps from the fp16 bounds (SelectOptions.warps None)
SPAN_WARPS_SUMMARY = 2  # and from the e4m3 summary, where a row has more than ONE_WARP_SPANS spans
ONE_WARP_SPANS = 8  # from the e4m3 summary, rows of at most this many spans get one-warp spans


@dataclass(frozen=True)
class SelectOptions:
    """How the Triton kernels select the L2 blocks of the sparse tier's table.

    split: score each row's L2 blocks with several programs, then merge their top-k in a second launch
        (``"split"`` of :func:`select_kernel`); None: where the rows are few for the card (:func:`few_rows`:
        on an H200, 32 rows took 32 µs split against 53 µs single, 128 rows 31 µs against 23 µs;
        ``benchmarks/decode_attention.py --quest``), and from the e4m3 summary where they are at most one
        a multiprocessor (:func:`select_kernel`); True / False: always / never.
    programs_per_sm: the split plan aims at this many scoring programs per multiprocessor (8 one-warp
        programs: two warps a scheduler).
    maxnreg: register cap per thread of the span kernel (None: the compiler's choice, 185 at one warp, head
        dim 128 and top 32, no spills; at 8 warps 128 lets two programs share a multiprocessor).
    splits: scoring programs per row (None: planned by :func:`split_plan`; tests and sweeps set it).
    warps: warps of a span's program (None: :data:`SPAN_WARPS` from the fp16 bounds; from the e4m3 summary
        one where the plan gives a row at most :data:`ONE_WARP_SPANS` spans, else :data:`SPAN_WARPS_SUMMARY`:
        on an H100 SXM at 16 x 32K, 8 spans a row, 13.9 µs with one-warp spans and a 256-key merge against
        14.8 with two-warp spans and 512 keys, and at 4 x 128K, 16 spans, 18.5 against 17.0;
        ``lab/scripts/select_warps.py``, run 62a). Few warps: a program meets no other warp until
        the merge, and issues about a quarter fewer instructions a block at one warp than at 8 (sm_90
        SASS). On an H100 SXM, top 2,048 (``lab/scripts/select_warps.py``, run 52a), fp16 / e4m3 bounds:
        at 4 x 128K 19.7 / 17.7 µs with 32 one-warp spans a row (1,024-key merge), 22.5 / 17.0 with 16
        two-warp spans (512 keys), 26.6 / 18.2 with 8 spans of 8 warps and 64 blocks a step; at 16 x 32K
        (8 spans a row) 20.6 / 16.2 with one warp and 1,024 keys, 18.7 / **14.9** with two warps and 512
        keys, against 18.4 / 16.8 single.
    chunk: L2 positions a span's program scores at a time, a power of two dividing :data:`CHUNK`.
    merge_l1_ahead: where the merge also splits the table by bits, it loads its first step of L1 ids and
        their bits before its top-k network (whose instructions then hide the bits' round trip) instead of
        after it. The same outputs; not yet timed on a GPU, so off (``lab/scripts/select_warps.py``'s
        variants ending in ``pa`` time it).
    """

    split: bool | None = None
    programs_per_sm: int = 8
    maxnreg: int | None = None
    splits: int | None = None
    warps: int | None = None
    chunk: int = 16
    merge_l1_ahead: bool = False

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1:
            raise ValueError(
                f"`programs_per_sm >= 1` must hold, but got programs_per_sm={self.programs_per_sm}"
            )
        if self.maxnreg is not None and not 32 <= self.maxnreg <= 255:
            raise ValueError(f"`32 <= maxnreg <= 255` must hold (or None), but got maxnreg={self.maxnreg}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"`splits >= 1` must hold (or None: planned), but got splits={self.splits}")
        if self.warps not in (None, 1, 2, 4, 8, 16):
            raise ValueError(f"`warps in (1, 2, 4, 8, 16)` must hold (or None), but got warps={self.warps}")
        if self.chunk not in (16, 32, 64):
            raise ValueError(f"`chunk in (16, 32, 64)` must hold, but got chunk={self.chunk}")

    def span_warps(self, summary: bool, splits: int = 0) -> int:
        """The span programs' warps: as set, else by the bounds read and the plan's ``splits`` spans a row
        (0: not known; see ``warps``)."""
        if self.warps is not None:
            return self.warps
        if not summary:
            return SPAN_WARPS
        return 1 if 0 < splits <= ONE_WARP_SPANS else SPAN_WARPS_SUMMARY


DEFAULT_SELECT = SelectOptions()


class SplitPlan(NamedTuple):
    """A split launch: ``splits`` spans of ``span`` row positions (a multiple of :data:`CHUNK`) per row."""

    splits: int
    span: int


def merge_keys(summary: bool = False) -> int:
    """Keys the merge ranks at once (its build's width): :data:`MERGE_KEYS`, or
    :data:`MERGE_KEYS_SUMMARY` from the e4m3 summary (a separate build either way)."""
    return MERGE_KEYS_SUMMARY if summary else MERGE_KEYS


def max_splits(k_blocks: int, summary: bool = False) -> int:
    """The most spans a row may have: the merge ranks ``splits x next_pow2(k_blocks)`` keys at once."""
    return max(1, merge_keys(summary) // next_pow2(k_blocks))


def merge_width(k_blocks: int, splits: int) -> int:
    """Keys the merge ranks at once for ``splits`` spans of ``next_pow2(k_blocks)`` keys each: their number
    rounded up to a power of two, :data:`MERGE_KEYS_MIN` at least (at most :func:`merge_keys` where
    ``splits`` is at most :func:`max_splits`). A build per width: a narrower merge where the plan gives a
    row few spans (16 x 32K from the e4m3 summary: 8 spans at top 32, 256 keys against 512)."""
    return max(MERGE_KEYS_MIN, next_pow2(splits * next_pow2(k_blocks)))


def build_spans(k_blocks: int, summary: bool = False, options: SelectOptions = DEFAULT_SELECT) -> list[int]:
    """A span count for each build the split selection may launch at top ``k_blocks`` (the spans' warps and
    the merge's width both follow a row's spans: :meth:`SelectOptions.span_warps`, :func:`merge_width`), the
    fewest spans first: what a warm-up launches, each with ``splits`` forced, so that no step compiles one
    (from the e4m3 summary at top 32: 1 and 9; from fp16: 1, 9 and 17)."""
    builds: dict[tuple[int, int], int] = {}
    for spans in range(1, max_splits(k_blocks, summary) + 1):
        builds.setdefault((options.span_warps(summary, spans), merge_width(k_blocks, spans)), spans)
    return list(builds.values())


def split_plan(
    rows: int, width: int, k_blocks: int, sms: int, options: SelectOptions, summary: bool = False
) -> SplitPlan:
    """Spans per row for ``rows`` (sequence, KV head) rows of ``width`` positions on ``sms``
    multiprocessors: about ``options.programs_per_sm`` scoring programs per multiprocessor, at least one
    chunk per span, at most :func:`max_splits` (from the e4m3 summary where ``summary``). Depends on sizes
    only (no data): capturable."""
    chunks = max(1, cdiv(width, CHUNK))
    wanted = options.splits or cdiv(options.programs_per_sm * sms, max(rows, 1))
    splits = max(1, min(wanted, chunks, max_splits(k_blocks, summary)))
    span = cdiv(chunks, splits) * CHUNK
    return SplitPlan(cdiv(chunks * CHUNK, span), span)


def few_rows(rows: int, sms: int) -> bool:
    """Whether ``rows`` (sequence, KV head) rows leave most of ``sms`` multiprocessors idle under the
    single-program kernel (one program per row): at most one row per two multiprocessors."""
    return 0 < 2 * rows <= sms


def select_kernel(
    k_blocks: int,
    head_dim: int,
    options: SelectOptions | None = None,
    rows: int = 0,
    sms: int = 0,
    summary: bool = False,
) -> SelectKernel | None:
    """The Triton kernels that build the table, None where the reference must (a head dim the kernels do
    not tile). ``"split"`` where there is something to select (``k_blocks > 0``) and the options ask for it
    (None: :data:`DEFAULT_SELECT`; ``split`` None: where :func:`few_rows` holds for ``rows`` on ``sms``
    multiprocessors, unknown sizes 0, and from the e4m3 summary (``summary``) where the rows are at most
    one a multiprocessor: on an H100 SXM at 16 x 32K, 128 rows, 14.9 µs split against 16.8 single from the
    summary, 18.7 against 18.4 from fp16; run 52a)."""
    if not tileable_head_dim(head_dim):
        return None
    opts = DEFAULT_SELECT if options is None else options
    wide = few_rows(rows, sms) or (summary and 0 < rows <= sms)
    split = wide if opts.split is None else opts.split
    return "split" if split and k_blocks > 0 else "single"
