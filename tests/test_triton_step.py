"""The decode step's small Triton kernels (RMSNorm + residual, RoPE of the fused qkv, SiLU·up, the access
update, the sparse tier's table) against their PyTorch references.

As in ``test_triton_kernels.py`` (whose ``test_interpreted_suite`` also runs this file's ``interpreted`` tests
in its TRITON_INTERPRET=1 child process): tiny shapes under the interpreter on the CPU, larger ones, bf16
included, on a GPU. Fresh random inputs each time; outputs are fresh ``torch.empty`` buffers of a poisoned
allocator on the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from kvtune.kernels.access import accessed_blocks_ref, update_access_ref
from kvtune.kernels.elementwise import add_rms_norm_ref, rope_qkv_ref, silu_mul_ref
from kvtune.tests.triton_testlib import fixtures

pytest.importorskip("triton")

# model dtype -> (rtol, atol) against the reference (RoPE and SiLU·up: the float32 reference rounded once)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
MODULES = ("triton_elementwise", "triton_access", "triton_sparse_table", "triton_sparse_split")


kernels, gpu_kernels = fixtures(MODULES)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def check_add_rms_norm(k, n: int, hidden: int, dtype: torch.dtype, residual: bool, device: str) -> None:
    x = torch.randn(n, hidden, device=device).to(dtype)
    delta = torch.randn(n, hidden, device=device).to(dtype) if residual else None
    w = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    s, out = k.triton_elementwise.add_rms_norm_triton(x, delta, w, 1e-5)
    s_ref, out_ref = add_rms_norm_ref(x, delta, w, 1e-5)
    assert torch.equal(s, s_ref)  # the residual add rounds exactly as torch's does
    _close(out, out_ref)
    if residual:  # the sum written in place over x: the same values
        x_in = x.clone()
        s_in, out_in = k.triton_elementwise.add_rms_norm_triton(x_in, delta, w, 1e-5, sum_out=x_in)
        assert s_in.data_ptr() == x_in.data_ptr() and torch.equal(x_in, s) and torch.equal(out_in, out)


def check_rope_qkv(k, n: int, hq: int, h: int, d: int, dtype: torch.dtype, device: str) -> None:
    qkv = torch.randn(n, (hq + 2 * h) * d + 8, device=device).to(dtype)[:, 8:]  # a row stride > width
    pos = torch.randint(0, 5000, (n,), device=device).float()
    freqs = pos[:, None] * (10000.0 ** (-torch.arange(0, d, 2, device=device) / d))[None, :]
    emb = torch.cat([freqs, freqs], -1)
    got = k.triton_elementwise.rope_qkv_triton(qkv, emb.cos(), emb.sin(), hq, h)
    want = rope_qkv_ref(qkv.float(), emb.cos(), emb.sin(), hq, h)  # float32, rounded once as the kernel does
    for g, w in zip(got, want):
        _close(g, w.to(dtype))
    assert torch.equal(got[2], rope_qkv_ref(qkv, emb.cos(), emb.sin(), hq, h)[2])  # v is copied
    # written into given buffers (the first n rows of larger ones, as the pieces' static buffers are)
    out = tuple(torch.full((n + 3, *g.shape[1:]), 7.0, device=device).to(dtype)[:n] for g in got)
    assert k.triton_elementwise.rope_qkv_triton(qkv, emb.cos(), emb.sin(), hq, h, out=out) is out
    assert all(torch.equal(o, g) for o, g in zip(out, got))


def check_silu_mul(k, n: int, f: int, dtype: torch.dtype, device: str) -> None:
    gu = (torch.randn(n, 2 * f, device=device) * 3).to(dtype)
    _close(k.triton_elementwise.silu_mul_triton(gu), silu_mul_ref(gu.float()).to(dtype))


def check_access(k, n_blocks: int, b: int, h: int, m: int, device: str, seed: int) -> None:
    """Shared blocks (a prefix), padding, NaN EMAs; statistics equal the reference's, flags end at zero."""
    gen = torch.Generator(device=device).manual_seed(seed)
    table = torch.randint(0, n_blocks, (b, h, m), generator=gen, device=device, dtype=torch.int32)
    table[:, :, : m // 3] = table[:1, :1, : m // 3]  # every head of every sequence lists this prefix
    num_cold = torch.randint(0, m + 1, (b, h), generator=gen, device=device, dtype=torch.int32)
    num_cold[0, 0] = m
    table = torch.where(torch.arange(m, device=device) < num_cold[..., None], table, -1).to(torch.int32)
    mass = torch.rand((b, h, m), generator=gen, device=device)
    last = torch.rand(n_blocks, generator=gen, device=device, dtype=torch.float64) * 100
    nan = torch.rand(n_blocks, generator=gen, device=device) < 0.5
    ema = torch.where(nan, math.nan, 50.0).to(torch.float64)
    ref_last, ref_ema = last.clone(), ema.clone()
    update_access_ref(ref_last, ref_ema, mass, table, num_cold, 1234567.125)
    # the clock as a float, and as a float64 device scalar (what a step captured in a CUDA graph reads)
    for now in (1234567.125, torch.tensor(1234567.125, dtype=torch.float64, device=device)):
        got_last, got_ema = last.clone(), ema.clone()
        flags = torch.zeros(n_blocks, dtype=torch.int32, device=device)
        k.triton_access.update_access_triton(got_last, got_ema, mass, table, num_cold, now, flags)
        assert torch.equal(got_last, ref_last) and not flags.any()
        torch.testing.assert_close(got_ema, ref_ema, equal_nan=True, rtol=1e-14, atol=0)
    assert accessed_blocks_ref(n_blocks, mass, table, num_cold).any() == (m > 1)  # one block: never above


def test_the_elementwise_outputs_given_are_checked_and_filled() -> None:
    """The references write into given outputs as the kernels do (the sum in place over x; q, k, v into
    buffers); a sum without delta, or outputs of another shape or dtype, are refused with one line."""
    x, delta, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16) + 0.5
    s, out = add_rms_norm_ref(x, delta, w, 1e-5)
    x_in = x.clone()
    s_in, out_in = add_rms_norm_ref(x_in, delta, w, 1e-5, sum_out=x_in)
    assert s_in is x_in and torch.equal(x_in, s) and torch.equal(out_in, out)
    with pytest.raises(ValueError, match="sum_out is given with delta"):
        add_rms_norm_ref(x, None, w, 1e-5, sum_out=x.clone())
    qkv, cos = torch.randn(3, 4 * 16), torch.rand(3, 16)
    want = rope_qkv_ref(qkv, cos, cos, 2, 1)
    out = (torch.empty(3, 2, 16), torch.empty(3, 1, 16), torch.empty(3, 1, 16))
    assert rope_qkv_ref(qkv, cos, cos, 2, 1, out=out) is out
    assert all(torch.equal(o, g) for o, g in zip(out, want))
    with pytest.raises(ValueError, match="rope_qkv: `out is contiguous"):
        rope_qkv_ref(qkv, cos, cos, 2, 1, out=(out[0], out[1], out[2].double()))


