"""The Triton kernels against their plain-PyTorch references.

Where there is no GPU, the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) with tiny shapes
and fp16/fp32 model precision (``tl.dot`` on bf16 is wrong under the interpreter). Triton reads the variable
when a ``@triton.jit`` function is *defined* -- its own ``tl.zeros`` & co. when ``triton`` is imported, which
``import torch`` already does -- so setting it inside a running pytest process is too late. The interpreted
tests therefore run in one child pytest process started with the variable set (``test_interpreted_suite``, a
subprocess for this file only); in the parent they skip with that reason. Where there is a GPU, the
``gpu``-marked tests run the compiled kernels with larger shapes, bf16 included, and the interpreter suite is
skipped.

Every test draws fresh random inputs; outputs written by a kernel are poisoned first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from kvtune.kernels.decode_attention import hybrid_decode_attention, hybrid_decode_attention_ref
from kvtune.kernels.layout import ColdLayout, ColdPool
from kvtune.kernels.quant import codes_of_rows, dequantize_blocks_ref, seal_blocks_ref
from kvtune.kernels.quest import quest_topk, quest_topk_ref
from kvtune.kernels.requant import requantize_int4_ref
from kvtune.tests.triton_testlib import HAS_CUDA, INTERPRETING, assert_interpreted_suite_passed, fixtures

pytest.importorskip("triton")

MODULES = ("triton_decode", "triton_quest", "triton_quant", "gluon_decode")

# model dtype -> (relative L2 error of the attention output, absolute error of block/hot mass)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-3), torch.bfloat16: (1.5e-2, 5e-3)}


kernels, gpu_kernels = fixtures(MODULES)


@pytest.mark.skipif(HAS_CUDA or INTERPRETING, reason="CPU-only machines run the interpreter suite")
def test_interpreted_suite() -> None:
    """The interpreted tests of ``INTERPRETED_FILES`` (this file's, test_triton_step.py's,
    test_quest_summary.py's, test_chunk_kv.py's and test_gluon_mixed.py's) in a child pytest with
    TRITON_INTERPRET=1 (started when collection ends: it runs beside the rest of the suite, which waits for it
    at its end)."""
    assert_interpreted_suite_passed()


# ---- problem builders
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    max_blocks: int
    hot_cap: int


CPU_SHAPES = [Shape(1, 1, 1, 32, 8, 1, 16), Shape(2, 2, 3, 32, 24, 5, 40), Shape(3, 2, 4, 64, 16, 7, 24)]
GPU_SHAPES = [
    Shape(4, 8, 4, 128, 64, 40, 128),
    Shape(5, 3, 7, 64, 24, 33, 56),
    Shape(2, 8, 4, 128, 64, 300, 128),
]
# the shapes the Gluon cold kernel takes (blocks of 16, 32 or 64 tokens)
GLUON_SHAPES = [GPU_SHAPES[0], GPU_SHAPES[2], Shape(3, 4, 3, 64, 32, 21, 48), Shape(2, 2, 8, 128, 16, 50, 70),
                Shape(1, 3, 1, 64, 64, 9, 64)]  # fmt: skip


def make_pool(shape: Shape, bits: int, dtype: torch.dtype, device: str, demote: bool) -> ColdPool:
    """A pool sealed by the reference from random K/V; in an 8-bit pool some blocks demoted to 4 bits."""
    n = shape.batch * shape.kv_heads * shape.max_blocks + 2
    pool = ColdLayout(shape.block_size, shape.kv_heads, shape.head_dim, bits, dtype).allocate(n, device)
    kv = torch.randn(2, n, shape.block_size, shape.kv_heads, shape.head_dim, device=device) * 2 + 0.5
    seal_blocks_ref(pool, torch.arange(n, device=device), kv[0].to(dtype), kv[1].to(dtype), bits)
    if bits == 8 and demote:
        requantize_int4_ref(pool, torch.randperm(n, device=device)[: n // 3])
    return pool


def make_decode(shape: Shape, bits: int, dtype: torch.dtype, device: str, demote: bool = True) -> dict:
    """Random decode inputs: scattered block ids, num_cold in [0, max_blocks], hot_len in [0, hot_cap]."""
    pool = make_pool(shape, bits, dtype, device, demote)
    B, H, M = shape.batch, shape.kv_heads, shape.max_blocks
    num_cold = torch.randint(0, M + 1, (B, H), device=device, dtype=torch.int32)
    num_cold[0, 0] = M
    ids = torch.randperm(pool.num_blocks, device=device)[: B * H * M].view(B, H, M).to(torch.int32)
    table = torch.where(torch.arange(M, device=device) < num_cold[..., None], ids, -1).to(torch.int32)
    slots = B + 1
    hot_len = torch.randint(0, shape.hot_cap + 1, (B,), device=device, dtype=torch.int32)
    hot_len[0] = max(1, shape.hot_cap - 1)
    return dict(
        q=torch.randn(B, H * shape.group, shape.head_dim, device=device).to(dtype),
        hot_k=torch.randn(slots, H, shape.hot_cap, shape.head_dim, device=device).to(dtype),
        hot_v=torch.randn(slots, H, shape.hot_cap, shape.head_dim, device=device).to(dtype),
        hot_slot=torch.randperm(slots, device=device)[:B].to(torch.int32),
        hot_len=hot_len, pool=pool, block_table=table, num_cold=num_cold,
        sm_scale=1 / math.sqrt(shape.head_dim),
    )  # fmt: skip


def assert_decode_close(got: tuple, want: tuple, num_cold: torch.Tensor, dtype: torch.dtype) -> None:
    out_tol, mass_tol = TOLERANCE[dtype]
    out, mass, hot = got
    assert out.dtype == want[0].dtype and torch.isfinite(out).all()
    err = float((out.float() - want[0].float()).norm() / want[0].float().norm())
    assert err < out_tol, f"relative error {err:.2e} >= {out_tol:.0e}"
    padding = torch.arange(mass.shape[2], device=mass.device) >= num_cold[..., None]
    assert (mass[padding] == 0).all()
    torch.testing.assert_close(mass, want[1], atol=mass_tol, rtol=0)
    torch.testing.assert_close(hot, want[2], atol=mass_tol, rtol=0)


def check_path(td, shape: Shape, bits: int, dtype: torch.dtype, device: str, opts, flag: str) -> None:
    """A launch with ``opts`` takes the ``flag`` path (a compile-time value of the split kernel) on a pool
    where nothing was demoted, and matches the reference."""
    inp = make_decode(shape, bits, dtype, device, demote=False)
    assert td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts).meta[flag], flag
    want = hybrid_decode_attention_ref(**inp)
    poison_allocator(device)
    got = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert_decode_close(got, want, inp["num_cold"], dtype)


def poison_allocator(device: str) -> None:
    """Fill freed cached memory with NaN so that unwritten outputs of the next launch show up."""
    if device == "cuda":
        torch.full((1 << 26,), float("nan"), device=device)


# ---- CPU: interpreter
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize(
    ("bits", "dtype", "knobs"),
    [(8, torch.float32, {}), (8, torch.float16, {"cvt": 1}),
     (8, torch.float16, {"cvt": 0, "k_transposed": True}),
     (8, torch.float16, {"cvt": 1, "k_transposed": True, "mixed": False}), (4, torch.float16, {"cvt": 1}),
     (4, torch.float16, {"cvt": 1, "k_transposed": True}), (4, torch.float32, {}), (0, torch.float16, {}),
     (0, torch.float32, {}),
     (8, torch.float16, {"cvt": 1, "mixed": False, "v_pairs": True}),
     (8, torch.float16, {"cvt": 0, "mixed": False, "v_pairs": True, "k_transposed": True}),
     (8, torch.float32, {"mixed": False, "v_pairs": True})],
    ids=str,
)  # fmt: skip
def test_decode_attention_interpreted(
    kernels, shape: Shape, bits: int, dtype: torch.dtype, knobs: dict
) -> None:
    inp = make_decode(shape, bits, dtype, "cpu", demote=knobs.get("mixed", True))
    opts = kernels.triton_decode.DecodeKernelOptions(**{"min_blocks_per_split": 2, **knobs})
    got = kernels.triton_decode.hybrid_decode_attention_triton(**inp, options=opts)
    assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], dtype)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize(
    ("bits", "dtype", "busy"), [(8, torch.float16, 1), (4, torch.float16, 1), (4, torch.float32, 3)], ids=str
)
@pytest.mark.parametrize(
    ("group_rows", "tile"), [(False, 4), (True, 8), (True, 16)], ids=["padded", "group8", "group16"]
)
def test_merge_attends_hot_zone_interpreted(
    kernels, monkeypatch, shape: Shape, bits: int, dtype, busy: int, group_rows: bool, tile: int
) -> None:
    """The Gluon path's merge (``HOT``: it attends the hot zone, then merges the cold splits). The Gluon
    kernel cannot run here; the split kernel writes the same cold partials (the hot zone left out) in its
    place, and the result must match the reference. With ``gluon_busy_blocks`` above 1 a row keeps fewer
    splits busy than planned: the others' partials are NaN here (the Gluon kernel leaves them unwritten),
    which the merge must not read. ``group8``, ``group16``: the partials, output and mass at the group's rows
    (``MERGE_GROUP_ROWS``, groups of 1, 3 and 4 here), 8 or 16 partials in flight."""
    td = kernels.triton_decode
    monkeypatch.setattr(td, "MERGE_GROUP_ROWS", group_rows)
    monkeypatch.setattr(td, "MERGE_TILE", tile)
    inp = make_decode(shape, bits, dtype, "cpu", demote=False)
    opts = td.DecodeKernelOptions(cvt=1, mixed=False, min_blocks_per_split=2, gluon=True, gluon_pdl=False,
                                  gluon_busy_blocks=busy)  # fmt: skip
    meta = td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts).meta
    pool, hot_k = inp["pool"], inp["hot_k"]
    no_hot = torch.zeros_like(inp["hot_len"])
    ran = []

    def cold_partials(grid, args, **_):
        q, *codes, part_acc, part_ml, blk_lse, qk_scale, per, splits, m = args[:16]
        assert per == busy
        ran.append(grid)
        td._split_kernel[grid](
            q, hot_k, inp["hot_v"], inp["hot_slot"], no_hot, *codes[:6], pool.block_bits, *codes[6:],
            part_acc, part_ml, blk_lse, torch.empty(grid[1], meta["G"]), qk_scale, per, splits, m,
            q.stride(0), q.stride(1), hot_k.stride(0), hot_k.stride(1), hot_k.stride(2),
            pool.k.stride(0), pool.k.stride(1), pool.k.stride(2),
            pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1), **meta,
            BUSY=True,
        )  # fmt: skip
        rows = (-(-codes[7].flatten().long() // per)).clamp(1, splits)  # each row's busy splits
        idle = (torch.arange(splits)[None, :] >= rows[:, None]).flatten()
        part_acc[idle] = float("nan")
        part_ml[idle] = float("nan")

    monkeypatch.setattr(td.gluon_decode, "launch_cold", cold_partials)
    got = td.hybrid_decode_attention_triton(**inp, options=opts, kernel="gluon")
    assert ran, "the launcher did not take the Gluon path"
    assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], dtype)


@pytest.mark.parametrize("bits", [8, 0])
def test_groups_wider_than_16_interpreted(kernels, bits: int) -> None:
    """A group of 20 query heads a KV head (padded to 32 rows, wider than the 16 the Gluon path's hot zone
    needs): the split kernel's merge keeps all its rows, with the merge's partials at the group's rows on."""
    td = kernels.triton_decode
    assert td.MERGE_GROUP_ROWS
    inp = make_decode(Shape(2, 1, 20, 32, 8, 3, 16), bits, torch.float32, "cpu", demote=False)
    got = td.hybrid_decode_attention_triton(**inp, options=td.DecodeKernelOptions(min_blocks_per_split=1))
    assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], torch.float32)


