"""The mixed Gluon path (``DecodeKernelOptions.gluon_mixed``): an 8-bit pool with demoted 4-bit blocks, its
table split by bits (``kernels/bits_partition_ref.py``, ``kernels/triton_bits_partition.py``), the 8-bit and
4-bit Gluon builds over their parts, the merge over both.

Here (no GPU) the partition kernel runs under the interpreter against its reference, and the launcher's
orchestration (the split table, each build's partial slots, the block lse the merge finds by position) runs
with the split kernel writing the partials in the Gluon kernel's place; the interpreted tests run in a child
process started with ``TRITON_INTERPRET=1`` (see ``tests/test_triton_kernels.py``). On a GPU the
``gpu``-marked tests run the real builds, eagerly and replayed from a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtune.kernels.bits_partition_ref import empty_partition, partition_by_bits_ref, partition_width
from kvtune.kernels.decode_attention import hybrid_decode_attention_ref
from kvtune.kernels.requant import requantize_int4_ref
from kvtune.tests.test_triton_kernels import Shape, assert_decode_close, make_decode, poison_allocator
from kvtune.tests.triton_testlib import HAS_CUDA, INTERPRETING, assert_interpreted_suite_passed, fixtures

pytest.importorskip("triton")

kernels, gpu_kernels = fixtures(("triton_decode", "triton_bits_partition", "gluon_decode"))


@pytest.mark.skipif(HAS_CUDA or INTERPRETING, reason="CPU-only machines run the interpreter suite")
def test_interpreted_suite() -> None:
    """This file's interpreted tests, in the child pytest with TRITON_INTERPRET=1 that runs beside the rest of
    the suite (``triton_testlib.INTERPRETED_FILES``; the session waits for it at its end)."""
    assert_interpreted_suite_passed()


def _mixed_table(b: int, h: int, m: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A table of scattered ids (num_cold in [0, m], -1 after) over a pool whose blocks are a third 4-bit."""
    gen = torch.Generator().manual_seed(seed)
    n = b * h * m + 3
    bits = torch.full((n,), 8, dtype=torch.uint8)
    bits[torch.randperm(n, generator=gen)[: n // 3]] = 4
    num_cold = torch.randint(0, m + 1, (b, h), generator=gen, dtype=torch.int32)
    num_cold.view(-1)[0] = m
    ids = torch.randperm(n, generator=gen)[: b * h * m].view(b, h, m).to(torch.int32)
    table = torch.where(torch.arange(m) < num_cold[..., None], ids, -1).to(torch.int32)
    return table.to(device), num_cold.to(device), bits.to(device)


# ---- the partition's reference: what the split means
def test_partition_reference_keeps_order_and_places_every_entry() -> None:
    table, num_cold, bits = _mixed_table(2, 3, 9, "cpu")
    parts = partition_by_bits_ref(table, num_cold, bits)
    w = partition_width(9)
    assert w == 12 and parts.table.shape == (2, 3, 24) and parts.counts.shape == (2, 2, 3)
    for b in range(2):
        for h in range(3):
            n = int(num_cold[b, h])
            ids = table[b, h, :n]
            four = bits[ids.long()] == 4
            n8, n4 = int(parts.counts[0, b, h]), int(parts.counts[1, b, h])
            assert (n8, n4) == (int((~four).sum()), int(four.sum()))
            assert torch.equal(parts.table[b, h, :n8], ids[~four])
            assert torch.equal(parts.table[b, h, w : w + n4], ids[four])
            assert (parts.table[b, h, n8:w] == -1).all() and (parts.table[b, h, w + n4 :] == -1).all()
            assert torch.equal(parts.table[b, h, parts.positions[b, h, :n].long()], ids)
            assert (parts.positions[b, h, n:] == -1).all()


@pytest.mark.parametrize(("m", "w"), [(0, 4), (1, 4), (4, 4), (5, 8), (543, 544)])
def test_partition_halves_start_16_byte_aligned(m: int, w: int) -> None:
    """Each half (int32 ids) and each count row starts at a multiple of 16 bytes whatever the width and the
    batch: a pointer's alignment is part of a Triton build's key."""
    assert partition_width(m) == w and w % 4 == 0
    for rows in (1, 3, 4, 5):
        parts = empty_partition(rows, 1, m, torch.device("cpu"))
        assert parts.table.shape == (rows, 1, 2 * w)
        assert (parts.counts[1].data_ptr() - parts.counts[0].data_ptr()) % 16 == 0


# ---- CPU: interpreter
@pytest.mark.parametrize(("b", "h", "m"), [(1, 1, 1), (2, 3, 5), (3, 2, 130), (1, 2, 0)])
def test_partition_kernel_interpreted(kernels, b: int, h: int, m: int) -> None:
    table, num_cold, bits = _mixed_table(b, h, max(m, 1), "cpu", seed=m)
    table = table[..., :m].contiguous()
    num_cold = num_cold.clamp(max=m)
    got = kernels.triton_bits_partition.partition_by_bits_triton(table, num_cold, bits)
    want = partition_by_bits_ref(table, num_cold, bits)
    for name, x, y in zip(want._fields, got, want, strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "shape", [Shape(1, 1, 1, 32, 8, 3, 16), Shape(2, 2, 3, 32, 24, 5, 40), Shape(3, 2, 4, 64, 16, 7, 24)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize(("dtype", "demoted", "splits4", "busy", "builds"), [
    (torch.float16, "third", 0, (1, 0), "two"), (torch.float32, "third", 0, (1, 0), "two"),
    (torch.float16, "none", 0, (1, 0), "two"), (torch.float16, "all", 0, (1, 0), "two"),
    (torch.float16, "third", 1, (1, 0), "two"), (torch.float32, "all", 1, (1, 0), "two"),
    (torch.float16, "third", 0, (3, 2), "two"), (torch.float32, "all", 0, (2, 0), "two"),
    (torch.float16, "none", 0, (100, 1), "two"),
    (torch.float16, "third", 0, (1, 0), "by_id"), (torch.float16, "third", 1, (3, 2), "paired")])  # fmt: skip
def test_mixed_launch_interpreted(
    kernels, monkeypatch, shape: Shape, dtype: torch.dtype, demoted: str, splits4: int, busy: tuple[int, int],
    builds: str,
) -> None:  # fmt: skip
    """The mixed launcher end to end but for the Gluon kernel (it cannot run here): the split kernel, which
    honours per-block bits, writes each build's partials into that build's slots over the half of the split
    table it is given (its ids, counts, row stride and block-lse row), and the merge must then match the
    reference, block mass included (found through the partition's positions). Also where one half is empty:
    nothing demoted, or every block; with the 4-bit build given its own split count (``splits4``: one
    split, however many blocks its half lists); and with fewer busy splits than planned
    (``gluon_busy_blocks``, ``gluon_busy_blocks4``): the partials of the splits past a row's busy ones are
    NaN here, which the merge must not read. ``builds``: both builds in one launch (``gluon_builds``),
    whose arguments are taken apart here into the two builds' (the pair kernel's own order)."""
    td = kernels.triton_decode
    if splits4:
        planned = td.launch_plan
        monkeypatch.setattr(td, "launch_plan", lambda *a, **k: planned(*a, **k)._replace(splits4=splits4))
    inp = make_decode(shape, 8, dtype, "cpu", demote=demoted == "third")
    pool, hot_k = inp["pool"], inp["hot_k"]
    if demoted == "all":
        requantize_int4_ref(pool, torch.arange(pool.num_blocks))
    assert {"none": {8}, "all": {4}, "third": {4, 8}}[demoted] == set(pool.block_bits.tolist())
    opts = replace(td.default_options(8), cvt=1, min_blocks_per_split=2, gluon_mixed=True, gluon_pdl=False,
                   gluon_busy_blocks=busy[0], gluon_busy_blocks4=busy[1], gluon_builds=builds)  # fmt: skip
    meta = td.launch_plan(inp["q"], hot_k, pool, inp["block_table"], opts, kernel="split").meta
    no_hot = torch.zeros_like(inp["hot_len"])
    ran = []

    def cold_partials(grid, args, *, kind, row, G, D, **_):
        q, *codes, table, ncold, part_acc, part_ml, blk_lse, qk_scale, per, splits, m, stride, part0 = args[
            :18
        ]
        assert row == D and m % 8 == 0 and part0 + splits <= stride and (part0 == 0) == (kind == 8)
        assert per == (busy[0] if kind == 8 else busy[1] or busy[0])
        ran.append((kind, splits, idle_splits(ncold.flatten()[: grid[1]], splits, per)))
        acc = torch.empty(grid[1] * splits, G, D)
        ml = torch.empty(grid[1] * splits, 2, G)
        td._split_kernel[grid](
            q, hot_k, inp["hot_v"], inp["hot_slot"], no_hot, *codes, pool.block_bits, table, ncold,
            acc, ml, blk_lse, torch.empty(grid[1], G), qk_scale, per, splits, m,
            q.stride(0), q.stride(1), hot_k.stride(0), hot_k.stride(1), hot_k.stride(2),
            pool.k.stride(0), pool.k.stride(1), pool.k.stride(2),
            pool.k_min.stride(0), pool.k_min.stride(1), pool.v_min.stride(0), pool.v_min.stride(1), **meta,
            BUSY=True,
        )  # fmt: skip
        idle = idle_splits(ncold.flatten()[: grid[1]], splits, per)
        acc[idle.flatten()] = float("nan")  # what the Gluon kernel leaves unwritten
        ml[idle.flatten()] = float("nan")
        part_acc.view(grid[1], stride, G, D)[:, part0 : part0 + splits] = acc.view(grid[1], splits, G, D)
        part_ml.view(grid[1], stride, 2, G)[:, part0 : part0 + splits] = ml.view(grid[1], splits, 2, G)

    def pair_partials(splits, rows, args, *, stages, by_id, D, **kw):
        assert by_id == (builds == "by_id") and splits[1] == (splits4 or splits[0])
        head, (t8, n8, lse8, t4, n4, lse4, acc, ml, scale, busy8, busy4, s8, s4, m, stride), strides = (
            args[:7], args[7:22], args[22:]
        )  # fmt: skip
        assert (s8, s4) == splits and stride == s8 + s4
        for kind, table, n, lse, per, s, part0 in (
            (8, t8, n8, lse8, busy8, s8, 0),
            (4, t4, n4, lse4, busy4, s4, s8),
        ):
            build = (*head, table, n, acc, ml, lse, scale, per, s, m, stride, part0, *strides)
            cold_partials((s, rows), build, kind=kind, row=D, D=D, **kw)

    monkeypatch.setattr(td.gluon_decode, "launch_cold", cold_partials)
    monkeypatch.setattr(td.gluon_decode, "launch_pair", pair_partials)
    got = td.hybrid_decode_attention_triton(**inp, options=opts, kernel="gluon_mixed")
    assert [kind for kind, *_ in ran] == [8, 4], "the launcher did not take the mixed path"
    assert not splits4 or ran[1][1] == splits4
    if busy[0] > 1 and demoted != "all":  # some 8-bit row left splits idle: the NaN partials were there
        assert any(bool(idle.any()) for _, _, idle in ran)
    assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], dtype)


def idle_splits(counts: torch.Tensor, splits: int, busy_blocks: int) -> torch.Tensor:
    """[rows, splits] bool: the splits of each row of ``counts`` listed blocks past its busy ones (the
    kernels' ``_busy_splits``), whose partials the merge must not read."""
    busy = (-(-counts.long() // busy_blocks)).clamp(1, splits)
    return torch.arange(splits)[None, :] >= busy[:, None]


# ---- the dispatcher
def test_decode_kernel_takes_the_mixed_path_only_when_asked_and_supported(monkeypatch) -> None:
    """``decode_kernel``: an 8-bit pool read with per-block bits takes ``gluon_mixed`` where its option is
    on (the default) and the Gluon kernel applies (it needs CUDA: told so here, then not); pure pools keep
    their own choice."""
    from kvtune.kernels import gluon_decode
    from kvtune.kernels.decode_attention import decode_kernel
    from kvtune.kernels.decode_choice import PURE_INT8, default_options

    shape = Shape(2, 2, 3, 32, 24, 5, 40)
    mixed = make_decode(shape, 8, torch.float16, "cpu")
    pure4 = make_decode(shape, 4, torch.float16, "cpu", demote=False)
    plain = make_decode(shape, 0, torch.float16, "cpu", demote=False)
    args = {n: (x["q"], x["pool"], x["block_table"]) for n, x in (("8", mixed), ("4", pure4), ("0", plain))}
    on, off = default_options(8), replace(default_options(8), gluon_mixed=False)
    assert on.gluon_mixed and not PURE_INT8.gluon_mixed
    assert decode_kernel(*args["8"], triton=True, options=on) == "split"  # CPU tensors: no Gluon
    assert decode_kernel(*args["8"], options=on) == "reference"  # CPU tensors: no Triton
    monkeypatch.setattr(gluon_decode, "supported", lambda q, bits, mixed, *_: bits == 4 or not mixed)
    monkeypatch.setattr(gluon_decode, "aligned", lambda pool: True)  # blocks of 24: strides of 24 elements
    assert decode_kernel(*args["8"], triton=True) == "gluon_mixed"  # the default: on
    assert decode_kernel(*args["8"], triton=True, options=off) == "split"
    monkeypatch.setattr(gluon_decode, "aligned", lambda pool: False)  # e.g. a page view with odd strides
    assert decode_kernel(*args["8"], triton=True) == "split"
    assert decode_kernel(*args["4"], triton=True) == "split"
    monkeypatch.setattr(gluon_decode, "aligned", lambda pool: True)
    assert decode_kernel(*args["8"], triton=True, options=replace(on, mixed=False, gluon=True)) == "gluon"
    assert decode_kernel(*args["4"], triton=True, options=replace(default_options(4), gluon_mixed=True)) == (
        "gluon"
    )
    assert decode_kernel(*args["0"], triton=True, options=replace(default_options(0), gluon_mixed=True)) == (
        "split"
    )
    monkeypatch.setattr(gluon_decode, "supported", lambda *_: False)  # e.g. head_dim 32 or a CPU tensor
    assert decode_kernel(*args["8"], triton=True, options=on) == "split"


# ---- GPU: the real builds
GPU_SHAPES = [
    Shape(4, 8, 4, 128, 64, 40, 128),
    Shape(2, 8, 4, 128, 64, 300, 128),
    Shape(3, 4, 3, 64, 32, 21, 48),
    Shape(2, 2, 8, 128, 16, 50, 70),
    Shape(1, 3, 1, 64, 64, 9, 64),
]


def _mixed_options(td, stages: int = 3, pdl: bool = True, overlap: bool = False, builds: str = "two",
                   stages4: int = 0, tma: bool = False):  # fmt: skip
    return replace(td.default_options(8), gluon_mixed=True, gluon_stages=stages, gluon_pdl=pdl,
                   gluon_overlap=overlap, gluon_builds=builds, gluon_stages4=stages4,
                   gluon_tma=tma)  # fmt: skip


def _check_mixed(td, shape: Shape, dtype: torch.dtype, stages: int = 3, pdl: bool = True,
                 overlap: bool = False, builds: str = "two", stages4: int = 0,
                 tma: bool = False) -> None:  # fmt: skip
    inp = make_decode(shape, 8, dtype, "cuda", demote=True)
    opts = _mixed_options(td, stages, pdl, overlap, builds, stages4, tma)
    plan = td.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts)
    assert plan.kernel == "gluon_mixed" and plan.stages4 == (stages4 or min(stages, 2))
    assert plan.options.gluon_tma == tma
    want = hybrid_decode_attention_ref(**inp)
    poison_allocator("cuda")
    got = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert_decode_close(got, want, inp["num_cold"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_gluon_gpu(gpu_kernels, shape: Shape, dtype: torch.dtype) -> None:
    """The mixed path on an INT8 pool with a third of its blocks demoted matches the reference (head dims
    64 and 128, blocks of 16, 32 and 64 tokens, 1 to 8 query heads per KV head, long and short tables)."""
    _check_mixed(gpu_kernels.triton_decode, shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("stages", "pdl"), [(2, False), (0, True)])
def test_mixed_gluon_variants_gpu(gpu_kernels, stages: int, pdl: bool) -> None:
    """A ring of 2 blocks with the merge launched after both builds end; no ring (blocks into registers)."""
    _check_mixed(gpu_kernels.triton_decode, GPU_SHAPES[0], torch.bfloat16, stages, pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_mixed_gluon_with_the_builds_overlapped_gpu(gpu_kernels, shape: Shape) -> None:
    """``gluon_overlap``: the 4-bit build started beside the 8-bit one still matches the reference, block
    mass included (the merge waits on the 4-bit build, which ends after the 8-bit one)."""
    _check_mixed(gpu_kernels.triton_decode, shape, torch.bfloat16, overlap=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize(("builds", "stages4"), [("paired", 0), ("by_id", 0), ("paired", 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_gluon_in_one_launch_gpu(
    gpu_kernels, shape: Shape, builds: str, stages4: int, dtype: torch.dtype
) -> None:
    """``gluon_builds``: both builds in one launch, each program reading its split of both or one build's
    split by its id, match the reference, block mass included; with a 4-bit ring of 4 in the 8-bit ring's
    shared memory."""
    _check_mixed(gpu_kernels.triton_decode, shape, dtype, builds=builds, stages4=stages4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize(("builds", "stages"), [("by_id", 3), ("paired", 2), ("two", 3)])
def test_mixed_gluon_on_tensor_copies_gpu(gpu_kernels, shape: Shape, builds: str, stages: int) -> None:
    """``gluon_tma`` (sm_90): both builds' rings filled by tensor copies (the 4-bit build's codes a
    ``[T, D / 2]`` box of the ``D``-byte rows) match the reference, in one launch or two."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tensor copies (TMA) need sm_90")
    _check_mixed(gpu_kernels.triton_decode, shape, torch.bfloat16, stages, builds=builds, tma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("way", ["two", "overlap", "paired", "by_id"])
def test_mixed_gluon_in_a_cuda_graph_gpu(gpu_kernels, shape: Shape, dtype: torch.dtype, way: str) -> None:
    """Captured once, replayed on new queries, a new table (other blocks, other counts, other bits mix) and
    new hot lengths written into the captured inputs: each replay matches the reference of what the inputs
    then hold (nothing is read back to the host while capturing; a sync would fail the capture); with the
    4-bit build after the 8-bit one, beside it (``gluon_overlap``) and in one launch with it
    (``gluon_builds``)."""
    td = gpu_kernels.triton_decode
    inp = make_decode(shape, 8, dtype, "cuda", demote=True)
    overlap, builds = way == "overlap", way if way in ("paired", "by_id") else "two"
    opts = _mixed_options(td, overlap=overlap, builds=builds)
    run = lambda: td.hybrid_decode_attention_triton(**inp, options=opts)
    run()  # compiles, and reads the build's occupancy, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    for seed in range(3):
        torch.manual_seed(100 + seed)
        fresh = make_decode(shape, 8, dtype, "cuda", demote=True)
        for name in ("q", "hot_k", "hot_v", "hot_slot", "hot_len", "block_table", "num_cold"):
            inp[name].copy_(fresh[name])
        pool, new = inp["pool"], fresh["pool"]
        for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits"):
            getattr(pool, name).copy_(getattr(new, name))
        graph.replay()
        torch.cuda.synchronize()
        assert_decode_close(got, hybrid_decode_attention_ref(**inp), inp["num_cold"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("builds", ["two", "by_id"])
def test_mixed_gluon_reads_a_given_split_gpu(gpu_kernels, builds: str) -> None:
    """Given the table split by bits (as the split selection writes it), the builds and the merge read it
    and give bit for bit what they give after their own partition, eagerly and replayed from a graph."""
    td = gpu_kernels.triton_decode
    inp = make_decode(GPU_SHAPES[1], 8, torch.bfloat16, "cuda", demote=True)
    opts = _mixed_options(td, builds=builds)
    want = td.hybrid_decode_attention_triton(**inp, options=opts)
    parts = partition_by_bits_ref(inp["block_table"], inp["num_cold"], inp["pool"].block_bits)
    run = lambda: td.hybrid_decode_attention_triton(**inp, options=opts, partition=parts)
    got = run()
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    inp["q"].normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = td.hybrid_decode_attention_triton(**inp, options=opts)
    assert all(torch.equal(x, y) for x, y in zip(captured, want, strict=True))


@pytest.mark.gpu
def test_mixed_gluon_on_a_sparse_table_gpu(gpu_kernels) -> None:
    """The sparse tier's table of an INT8 pool: the L1 blocks (8-bit) then the selected L2 ones (demoted),
    -1 padded past each row's count, at Llama-3-8B heads."""
    td = gpu_kernels.triton_decode
    inp = make_decode(Shape(3, 8, 4, 128, 64, 48, 128), 8, torch.bfloat16, "cuda", demote=False)
    pool, table = inp["pool"], inp["block_table"]
    demoted = table[:, :, 20:].flatten()
    demoted = demoted[demoted >= 0].long()
    requantize_int4_ref(pool, demoted.unique())
    want = hybrid_decode_attention_ref(**inp)
    for builds in ("two", "paired", "by_id"):
        poison_allocator("cuda")
        got = td.hybrid_decode_attention_triton(**inp, options=_mixed_options(td, builds=builds))
        assert_decode_close(got, want, inp["num_cold"], torch.bfloat16)


def test_aligned_pools_only_take_the_gluon_kernel() -> None:
    """``gluon_decode.aligned``: a pool allocated by kvtune with blocks of 16 or 64 tokens is aligned; a
    view whose block stride is not a multiple of 16 elements (a vLLM page of an odd width) is not."""
    from kvtune.kernels import gluon_decode

    for block in (16, 64):
        pool = make_decode(Shape(2, 2, 3, 64, block, 5, 40), 8, torch.float16, "cpu")["pool"]
        assert gluon_decode.aligned(pool)
    odd = replace(pool, k_min=torch.zeros(22, 2 * 64 + 8, dtype=torch.float16)[:, :128].view(22, 2, 64))
    assert not gluon_decode.aligned(odd)


@pytest.mark.gpu
@pytest.mark.parametrize("builds", ["by_id", "paired", "two"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_mixed_builds_launched_after_the_selection_gpu(gpu_kernels, builds: str, tma: bool) -> None:
    """``gluon_after_select`` (sm_90): the split selection writes the table split by bits and its merge lets
    the builds start at once; they wait for it before reading the split. The step's outputs are those of
    the builds launched after the selection ends, bit for bit, eagerly and replayed from a graph on new
    queries and tiers (the table then changes under the waiting builds)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    from kvtune.kernels.sparse_table import L1, L2, ByteCount
    from kvtune.kernels.sparse_table_choice import SelectOptions
    from kvtune.kernels.triton_sparse_split import sparse_block_table_split_triton

    td = gpu_kernels.triton_decode
    inp = make_decode(Shape(4, 8, 4, 128, 64, 96, 128), 8, torch.bfloat16, "cuda", demote=False)
    pool = inp["pool"]
    b, m, k = 4, 96, 8
    blocks = torch.randperm(pool.num_blocks, device="cuda")[: b * m].view(b, m)
    tier = torch.full((pool.num_blocks,), L2, device="cuda", dtype=torch.int8)
    tier[blocks[:, -12:]] = L1  # the newest eighth of each row
    requantize_int4_ref(pool, blocks[:, :-12].flatten())  # L2 blocks are 4-bit in an 8-bit pool
    pool.may_demote = True
    count = ByteCount(torch.arange(9, device="cuda") * 1000, 4096, torch.zeros((), dtype=torch.int64,
                                                                            device="cuda"))  # fmt: skip

    def step(after: bool) -> tuple[torch.Tensor, ...]:
        parts = empty_partition(b, 8, m + k, "cuda")
        table, num, _ = sparse_block_table_split_triton(inp["q"], pool, blocks, tier, k, count,
                                                        SelectOptions(split=True), None, parts)  # fmt: skip
        opts = _mixed_options(td, builds=builds, tma=tma)
        return td.hybrid_decode_attention_triton(
            inp["q"], inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], pool, table, num,
            inp["sm_scale"], options=replace(opts, gluon_after_select=after), partition=parts,
        )  # fmt: skip

    plan_opts = replace(_mixed_options(td, builds=builds, tma=tma), gluon_after_select=True)
    plan = td.launch_plan(inp["q"], inp["hot_k"], pool, inp["block_table"], plan_opts)
    assert plan.options.gluon_after_select
    want = step(False)
    got = step(True)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(True)
    inp["q"].normal_()
    tier[blocks[:, -24:-12]] = L1  # more L1 blocks (4-bit ones among them: promoted back)
    graph.replay()
    torch.cuda.synchronize()
    want = step(False)
    assert all(torch.equal(x, y) for x, y in zip(captured, want, strict=True))
