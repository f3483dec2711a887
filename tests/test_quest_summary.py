"""The float8 summary of Quest's key bounds (:mod:`kvtune.kernels.quest_summary`): its bounds hold, the single
and split Triton selections from it equal the reference's, and it selects most of what the fp16 bounds do.

As in ``test_triton_step.py``: the ``interpreted`` tests run in the TRITON_INTERPRET=1 child process of
``test_triton_kernels.test_interpreted_suite`` on tiny shapes (the interpreter loads and converts float8
tiles), the ``gpu`` ones on a GPU with larger shapes; the rest are plain PyTorch on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtune.kernels.layout import ColdLayout, ColdPool, key_bounds
from kvtune.kernels.quant import seal_blocks_ref
from kvtune.kernels.quest_summary import E4M3, outward, outward_codes, summary8
from kvtune.kernels.requant import requantize_int4_ref
from kvtune.kernels.sparse_table import L1, L2, ByteCount, sparse_block_table_ref
from kvtune.tests.triton_testlib import INTERPRETING, fixtures

pytest.importorskip("triton")

MODULES = ("triton_sparse_table", "triton_sparse_split", "triton_quant")
# pool kinds: (pool bits, a third of the blocks demoted to 4 bits, may_demote)
POOLS = {"int8 mixed": (8, True, True), "int8": (8, False, False), "int4": (4, False, False),
         "unquantized": (0, False, False)}  # fmt: skip

kernels, gpu_kernels = fixtures(MODULES)


def _pool(kind: str, n: int, h: int, d: int, gen: torch.Generator, device: str, bs: int = 8) -> ColdPool:
    """n blocks of random keys and values (keys ~ 3·N(0, 1) plus a per-channel offset, as real keys have
    outlier channels), sealed with the kind's bits; some blocks copy another's key bounds (equal bounds)."""
    bits, demote, may_demote = POOLS[kind]
    pool = ColdLayout(bs, h, d, bits, torch.float32).allocate(n, device)
    pool.may_demote = may_demote
    kv = torch.randn(2, n, bs, h, d, generator=gen, device=device) * 3
    kv[0] += torch.randn(h, d, generator=gen, device=device) * 4
    seal_blocks_ref(pool, torch.arange(n, device=device), kv[0], kv[1], bits)
    if demote:
        requantize_int4_ref(pool, torch.randperm(n, generator=gen, device=device)[: n // 3])
    src, dst = torch.randperm(n, generator=gen, device=device)[: 2 * (n // 8)].view(2, -1)
    for name in ("k_min", "k_scale", "block_bits"):
        getattr(pool, name)[dst] = getattr(pool, name)[src]
    return pool


def _rows(pool: ColdPool, b: int, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """b rows of m scattered blocks (a shared prefix, -1 padding, row 1 without L2 blocks), random tiers."""
    device = pool.k_min.device
    blocks = torch.randperm(pool.num_blocks, generator=gen, device=device)[: b * m].view(b, m)
    blocks[:, : m // 4] = blocks[:1, : m // 4]
    lengths = torch.randint(0, m + 1, (b,), generator=gen, device=device)
    lengths[0] = m
    blocks = torch.where(torch.arange(m, device=device) < lengths[:, None], blocks, -1)
    tier = torch.randint(L1, L2 + 1, (pool.num_blocks,), generator=gen, device=device).to(torch.int8)
    if b > 1:
        tier[blocks[1][blocks[1] >= 0]] = L1
    return blocks, tier


def _count(device: str, quest_cost: int = 11) -> ByteCount:
    cost = torch.arange(9, device=device, dtype=torch.int64) * 1000 + 7
    return ByteCount(cost, quest_cost, torch.zeros((), dtype=torch.int64, device=device))


# ---- the summary's bounds
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
E4M3_VALUES = E4M3_VALUES[E4M3_VALUES.isfinite()].unique()  # every finite value, ascending (one zero)


def test_outward_is_the_nearest_value_on_the_side_asked() -> None:
    """Rounded down, a value is the largest e4m3 value at or below it; rounded up, the smallest at or above:
    exact values, halfway points, subnormals (below 2^-6) and values rounding to a zero of either sign."""
    halfway = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
    edges = torch.tensor([1e-4, -1e-4, 0.0, -0.0, 448.0, -448.0])
    x = torch.cat([E4M3_VALUES, halfway, torch.randn(4000) * 50, torch.randn(1000) * 0.01, edges])
    x = x.clamp(-448, 448)
    below = torch.where(E4M3_VALUES[None, :] <= x[:, None], E4M3_VALUES, -float("inf")).amax(1)
    above = torch.where(E4M3_VALUES[None, :] >= x[:, None], E4M3_VALUES, float("inf")).amin(1)
    assert torch.equal(outward(x, E4M3, up=False), below)
    assert torch.equal(outward(x, E4M3, up=True), above)
    assert torch.equal(outward(x.double(), E4M3, up=True), above)  # a float64 input rounds once, not twice


@pytest.mark.parametrize("kind", list(POOLS))
def test_summary_bounds_every_key(kind: str) -> None:
    """lo <= the key min and lo + span >= the key max (``min + scale · levels``, the block's levels) in
    float32, channel by channel; and each is the nearest e4m3 value on its side (lo the largest at or below
    the min)."""
    gen = torch.Generator().manual_seed(len(kind))
    pool = _pool(kind, 64, 2, 32, gen, "cpu")
    summary = summary8(pool)
    assert summary.lo.dtype == summary.span.dtype == E4M3 and summary.lo.shape == pool.k_min.shape
    k_min, k_max = key_bounds(pool, torch.arange(pool.num_blocks))
    lo, span = summary.lo.float(), summary.span.float()
    assert (lo <= k_min).all() and (lo + span >= k_max).all()
    assert torch.equal(lo, outward(k_min, E4M3, up=False))
    assert (span > 0).all() and (span <= 448).all()
    assert summary.bytes_per_block == 2 * 2 * 32  # a byte of lo and one of span per channel and KV head


def test_summary_refuses_bounds_past_the_e4m3_range() -> None:
    """No e4m3 value bounds a key min or span past 448: the summary is refused, naming the rule."""
    pool = ColdLayout(8, 1, 4, 4, torch.float32).allocate(2, "cpu")
    pool.k_min[1, 0, 2] = -460.0
    with pytest.raises(ValueError, match="448"):
        summary8(pool)
    pool.k_min[1, 0, 2] = -300.0
    pool.k_scale[1, 0, 2] = 12.0  # max = -300 + 12 · 15 = -120: the span is 180
    summary8(pool)
    pool.k_scale[1, 0, 2] = 40.0  # the span is 600
    with pytest.raises(ValueError, match="448"):
        summary8(pool)


# ---- the selection from the summary: the Triton kernels against the reference
def check_summary_table(k: Any, b: int, h: int, g: int, d: int, m: int, k_blocks: int, kind: str, device: str,
                        splits: int | None) -> None:  # fmt: skip
    """The table, counts and bytes of the single kernel (``splits`` None) or the split one (``splits`` spans
    at most) with the summary equal the reference's with it, exactly: the bounds are the same sums over the
    same e4m3 values, and equal bounds (blocks sharing key bounds) follow the same tie rule. Quest's bytes
    are the summary's, not ``quest_cost``."""
    from kvtune.kernels.sparse_table_choice import SelectOptions

    gen = torch.Generator(device=device).manual_seed(b * 100 + m)
    pool = _pool(kind, b * m + 3, h, d, gen, device)
    blocks, tier = _rows(pool, b, m, gen)
    q = torch.randn(b, h * g, d, generator=gen, device=device)
    summary = summary8(pool)
    got_n, want_n = _count(device), _count(device)
    if splits is None:
        got = k.triton_sparse_table.sparse_block_table_triton(q, pool, blocks, tier, k_blocks, got_n, summary)
    else:
        opts = SelectOptions(split=True, splits=splits)
        launch = k.triton_sparse_split.sparse_block_table_split_triton
        got = launch(q, pool, blocks, tier, k_blocks, got_n, opts, summary)
    want = sparse_block_table_ref(q, pool, blocks, tier, k_blocks, want_n, summary)
    for name, x, y in zip(("table", "num_cold", "num_l1"), got, want, strict=True):
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y), name
    assert int(got_n.total) == int(want_n.total)
    table = want[0]  # the bytes: each table entry's cost by its bits, and the summary's per L2 block
    attended = torch.where(table >= 0, want_n.cost[pool.block_bits[table.clamp(min=0)].long()], 0).sum()
    l2 = int(((blocks >= 0) & (tier[blocks.clamp(min=0)] == L2)).sum())
    assert l2 > 0 and int(want_n.total) == int(attended) + l2 * summary.bytes_per_block