@pytest.mark.parametrize("bits", [4, 0])
def test_merge_tiles_agree_interpreted(kernels, monkeypatch, bits: int) -> None:
    """The merge loading 4 or 8 splits' partials before it merges them gives what it gives merging them one by
    one (the same sums in another order), with a split count that is not a multiple of 4 and rows whose
    listed blocks end before the table does; so does the per-block mass with its first step's loads issued
    early (``MASS_AHEAD``), in steps of the whole table or of fewer blocks than a row lists
    (``MASS_TILE``)."""
    td = kernels.triton_decode
    torch.manual_seed(0)  # a draw whose rows list different numbers of blocks (asserted below)
    inp = make_decode(Shape(2, 2, 3, 32, 8, 7, 16), bits, torch.float32, "cpu")
    opts = td.DecodeKernelOptions(min_blocks_per_split=1, programs_per_sm=64)
    assert td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts).splits == 7
    assert int(inp["num_cold"].min()) < int(inp["num_cold"].max()) > 4
    got = {}
    for tile, ahead, mass in ((1, False, 64), (4, False, 64), (4, True, 64), (4, True, 4), (1, False, 4),
                              (8, True, 64), (8, False, 4)):  # fmt: skip
        monkeypatch.setattr(td, "MERGE_TILE", tile)
        monkeypatch.setattr(td, "MASS_AHEAD", ahead)
        monkeypatch.setattr(td, "MASS_TILE", mass)
        got[tile, ahead, mass] = td.hybrid_decode_attention_triton(**inp, options=opts)
    first = got[1, False, 64]
    for key, out in got.items():
        for a, b in zip(first, out):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    assert_decode_close(got[4, True, 64], hybrid_decode_attention_ref(**inp), inp["num_cold"], torch.float32)