# ---- CPU: interpreter
@pytest.mark.parametrize(("n", "hidden"), [(1, 16), (3, 48), (5, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_interpreted(kernels, n: int, hidden: int, dtype: torch.dtype, residual: bool) -> None:
    check_add_rms_norm(kernels, n, hidden, dtype, residual, "cpu")


@pytest.mark.parametrize(("n", "hq", "h", "d"), [(1, 1, 1, 16), (3, 4, 2, 16), (2, 6, 2, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_qkv_interpreted(kernels, n: int, hq: int, h: int, d: int, dtype: torch.dtype) -> None:
    check_rope_qkv(kernels, n, hq, h, d, dtype, "cpu")


@pytest.mark.parametrize(("n", "f"), [(1, 8), (3, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_interpreted(kernels, n: int, f: int, dtype: torch.dtype) -> None:
    check_silu_mul(kernels, n, f, dtype, "cpu")


@pytest.mark.parametrize(("n_blocks", "b", "h", "m"), [(11, 3, 2, 5), (40, 2, 3, 70), (3, 1, 1, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_update_access_interpreted(kernels, n_blocks: int, b: int, h: int, m: int, seed: int) -> None:
    check_access(kernels, n_blocks, b, h, m, "cpu", seed)


# ---- GPU: compiled
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "hidden"), [(1, 576), (64, 4096), (37, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_gpu(gpu_kernels, n: int, hidden: int, dtype: torch.dtype, residual: bool) -> None:
    check_add_rms_norm(gpu_kernels, n, hidden, dtype, residual, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "hq", "h", "d"), [(64, 32, 8, 128), (33, 9, 3, 64), (1, 4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_qkv_gpu(gpu_kernels, n: int, hq: int, h: int, d: int, dtype: torch.dtype) -> None:
    check_rope_qkv(gpu_kernels, n, hq, h, d, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "f"), [(64, 14336), (33, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gpu(gpu_kernels, n: int, f: int, dtype: torch.dtype) -> None:
    check_silu_mul(gpu_kernels, n, f, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("n_blocks", "b", "h", "m"), [(5000, 64, 8, 130), (300, 32, 3, 40)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_update_access_gpu(gpu_kernels, n_blocks: int, b: int, h: int, m: int, seed: int) -> None:
    check_access(gpu_kernels, n_blocks, b, h, m, "cuda", seed)


# ---- the sparse tier's table
# pool kinds: (pool bits, blocks demoted to 4 bits, may_demote)
POOLS = {"int8 mixed": (8, True, True), "int8": (8, False, False), "int4": (4, False, False),
         "unquantized": (0, False, False)}  # fmt: skip


def _assert_selected(got: list[int], want: list[int], bound: dict[int, float], where: str) -> None:
    """The selected L2 blocks of one row: the reference's as a set, or (blocks of equal bound may be chosen
    differently) blocks of the same bounds; distinct, best first."""
    assert len(got) == len(want) and len(set(got)) == len(got), where
    scores = [bound[i] for i in got]  # only L2 blocks of the row have a bound
    if sorted(got) != sorted(want):
        torch.testing.assert_close(sorted(scores), sorted(bound[i] for i in want), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where}: {m}")  # fmt: skip
    descending = all(a >= b - 1e-5 * (1 + abs(a)) for a, b in itertools.pairwise(scores))
    assert descending, f"{where}: not best first"


def _launch(k, options: Any) -> Any:
    """The single-program launcher (options None), else the split one planned with ``options``."""
    if options is None:
        return k.triton_sparse_table.sparse_block_table_triton
    return lambda *args: k.triton_sparse_split.sparse_block_table_split_triton(*args, options)


def check_sparse_table(k, b: int, h: int, g: int, d: int, m: int, k_blocks: int, pool_kind: str, device: str,
                       seed: int, options: Any = None, parts: bool = True) -> None:  # fmt: skip
    """Random tiers over scattered blocks (a shared prefix, -1 padding, a row without L2 blocks, a row with
    one, blocks of equal bounds): the L1 blocks in order, the reference's selection (as sets), counts and
    bytes equal, -1 after the count. ``options`` (a ``SelectOptions``): the kernels it selects, whose table,
    counts and bytes must also equal the default kernel's exactly, and (``parts``, an 8-bit pool with
    demoted blocks) whose split of the table by bits must equal the partition's."""
    from kvtune.kernels.layout import ColdLayout
    from kvtune.kernels.quant import seal_blocks_ref
    from kvtune.kernels.quest import quest_scores_ref
    from kvtune.kernels.requant import requantize_int4_ref
    from kvtune.kernels.sparse_table import L1, L2, ByteCount, sparse_block_table_ref

    bits, demote, may_demote = POOLS[pool_kind]
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = 8
    n = b * m + 3
    pool = ColdLayout(bs, h, d, bits, torch.float32).allocate(n, device)
    pool.may_demote = may_demote
    kv = torch.randn(2, n, bs, h, d, generator=gen, device=device)
    seal_blocks_ref(pool, torch.arange(n, device=device), kv[0], kv[1], bits)
    if demote:
        requantize_int4_ref(pool, torch.randperm(n, generator=gen, device=device)[: n // 3])
    src, dst = torch.randperm(n, generator=gen, device=device)[: 2 * (n // 8)].view(2, -1)
    for name in ("k_min", "k_scale", "block_bits"):  # equal bounds: ties
        getattr(pool, name)[dst] = getattr(pool, name)[src]
    blocks = torch.randperm(n, generator=gen, device=device)[: b * m].view(b, m)
    blocks[:, : m // 4] = blocks[:1, : m // 4]
    lengths = torch.randint(0, m + 1, (b,), generator=gen, device=device)
    lengths[0] = m
    blocks = torch.where(torch.arange(m, device=device) < lengths[:, None], blocks, -1)
    tier = torch.randint(L1, L2 + 1, (n,), generator=gen, device=device).to(torch.int8)
    if b > 1:  # a row of L1 blocks only, then one with a single L2 block (the shared prefix turns L1 too)
        tier[blocks[1][blocks[1] >= 0]] = L1
        if b > 2 and lengths[2] > m // 4:
            tier[blocks[2][blocks[2] >= 0]] = L1
            tier[blocks[2, lengths[2] - 1]] = L2
    q = torch.randn(b, h * g, d, generator=gen, device=device)
    cost = torch.arange(9, device=device, dtype=torch.int64) * 1000 + 7
    got_n, want_n = (ByteCount(cost, 11, torch.zeros((), dtype=torch.int64, device=device)) for _ in range(2))
    table, num, n1 = _launch(k, options)(q, pool, blocks, tier, k_blocks, got_n)
    want_table, want_num, want_n1 = sparse_block_table_ref(q, pool, blocks, tier, k_blocks, want_n)
    if options is not None:  # the same table as the default kernel's, bit for bit
        single_n = ByteCount(cost, 11, torch.zeros((), dtype=torch.int64, device=device))
        single = k.triton_sparse_table.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, single_n)
        assert all(torch.equal(x, y) for x, y in zip((table, num, n1), single, strict=True))
        assert int(got_n.total) == int(single_n.total)
        if parts and may_demote and k_blocks > 0:  # split by bits as the partition splits it
            _check_parts(k, q, pool, blocks, tier, k_blocks, cost, options, table, num, device)
    for name, x, y in (("table", table, want_table), ("num_cold", num, want_num), ("num_l1", n1, want_n1)):
        assert x.dtype == y.dtype == torch.int32 and x.shape == y.shape, name
    assert torch.equal(num, want_num) and torch.equal(n1, want_n1)
    assert int(got_n.total) == int(want_n.total) > 0
    positions = torch.arange(table.shape[2], device=device)
    assert (table[positions >= num[..., None]] == -1).all()
    l2 = [blocks[i][(blocks[i] >= 0) & (tier[blocks[i].clamp(min=0)] == L2)] for i in range(b)]
    for i in range(b):
        bound = quest_scores_ref(q[i : i + 1], pool, l2[i][None].to(torch.int32),
                                 torch.tensor([len(l2[i])], dtype=torch.int32, device=device))[0]  # fmt: skip
        for j in range(h):
            a, c = int(n1[i, j]), int(num[i, j])
            assert torch.equal(table[i, j, :a], want_table[i, j, :a]), f"L1 blocks of row ({i}, {j})"
            _assert_selected(table[i, j, a:c].tolist(), want_table[i, j, a:c].tolist(),
                             dict(zip(l2[i].tolist(), bound[j].tolist())), f"row ({i}, {j})")  # fmt: skip


def _check_parts(k, q, pool, blocks, tier, k_blocks: int, cost, options, table, num, device: str) -> None:
    """The split selection given a partition to write (``parts``): the same table, counts and bytes, and
    the table split by bits exactly as ``partition_by_bits_ref`` splits it, with the merge's first L1 step
    loaded after its top-k network and before it (``merge_l1_ahead``). Each output starts filled with a
    value no kernel writes, so an entry left unwritten shows."""
    from kvtune.kernels.bits_partition_ref import empty_partition, partition_by_bits_ref
    from kvtune.kernels.sparse_table import ByteCount

    b, h, w = table.shape
    want = partition_by_bits_ref(table, num, pool.block_bits)
    split = k.triton_sparse_split.sparse_block_table_split_triton
    for ahead in (False, True):
        parts = empty_partition(b, h, w, device)
        for x in parts:
            x.fill_(-7)
        count = ByteCount(cost, 11, torch.zeros((), dtype=torch.int64, device=device))
        opts = dataclasses.replace(options, merge_l1_ahead=ahead)
        got = split(q, pool, blocks, tier, k_blocks, count, opts, parts=parts)
        assert all(torch.equal(x, y) for x, y in zip(got, (table, num), strict=False)), "the table changed"
        for name, x, y in zip(("table", "counts", "positions"), parts, want, strict=True):
            assert torch.equal(x, y), f"split by bits (L1 ahead {ahead}): {name} differs from the reference"


# (sequences, KV heads, group, head dim, blocks per row, k_blocks): k_blocks 0, 1, above the 64-block chunk
# and not a power of two; many chunks for a few blocks (the k-th best filters most); rows longer than one
# step of the split (512)
CPU_TABLES = [(1, 1, 1, 32, 1, 8), (3, 2, 3, 32, 9, 2), (3, 2, 3, 32, 70, 16), (2, 2, 2, 32, 5, 0),
              (4, 1, 1, 32, 40, 1), (3, 3, 2, 64, 150, 100), (3, 2, 2, 32, 400, 3),
              (2, 2, 4, 32, 600, 24)]  # fmt: skip
GPU_TABLES = [(16, 8, 4, 128, 512, 32), (64, 8, 4, 128, 130, 32), (5, 3, 7, 64, 300, 8), (3, 2, 3, 32, 9, 16),
              (4, 8, 4, 128, 2000, 100)]  # fmt: skip


@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks"), CPU_TABLES)
@pytest.mark.parametrize("pool_kind", list(POOLS))
def test_sparse_block_table_interpreted(kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int,
                                        pool_kind: str) -> None:  # fmt: skip
    check_sparse_table(kernels, b, h, g, d, m, k_blocks, pool_kind, "cpu", seed=b * 100 + m)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks"), GPU_TABLES)
@pytest.mark.parametrize("pool_kind", list(POOLS))
def test_sparse_block_table_gpu(gpu_kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int,
                                pool_kind: str) -> None:  # fmt: skip
    check_sparse_table(gpu_kernels, b, h, g, d, m, k_blocks, pool_kind, "cuda", seed=b + m)


# ---- the split selection (several programs score a row's L2 blocks, a second launch merges their top-k)
def _split(splits: int | None, build: str = "8:64") -> Any:
    """The split selection with ``splits`` spans a row (None: planned), its span programs at ``build``
    (``warps:chunk``; at 8 warps capped at 128 registers, two programs a multiprocessor, the build before
    one-warp spans; fewer warps uncapped, as a one-warp program needs)."""
    from kvtune.kernels.sparse_table_choice import SelectOptions

    warps, chunk = (int(x) for x in build.split(":"))
    return SelectOptions(split=True, splits=splits, warps=warps, chunk=chunk,
                         maxnreg=128 if warps == 8 else None)  # fmt: skip


@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks"), [t for t in CPU_TABLES if t[5] > 0])
@pytest.mark.parametrize("pool_kind", ["int8 mixed", "int4"])
# spans planned (a CPU plans with 4 multiprocessors) or 3 at most; one-warp span programs, 16 blocks a step
@pytest.mark.parametrize(("splits", "build"), [(None, "8:64"), (3, "8:64"), (3, "1:16")])
def test_split_selection_interpreted(kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int,
                                     pool_kind: str, splits: int | None, build: str) -> None:  # fmt: skip
    check_sparse_table(kernels, b, h, g, d, m, k_blocks, pool_kind, "cpu", seed=b * 100 + m,
                       options=_split(splits, build), parts=splits is None and m >= 40)  # fmt: skip


# 16 x 32K-like rows (Llama-3-8B heads, top 32) and SmolLM2-like heads; spans planned, and 5 wanted (4 at
# 512); the span programs at 8 warps and 64 blocks a step, and at 1, 2 and 4 warps with smaller steps
GPU_SPLITS = [(*t, pool, splits, build) for t in (GPU_TABLES[0], GPU_TABLES[2])
              for pool in ("int8 mixed", "int4", "unquantized") for splits in (None, 5)
              for build in ("8:64", "4:32", "2:16", "1:16")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks", "pool_kind", "splits", "build"), GPU_SPLITS)
def test_split_selection_gpu(gpu_kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int,
                             pool_kind: str, splits: int | None, build: str) -> None:  # fmt: skip
    check_sparse_table(gpu_kernels, b, h, g, d, m, k_blocks, pool_kind, "cuda", seed=b + m,
                       options=_split(splits, build))  # fmt: skip


def _tied_rows(levels: int, device: str, m: int = 70, h: int = 2, g: int = 2, d: int = 32) -> tuple[Any, ...]:
    """q, an 8-bit pool with demoted blocks whose key bounds take ``levels`` values (each block a copy of
    one of the first ``levels`` blocks), blocks [4, m], tiers: row 0 all L2, row 1 empty, row 2 three L2
    blocks (fewer than k), row 3 random tiers."""
    from kvtune.kernels.layout import ColdLayout
    from kvtune.kernels.quant import seal_blocks_ref
    from kvtune.kernels.requant import requantize_int4_ref
    from kvtune.kernels.sparse_table import L1, L2

    gen = torch.Generator(device=device).manual_seed(levels)
    n = 4 * m + levels
    pool = ColdLayout(8, h, d, 8, torch.float32).allocate(n, device)
    kv = torch.randn(2, n, 8, h, d, generator=gen, device=device)
    seal_blocks_ref(pool, torch.arange(n, device=device), kv[0], kv[1], 8)
    requantize_int4_ref(pool, torch.arange(1, n, 2, device=device))
    src = torch.randint(0, levels, (n,), generator=gen, device=device)
    for name in ("k_min", "k_scale", "block_bits"):
        getattr(pool, name).copy_(getattr(pool, name)[src])
    blocks = torch.randperm(n, generator=gen, device=device)[: 4 * m].view(4, m)
    blocks[1] = -1
    tier = torch.randint(L1, L2 + 1, (n,), generator=gen, device=device).to(torch.int8)
    tier[blocks[0]] = L2
    tier[blocks[2]] = L1
    tier[blocks[2, [5, m // 2, m - 1]]] = L2
    return torch.randn(4, h * g, d, generator=gen, device=device), pool, blocks, tier


def check_ties(k, levels: int, k_blocks: int, kernel: str, device: str) -> None:
    """The tie rule: of equal bounds the block later in the row first, and kept where the k-th place falls
    among them. With one level the selection is the row's last k_blocks L2 blocks, newest first; with three
    the table equals the reference's exactly (its order among equal bounds is the rule alone)."""
    from kvtune.kernels.sparse_table import ByteCount, sparse_block_table_ref

    q, pool, blocks, tier = _tied_rows(levels, device)
    cost = torch.arange(9, device=device, dtype=torch.int64) * 1000 + 7
    got_n, want_n = (ByteCount(cost, 11, torch.zeros((), dtype=torch.int64, device=device)) for _ in range(2))
    if kernel == "reference":
        got = sparse_block_table_ref(q, pool, blocks, tier, k_blocks, got_n)
    else:
        options = _split(2) if kernel == "split" else None
        got = _launch(k, options)(q, pool, blocks, tier, k_blocks, got_n)
    want = sparse_block_table_ref(q, pool, blocks, tier, k_blocks, want_n)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)) and int(got_n.total) == int(
        want_n.total
    )
    table, num, n1 = got
    assert num[1].tolist() == n1[1].tolist() == [0, 0] and (table[1] == -1).all()  # the empty row
    assert (num[2] - n1[2]).tolist() == [min(3, k_blocks)] * 2  # fewer L2 blocks than k
    if levels == 1:  # row 0 is all L2 blocks of one bound
        newest = blocks[0].flip(0)[:k_blocks].to(torch.int32)
        assert all(torch.equal(table[0, j, :k_blocks], newest) for j in range(table.shape[1]))


@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("k_blocks", [5, 64])
@pytest.mark.parametrize("kernel", ["single", "split"])
def test_ties_interpreted(kernels, levels: int, k_blocks: int, kernel: str) -> None:
    check_ties(kernels, levels, k_blocks, kernel, "cpu")


@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("k_blocks", [5, 64])
def test_reference_tie_rule(levels: int, k_blocks: int) -> None:
    check_ties(None, levels, k_blocks, "reference", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("k_blocks", [5])
@pytest.mark.parametrize("kernel", ["single", "split"])
def test_ties_gpu(gpu_kernels, levels: int, k_blocks: int, kernel: str) -> None:
    check_ties(gpu_kernels, levels, k_blocks, kernel, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "m"), [(16, 511), (4, 2047)])  # 16 x 32K and 4 x 128K in blocks of 64
def test_split_selection_in_a_cuda_graph_gpu(gpu_kernels, b: int, m: int) -> None:
    """Both launches of the split selection captured in a CUDA graph: a replay on new queries and tiers
    gives the table, counts and bytes of an eager launch of the default kernel on the same inputs."""
    from kvtune.kernels.layout import ColdLayout
    from kvtune.kernels.sparse_table import L1, L2, ByteCount

    h, dev = 8, "cuda"
    pool = ColdLayout(64, h, 128, 8, torch.bfloat16).allocate(b * m, dev)
    pool.k_min.normal_()
    pool.k_scale.uniform_(0.001, 0.01)
    pool.block_bits[torch.randperm(b * m, device=dev)[: b * m // 2]] = 4
    blocks = torch.randperm(b * m, device=dev).view(b, m)
    q = torch.randn(b, 4 * h, 128, device=dev, dtype=torch.bfloat16)
    tier = torch.full((b * m,), L2, device=dev, dtype=torch.int8)
    count = ByteCount(
        torch.arange(9, device=dev) * 1000 + 7, 4096, torch.zeros((), dtype=torch.int64, device=dev)
    )

    def run() -> tuple[torch.Tensor, ...]:
        return _launch(gpu_kernels, _split(None))(q, pool, blocks, tier, 32, count)

    run()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    q.normal_()
    tier[blocks[:, -m // 8 :]] = L1  # the newest eighth of each row to L1
    count.total.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = int(count.total)
    eager_n = ByteCount(count.cost, 4096, torch.zeros((), dtype=torch.int64, device=dev))
    eager = gpu_kernels.triton_sparse_table.sparse_block_table_triton(q, pool, blocks, tier, 32, eager_n)
    assert all(torch.equal(x, y) for x, y in zip(captured, eager, strict=True))
    assert replayed == int(eager_n.total) > 0


# ---- the whole cache on the Triton kernels
DISPATCHERS = ("elementwise", "decode_attention", "access", "quant", "requant", "quest", "sparse_table")


def _prefilled_cache(seed: int, steps: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences (60 and 75 tokens) prefilled into a 2-layer INT8 cache with a sparse tier, and the q/k/v
    of their next ``steps`` tokens."""
    from kvtune.cache_impl.config import HybridConfig
    from kvtune.cache_impl.hybrid_cache import HybridCache, ModelKVShape

    shape = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4, dtype=torch.float32)
    cfg = HybridConfig("hybrid_v2", hot_tokens=16, block_size=8, quantization_bits=8, sparse_top_k=16,
                       migration_interval=4, migration_threshold_ms=5.0)  # fmt: skip
    cache = HybridCache(cfg, shape, 1 << 22, "cpu", max_seqs=2)
    g = torch.Generator().manual_seed(seed)
    n = 75 + steps
    q = torch.randn(2, n, 4, 32, generator=g)
    k, v = torch.randn(2, n, 2, 32, generator=g), torch.randn(2, n, 2, 32, generator=g)
    for sid, length in ((0, 60), (1, 75)):
        cache.add_sequence(sid, list(range(sid * 100, sid * 100 + length)))
        for layer in range(2):
            cache.prefill(layer, sid, q[layer, :length], k[layer, :length], v[layer, :length])
    return cache, q, k, v


def _run_cache(seed: int, steps: int) -> tuple[list[torch.Tensor], dict, torch.Tensor]:
    """Two sequences prefilled and decoded ``steps`` steps (seals, demotions to L2, Quest selection); the
    outputs of every step, the cache's stats and its tiers."""
    cache, q, k, v = _prefilled_cache(seed, steps)
    outs = []
    for t in range(steps):
        plan = cache.begin_step([0, 1], 10.0 * t)
        rows = [60 + t, 75 + t]
        layers = [cache.decode(i, plan, q[i, rows], k[i, rows], v[i, rows]) for i in range(2)]
        outs.append(torch.stack(layers))
        cache.end_step(plan)
    cache.check_integrity()
    return outs, cache.stats(), cache.tiers.tier.clone()


def test_cache_on_the_triton_kernels_equals_the_references_interpreted(
    kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's CUDA path (every launcher, the plan's tables, the flags buffer, the byte count) run by the
    interpreter on CPU tensors gives the reference path's outputs, tiers and statistics."""
    want = _run_cache(seed=3, steps=12)
    for name in DISPATCHERS:
        monkeypatch.setattr(importlib.import_module(f"kvtune.kernels.{name}"), "use_triton", lambda t: True)
    got = _run_cache(seed=3, steps=12)
    assert want[1]["l2_blocks"] > 0 and want[1]["migrations_done"] > 0  # the sparse tier was exercised
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    assert got[1] == want[1]
    assert torch.equal(got[2], want[2])


class _Padded:
    """A static step's shape rounded up as graph buckets are: 4 rows, a 16-block table, 2 seal entries."""

    def rows_for(self, batch: int) -> int:
        return 4

    def width_for(self, blocks: int) -> int:
        return 16

    def seals_for(self, seals: int) -> int:
        return 2


def _run_static(seed: int, steps: int) -> tuple[list[torch.Tensor], dict, torch.Tensor]:
    """``_run_cache`` through the static step (what a CUDA graph replays): seals before the step, padded
    rows, a fixed table width, the clock, threshold and planning flag in the step buffers, the tier work on
    the device."""
    from kvtune.cache_impl.plan import StepBuffers

    cache, q, k, v = _prefilled_cache(seed, steps)
    buffers, policy = StepBuffers(4, 16, "cpu"), _Padded()
    slots = np.asarray([cache.slot_of(0), cache.slot_of(1)])
    outs = []
    for t in range(steps):
        info = cache.prepare_step(slots, np.zeros(2, dtype=np.int64), 10.0 * t, buffers, policy)
        if info.num_seals:
            cache.seal_static(buffers, info.seal_rows)
        plan, extra = buffers.plan(info.rows, info.width, 2), info.rows - 2
        rows = [60 + t, 75 + t]
        qp, kp, vp = (torch.cat([x[:, rows], x.new_zeros((2, extra, *x.shape[2:]))], 1) for x in (q, k, v))
        layers = [cache.decode(i, plan, qp[i], kp[i], vp[i])[:2] for i in range(2)]
        cache.migrate_static(buffers)  # the tier planning and migrations, inside the step (as in its graph)
        outs.append(torch.stack(layers))
        cache.finish_step(info)
    cache.check_integrity()
    return outs, cache.stats(), cache.tiers.tier.clone()


def test_static_step_on_the_triton_kernels_equals_the_references_interpreted(
    kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The static step (clock read from the step buffers, sparse table at a fixed width, seals before the
    step) on the Triton kernels, interpreted, gives the reference static step's outputs and statistics, and
    the eager step's."""
    eager = _run_cache(seed=3, steps=12)
    want = _run_static(seed=3, steps=12)
    for name in DISPATCHERS:
        monkeypatch.setattr(importlib.import_module(f"kvtune.kernels.{name}"), "use_triton", lambda t: True)
    got = _run_static(seed=3, steps=12)
    assert want[1]["l2_blocks"] > 0 and want[1]["migrations_done"] > 0  # the sparse tier was exercised
    for step, (a, b, c) in enumerate(zip(got[0], want[0], eager[0])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-4, msg=f"step {step} (eager)")
    assert got[1] == want[1] == eager[1]
    assert torch.equal(got[2], want[2]) and torch.equal(want[2], eager[2])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_no_kernel_compiles_inside_a_timed_replay_gpu(gpu_kernels, monkeypatch, bits: int) -> None:
    """On the GPU, every Triton compilation of a replay falls in its warm-up: the timed part (a sparse tier,
    a changing batch, seals, demotions) compiles nothing."""
    from triton.runtime.jit import JITFunction

    from kvtune.cache_impl.config import HybridConfig
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.traces import Request

    phase = ["load"]
    compiled: list[tuple[str, str]] = []
    do_compile, run = JITFunction._do_compile, Engine._run

    def recording_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append((phase[0], self.__name__))
        return do_compile(self, *args, **kwargs)

    def phased_run(self: Any, *args: Any, compile_kernels: bool = False, **kwargs: Any) -> Any:
        phase[0] = "warm-up" if compile_kernels else "timed"
        return run(self, *args, compile_kernels=compile_kernels, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", recording_compile)
    monkeypatch.setattr(Engine, "_run", phased_run)
    model = load_model("random:smollm2-135m", torch.device("cuda"), dtype=torch.bfloat16)
    config = HybridConfig(
        "hybrid_v2", hot_tokens=16, block_size=16, quantization_bits=bits, sparse_top_k=64,
        migration_interval=8, migration_threshold_ms=1.0,
    )  # fmt: skip
    requests = [Request(i, 5.0 * i, 96 + 37 * i, 40 + 3 * i) for i in range(12)]
    engine = Engine(model, config, 1 << 30, torch.device("cuda"), SchedulerConfig(max_num_seqs=8))
    engine.replay(requests, time_scale=1.0, warmup_requests=2)
    timed = sorted({name for when, name in compiled if when == "timed"})
    warmed = {name for when, name in compiled if when == "warm-up"}
    assert not timed, f"compiled inside the timed replay: {timed} (warm-up compiled {sorted(warmed)})"