# (sequences, KV heads, group, head dim, blocks per row, k_blocks): top 1, above the 64-block chunk, several
# chunks of rows longer than the k-th best (the split's spans), head dim 64
CPU_TABLES = [(3, 2, 3, 32, 9, 2), (2, 2, 2, 32, 150, 5), (2, 1, 4, 64, 40, 1), (2, 2, 1, 32, 70, 80)]
GPU_TABLES = [(16, 8, 4, 128, 512, 32), (5, 3, 7, 64, 300, 8), (4, 8, 4, 128, 2000, 100)]


@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks"), CPU_TABLES)
@pytest.mark.parametrize("kind", ["int8 mixed", "int4", "unquantized"])
@pytest.mark.parametrize("splits", [None, 3])
def test_summary_selection_interpreted(kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int,
                                       kind: str, splits: int | None) -> None:  # fmt: skip
    check_summary_table(kernels, b, h, g, d, m, k_blocks, kind, "cpu", splits)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "h", "g", "d", "m", "k_blocks"), GPU_TABLES)
@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("splits", [None, 5])
def test_summary_selection_gpu(gpu_kernels, b: int, h: int, g: int, d: int, m: int, k_blocks: int, kind: str,
                               splits: int | None) -> None:  # fmt: skip
    check_summary_table(gpu_kernels, b, h, g, d, m, k_blocks, kind, "cuda", splits)