@pytest.mark.parametrize("bits", [8, 0])
def test_split_kernel_launch_orders_agree_interpreted(kernels, monkeypatch, bits: int) -> None:
    """The split kernel launched split-major (``triton_decode.SPLIT_MAJOR``) or with a row's splits one after
    another runs the same programs: the same outputs bit for bit, over several splits a row."""
    td = kernels.triton_decode
    inp = make_decode(Shape(2, 2, 3, 32, 8, 7, 16), bits, torch.float32, "cpu")
    opts = td.DecodeKernelOptions(min_blocks_per_split=1, programs_per_sm=64)
    assert td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts).splits == 7
    got = {}
    for major in (False, True):
        monkeypatch.setattr(td, "SPLIT_MAJOR", major)
        got[major] = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert all(torch.equal(x, y) for x, y in zip(got[False], got[True]))
    assert_decode_close(got[True], hybrid_decode_attention_ref(**inp), inp["num_cold"], torch.float32)


def test_v_pairs_only_on_pure_8bit_pools_interpreted(kernels) -> None:
    td = kernels.triton_decode
    opts = td.DecodeKernelOptions(cvt=1, mixed=False, v_pairs=True)
    for bits, demote, on in [(8, False, True), (8, True, False), (4, False, False), (0, False, False)]:
        inp = make_decode(CPU_SHAPES[1], bits, torch.float16, "cpu", demote=demote)
        inp["pool"].may_demote = demote
        resolved = opts if not demote else replace(opts, mixed=True)
        meta = td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], resolved).meta
        assert meta["VPAIR"] == on, (bits, demote)


