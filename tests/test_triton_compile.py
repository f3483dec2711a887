"""Every Triton kernel compiles for Hopper (sm_90), with the arguments its launcher really passes, on a
machine without a GPU (:mod:`kvtune.kernels.aot`).

Each case calls a public launcher on CPU tensors of Llama-3-8B / SmolLM2 decode shapes with the launches
recorded, not run; each is specialized as Triton's JIT would and lowered to a sm_90 cubin with the launch's
``num_warps``/``num_stages``/``maxnreg``. A kernel the interpreter accepts but the compiler rejects (or whose
inline assembly ``ptxas`` refuses) fails here, in CI, not on the GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from kvtune.kernels.aot import compile_launch, record_launches, specialization, target_of  # noqa: E402
from kvtune.kernels.arch import ARCHS  # noqa: E402
from kvtune.kernels.layout import ColdLayout, ColdPool  # noqa: E402
from kvtune.tests.triton_testlib import INTERPRETING  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRETING, reason="kernels defined under the interpreter do not compile")


# ---- the launches: CPU tensors of real decode shapes
def _pool(
    bits: int, heads: int = 8, d: int = 128, bs: int = 64, demotable: bool = True, summary: bool = False
) -> ColdPool:
    pool = ColdLayout(bs, heads, d, bits, torch.bfloat16, summary=summary).allocate(40, "cpu")
    pool.may_demote = demotable
    return pool


def _decode(
    bits: int,
    demotable: bool,
    heads: int = 8,
    group: int = 4,
    d: int = 128,
    b: int = 3,
    m: int = 9,
    bs: int = 64,
    kernel: str | None = None,
    arch: Any = None,
    **options: Any,
) -> Callable[[], Any]:
    """b sequences of m cold blocks; ``options``: a variant of the bits' default ``DecodeKernelOptions`` (the
    byte values, say); ``kernel``: the launcher's choice of kernel, where given; ``arch``: the architecture
    the launcher plans for (None: sm_90, a CPU device's)."""
    from dataclasses import replace

    from kvtune.kernels.triton_decode import PURE_INT8, default_options, hybrid_decode_attention_triton

    base = PURE_INT8 if bits == 8 and not demotable else default_options(bits)
    opts = replace(base, **options) if options else None

    pool = _pool(bits, heads, d, bs, demotable=demotable)
    hot = torch.zeros(max(4, b), heads, 96, d, dtype=torch.bfloat16)
    table = torch.arange(b * heads * m, dtype=torch.int32).view(b, heads, m) % 40
    return lambda: hybrid_decode_attention_triton(
        torch.zeros(b, heads * group, d, dtype=torch.bfloat16), hot, hot.clone(),
        torch.arange(b, dtype=torch.int32), torch.full((b,), 40, dtype=torch.int32), pool, table,
        torch.full((b, heads), m, dtype=torch.int32), 1 / math.sqrt(d), options=opts, kernel=kernel,
        arch=arch,
    )  # fmt: skip


def _gluon(bits: int, heads: int = 8, group: int = 4, d: int = 128, bs: int = 64, b: int = 3,
           m: int = 9, stages: int = 2, tma: bool = False) -> Callable[[], Any]:  # fmt: skip
    """The launches with the Gluon cold kernel: it takes CUDA tensors only, so the launcher is told it
    applies (every other condition of ``gluon_decode.supported`` holds for these pools); ``tma``: its ring
    filled by tensor copies (``gluon_tma``)."""
    return _decode(bits, demotable=False, heads=heads, group=group, d=d, b=b, m=m, bs=bs, kernel="gluon",
                   gluon=True, gluon_stages=stages, gluon_tma=tma)  # fmt: skip


def _gluon_mixed(d: int = 128, bs: int = 64, b: int = 3, m: int = 9, stages: int = 3, heads: int = 8,
                 group: int = 4, arch: Any = None, overlap: bool = False, builds: str | None = None,
                 stages4: int = 0, tma: bool = False, after: bool = False) -> Callable[[], Any]:  # fmt: skip
    """The launches of the mixed Gluon path (an 8-bit pool with demoted blocks: the partition kernel, the
    8-bit and the 4-bit builds, the merge); the launcher is told it applies, as for ``_gluon``;
    ``overlap``: the 4-bit build beside the 8-bit one (``gluon_overlap``, two launches); ``builds``: how
    the builds launch (``gluon_builds``; None: the default), with a 4-bit ring of ``stages4``; ``tma``: the
    rings filled by tensor copies (``gluon_tma``); ``after``: the builds launched as programmatic dependents
    of the launch before (``gluon_after_select``)."""
    ways = {"gluon_builds": "two" if overlap else builds} if overlap or builds else {}
    return _decode(8, demotable=True, heads=heads, group=group, d=d, b=b, m=m, bs=bs, kernel="gluon_mixed",
                   arch=arch, gluon_mixed=True, gluon_stages=stages, gluon_overlap=overlap,
                   gluon_stages4=stages4, gluon_tma=tma, gluon_after_select=after, **ways)  # fmt: skip


def _partition(b: int = 3, m: int = 9, heads: int = 8) -> Callable[[], Any]:
    from kvtune.kernels.triton_bits_partition import partition_by_bits_triton

    table = (torch.arange(b * heads * m, dtype=torch.int32) % 40).view(b, heads, m)
    count = torch.full((b, heads), m, dtype=torch.int32)
    return lambda: partition_by_bits_triton(table, count, _pool(8).block_bits)


def _quest(bits: int, b: int = 2, m: int = 9) -> Callable[[], Any]:
    from kvtune.kernels.triton_quest import quest_scores_triton

    table = (torch.arange(b * m, dtype=torch.int32) % 40).view(b, m)
    count = torch.full((b,), m, dtype=torch.int32)
    q = torch.zeros(b, 32, 128, dtype=torch.bfloat16)
    return lambda: quest_scores_triton(q, _pool(bits), table, count)


def _seal(
    pool_bits: int, bits: int, from_hot_zones: bool = False, summary: bool = False
) -> Callable[[], Any]:
    """The seal's launch; ``summary``: the pool keeps the e4m3 key bounds, which the kernel writes too."""
    from kvtune.kernels.triton_quant import seal_blocks_triton

    pool = _pool(pool_bits, summary=summary)
    if from_hot_zones:  # the cache's path: block i read in place from hot zone rows[i]
        zones = torch.zeros(2, 6, 8, 96, 128, dtype=torch.bfloat16)[:, :, :, :64].transpose(2, 3)
        rows = torch.tensor([4, 0, 2])
        return lambda: seal_blocks_triton(pool, torch.arange(3), zones[0], zones[1], bits, rows)
    kv = torch.zeros(2, 5, 64, 8, 128, dtype=torch.bfloat16)
    return lambda: seal_blocks_triton(pool, torch.arange(5), kv[0], kv[1], bits)


def _pack(bits: int, heads: int = 8, d: int = 128, bs: int = 64) -> Callable[[], Any]:
    """A chunk layer's packing (:mod:`kvtune.kernels.chunk_kv`): rows of every kind, a Llama-3-8B shape."""
    from kvtune.kernels.triton_chunk_kv import pack_kv_triton

    hot = torch.zeros(2, 6, heads, bs + 32, d, dtype=torch.bfloat16)
    k = torch.zeros(300, heads, d, dtype=torch.bfloat16)
    kind = torch.arange(700) % 3
    return lambda: pack_kv_triton(_pool(bits, heads, d, bs), hot, k, k.clone(), kind, torch.arange(700),
                                  torch.bfloat16)  # fmt: skip


def _hot_write(rows: bool) -> Callable[[], Any]:
    from kvtune.kernels.triton_chunk_kv import hot_write_triton

    hot = torch.zeros(2, 6, 8, 96, 128, dtype=torch.bfloat16)
    k = torch.zeros(40, 8, 128, dtype=torch.bfloat16)
    which = torch.arange(5) if rows else None
    return lambda: hot_write_triton(hot, k, k.clone(), torch.arange(5), torch.arange(5), which)


def _requantize(summary: bool = False) -> Callable[[], Any]:
    from kvtune.kernels.triton_quant import requantize_int4_triton

    pool = _pool(8, summary=summary)
    return lambda: requantize_int4_triton(pool, torch.arange(5))


def _requantize_masked(summary: bool = False) -> Callable[[], Any]:
    from kvtune.kernels.triton_quant import requantize_int4_masked_triton

    pools = ColdLayout(64, 8, 128, 8, torch.bfloat16, summary=summary).allocate_layers(2, 40, "cpu")
    return lambda: requantize_int4_masked_triton(pools, torch.ones(2, 40, dtype=torch.bool))


def _elementwise(which: str) -> Callable[[], Any]:
    from kvtune.kernels import triton_elementwise as e

    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    cos = torch.zeros(16, 128)
    return {
        "add_rms_norm": lambda: e.add_rms_norm_triton(x, x.clone(), x[0].clone(), 1e-5),
        "rms_norm": lambda: e.add_rms_norm_triton(x, None, x[0].clone(), 1e-5),
        "rope_qkv": lambda: e.rope_qkv_triton(torch.zeros(16, 6144, dtype=torch.bfloat16), cos, cos, 32, 8),
        "silu_mul": lambda: e.silu_mul_triton(torch.zeros(16, 2 * 14336, dtype=torch.bfloat16)),
    }[which]


def _access(b: int = 3, m: int = 9, now_ms: float = 1234.5) -> Callable[[], Any]:
    from kvtune.kernels.triton_access import update_access_triton

    n, h = 100, 8
    last = torch.zeros(n, dtype=torch.float64)
    return lambda: update_access_triton(
        last, last.clone(), torch.zeros(b, h, m), torch.zeros(b, h, m, dtype=torch.int32),
        torch.full((b, h), m, dtype=torch.int32), now_ms, torch.zeros(n, dtype=torch.int32),
    )  # fmt: skip


def _sparse_table(b: int = 2, m: int = 9, bits: int = 8, demotable: bool = True, k_blocks: int = 4,
                  heads: int = 8, group: int = 4, d: int = 128, split: bool = False,
                  parts: bool = False, summary: bool = False,
                  l1_ahead: bool = False) -> Callable[[], Any]:  # fmt: skip
    """The sparse tier's table; ``split``: with the split Quest selection (the span and merge kernels);
    ``parts``: writing the table split by bits too, as the cache asks it to for an 8-bit pool with demoted
    blocks; ``summary``: Quest from the pool's e4m3 summary (sm_89 and newer); ``l1_ahead``: the merge's
    first L1 step loaded before its top-k network (``SelectOptions.merge_l1_ahead``)."""
    from kvtune.kernels.bits_partition_ref import empty_partition
    from kvtune.kernels.sparse_table import ByteCount
    from kvtune.kernels.sparse_table_choice import SelectOptions
    from kvtune.kernels.triton_sparse_split import sparse_block_table_split_triton
    from kvtune.kernels.triton_sparse_table import sparse_block_table_triton

    count = ByteCount(torch.zeros(9, dtype=torch.int64), 4096, torch.zeros((), dtype=torch.int64))
    blocks = (torch.arange(b * m) % 40).view(b, m)
    tier = torch.ones(40, dtype=torch.int8)
    q = torch.zeros(b, heads * group, d, dtype=torch.bfloat16)
    pool = _pool(bits, heads, d, demotable=demotable, summary=summary)
    if split:
        opts = SelectOptions(split=True, merge_l1_ahead=l1_ahead)
        out = empty_partition(b, heads, m + k_blocks, "cpu") if parts else None
        select = sparse_block_table_split_triton
        return lambda: select(q, pool, blocks, tier, k_blocks, count, opts, pool.summary, parts=out)
    return lambda: sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, pool.summary)