@pytest.mark.skipif(INTERPRETING, reason="kernels defined under the interpreter do not compile")
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.parametrize("kind", ["int8 mixed", "int4"])
@pytest.mark.parametrize("split", [False, True])
def test_summary_kernels_compile_from_ada_on(arch: str, kind: str, split: bool) -> None:
    """The launches with a summary (Llama-3-8B heads, 16 rows of 512 blocks, top 32) compile for sm_89 and
    sm_90, on any machine (:mod:`kvtune.kernels.aot`), and score e4m3 tiles; for sm_80 and sm_86 Triton has
    no e4m3 loads, which is why the dispatcher refuses a summary there (next test)."""
    from kvtune.kernels.aot import compile_launch, record_launches, target_of
    from kvtune.kernels.arch import ARCHS
    from kvtune.kernels.sparse_table_choice import SelectOptions
    from kvtune.kernels.triton_sparse_split import sparse_block_table_split_triton
    from kvtune.kernels.triton_sparse_table import sparse_block_table_triton

    pool = _pool(kind, 40, 8, 128, torch.Generator().manual_seed(0), "cpu")
    blocks, tier = (torch.arange(16 * 512) % 40).view(16, 512), torch.full((40,), L2, dtype=torch.int8)
    args = (torch.zeros(16, 32, 128, dtype=torch.bfloat16), pool, blocks, tier, 32, _count("cpu"))
    if split:
        launches = record_launches(lambda: sparse_block_table_split_triton(*args, SelectOptions(split=True),
                                                                           summary8(pool)))  # fmt: skip
    else:
        launches = record_launches(lambda: sparse_block_table_triton(*args, summary8(pool)))
    assert len(launches) == 1 + split and launches[0].kwargs["SUMMARY8"]
    target = target_of(ARCHS[arch])
    if not ARCHS[arch].fp8:
        with pytest.raises(Exception, match=r"fp8e4nv not supported in this architecture"):
            compile_launch(launches[0], target)
        return
    ptx = [compile_launch(launch, target).asm["ptx"] for launch in launches]
    assert all(f".target {arch}" in p for p in ptx) and "e4m3" in ptx[0]