def test_decode_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_kernel``: the reference where Triton may not run (a CPU tensor) or the head dim does not tile;
    the Gluon kernel where the options ask for it and it applies (told so here: it needs CUDA and an aligned
    pool); else the split kernel."""
    from kvtune.kernels import gluon_decode
    from kvtune.kernels.decode_attention import decode_kernel
    from kvtune.kernels.triton_decode import PURE_INT8, default_options

    monkeypatch.setattr(gluon_decode, "supported", lambda q, bits, mixed, *_: bits == 4 or not mixed)
    monkeypatch.setattr(gluon_decode, "aligned", lambda pool: True)  # blocks of 8: strides of 8 elements
    mixed = make_decode(CPU_SHAPES[1], 8, torch.float16, "cpu")
    pure = make_decode(CPU_SHAPES[1], 8, torch.float16, "cpu", demote=False)
    pure["pool"].may_demote = False
    odd = make_decode(Shape(1, 1, 1, 48, 8, 1, 8), 4, torch.float16, "cpu")
    kind = {name: (x["q"], x["pool"], x["block_table"]) for name, x in (("mixed", mixed), ("pure", pure),
                                                                        ("odd", odd))}  # fmt: skip
    assert decode_kernel(*kind["pure"]) == "reference"  # CPU tensors: no Triton
    assert decode_kernel(*kind["odd"], triton=True) == "reference"
    assert decode_kernel(*kind["mixed"], triton=True) == "gluon_mixed"  # 8-bit pools that may demote a block
    no_mixed = replace(default_options(8), gluon_mixed=False)
    assert decode_kernel(*kind["mixed"], triton=True, options=no_mixed) == "split"
    assert decode_kernel(*kind["pure"], triton=True) == "gluon"  # PURE_INT8
    assert decode_kernel(*kind["pure"], triton=True, options=replace(PURE_INT8, gluon=False)) == "split"


@pytest.mark.parametrize("head_dim", [16, 48])
def test_untileable_head_dim_takes_reference_interpreted(kernels, head_dim: int) -> None:
    inp = make_decode(Shape(2, 2, 2, head_dim, 8, 3, 8), 8, torch.float32, "cpu")
    got = kernels.triton_decode.hybrid_decode_attention_triton(**inp)
    for a, b in zip(got, hybrid_decode_attention_ref(**inp)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [8, 4, 0])
@pytest.mark.parametrize(("m2", "k_blocks"), [(1, 1), (9, 4), (20, 25)])
def test_quest_topk_interpreted(kernels, bits: int, m2: int, k_blocks: int) -> None:
    shape = Shape(3, 2, 3, 32, 8, m2, 8)
    check_quest(kernels, shape, bits, torch.float32, "cpu", k_blocks)


@pytest.mark.parametrize("block_size", [8, 24])
@pytest.mark.parametrize(("pool_bits", "bits"), [(8, 8), (8, 4), (4, 4), (0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hot", [False, True])
def test_seal_interpreted(
    kernels, block_size: int, pool_bits: int, bits: int, dtype: torch.dtype, hot: bool
) -> None:
    check_seal(kernels, Shape(1, 2, 1, 32, block_size, 3, 8), pool_bits, bits, dtype, "cpu", hot)


@pytest.mark.parametrize("block_size", [8, 24])
def test_requantize_interpreted(kernels, block_size: int) -> None:
    check_requant(kernels, Shape(1, 2, 1, 32, block_size, 4, 8), torch.float16, "cpu")


@pytest.mark.parametrize("stacked", [True, False])
def test_requantize_masked_interpreted(kernels, stacked: bool) -> None:
    check_requant_masked(kernels, Shape(1, 2, 1, 32, 8, 5, 8), torch.float16, "cpu", stacked)


# ---- shared checks
# ---------------------------------------------------------------------------------------------
def check_quest(kernels, shape: Shape, bits: int, dtype: torch.dtype, device: str, k_blocks: int) -> None:
    pool = make_pool(shape, bits, dtype, device, demote=True)
    B, M2 = shape.batch, shape.max_blocks
    count = torch.randint(0, M2 + 1, (B,), device=device, dtype=torch.int32)
    count[0] = M2
    ids = torch.randperm(pool.num_blocks, device=device)[: B * M2].view(B, M2).to(torch.int32)
    l2_table = torch.where(torch.arange(M2, device=device) < count[:, None], ids, -1).to(torch.int32)
    q = torch.randn(B, shape.kv_heads * shape.group, shape.head_dim, device=device).to(dtype)
    got = kernels.triton_quest.quest_topk_triton(q, pool, l2_table, count, k_blocks)
    want = quest_topk_ref(q, pool, l2_table, count, k_blocks)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert [sorted(r) for r in got.flatten(0, 1).tolist()] == [sorted(r) for r in want.flatten(0, 1).tolist()]


def _poisoned_pair(
    shape: Shape, pool_bits: int, dtype: torch.dtype, device: str
) -> tuple[ColdPool, ColdPool]:
    n = shape.max_blocks + 2
    layout = ColdLayout(shape.block_size, shape.kv_heads, shape.head_dim, pool_bits, dtype)
    a, b = layout.allocate(n, device), layout.allocate(n, device)
    for pool in (a, b):
        for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale"):
            x = getattr(pool, name)
            x.copy_(torch.full_like(x, 171 if x.dtype == torch.uint8 else float("nan")))
    return a, b


def _field_msg(name: str) -> Callable[[str], str]:
    """assert_close's message callback naming the pool field."""
    return lambda m: f"pool.{name}: {m}"


