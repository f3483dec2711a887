"""A prompt chunk's packed keys and values and the hot-zone writes (:mod:`kvtune.kernels.chunk_kv`): the
reference against the cold blocks dequantized whole, the Triton kernels against the reference.

The Triton kernels give the reference's values exactly (the same float32 operations, no fused multiply-add,
one rounding): under the interpreter here, compiled where there is a GPU (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.chunk_kv import HOT, NEW, PREFIX, hot_write_ref, pack_kv_ref
from kvtune.kernels.layout import ColdLayout, ColdPool
from kvtune.kernels.quant import dequantize_blocks_ref, seal_blocks_ref
from kvtune.kernels.requant import requantize_int4_ref
from kvtune.tests.triton_testlib import fixtures

pytest.importorskip("triton")

kernels, gpu_kernels = fixtures(("triton_chunk_kv",))


def _pool(bits: int, heads: int, d: int, bs: int, n: int, dtype: torch.dtype, device: str) -> ColdPool:
    """A pool of n blocks sealed from random K/V; in an 8-bit pool a third of them demoted to 4 bits."""
    pool = ColdLayout(bs, heads, d, bits, dtype).allocate(n, device)
    if n:
        kv = (torch.randn(2, n, bs, heads, d, device=device) * 2 + 0.5).to(dtype)
        seal_blocks_ref(pool, torch.arange(n, device=device), kv[0], kv[1], bits)
        if bits == 8:
            requantize_int4_ref(pool, torch.randperm(n, device=device)[: n // 3])
    return pool


def _scene(bits: int, heads: int, d: int, bs: int, dtype: torch.dtype, device: str, rows: int = 37,
           blocks: int = 5) -> dict:  # fmt: skip
    """Random packing inputs: ``rows`` packed rows of every kind in random order (no cold row without
    blocks)."""
    pool = _pool(bits, heads, d, bs, blocks, dtype, device)
    slots, cap, new = 4, bs + 8, 11
    hot = (torch.randn(2, slots, heads, cap, d, device=device) * 3).to(dtype)
    k = (torch.randn(new, heads, d, device=device) * 3).to(dtype)
    v = (torch.randn(new, heads, d, device=device) * 3).to(dtype)
    kinds = [NEW, HOT, PREFIX] if blocks else [NEW, HOT]
    kind = torch.tensor(kinds, device=device)[torch.randint(0, len(kinds), (rows,), device=device)]
    src = torch.where(
        kind == NEW,
        torch.randint(0, new, (rows,), device=device),
        torch.where(kind == HOT, torch.randint(0, slots * cap, (rows,), device=device),
                    torch.randint(0, max(1, blocks * bs), (rows,), device=device)),
    )  # fmt: skip
    return dict(pool=pool, hot=hot, k=k, v=v, kind=kind, src=src)


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_the_reference_packs_what_each_source_holds(bits: int) -> None:
    """Every packed row is its source's: the cold blocks dequantized whole (``dequantize_blocks_ref``), the
    hot zones, the new rows; rounded once to the packed dtype."""
    s = _scene(bits, 2, 32, 8, torch.float32, "cpu")
    got = pack_kv_ref(**s, dtype=torch.float16)
    pool, bs, cap = s["pool"], 8, s["hot"].shape[3]
    k_all, v_all = dequantize_blocks_ref(pool, torch.arange(pool.num_blocks))  # [n, H, bs, D]
    for r, (kind, src) in enumerate(zip(s["kind"].tolist(), s["src"].tolist())):
        if kind == PREFIX:
            want = torch.stack([k_all[src // bs, :, src % bs], v_all[src // bs, :, src % bs]])
        elif kind == HOT:
            want = s["hot"][:, src // cap, :, src % cap]
        else:
            want = torch.stack([s["k"][src], s["v"][src]])
        assert torch.equal(got[:, r], want.to(torch.float16)), (r, kind)


def test_the_reference_packs_without_a_cold_block() -> None:
    s = _scene(8, 2, 32, 8, torch.float32, "cpu", blocks=0)
    got = pack_kv_ref(**s, dtype=torch.float32)
    assert got.shape == (2, 37, 2, 32) and torch.isfinite(got).all()


@pytest.mark.parametrize("rows", [False, True])
def test_the_hot_write_reference_writes_each_row_once(rows: bool) -> None:
    hot = torch.zeros(2, 5, 2, 12, 32)
    k, v = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    slots, pos = torch.tensor([4, 0, 2]), torch.tensor([11, 3, 0])
    which = torch.tensor([5, 1, 2]) if rows else None
    hot_write_ref(hot, k, v, slots, pos, which)
    src = which if which is not None else torch.arange(3)
    for i in range(3):
        assert torch.equal(hot[0, slots[i], :, pos[i]], k[src[i]])
        assert torch.equal(hot[1, slots[i], :, pos[i]], v[src[i]])
    assert int((hot != 0).any(-1).sum()) == 3 * 2 * 2  # nothing else written


# ---- the kernels against the reference
def check_pack(kernels, bits: int, heads: int, d: int, bs: int, dtype: torch.dtype, device: str,
               blocks: int = 5, rows: int = 37) -> None:  # fmt: skip
    s = _scene(bits, heads, d, bs, dtype, device, rows=rows, blocks=blocks)
    want = pack_kv_ref(**s, dtype=dtype)
    got = kernels.triton_chunk_kv.pack_kv_triton(**s, dtype=dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def check_hot_write(kernels, heads: int, d: int, dtype: torch.dtype, device: str, rows: bool) -> None:
    hot = (torch.randn(2, 7, heads, 20, d, device=device) * 3).to(dtype)
    want = hot.clone()
    k = torch.randn(40, heads, d, device=device).to(dtype)
    v = torch.randn(40, heads, d, device=device).to(dtype)
    n = 19
    cells = torch.randperm(7 * 20, device=device)[:n]  # distinct (slot, position) pairs
    slots, pos = cells // 20, cells % 20
    which = torch.randperm(40, device=device)[:n] if rows else None
    kernels.triton_chunk_kv.hot_write_triton(hot, k, v, slots, pos, which)
    hot_write_ref(want, k, v, slots, pos, which)
    torch.testing.assert_close(hot, want, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("d", "bs"), [(32, 8), (64, 24)])
def test_pack_interpreted(kernels, bits: int, dtype: torch.dtype, d: int, bs: int) -> None:
    check_pack(kernels, bits, 2, d, bs, dtype, "cpu")


def test_pack_without_a_cold_block_interpreted(kernels) -> None:
    check_pack(kernels, 8, 2, 32, 8, torch.float32, "cpu", blocks=0)


@pytest.mark.parametrize("rows", [False, True])
def test_hot_write_interpreted(kernels, rows: bool) -> None:
    check_hot_write(kernels, 2, 32, torch.float16, "cpu", rows)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "d", "bs"), [(8, 128, 64), (3, 64, 32)])
def test_pack_gpu(gpu_kernels, bits: int, dtype: torch.dtype, heads: int, d: int, bs: int) -> None:
    check_pack(gpu_kernels, bits, heads, d, bs, dtype, "cuda", blocks=40, rows=2000)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [False, True])
def test_hot_write_gpu(gpu_kernels, rows: bool) -> None:
    check_hot_write(gpu_kernels, 8, 128, torch.bfloat16, "cuda", rows)