def test_the_selection_refuses_a_summary_below_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an A100 or an A10G the selection refuses a summary in one line naming the rule and the way out,
    before any launch."""
    from kvtune.kernels import sparse_table
    from kvtune.kernels.arch import ARCHS

    pool = _pool("int4", 8, 2, 32, torch.Generator().manual_seed(0), "cpu")
    blocks, tier = torch.arange(8).view(1, 8), torch.full((8,), L2, dtype=torch.int8)
    monkeypatch.setattr(sparse_table, "use_triton", lambda q: True)
    for arch in ("sm_80", "sm_86"):
        monkeypatch.setattr(sparse_table, "arch_of", lambda device, arch=arch: ARCHS[arch])
        with pytest.raises(ValueError, match=f"needs sm_89 or newer .e4m3 loads., but cpu is {arch}: select"):
            sparse_table.sparse_block_table(torch.zeros(1, 4, 32), pool, blocks, tier, 2, _count("cpu"),
                                            summary=summary8(pool))  # fmt: skip


# ---- the selection from the summary against the fp16 one
def _selected(table: torch.Tensor, num: torch.Tensor, n1: torch.Tensor) -> list[set[int]]:
    """The selected L2 blocks of each (sequence, KV head) row, as sets."""
    return [set(table[i, j, n1[i, j] : num[i, j]].tolist()) for i in range(table.shape[0])
            for j in range(table.shape[1])]  # fmt: skip


@pytest.mark.parametrize("kind", ["int8 mixed", "int4"])
def test_summary_selects_most_of_the_fp16_selection(kind: str) -> None:
    """Rows of 400 blocks, top 32, 4 KV heads of 4 query heads, head dim 64: of the blocks the fp16 bounds
    select, the summary's keep >= 80 % per row on average, >= 70 % in every row. Rounding widens a
    channel's bounds by less than one e4m3 step (6-12 % of the value), so only blocks whose bounds lie near
    the k-th best change sides: 87-92 % are kept on these rows (seeds 7-9, every pool kind; rows >= 81 %;
    real keys, ``lab/scripts/quest_fp8.py``: 95-97.5 %). A summary that lost the ordering keeps far less:
    without the levels ~25 %, with lo's sign flipped ~17 %, a random choice 8 % (32 of 400)."""
    gen = torch.Generator().manual_seed(7)
    pool = _pool(kind, 2 * 400, 4, 64, gen, "cpu")
    blocks = torch.randperm(pool.num_blocks, generator=gen).view(2, 400)
    tier = torch.full((pool.num_blocks,), L2, dtype=torch.int8)
    q = torch.randn(2, 16, 64, generator=gen)
    fp16 = _selected(*sparse_block_table_ref(q, pool, blocks, tier, 32, _count("cpu")))
    fp8 = _selected(*sparse_block_table_ref(q, pool, blocks, tier, 32, _count("cpu"), summary8(pool)))
    shared = [len(a & b) / len(a) for a, b in zip(fp16, fp8, strict=True)]
    assert all(len(a) == len(b) == 32 for a, b in zip(fp16, fp8, strict=True))
    assert sum(shared) / len(shared) >= 0.8 and min(shared) >= 0.7, shared


@pytest.mark.parametrize("kind", ["int4", "unquantized"])
def test_summary_of_e4m3_bounds_selects_the_same_blocks(kind: str) -> None:
    """Where the fp16 key mins are e4m3 values and the ranges (scale · levels) too, the summary holds the
    same bounds (no rounding): it selects the same blocks, in the same order. 4 bits: scales are powers of
    two (15 · 2^e has 4 significant bits); unquantized: scales are e4m3 values."""
    gen = torch.Generator().manual_seed(3)
    pool = _pool(kind, 2 * 150, 2, 32, gen, "cpu")
    pool.k_min.copy_((pool.k_min.float() * 4).round().div(4).to(E4M3).float())
    if kind == "int4":
        pool.k_scale.copy_(torch.exp2(torch.randint(-6, 1, pool.k_scale.shape, generator=gen)))
    else:
        pool.k_scale.copy_(pool.k_scale.float().to(E4M3).float())
    summary = summary8(pool)
    k_min, k_max = key_bounds(pool, torch.arange(pool.num_blocks))
    assert torch.equal(summary.lo.float(), k_min) and torch.equal(summary.span.float(), k_max - k_min)
    blocks, tier = _rows(pool, 2, 150, gen)
    q = torch.randn(2, 6, 32, generator=gen)
    want = sparse_block_table_ref(q, pool, blocks, tier, 20, _count("cpu"))
    got = sparse_block_table_ref(q, pool, blocks, tier, 20, _count("cpu"), summary)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