def assert_pools_equal(got: ColdPool, want: ColdPool) -> None:
    for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0, equal_nan=True,
                                   msg=_field_msg(name))  # fmt: skip


def _codes(pool: ColdPool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of every row as ints [N, H, bs, D] (4-bit rows unpacked; demoted rows of an 8-bit pool too)."""
    bits = pool.block_bits.view(-1, 1, 1)
    return codes_of_rows(pool.k, bits, pool.bits), codes_of_rows(pool.v, bits, pool.bits)


def assert_pools_close(got: ColdPool, want: ColdPool, ids: torch.Tensor, x: tuple | None) -> None:
    """The GPU form of equality: the Triton seal was seen one fp16 step off the reference run by PyTorch on
    CUDA in 1-4 % of the scales (likely PyTorch dividing by a Python scalar through its reciprocal; the H200
    run of 2026-11-29 saw relative differences up to 1.3e-3, i.e. two ulps at mantissa 1.5). So: scales
    and mins agree within two fp16 ulps, codes within one step in under 1 % of entries, and the
    Triton output meets the layout's bound |x - (min + code * scale)| <= scale / 2 on the input x
    (k, v [n, H, bs, D] float32)."""
    assert torch.equal(got.block_bits, want.block_bits)
    for name in ("k_min", "k_scale", "v_min", "v_scale"):
        torch.testing.assert_close(
            getattr(got, name)[ids], getattr(want, name)[ids], rtol=2**-9, atol=2**-23,
            msg=_field_msg(name),
        )  # fmt: skip
    for mine, theirs in zip(_codes(got), _codes(want)):
        diff = (mine[ids] - theirs[ids]).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (
            f"codes differ: {diff.max()}, {diff.mean()}"
        )
    if x is not None:
        k, v = dequantize_blocks_ref(got, ids)
        k_step = got.k_scale[ids].float()[:, :, None, :]
        v_step = got.v_scale[ids].float()[..., None]
        assert ((x[0] - k).abs() <= k_step * (0.5 + 2**-9) + 1e-6).all()
        assert ((x[1] - v).abs() <= v_step * (0.5 + 2**-9) + 1e-6).all()


def check_seal(
    kernels, shape: Shape, pool_bits: int, bits: int, dtype: torch.dtype, device: str, hot: bool = False
) -> None:
    """``hot``: the blocks are read in place from hot zones [slots, H, C, D] at scattered slots (``rows``)."""
    got, want = _poisoned_pair(shape, pool_bits, dtype, device)
    n = shape.max_blocks
    ids = torch.randperm(got.num_blocks, device=device)[:n]
    kv = torch.randn(2, n, shape.block_size, shape.kv_heads, shape.head_dim, device=device).to(dtype) * 3
    if hot:
        zones = torch.randn(2, n + 3, shape.kv_heads, shape.block_size + 5, shape.head_dim, device=device)
        zones = zones.to(dtype) * 3
        rows = torch.randperm(n + 3, device=device)[:n]
        views = zones[:, :, :, : shape.block_size].transpose(2, 3)  # [2, slots, bs, H, D], no copy
        kernels.triton_quant.seal_blocks_triton(got, ids, views[0], views[1], bits, rows)
        kv = views[:, rows]
    else:
        kernels.triton_quant.seal_blocks_triton(got, ids, kv[0], kv[1], bits)
    seal_blocks_ref(want, ids, kv[0], kv[1], bits)
    if device == "cpu" or bits == 0:
        assert_pools_equal(got, want)
    else:
        x = kv.float().permute(0, 1, 3, 2, 4)
        assert_pools_close(got, want, ids, (x[0], x[1]))


def check_requant(kernels, shape: Shape, dtype: torch.dtype, device: str) -> None:
    got, want = _poisoned_pair(shape, 8, dtype, device)
    n = got.num_blocks
    kv = torch.randn(2, n, shape.block_size, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    for pool in (got, want):
        seal_blocks_ref(pool, torch.arange(n, device=device), kv[0], kv[1], 8)
        requantize_int4_ref(pool, torch.tensor([0], device=device))  # already 4 bits: must stay as is
    ids = torch.randperm(n, device=device)[: n - 1]
    before = dequantize_blocks_ref(got, ids)
    kernels.triton_quant.requantize_int4_triton(got, ids)
    requantize_int4_ref(want, ids)
    if device == "cpu":
        assert_pools_equal(got, want)
    else:
        assert_pools_close(got, want, ids, before)


def check_requant_masked(kernels, shape: Shape, dtype: torch.dtype, device: str, stacked: bool) -> None:
    """The device-side demotion of a [layers, blocks] mask (one launch over pools of one allocation, one per
    layer otherwise) against the reference on each layer's listed blocks; blocks already at 4 bits stay."""
    layers, n = 3, shape.max_blocks + 3
    layout = ColdLayout(shape.block_size, shape.kv_heads, shape.head_dim, 8, dtype)

    def pools() -> list[ColdPool]:
        if stacked:
            return layout.allocate_layers(layers, n, device)
        return [layout.allocate(n, device) for _ in range(layers)]

    got, want = pools(), pools()
    kv = torch.randn(layers, 2, n, shape.block_size, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    for a, b, x in zip(got, want, kv):
        for pool in (a, b):
            seal_blocks_ref(pool, torch.arange(n, device=device), x[0], x[1], 8)
            requantize_int4_ref(pool, torch.tensor([0], device=device))  # already 4 bits: must stay as is
    mask = torch.rand(layers, n, device=device) < 0.5
    mask[:, 0] = True
    mask[1] = False  # a layer with nothing to do
    before = [dequantize_blocks_ref(pool, torch.arange(n, device=device)) for pool in got]
    kernels.triton_quant.requantize_int4_masked_triton(got, mask)
    for layer, (a, b) in enumerate(zip(got, want)):
        ids = mask[layer].nonzero().flatten()
        if ids.numel():
            requantize_int4_ref(b, ids)
        if device == "cpu":
            assert_pools_equal(a, b)
        else:
            k, v = before[layer]
            assert_pools_close(a, b, torch.arange(n, device=device), (k, v))


# ---- GPU: compiled
# -----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4, 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_gpu(gpu_kernels, shape: Shape, bits: int, dtype: torch.dtype) -> None:
    inp = make_decode(shape, bits, dtype, "cuda")
    want = hybrid_decode_attention_ref(**inp)
    poison_allocator("cuda")
    got = hybrid_decode_attention(**inp)  # the public launcher dispatches to Triton on CUDA tensors
    assert_decode_close(got, want, inp["num_cold"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("knobs", [{}, {"maxnreg": None}], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_v_pairs_gpu(gpu_kernels, shape: Shape, knobs: dict, dtype: torch.dtype) -> None:
    td = gpu_kernels.triton_decode
    check_path(td, shape, 8, dtype, "cuda", replace(td.PURE_INT8, v_pairs=True, **knobs), "VPAIR")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "stages, pdl, key_rows, table_ahead",
    [(2, True, True, True), (3, False, True, True), (0, True, True, True), (3, True, False, False),
     (4, True, True, True)],
)  # fmt: skip
def test_decode_gluon_gpu(
    gpu_kernels, shape: Shape, bits: int, dtype: torch.dtype, stages: int, pdl: bool, key_rows: bool,
    table_ahead: bool,
) -> None:  # fmt: skip
    """The Gluon cold kernel (the merge attends the hot zone) matches the reference: its blocks through a
    ring of shared memory (key rows copied whole or as loaded; block ids carried in the ring or loaded an
    iteration ahead) or loaded straight into registers (0), the merge a programmatic dependent or not."""
    td = gpu_kernels.triton_decode
    inp = make_decode(shape, bits, dtype, "cuda", demote=False)
    base = td.PURE_INT8 if bits == 8 else td.default_options(bits)
    opts = replace(base, gluon=True, gluon_stages=stages, gluon_pdl=pdl, gluon_key_rows=key_rows,
                   gluon_table_ahead=table_ahead)  # fmt: skip
    meta = td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts).meta
    pool = inp["pool"]
    assert gpu_kernels.gluon_decode.supported(
        inp["q"], bits, bool(meta["MIXED"]), pool.k.shape[2], tuple(pool.k.stride()), pool.k.shape[1]
    )
    want = hybrid_decode_attention_ref(**inp)
    poison_allocator("cuda")
    got = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert_decode_close(got, want, inp["num_cold"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("dtype", "stages"), [(torch.bfloat16, 2), (torch.bfloat16, 3), (torch.float16, 4)])
def test_decode_gluon_tma_gpu(gpu_kernels, monkeypatch, shape: Shape, bits: int, dtype: torch.dtype,
                              stages: int) -> None:  # fmt: skip
    """``gluon_tma`` (sm_90): the ring filled by tensor copies gives the ``cp.async`` ring's outputs bit for
    bit under the same split plan (the same bytes reach the same registers), and matches the reference;
    captured in a CUDA graph and replayed on new inputs written into the captured ones (the descriptors
    hold the pool's addresses), it matches the reference of what they then hold."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tensor copies (TMA) need sm_90")
    td = gpu_kernels.triton_decode
    inp = make_decode(shape, bits, dtype, "cuda", demote=False)
    base = replace(td.PURE_INT8 if bits == 8 else td.default_options(bits), gluon=True, gluon_stages=stages)
    tma = replace(base, gluon_tma=True)
    assert gpu_kernels.gluon_decode.tma_ready(inp["pool"])
    assert td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], tma).options.gluon_tma

    def fixed(bh, m, device, options, resident=None):  # the same splits for both rings
        per = max(1, -(-m // 3))
        return -(-m // per), per

    monkeypatch.setattr(td, "plan_splits", fixed)
    want = hybrid_decode_attention_ref(**inp)
    plain = td.hybrid_decode_attention_triton(**inp, options=base)
    poison_allocator("cuda")
    got = td.hybrid_decode_attention_triton(**inp, options=tma)
    assert all(torch.equal(x, y) for x, y in zip(got, plain))
    assert_decode_close(got, want, inp["num_cold"], dtype)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = td.hybrid_decode_attention_triton(**inp, options=tma)
    torch.manual_seed(7)
    fresh = make_decode(shape, bits, dtype, "cuda", demote=False)
    for name in ("q", "hot_k", "hot_v", "hot_slot", "hot_len", "block_table", "num_cold"):
        inp[name].copy_(fresh[name])
    for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale"):
        getattr(inp["pool"], name).copy_(getattr(fresh["pool"], name))
    graph.replay()
    torch.cuda.synchronize()
    assert_decode_close(captured, hybrid_decode_attention_ref(**inp), inp["num_cold"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 0])
@pytest.mark.parametrize("bits", [8, 4])
def test_gluon_error_does_not_grow_with_the_blocks_a_program_reads_gpu(
    gpu_kernels, monkeypatch, bits: int, stages: int
) -> None:
    """Full rows of 256 blocks, the split count forced to 256 (one block a program) and to 4 (64 blocks): the
    Gluon kernel's error against the float32 reference stays within 2x (fp16). Values enter the matrix
    unit as ``1024 + code``; with that offset taken off only at the end, INT4's error was 40x larger at 64
    blocks than at one (1.7e-2 against 3.9e-4 on an H200, ``lab/scripts/split_error.py``)."""
    td = gpu_kernels.triton_decode
    shape = Shape(2, 8, 4, 128, 64, 256, 128)
    inp = make_decode(shape, bits, torch.float16, "cuda", demote=False)
    pool, (B, H, M) = inp["pool"], inp["block_table"].shape
    inp["block_table"] = torch.randperm(pool.num_blocks, device="cuda")[: B * H * M].view(B, H, M).int()
    inp["num_cold"].fill_(M)
    exact = hybrid_decode_attention_ref(
        **{**inp, "q": inp["q"].float(), "hot_k": inp["hot_k"].float(), "hot_v": inp["hot_v"].float()}
    )[0]
    base = td.PURE_INT8 if bits == 8 else td.default_options(bits)
    opts = replace(base, gluon=True, gluon_stages=stages, gluon_busy_blocks=1)
    err = {}
    for splits in (M, M // 64):

        def forced(bh, m, device, options, resident=None, n=splits):
            per = -(-m // n)
            return -(-m // per), per

        monkeypatch.setattr(td, "plan_splits", forced)
        plan = td.launch_plan(inp["q"], inp["hot_k"], pool, inp["block_table"], opts)
        assert plan.kernel == "gluon" and plan.splits == splits, (plan.kernel, plan.splits)
        out = td.hybrid_decode_attention_triton(**inp, options=opts)[0]
        err[M // splits] = float((out.float() - exact).norm() / exact.norm())
    assert err[64] < 2 * err[1] and err[64] < 1e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "busy"), [(8, 1), (4, 1), (4, 5)])
def test_decode_gluon_launch_orders_agree_gpu(gpu_kernels, monkeypatch, bits: int, busy: int) -> None:
    """The Gluon cold kernel launched split-major (``gluon_decode.SPLIT_MAJOR``) or row-major computes the
    same programs: the outputs agree bit for bit, with every split busy or one per ``busy`` listed blocks."""
    td = gpu_kernels.triton_decode
    inp = make_decode(Shape(3, 8, 4, 128, 64, 50, 128), bits, torch.bfloat16, "cuda", demote=False)
    base = td.PURE_INT8 if bits == 8 else td.default_options(bits)
    opts = replace(base, gluon=True, gluon_busy_blocks=busy)
    td.hybrid_decode_attention_triton(**inp, options=opts)  # the build's occupancy: the same plan after it
    got = {}
    for major in (False, True):
        monkeypatch.setattr(gpu_kernels.gluon_decode, "SPLIT_MAJOR", major)
        got[major] = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert all(torch.equal(x, y) for x, y in zip(got[False], got[True]))
    assert_decode_close(got[True], hybrid_decode_attention_ref(**inp), inp["num_cold"], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cvt", [0, 1, 2])
@pytest.mark.parametrize("k_transposed", [False, True])
@pytest.mark.parametrize(("bits", "mixed"), [(8, True), (8, False), (4, True)])
def test_decode_variants_gpu(gpu_kernels, cvt: int, k_transposed: bool, bits: int, mixed: bool) -> None:
    inp = make_decode(GPU_SHAPES[0], bits, torch.bfloat16, "cuda", demote=mixed)
    opts = gpu_kernels.triton_decode.DecodeKernelOptions(cvt=cvt, k_transposed=k_transposed, mixed=mixed)
    got = gpu_kernels.triton_decode.hybrid_decode_attention_triton(**inp, options=opts)
    assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4, 0])
@pytest.mark.parametrize(("m2", "k_blocks"), [(200, 32), (7, 16)])
def test_quest_topk_gpu(gpu_kernels, bits: int, m2: int, k_blocks: int) -> None:
    shape = Shape(3, 8, 4, 128, 64, m2, 64)
    check_quest(gpu_kernels, shape, bits, torch.bfloat16, "cuda", k_blocks)
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    pool = make_pool(Shape(2, 8, 4, 128, 64, 4, 64), bits, torch.bfloat16, "cuda", demote=True)
    table = torch.arange(6, device="cuda", dtype=torch.int32).view(2, 3)
    count = torch.tensor([3, 2], device="cuda", dtype=torch.int32)
    assert torch.equal(quest_topk(q, pool, table, count, 2).sort(-1).values,
                       quest_topk_ref(q, pool, table, count, 2).sort(-1).values)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 24])
@pytest.mark.parametrize(("pool_bits", "bits"), [(8, 8), (8, 4), (4, 4), (0, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hot", [False, True])
def test_seal_gpu(
    gpu_kernels, block_size: int, pool_bits: int, bits: int, dtype: torch.dtype, hot: bool
) -> None:
    check_seal(gpu_kernels, Shape(1, 8, 1, 128, block_size, 37, 8), pool_bits, bits, dtype, "cuda", hot)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 24])
def test_requantize_gpu(gpu_kernels, block_size: int) -> None:
    check_requant(gpu_kernels, Shape(1, 8, 1, 128, block_size, 37, 8), torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False])
def test_requantize_masked_gpu(gpu_kernels, stacked: bool) -> None:
    check_requant_masked(gpu_kernels, Shape(1, 8, 1, 128, 64, 37, 8), torch.bfloat16, "cuda", stacked)