def _sparse_split(**kw: Any) -> Callable[[], Any]:
    return _sparse_table(split=True, **kw)


CASES: dict[str, Callable[[], Callable[[], Any]]] = {
    "decode int8 pure": lambda: _decode(8, demotable=False),
    "decode int8 mixed": lambda: _decode(8, demotable=True),
    "decode int4": lambda: _decode(4, demotable=False),
    "decode unquantized": lambda: _decode(0, demotable=False),
    "decode int8 smollm2 heads": lambda: _decode(8, demotable=False, heads=3, group=3, d=64),
    "decode int8 byte values": lambda: _decode(8, False, v_pairs=False),
    **{f"decode int{bits} gluon d{d} bs{bs}": (lambda bits=bits, d=d, bs=bs: _gluon(bits, d=d, bs=bs))
       for bits in (8, 4) for d in (64, 128) for bs in (16, 32, 64)},
    "decode int4 gluon smollm2 heads": lambda: _gluon(4, heads=3, group=3, d=64, bs=32),
    **{f"decode int{bits} gluon stages {s}": (lambda bits=bits, s=s: _gluon(bits, stages=s))
       for bits in (8, 4) for s in (0, 3)},
    **{f"decode int{bits} gluon tma d{d} bs{bs} stages {s}": (
        lambda bits=bits, d=d, bs=bs, s=s: _gluon(bits, d=d, bs=bs, stages=s, tma=True))
       for bits in (8, 4) for d, bs, s in ((128, 64, 2), (128, 64, 3), (64, 16, 2), (64, 32, 4))},
    "decode int4 gluon tma smollm2 heads": lambda: _gluon(4, heads=3, group=3, d=64, bs=32, tma=True),
    **{f"decode int8 gluon mixed d{d} bs{bs}": (lambda d=d, bs=bs: _gluon_mixed(d, bs))
       for d in (64, 128) for bs in (16, 32, 64)},
    "decode int8 gluon mixed smollm2 heads": lambda: _gluon_mixed(64, 32, heads=3, group=3),
    "decode int8 gluon mixed, builds overlapped": lambda: _gluon_mixed(overlap=True),
    **{f"decode int8 gluon mixed, builds {w}": (lambda w=w: _gluon_mixed(builds=w))
       for w in ("two", "paired", "by_id")},
    "decode int8 gluon mixed, one launch, 4-bit ring 4": lambda: _gluon_mixed(builds="paired", stages4=4),
    "decode int8 gluon mixed smollm2 heads, paired": lambda: _gluon_mixed(64, 32, heads=3, group=3,
                                                                          builds="paired"),
    **{f"decode int8 gluon mixed stages {s}": (lambda s=s: _gluon_mixed(stages=s)) for s in (0, 2)},
    **{f"decode int8 gluon mixed tma, builds {w}": (lambda w=w: _gluon_mixed(builds=w, tma=True))
       for w in ("two", "paired", "by_id")},
    "decode int8 gluon mixed tma d64 bs16": lambda: _gluon_mixed(64, 16, tma=True),
    **{f"decode int8 gluon mixed after the selection, builds {w}": (
        lambda w=w: _gluon_mixed(builds=w, after=True)) for w in ("two", "paired", "by_id")},
    "decode int8 gluon mixed tma after the selection": lambda: _gluon_mixed(tma=True, after=True),
    "decode int8 gluon mixed tma smollm2 heads": lambda: _gluon_mixed(64, 32, heads=3, group=3, tma=True),
    "bits partition": _partition,
    "bits partition 16 x 543": lambda: _partition(b=16, m=543),
    "quest int8": lambda: _quest(8),
    "quest int4": lambda: _quest(4),
    "quest unquantized": lambda: _quest(0),
    "seal int8": lambda: _seal(8, 8),
    "seal int4 in an 8-bit pool": lambda: _seal(8, 4),
    "seal int4": lambda: _seal(4, 4),
    "seal int8 from hot zones": lambda: _seal(8, 8, from_hot_zones=True),
    "seal unquantized": lambda: _seal(0, 0),
    "seal unquantized from hot zones": lambda: _seal(0, 0, from_hot_zones=True),
    "requantize": _requantize,
    "requantize masked": _requantize_masked,
    "pack int8": lambda: _pack(8),
    "pack int4": lambda: _pack(4),
    "pack unquantized": lambda: _pack(0),
    "pack int4 smollm2 heads": lambda: _pack(4, heads=3, d=64, bs=32),
    "hot write": lambda: _hot_write(False),
    "hot write from rows": lambda: _hot_write(True),
    **{n: (lambda n=n: _elementwise(n)) for n in ("add_rms_norm", "rms_norm", "rope_qkv", "silu_mul")},
    "access update": _access,
    "sparse table": _sparse_table,
    "sparse table int8 pure": lambda: _sparse_table(bits=8, demotable=False),
    "sparse table int4": lambda: _sparse_table(bits=4, demotable=False),
    "sparse table unquantized": lambda: _sparse_table(bits=0, demotable=False),
    "sparse table 16 x 512, top 32": lambda: _sparse_table(b=16, m=512, k_blocks=32),
    "sparse table top 100": lambda: _sparse_table(k_blocks=100),
    "sparse table top 1": lambda: _sparse_table(k_blocks=1),
    "sparse table without selection": lambda: _sparse_table(k_blocks=0),
    "sparse table smollm2 heads": lambda: _sparse_table(bits=4, demotable=False, heads=3, group=3, d=64),
    "sparse split": _sparse_split,
    "sparse split int8 pure": lambda: _sparse_split(bits=8, demotable=False),
    "sparse split int4": lambda: _sparse_split(bits=4, demotable=False),
    "sparse split unquantized": lambda: _sparse_split(bits=0, demotable=False),
    "sparse split 16 x 512, top 32": lambda: _sparse_split(b=16, m=512, k_blocks=32),
    "sparse split top 100": lambda: _sparse_split(k_blocks=100),
    "sparse split top 1": lambda: _sparse_split(k_blocks=1),
    "sparse split smollm2 heads": lambda: _sparse_split(bits=4, demotable=False, heads=3, group=3, d=64),
    "sparse split, split by bits": lambda: _sparse_split(parts=True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_compile_for_sm90(case: str) -> None:
    launches = record_launches(CASES[case]())
    assert launches, "the launcher launched no kernel"
    for launch in launches:
        compiled = compile_launch(launch)
        assert compiled.asm["cubin"], f"{launch.fn.__name__}: no cubin"
        assert ".target sm_90" in compiled.asm["ptx"]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_tma_build_fills_its_ring_by_tensor_copies_only(bits: int) -> None:
    """``gluon_tma`` on sm_90: the cold kernel's ring takes six tensor copies a block and no ``cp.async``
    (the block ids are loaded an iteration ahead), keeps every value in registers, and needs fewer
    registers than the ``cp.async`` build, whose lanes hold their copies' addresses (INT4: 195 against 255
    registers, 10 programs a multiprocessor against 8)."""
    from kvtune.kernels.aot import resources
    from kvtune.kernels.triton_decode import resident_programs

    (tma,) = [x for x in record_launches(_gluon(bits, tma=True)) if x.fn.__name__ == "_cold_kernel"]
    (plain,) = [x for x in record_launches(_gluon(bits)) if x.fn.__name__ == "_cold_kernel"]
    assert tma.kwargs["TMA"] and not tma.kwargs["TABLE_AHEAD"] and "TMA" not in plain.kwargs
    compiled = compile_launch(tma)
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d") == 12  # six a block, before the loop and in it
    assert "cp.async.ca" not in ptx and "cp.async.cg" not in ptx and "cp.async.commit_group" not in ptx
    r, r0 = resources(tma, compiled=compiled), resources(plain)
    assert r.stack_bytes == 0 and r.registers < r0.registers, (r, r0)
    resident = [resident_programs(x.registers, 1, x.shared_bytes) for x in (r, r0)]
    assert resident[0] >= resident[1], resident


@pytest.mark.parametrize("builds", ["by_id", "paired"])
def test_the_mixed_pair_on_tensor_copies_reads_each_builds_codes_by_its_own_descriptors(builds: str) -> None:
    """``gluon_mixed`` with ``gluon_tma``, both builds in one launch: the 8-bit build's codes come as
    ``[T, D]`` boxes, the 4-bit build's as ``[T, D / 2]`` boxes of the same ``D``-byte rows; both read the
    same scale descriptors; the pair compiles with tensor copies only and no stack."""
    from kvtune.kernels.aot import resources

    (pair,) = [x for x in record_launches(_gluon_mixed(builds=builds, tma=True))
               if x.fn.__name__ == "_cold_pair_kernel"]  # fmt: skip
    kw = pair.kwargs
    assert kw["TMA"] and not kw["TABLE_AHEAD"]
    assert kw["kd"].block_shape == [64, 128] and kw["kd4"].block_shape == [64, 64]
    assert kw["kd"].shape == kw["kd4"].shape == [40 * 8 * 64, 128]
    compiled = compile_launch(pair)
    assert "cp.async.cg" not in compiled.asm["ptx"] and "cp.async.bulk.tensor.2d" in compiled.asm["ptx"]
    assert resources(pair, compiled=compiled).stack_bytes == 0


@pytest.mark.parametrize("builds", ["two", "paired", "by_id"])
def test_builds_after_the_selection_launch_as_dependents_that_wait_before_the_table(builds: str) -> None:
    """``gluon_after_select``: the first cold launch is a programmatic dependent (``launch_pdl``) whose
    programs wait (``griddepcontrol.wait``) before they read the table split by bits; a second build
    launched after it is not one (unless overlapped: ``gluon_overlap``)."""
    cold = [x for x in record_launches(_gluon_mixed(builds=builds, after=True))
            if x.fn.__name__ in ("_cold_kernel", "_cold_pair_kernel")]  # fmt: skip
    first, rest = cold[0], cold[1:]
    assert first.kwargs["AFTER"] and first.kwargs["launch_pdl"]
    assert "griddepcontrol.wait" in compile_launch(first).asm["ptx"]
    assert all("AFTER" not in x.kwargs for x in rest) and len(cold) == (2 if builds == "two" else 1)


def test_the_selection_lets_the_builds_start_where_the_card_launches_dependents() -> None:
    """The split selection's merge, where it writes the split by bits, lets a programmatic dependent start
    as it starts (``gdc_launch_dependents``) when planned for sm_90; planned for sm_86, or on a CPU that
    plans for no GPU (the interpreter), it does not."""
    from kvtune.kernels.arch import ARCHS, HOPPER
    from kvtune.kernels.backend import Ahead, plan_ahead

    def merge(ahead: Any) -> Any:
        plan_ahead(ahead)
        try:
            launches = record_launches(_sparse_split(parts=True))
        finally:
            plan_ahead(None)
        return next(x for x in launches if x.fn.__name__ == "_merge_spans_kernel")

    hopper = merge(Ahead(HOPPER, 4))
    assert hopper.kwargs["TRIGGER"]
    assert "griddepcontrol.launch_dependents" in compile_launch(hopper).asm["ptx"]
    assert not merge(Ahead(ARCHS["sm_86"], 4)).kwargs["TRIGGER"] and not merge(None).kwargs["TRIGGER"]


def test_overlapped_builds_launch_the_4_bit_build_as_a_dependent_that_waits_at_its_end() -> None:
    """``gluon_overlap`` on sm_90: the 8-bit build lets the next launch start (``launch_dependents``), the
    4-bit build is that programmatic dependent and waits for it (``griddepcontrol.wait``) after its last
    store, and lets the merge start; without it the 8-bit build has neither and the 4-bit build no wait. On
    sm_80 the plan drops the programmatic launches altogether."""
    for overlap in (False, True):
        launches = record_launches(_gluon_mixed(overlap=overlap, builds="two"))
        names = [launch.fn.__name__ for launch in launches]
        assert names == ["_partition_kernel", "_cold_kernel", "_cold_kernel", "_merge_kernel"], names
        eight, four = launches[1], launches[2]
        assert eight.kwargs["KIND"] == 8 and four.kwargs["KIND"] == 4
        ptx8, ptx4 = (compile_launch(x).asm["ptx"] for x in (eight, four))
        assert ("griddepcontrol.launch_dependents" in ptx8) == overlap and "griddepcontrol.wait" not in ptx8
        assert "griddepcontrol.launch_dependents" in ptx4
        assert ("griddepcontrol.wait" in ptx4) == overlap and bool(four.kwargs.get("launch_pdl")) == overlap
        if overlap:  # the wait comes after the partials' stores
            assert ptx4.rindex("griddepcontrol.wait") > ptx4.rindex("st.global")
    old = ARCHS["sm_80"]
    for launch in record_launches(_gluon_mixed(arch=old, overlap=True)):
        assert not launch.kwargs.get("launch_pdl") and not launch.kwargs.get("FOLLOW"), launch.fn.__name__


def test_longest_loop_counts_the_span_of_the_longest_backward_branch() -> None:
    from kvtune.kernels.aot import longest_loop

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FADD R2, R2, R3 ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R10, R4 ;
        /*0030*/              @P0 BRA 0x10 ;
        /*0040*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0050*/              @P1 BRA 0x40 ;
        /*0060*/                   BRA 0x70 ;
        /*0070*/                   EXIT ;
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], R3 ;
        /*0090*/              @!P2 BRA 0x80 ;
        /*00a0*/                   BRA 0x20 ;
    """
    # 0x10..0x30; the 2-instruction loops, the forward branch and the out-of-line block's unconditional
    # return into the loop (0x20..0xa0) lose
    assert longest_loop(sass) == 3
    assert longest_loop("") == 0


def test_the_gluon_builds_block_loop_is_found_in_their_sass() -> None:
    """The Gluon INT8 and INT4 builds' block loop (benchmarks/kernel_resources.py reports it): a loop, and
    most of a program's instructions."""
    from kvtune.kernels.aot import resources

    for bits in (8, 4):
        launches = record_launches(_gluon(bits, stages=2))
        r = resources(launches[0])
        assert r.name == "_cold_kernel" and 500 < r.loop_instructions < 2000, (bits, r)
        # on tensor copies: the same loop less the lanes' copies (the wait's retry sits out of line)
        tma = resources(record_launches(_gluon(bits, stages=2, tma=True))[0])
        assert 500 < tma.loop_instructions < r.loop_instructions, (bits, tma, r)


def test_the_mixed_path_reads_the_split_the_selection_wrote() -> None:
    """Given the table split by bits (the split selection writes it for an 8-bit pool with demoted blocks),
    the mixed Gluon path launches no partition of its own and its builds and merge read the given split; a
    split of another table's shape is refused with the rule it breaks."""
    from kvtune.kernels.bits_partition_ref import empty_partition
    from kvtune.kernels.triton_decode import default_options, hybrid_decode_attention_triton

    b, heads, m, d = 3, 8, 9, 128
    pool = _pool(8)
    hot = torch.zeros(4, heads, 96, d, dtype=torch.bfloat16)
    table = torch.arange(b * heads * m, dtype=torch.int32).view(b, heads, m) % 40

    def attend(parts: Any) -> Any:
        return lambda: hybrid_decode_attention_triton(
            torch.zeros(b, heads * 4, d, dtype=torch.bfloat16), hot, hot.clone(),
            torch.arange(b, dtype=torch.int32), torch.full((b,), 40, dtype=torch.int32), pool, table,
            torch.full((b, heads), m, dtype=torch.int32), 1 / math.sqrt(d), options=default_options(8),
            kernel="gluon_mixed", partition=parts,
        )  # fmt: skip

    assert next(x.fn.__name__ for x in record_launches(attend(None))) == "_partition_kernel"
    parts = empty_partition(b, heads, m, "cpu")
    launches = record_launches(attend(parts))
    assert [x.fn.__name__ for x in launches] == ["_cold_pair_kernel", "_merge_kernel"]
    given = {x.data_ptr() for x in parts}
    for launch in launches:
        read = {a.data_ptr() for a in launch.args if isinstance(a, torch.Tensor)}
        assert read & given, f"{launch.fn.__name__} reads none of the given split"
    with pytest.raises(ValueError, match=r"partition: a split of the \[3, 8, 9\] table"):
        record_launches(attend(empty_partition(b, heads, m + 1, "cpu")))


# ---- the compile matrix: every card's architecture, with the options the dispatcher picks there -----------
def _matrix_cases(arch: Any) -> dict[str, Callable[[], Any]]:
    """The launches a decode step makes on ``arch`` with the default options (the Gluon kernel where a GPU
    takes it), the decode kernels at the architecture's largest block size, and every other kernel once."""
    big = arch.max_block_size
    return {
        "decode int8 mixed": lambda: _decode(8, True, arch=arch),
        "decode unquantized": lambda: _decode(0, False, arch=arch),
        **{f"decode int{bits} gluon d{d} bs{bs}": (lambda bits=bits, d=d, bs=bs: _decode(
            bits, False, d=d, bs=bs, kernel="gluon", arch=arch))
           for bits in (8, 4) for d, bs in ((128, 64), (64, 16))},
        # tensor copies asked: sm_90 builds them, the others keep cp.async
        **{f"decode int{bits} gluon, tma asked": (lambda bits=bits: _decode(
            bits, False, kernel="gluon", arch=arch, gluon_tma=True)) for bits in (8, 4)},
        **{f"decode int{bits}{' mixed' * dem} block {big}": (lambda bits=bits, dem=dem: _decode(
            bits, dem, bs=big, m=3, kernel="split", arch=arch))
           for bits, dem in ((8, True), (4, False), (0, False))},
        **{f"decode int8 gluon mixed d{d} bs{bs}": (lambda d=d, bs=bs: _gluon_mixed(d, bs, arch=arch))
           for d, bs in ((128, 64), (64, 16))},
        "decode int8 gluon mixed, two launches": lambda: _gluon_mixed(arch=arch, builds="two"),
        "decode int8 gluon mixed, tma asked": lambda: _gluon_mixed(arch=arch, tma=True),
        "decode int8 gluon mixed, after the selection asked": lambda: _gluon_mixed(arch=arch, after=True),
        "quest int8": lambda: _quest(8),
        "seal int4 in an 8-bit pool": lambda: _seal(8, 4),
        "seal int8 from hot zones": lambda: _seal(8, 8, from_hot_zones=True),
        "seal unquantized from hot zones": lambda: _seal(0, 0, from_hot_zones=True),
        "requantize": _requantize,
        "requantize masked": _requantize_masked,
        # the e4m3 summary's writes: integer rounding only, so every architecture compiles them
        "seal int8 with the summary": lambda: _seal(8, 8, from_hot_zones=True, summary=True),
        "seal unquantized with the summary": lambda: _seal(0, 0, summary=True),
        "requantize with the summary": lambda: _requantize(summary=True),
        "requantize masked with the summary": lambda: _requantize_masked(summary=True),
        **{f"pack {name}": (lambda bits=bits: _pack(bits)) for name, bits in (("int8", 8), ("int4", 4),
                                                                               ("unquantized", 0))},
        "hot write from rows": lambda: _hot_write(True),
        **{n: (lambda n=n: _elementwise(n)) for n in ("add_rms_norm", "rope_qkv", "silu_mul")},
        "access update": _access,
        "sparse table": _sparse_table,
        "sparse table int4": lambda: _sparse_table(bits=4, demotable=False),
        "sparse split": _sparse_split,
        "sparse split int4": lambda: _sparse_split(bits=4, demotable=False),
        "sparse split 16 x 512, top 32": lambda: _sparse_split(b=16, m=512, k_blocks=32),
        "sparse split, split by bits": lambda: _sparse_split(parts=True),
        "sparse split, split by bits, L1 ahead": lambda: _sparse_split(parts=True, l1_ahead=True),
        # Quest from the e4m3 summary (e4m3 loads: sm_89 and newer): one-warp spans and the 256-key merge
        # where a row has at most 8 spans, two-warp spans and 512 keys for one row of 10
        **({"sparse table from the summary": lambda: _sparse_table(summary=True),
            "sparse split from the summary": lambda: _sparse_split(summary=True, parts=True),
            "sparse split from the summary, 10 spans": lambda: _sparse_split(
                b=1, heads=1, m=10 * 64, k_blocks=32, summary=True)} if arch.fp8 else {}),
    }  # fmt: skip


MATRIX = [(a, case) for a in ARCHS for case in _matrix_cases(ARCHS[a])]


@pytest.mark.parametrize(
    ("case", "warps", "keys"),
    [("sparse split from the summary", 1, 256), ("sparse split from the summary, 10 spans", 2, 512)],
)
def test_from_the_summary_a_rows_spans_set_their_warps_and_the_merges_keys(
    case: str, warps: int, keys: int
) -> None:
    """The matrix's two builds of the split selection from the summary are the two a step may launch."""
    launches = {x.fn.__name__: x for x in record_launches(_matrix_cases(ARCHS["sm_90"])[case]())}
    assert launches["_span_kernel"].kwargs["num_warps"] == warps
    assert launches["_merge_spans_kernel"].kwargs["NK"] == keys


@pytest.mark.parametrize(("arch", "case"), MATRIX)
def test_kernels_compile_for_every_architecture(arch: str, case: str) -> None:
    """Each launch compiles for the architecture with the options the launcher planned for it, fits one
    program's shared memory there, and uses no Hopper-only instruction below sm_90 (``griddepcontrol``: the
    programmatic dependent launch). The Gluon cold kernel's builds keep every value in registers (no stack):
    a spill inside its block loop costs every block (a variant of the per-block offset spilled 16 bytes)."""
    from kvtune.kernels.aot import resources

    a = ARCHS[arch]
    launches = record_launches(_matrix_cases(a)[case]())
    assert launches, "the launcher launched no kernel"
    for launch in launches:
        compiled = compile_launch(launch, target_of(a))
        name, ptx = launch.fn.__name__, compiled.asm["ptx"]
        assert compiled.asm["cubin"] and f".target {arch}" in ptx, name
        assert compiled.metadata.shared <= a.shared_per_program, (name, compiled.metadata.shared)
        if not a.pdl:
            assert "griddepcontrol" not in ptx and not launch.kwargs.get("launch_pdl"), name
        if not a.tma:
            assert "cp.async.bulk" not in ptx and not launch.kwargs.get("TMA"), name
        if name == "_cold_kernel":
            stack = resources(launch, target_of(a), compiled).stack_bytes
            assert stack == 0, (name, launch.kwargs.get("KIND"), stack)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_gluon_ring_takes_the_shared_memory_the_plan_counts(arch: str, bits: int) -> None:
    """The ring depth the launcher plans on each architecture (:func:`gluon_decode.ring_stages`) is counted
    from the bytes the compiler gives the build (:func:`gluon_decode.ring_bytes`)."""
    from kvtune.kernels.gluon_decode import ring_bytes

    a = ARCHS[arch]
    (cold,) = [
        x
        for x in record_launches(_decode(bits, False, kernel="gluon", arch=a))
        if x.fn.__name__ == "_cold_kernel"
    ]
    stages = cold.kwargs["STAGES"]
    assert stages == EXPECTED_STAGES[bits][arch]
    assert compile_launch(cold, target_of(a)).metadata.shared == ring_bytes(128, 64, bits, stages)
    if a.tma:  # the ring on tensor copies: its barriers instead of the id ring
        (tma,) = [
            x
            for x in record_launches(_decode(bits, False, kernel="gluon", arch=a, gluon_tma=True))
            if x.fn.__name__ == "_cold_kernel"
        ]
        shared = compile_launch(tma, target_of(a)).metadata.shared
        assert shared == ring_bytes(128, 64, bits, stages, tma=True)


# the default ring (8-bit: 3, 4-bit: 2) where 4 programs fit a multiprocessor's shared memory, else shallower
EXPECTED_STAGES = {8: {"sm_80": 2, "sm_86": 0, "sm_89": 0, "sm_90": 3}, 4: dict.fromkeys(ARCHS, 2)}


@pytest.mark.parametrize("arch", [a for a in ARCHS if ARCHS[a].max_block_size < 256])
def test_a_block_past_the_largest_does_not_fit_the_architecture(arch: str) -> None:
    """Why a card of this architecture offers no larger block: the split kernel's shared memory for the next
    block size (8-bit codes with per-block bits) exceeds what one program may have."""
    a = ARCHS[arch]
    launches = record_launches(_decode(8, True, bs=2 * a.max_block_size, m=3, kernel="split", arch=a))
    shared = max(compile_launch(x, target_of(a)).metadata.shared for x in launches)
    assert shared > a.shared_per_program


# ---- sizes that change while a workload runs must not make the JIT compile again
def _step_sized(b: int, m: int) -> Callable[[], Any]:
    """A decode step's per-token kernels for b sequences; seals and re-quantizations of m blocks."""
    from kvtune.kernels import triton_elementwise as e
    from kvtune.kernels.triton_quant import requantize_int4_triton, seal_blocks_triton

    x, cos = torch.zeros(b, 576, dtype=torch.bfloat16), torch.zeros(b, 64)
    zones = torch.zeros(2, 40, 3, 96, 64, dtype=torch.bfloat16)[:, :, :, :64].transpose(2, 3)
    rows = torch.arange(m) % 40

    def run() -> None:
        e.add_rms_norm_triton(x, x.clone(), x[0].clone(), 1e-5)
        e.rope_qkv_triton(torch.zeros(b, 960, dtype=torch.bfloat16), cos, cos, 9, 3)
        e.silu_mul_triton(torch.zeros(b, 2 * 1536, dtype=torch.bfloat16))
        pool = _pool(8, heads=3, d=64)
        seal_blocks_triton(pool, torch.arange(m), zones[0], zones[1], 8, rows)
        requantize_int4_triton(pool, torch.arange(m))

    return run


SIZED: dict[str, Callable[[int, int], Callable[[], Any]]] = {
    "decode int8": lambda b, m: _decode(8, True, b=b, m=m),
    "decode int4": lambda b, m: _decode(4, False, b=b, m=m),
    "decode unquantized": lambda b, m: _decode(0, False, b=b, m=m),
    "decode int8 gluon": lambda b, m: _gluon(8, b=b, m=m),
    "decode int4 gluon": lambda b, m: _gluon(4, b=b, m=m),
    "decode int8 gluon mixed": lambda b, m: _gluon_mixed(b=b, m=m),
    "decode int8 gluon mixed smollm2 heads": lambda b, m: _gluon_mixed(64, 32, b=b, m=m, heads=3, group=3),
    "quest": lambda b, m: _quest(8, b, m),
    "sparse table": _sparse_table,
    "sparse split": lambda b, m: _sparse_split(b=b, m=m),
    "sparse split, rows of several spans": lambda b, m: _sparse_split(b=b, m=64 * m + 1),
    "sparse split, split by bits": lambda b, m: _sparse_split(b=b, m=m, parts=True),
    "access update": lambda b, m: _access(b, m, now_ms=1234.5 + b),
    "step kernels, seal, requantize": _step_sized,
}
# (sequences, blocks per sequence): one, a multiple of 16, odd and awkward ones, as a replay meets them
SIZES = [(1, 1), (2, 3), (16, 16), (17, 33), (5, 40), (32, 7)]


@pytest.mark.parametrize("case", list(SIZED))
def test_changing_sizes_compile_once(case: str) -> None:
    """Triton specializes int arguments equal to 1 or divisible by 16, and 16-byte aligned pointers: an
    argument that follows the batch or the block count would compile a kernel again (seconds each) in the
    middle of a measured replay. Every kernel must have one JIT cache key across the sizes of a workload."""
    keys: dict[str, set[tuple[Any, ...]]] = {}
    for b, m in SIZES:
        for launch in record_launches(SIZED[case](b, m)):
            name, key, options = specialization(launch)
            if "KIND" in launch.kwargs:  # one build per code width (the mixed path launches two)
                name = f"{name} KIND={launch.kwargs['KIND']}"
            keys.setdefault(name, set()).add((key, options))
    assert keys, "the launcher launched no kernel"
    for name, seen in keys.items():
        varying = sorted({a[0] for args in zip(*(k for k, _ in seen)) if len(set(args)) > 1 for a in args})
        assert len(seen) == 1, f"{case}: {name} compiles {len(seen)} times across sizes; varying: {varying}"


# ---- the sparse table's kernels: the split selection where the options ask for it, and only there
@pytest.mark.parametrize(
    ("split", "k_blocks", "kernels"),
    [(False, 4, ["_sparse_table_kernel"]), (True, 4, ["_span_kernel", "_merge_spans_kernel"]),
     (True, 0, ["_sparse_table_kernel"])],  # k_blocks 0: nothing to select
)  # fmt: skip
def test_the_sparse_table_takes_the_split_selection_where_asked(
    monkeypatch: pytest.MonkeyPatch, split: bool, k_blocks: int, kernels: list[str]
) -> None:
    """Through the dispatcher (Triton forced for CPU tensors, launches recorded): the default options launch
    the single-program kernel, ``SelectOptions(split=True)`` the span and merge kernels."""
    from kvtune.kernels import sparse_table
    from kvtune.kernels.sparse_table_choice import SelectOptions

    monkeypatch.setattr(sparse_table, "use_triton", lambda t: True)
    count = sparse_table.ByteCount(
        torch.zeros(9, dtype=torch.int64), 4096, torch.zeros((), dtype=torch.int64)
    )
    q, pool = torch.zeros(2, 32, 128, dtype=torch.bfloat16), _pool(8)
    blocks, tier = (torch.arange(18) % 40).view(2, 9), torch.ones(40, dtype=torch.int8)
    opts = SelectOptions(split=True) if split else None
    launches = record_launches(
        lambda: sparse_table.sparse_block_table(q, pool, blocks, tier, k_blocks, count, opts)
    )
    assert [x.fn.__name__ for x in launches] == kernels


# ---- the engine's warm-up compiles every kernel that a timed replay launches
def _keys_of(run: Callable[[], Any]) -> set[tuple[Any, ...]]:
    return {specialization(launch) for launch in record_launches(run)}


def _forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dispatcher takes its Triton launcher, also for CPU tensors (launches are recorded, not run)."""
    from kvtune.kernels import access, decode_attention, elementwise, quant, quest, requant, sparse_table

    for module in (access, decode_attention, elementwise, quant, quest, requant, sparse_table):
        monkeypatch.setattr(module, "use_triton", lambda t: True)


def _serve(cache: Any, seqs: int, steps: int, first: int = 0) -> None:
    """Prefill ``seqs`` prompts of different lengths, then ``steps`` decode steps over a changing batch."""
    s = cache.shape
    gen = torch.Generator().manual_seed(first)
    for i in range(first, first + seqs):
        n = 40 + 13 * i
        cache.add_sequence(i, list(range(1000 * i, 1000 * i + n)))
        q = torch.randn(n, s.num_q_heads, s.head_dim, generator=gen).to(s.dtype)
        k = torch.randn(n, s.num_kv_heads, s.head_dim, generator=gen).to(s.dtype)
        for layer in range(s.num_layers):
            cache.prefill(layer, i, q, k, k.clone())
    for step in range(steps):
        ids = list(range(first, first + 1 + step % seqs))
        b = len(ids)
        plan = cache.begin_step(ids, 10.0 * step)
        for layer in range(s.num_layers):
            q = torch.randn(b, s.num_q_heads, s.head_dim, generator=gen).to(s.dtype)
            k = torch.randn(b, s.num_kv_heads, s.head_dim, generator=gen).to(s.dtype)
            cache.decode(layer, plan, q, k, k.clone())
        cache.end_step(plan)


def test_warm_up_compiles_every_kernel_of_a_sparse_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's warm-up (a throw-away cache for 2 requests: ``compile_kernels``, their prefills and
    decode steps) must have compiled every kernel, with every JIT key, that the timed replay then launches:
    a replay cache with other batch sizes and slot counts, blocks demoted to L2, the sparse tier's table and
    Quest on every step."""
    from kvtune.cache_impl.config import HybridConfig
    from kvtune.cache_impl.hybrid_cache import HybridCache, ModelKVShape
    from kvtune.cache_impl.tiers import L2, Migrations

    _forced_triton(monkeypatch)
    shape = ModelKVShape(num_layers=3, num_kv_heads=2, head_dim=64, num_q_heads=6, dtype=torch.float16)
    config = HybridConfig(
        kv_cache_strategy="hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=8, sparse_top_k=32
    )
    budget = 16 << 20
    warm = HybridCache(config, shape, budget, "cpu", max_seqs=2)
    warm_keys = _keys_of(lambda: (warm.compile_kernels(), _serve(warm, seqs=2, steps=6)))

    timed = HybridCache(config, shape, budget, "cpu", max_seqs=6)

    def replay() -> None:
        _serve(timed, seqs=5, steps=3, first=10)
        blocks = np.array(sorted(timed._seqs[10].blocks[:2] + timed._seqs[12].blocks[:1]))
        layers = np.repeat(np.arange(shape.num_layers), len(blocks))
        todo = Migrations(layers, np.tile(blocks, shape.num_layers), np.full(len(layers), L2))
        timed.tiers.apply(todo, timed.pools)
        _serve(timed, seqs=1, steps=0, first=15)
        for step in range(7):
            ids = [10, 11, 12, 13, 14, 15][: 1 + step % 6]
            plan = timed.begin_step(ids, 100.0 + step)
            for layer in range(shape.num_layers):
                q = torch.zeros(len(ids), shape.num_q_heads, shape.head_dim, dtype=shape.dtype)
                k = torch.zeros(len(ids), shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
                timed.decode(layer, plan, q, k, k.clone())
            timed.end_step(plan)

    timed_keys = _keys_of(replay)
    names = {name for name, _, _ in timed_keys}
    assert {"_sparse_table_kernel", "_requant_kernel", "_merge_kernel"} <= names, names
    missing = timed_keys - warm_keys
    assert not missing, "compiled only when timed: " + "; ".join(
        f"{name}: {[a for a in key if a not in next((k for n, k, _ in warm_keys if n == name), ())]}"
        for name, key, _ in missing
    )


@pytest.mark.parametrize("summary", [False, True], ids=["fp16 bounds", "e4m3 summary"])
def test_warm_up_compiles_every_build_of_the_split_selection(
    monkeypatch: pytest.MonkeyPatch, summary: bool
) -> None:
    """The split selection's spans' warps and its merge's width follow a row's span count, which the step's
    rows and lengths set: ``compile_kernels`` on a GPU must have compiled the build of every count a plan may
    give (1 .. max_splits), so that a long row met only in the timed replay compiles nothing."""
    from kvtune.cache_impl import hybrid_cache
    from kvtune.cache_impl.config import HybridConfig
    from kvtune.cache_impl.hybrid_cache import HybridCache, ModelKVShape
    from kvtune.kernels.sparse_table import ByteCount, sparse_block_table_parts
    from kvtune.kernels.sparse_table_choice import CHUNK, SelectOptions, max_splits, split_plan

    _forced_triton(monkeypatch)
    monkeypatch.setattr(hybrid_cache, "on_gpu", lambda device: True)  # compile_kernels' GPU-only builds
    monkeypatch.setenv("KVTUNE_QUEST_SUMMARY", "1" if summary else "0")
    shape = ModelKVShape(num_layers=1, num_kv_heads=1, head_dim=64, num_q_heads=2, dtype=torch.float16)
    config = HybridConfig(
        kv_cache_strategy="hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=8, sparse_top_k=512
    )
    cache = HybridCache(config, shape, 16 << 20, "cpu", max_seqs=1)
    warm_keys = _keys_of(cache.compile_kernels)
    pool, k_blocks = cache.pools[0], config.sparse_blocks
    assert (pool.summary is not None) == summary
    q = torch.zeros(1, shape.num_q_heads, shape.head_dim, dtype=shape.dtype)
    count = ByteCount(cache._cost, cache._quest_cost, torch.zeros_like(cache._bytes_dev))
    for spans in range(1, max_splits(k_blocks, summary) + 1):  # one row of ``spans`` chunks: planned so
        blocks = torch.zeros((1, spans * CHUNK), dtype=torch.int64)
        assert split_plan(1, spans * CHUNK, k_blocks, 4, SelectOptions(split=True), summary).splits == spans
        keys = _keys_of(lambda blocks=blocks: sparse_block_table_parts(
            q, pool, blocks, cache.tiers.tier[0], k_blocks, count, SelectOptions(split=True), pool.summary
        ))  # fmt: skip
        assert {name for name, _, _ in keys} >= {"_span_kernel", "_merge_spans_kernel"}, keys
        assert keys <= warm_keys, f"{spans} spans: compiled only when met: {keys - warm_keys}"


# ---- the split count's wave model and the occupancy it plans with ---------------------------------------
@pytest.mark.parametrize(
    ("bits", "demotable", "most"), [(0, True, 4), (4, True, 4), (8, False, 4), (8, True, 4)], ids=str
)
def test_split_kernel_keeps_its_programs_per_sm(bits: int, demotable: bool, most: int) -> None:
    """The split kernel's default build for each pool width, compiled for sm_90, still fits the programs per
    multiprocessor its options were chosen at on the H200. Guards its registers: the busy-split arithmetic,
    when it was in this kernel unconditionally, took the unquantized build from 61 to 74 registers (3
    programs per multiprocessor) and its 64 x 8K attention from 0.506 to 0.653 ms."""
    from kvtune.kernels.aot import resources
    from kvtune.kernels.triton_decode import resident_programs

    launch = record_launches(_decode(bits, demotable, kernel="split"))[0]
    assert launch.fn.__name__ == "_split_kernel"
    r = resources(launch)
    assert resident_programs(r.registers, r.num_warps, r.shared_bytes) == most, r


def test_resident_programs_match_the_offline_table() -> None:
    """The H200 table of the decode variants (registers, shared memory -> programs per SM on sm_90)."""
    from kvtune.kernels.triton_decode import resident_programs

    kb = 1024
    assert resident_programs(128, 4, 38 * kb) == 4  # pure INT8, INT4 2 stages + cap 128
    assert resident_programs(96, 4, 38 * kb) == 5  # cap 96
    assert resident_programs(162, 4, 70 * kb) == 3  # INT4 3 stages
    assert resident_programs(61, 8, 38 * kb) == 4  # unquantized, 8 warps: shared memory decides
    assert resident_programs(16, 1, 0) == 32  # at most 32 blocks per multiprocessor


@pytest.mark.parametrize(("arch", "most"), [("sm_80", 32), ("sm_86", 16), ("sm_89", 24), ("sm_90", 32)])
def test_resident_programs_use_the_architectures_limits(arch: str, most: int) -> None:
    """A one-warp build without shared memory is held back only by the resident blocks of the card; a
    Gluon 8-bit ring of 3 stages (51,520 bytes) by its shared memory."""
    from kvtune.kernels.triton_decode import resident_programs

    assert resident_programs(16, 1, 0, ARCHS[arch]) == most
    assert (
        resident_programs(64, 1, 51520, ARCHS[arch]) == {"sm_80": 3, "sm_86": 1, "sm_89": 1, "sm_90": 4}[arch]
    )


def test_architectures_are_named_and_a_cpu_plans_as_hopper() -> None:
    from kvtune.kernels.arch import HOPPER, arch_for, arch_of

    assert arch_of(torch.device("cpu")) is HOPPER and arch_for((8, 6)).name == "sm_86"
    with pytest.raises(ValueError, match=r"compute capability \(7, 5\) is not one the kernels plan for"):
        arch_for((7, 5))


@pytest.mark.parametrize(
    ("bh", "m", "slots", "measured"),
    [
        (128, 511, 528, {3: 0.570, 5: 0.651, 9: 0.550, 17: 0.517}),  # INT4, 16x32K, 4 per SM
        (128, 511, 660, {3: 0.634, 5: 0.524, 9: 0.565, 17: 0.572}),  # INT8 cap 96, 16x32K, 5 per SM
        (512, 127, 660, {1: 0.558, 2: 0.584, 3: 0.577, 5: 0.526}),  # INT8 cap 96, 64x8K
    ],
)
def test_the_wave_model_ranks_first_what_the_h200_measured_fastest(
    bh: int, m: int, slots: int, measured: dict[int, float]
) -> None:
    """The H200's split sweeps: of the split counts measured, the least modeled time is the fastest."""
    from kvtune.kernels.triton_decode import wave_cost

    costs = {s: wave_cost(bh, m, s, slots) for s in measured}
    assert min(costs, key=lambda s: costs[s]) == min(measured, key=lambda s: measured[s])


def test_plan_splits_uses_the_wave_model_only_when_the_occupancy_is_known() -> None:
    from kvtune.kernels.triton_decode import DecodeKernelOptions, plan_splits, wave_splits

    cpu = torch.device("cpu")  # 4 multiprocessors stand in for a GPU's count
    base = DecodeKernelOptions(programs_per_sm=16)
    assert plan_splits(8, 200, cpu, base) == (8, 25)  # occupancy not read yet: 16 x 4 programs over 8 rows
    splits, per = plan_splits(8, 200, cpu, base, resident=4)
    assert splits == wave_splits(8, 200, 50, 16, 64) and splits * per >= 200 > (splits - 1) * per


def test_the_gluon_plan_leaves_the_asked_slots_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """``WAVE_FREE``: the wave model plans a Gluon build over its occupancy less that many programs a
    multiprocessor (at least one)."""
    from dataclasses import replace

    from kvtune.kernels import triton_decode as td

    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    hot = torch.zeros(4, 8, 96, 128, dtype=torch.bfloat16)
    pool = _pool(4, demotable=False)
    table = torch.zeros(4, 8, 2080, dtype=torch.int32)
    key = td.launch_plan(q, hot, pool, table, kernel="gluon").key
    monkeypatch.setitem(td._RESIDENT, key, 8)
    opts = replace(td.default_options(4), programs_per_sm=td.default_options(4).gluon_programs_per_sm)
    for free, resident in ((0, 8), (3, 5), (7, 1), (9, 1)):
        monkeypatch.setattr(td, "WAVE_FREE", free)
        got = td.launch_plan(q, hot, pool, table, kernel="gluon")
        assert (got.splits, got.per) == td.plan_splits(32, 2080, q.device, opts, resident), free


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_the_mixed_path_plans_each_builds_ring(arch: str) -> None:
    """The mixed Gluon path launches the partition kernel, the 8-bit build with the 8-bit ring the
    architecture allows, the 4-bit build (its codes in the first half of the pool's 8-bit rows) with the
    4-bit one, then the merge; each build takes the shared memory its plan counts. In one launch (the
    default, ``gluon_builds`` "by_id") the pair takes the larger of the two rings' bytes: the rings are
    live one after the other and share them."""
    from kvtune.kernels.gluon_decode import ring_bytes

    a = ARCHS[arch]
    launches = record_launches(_gluon_mixed(arch=a, builds="two"))
    names = [x.fn.__name__ for x in launches]
    assert names == ["_partition_kernel", "_cold_kernel", "_cold_kernel", "_merge_kernel"], names
    for cold, bits in zip(launches[1:3], (8, 4), strict=True):
        assert cold.kwargs["KIND"] == bits and cold.kwargs["ROW"] == 128
        stages = cold.kwargs["STAGES"]
        assert stages == EXPECTED_STAGES[bits][arch]
        assert compile_launch(cold, target_of(a)).metadata.shared == ring_bytes(128, 64, bits, stages)
    assert launches[3].kwargs["MAPPED"]
    launches = record_launches(_gluon_mixed(arch=a))
    assert [x.fn.__name__ for x in launches] == ["_partition_kernel", "_cold_pair_kernel", "_merge_kernel"]
    pair = launches[1]
    stages = (pair.kwargs["STAGES"], pair.kwargs["STAGES4"])
    assert stages == (EXPECTED_STAGES[8][arch], EXPECTED_STAGES[4][arch]) and pair.kwargs["BY_ID"]
    rings = max(ring_bytes(128, 64, 8, stages[0]), ring_bytes(128, 64, 4, stages[1]))
    assert compile_launch(pair, target_of(a)).metadata.shared == rings


def test_the_launchers_input_check_names_the_rule_that_fails() -> None:
    """``_check_inputs``: an input that breaks one rule gets the error naming that rule, and inputs that keep
    them all pass."""
    from kvtune.kernels import triton_decode as td

    pool = _pool(8, heads=2, d=64, bs=16)
    good = dict(
        q=torch.zeros(3, 4, 64, dtype=torch.bfloat16),
        hot_k=torch.zeros(3, 2, 32, 64, dtype=torch.bfloat16),
        hot_v=torch.zeros(3, 2, 32, 64, dtype=torch.bfloat16),
        pool=pool,
        block_table=torch.zeros(3, 2, 5, dtype=torch.int32),
        num_cold=torch.zeros(3, 2, dtype=torch.int32),
    )
    td._check_inputs(**good)
    wide = torch.zeros(3, 4, 128, dtype=torch.bfloat16)[..., ::2]  # D of 64, stride 2
    strided = torch.zeros(3, 32, 2, 64, dtype=torch.bfloat16).transpose(1, 2)  # hot_k's shape, other strides
    broken = {
        "Hq % H == 0": dict(q=torch.zeros(3, 3, 64, dtype=torch.bfloat16)),
        "hot_k.shape == hot_v.shape": dict(hot_v=torch.zeros(3, 2, 16, 64, dtype=torch.bfloat16)),
        "hot_k.stride() == hot_v.stride()": dict(hot_v=strided),
        "unit stride on D": dict(q=wide),
        "block_table [B, H, M] int32": dict(block_table=torch.zeros(3, 2, 5, dtype=torch.int64)),
        "num_cold [B, H]": dict(num_cold=torch.zeros(3, 3, dtype=torch.int32)),
    }  # fmt: skip
    for rule, change in broken.items():
        with pytest.raises(ValueError, match=re.escape(rule)):
            td._check_inputs(**{**good, **change})