# ---- the summary the cache keeps: written by the seal and both demotions, bit for bit the reference's
def test_outward_codes_equal_outward_and_saturate() -> None:
    """The integer rounding on the float32 bits (the seal kernels') gives :func:`outward`'s values on every
    e4m3 value, the halfway points, subnormals and zeros of either sign; past ±448 it saturates at ±448."""
    halfway = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
    x = torch.cat([E4M3_VALUES, halfway, torch.randn(4000) * 50, torch.randn(1000) * 0.01,
                   torch.tensor([1e-4, -1e-4, 0.0, -0.0, 7.94, 0.0089])]).clamp(-448, 448)  # fmt: skip
    for up in (False, True):
        assert torch.equal(outward_codes(x, up).view(E4M3).float(), outward(x, E4M3, up))
    big = outward_codes(torch.tensor([449.0, 500.0, 1e6, -449.0, -1e6]), up=True).view(E4M3).float()
    assert big.tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]


def test_layout_keeps_a_summary_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout with ``summary`` allocates e4m3 lo and span per layer (at the key mins' strides) and counts
    their 2 bytes a channel; the cache's layout keeps one with the sparse tier: by default (auto) only on a
    GPU that loads e4m3, never on the CPU; everywhere with KVTUNE_QUEST_SUMMARY=1, nowhere with 0; any other
    value is refused in one line."""
    from kvtune.cache_impl.layout import QUEST_SUMMARY_ENV, ModelKVShape, cache_layout, cold_layout
    from kvtune.tests.cache_testlib import config

    plain, kept = (ColdLayout(16, 2, 32, 8, torch.float16, summary=x) for x in (False, True))
    assert kept.bytes_per_block - plain.bytes_per_block == 2 * 2 * 32
    pools = kept.allocate_layers(3, 5, "cpu")
    for pool in pools:
        assert pool.summary is not None and pool.summary.lo.dtype == E4M3
        assert pool.summary.lo.stride() == pool.k_min.stride() and pool.summary.lo.shape == pool.k_min.shape
    assert plain.allocate(5, "cpu").summary is None and kept.allocate(5, "cpu").summary is not None
    shape = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4, dtype=torch.float16)
    dense = config(hot_tokens=32, block_size=16, quantization_bits=8)
    sparse = dense.replace(sparse_top_k=64)
    for unset in (None, "auto", ""):  # auto: the CPU cache does not keep it
        if unset is None:
            monkeypatch.delenv(QUEST_SUMMARY_ENV, raising=False)
        else:
            monkeypatch.setenv(QUEST_SUMMARY_ENV, unset)
        assert (
            not cold_layout(dense, shape).summary
            and not cache_layout(sparse, shape, 1 << 24, None, "cpu").summary
        )
    monkeypatch.setenv(QUEST_SUMMARY_ENV, "1")
    assert not cold_layout(dense, shape).summary and cold_layout(sparse, shape).summary
    on = cache_layout(sparse, shape, 1 << 24, None, "cpu")
    off = cache_layout(sparse.replace(sparse_top_k=0), shape, 1 << 24, None, "cpu")
    assert on.summary and on.cold.summary and on.block_bytes - off.block_bytes == 2 * (2 * 2 * 32)  # 2 layers
    monkeypatch.setenv(QUEST_SUMMARY_ENV, "0")
    assert not cold_layout(sparse, shape).summary
    monkeypatch.setenv(QUEST_SUMMARY_ENV, "yes")
    with pytest.raises(ValueError, match=r"^KVTUNE_QUEST_SUMMARY='yes': must be auto, 1 or 0$"):
        cold_layout(sparse, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the default follows it")
def test_a_gpu_cache_keeps_the_summary_by_default_where_it_loads_e4m3(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Auto: a sparse cache on a GPU of sm_89 or newer keeps the e4m3 summary and its selection reads it; on
    an older GPU it keeps only the fp16 bounds."""
    from kvtune.cache_impl.hybrid_cache import HybridCache
    from kvtune.cache_impl.layout import QUEST_SUMMARY_ENV, ModelKVShape
    from kvtune.tests.cache_testlib import config

    monkeypatch.delenv(QUEST_SUMMARY_ENV, raising=False)
    shape = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4, dtype=torch.float16)
    cache = HybridCache(config(hot_tokens=32, block_size=16, quantization_bits=8, sparse_top_k=64), shape,
                          1 << 24, "cuda")  # fmt: skip
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    assert cache.layout.summary == fp8 and all((p.summary is not None) == fp8 for p in cache.pools)


def _same_codes(a: ColdPool, b: ColdPool) -> bool:
    assert a.summary is not None and b.summary is not None
    return all(torch.equal(getattr(a.summary, n).view(torch.uint8), getattr(b.summary, n).view(torch.uint8))
               for n in ("lo", "span"))  # fmt: skip


def check_written_summary(kern: Any, bits: int, device: str) -> None:
    """Seal (the pool's bits, and 4 in an 8-bit pool's second layer), demote blocks by list and over a
    layer mask: the Triton kernels' e4m3 codes equal the reference's bit for bit, and :func:`summary8`'s
    where the keys fit e4m3's range; there lo ≤ every key and lo + span ≥ every key of the block. Keys at
    scales from 1e-3 to 300 (past ±448 the codes saturate alike)."""
    quant = kern.triton_quant
    gen = torch.Generator(device=device).manual_seed(bits)
    lay = ColdLayout(16, 2, 32, bits, torch.float16, summary=True)
    got, want = lay.allocate_layers(2, 7, device), lay.allocate_layers(2, 7, device)
    scale = torch.tensor([1e-3, 3.0, 30.0, 300.0, 1.0], device=device)[:, None, None, None]
    keys = (torch.randn(5, 16, 2, 32, generator=gen, device=device) * scale).half()
    vals = torch.randn(5, 16, 2, 32, generator=gen, device=device).half()
    ids = torch.tensor([0, 2, 3, 5, 6], device=device)
    for layer in range(2):
        seal_bits = 4 if bits == 8 and layer == 1 else bits
        quant.seal_blocks_triton(got[layer], ids, keys, vals, seal_bits)
        seal_blocks_ref(want[layer], ids, keys, vals, seal_bits)
        assert _same_codes(got[layer], want[layer]), layer
    fits = torch.tensor([True, True, True, False, True], device=device)  # the fourth block's keys pass 448
    for pool in want:
        s8 = summary8(ColdPool(pool.layout, *(getattr(pool, n)[ids[fits]] for n in
                      ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits"))))  # fmt: skip
        assert pool.summary is not None
        assert torch.equal(pool.summary.span[ids[fits]].view(torch.uint8), s8.span.view(torch.uint8))
        lo, span = pool.summary.lo[ids[fits]].float(), pool.summary.span[ids[fits]].float()
        kt = keys[fits].permute(0, 2, 1, 3).float()
        assert (lo <= kt.amin(2)).all() and (lo + span >= kt.amax(2)).all()
    if bits != 8:
        return
    quant.requantize_int4_triton(got[0], ids[:2])
    requantize_int4_ref(want[0], ids[:2])
    mask = torch.zeros(2, 7, dtype=torch.bool, device=device)
    mask[0, 3] = mask[0, 6] = mask[1, 5] = True
    quant.requantize_int4_masked_triton(got, mask)
    for layer in range(2):
        requantize_int4_ref(want[layer], torch.arange(7, device=device), where=mask[layer])
        assert torch.equal(got[layer].k_min, want[layer].k_min)
        assert _same_codes(got[layer], want[layer]), layer


@pytest.mark.parametrize("bits", [8, 4, 0])
def test_written_summary_interpreted(kernels, bits: int) -> None:
    check_written_summary(kernels, bits, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4, 0])
def test_written_summary_gpu(gpu_kernels, bits: int) -> None:
    check_written_summary(gpu_kernels, bits, "cuda")
