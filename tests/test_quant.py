"""Cold-block layout: INT4 packing, quantization error bounds, re-quantization, key bounds."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.layout import ColdLayout, key_bounds
from kvtune.kernels.quant import dequantize_blocks, pack_int4, seal_blocks, unpack_int4
from kvtune.kernels.requant import requantize_int4, requantize_int4_ref

FP32_SLACK = 1e-5  # relative fp32 rounding of (x − min) / scale and min + code · scale


@pytest.mark.parametrize("lead", [(1,), (3, 5), (2, 1, 7)])
@pytest.mark.parametrize("d", [2, 16, 34])
def test_int4_pack_unpack_exact(lead: tuple[int, ...], d: int) -> None:
    codes = torch.randint(0, 16, (*lead, d), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (*lead, d // 2)
    assert torch.equal(packed & 0xF, codes[..., : d // 2])
    assert torch.equal(packed >> 4, codes[..., d // 2 :])
    assert torch.equal(unpack_int4(packed), codes)


def _sealed(bits: int, n: int, bs: int, d: int, dtype: torch.dtype, scale: float = 1.0):
    layout = ColdLayout(block_size=bs, num_kv_heads=2, head_dim=d, bits=bits, dtype=dtype)
    pool = layout.allocate(n + 2, "cpu")
    g = torch.Generator().manual_seed(bits * 100 + n + bs + d)
    k = (torch.randn(n, bs, 2, d, generator=g) * scale + torch.randn(d, generator=g)).to(dtype)
    v = (torch.randn(n, bs, 2, d, generator=g) * scale).to(dtype)
    ids = torch.arange(1, n + 1)
    seal_blocks(pool, ids, k, v, bits)
    return pool, ids, k.float().transpose(1, 2), v.float().transpose(1, 2)  # [n, H, bs, D]


def _within(err: torch.Tensor, half_scale: torch.Tensor, x: torch.Tensor) -> bool:
    return bool((err <= half_scale * (1 + FP32_SLACK) + FP32_SLACK * x.abs() + 1e-7).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("bs", [8, 24])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantization_error_within_half_scale(bits: int, n: int, bs: int, d: int, dtype: torch.dtype) -> None:
    pool, ids, k, v = _sealed(bits, n, bs, d, dtype)
    kd, vd = dequantize_blocks(pool, ids)
    k_half = pool.k_scale[ids].float()[:, :, None, :] / 2  # keys: per channel
    v_half = pool.v_scale[ids].float()[..., None] / 2  # values: per token
    assert _within((kd - k).abs(), k_half, k)
    assert _within((vd - v).abs(), v_half, v)
    assert pool.k.shape[-1] == d * bits // 8 and pool.k.dtype == torch.uint8
    assert (pool.block_bits[ids] == bits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unquantized_blocks_are_exact_copies(dtype: torch.dtype) -> None:
    pool, ids, k, v = _sealed(0, 2, 8, 16, dtype)
    kd, vd = dequantize_blocks(pool, ids)
    assert torch.equal(kd, k) and torch.equal(vd, v)


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_key_bounds_contain_the_keys(bits: int) -> None:
    pool, ids, k, _ = _sealed(bits, 3, 16, 16, torch.float32)
    lo, hi = key_bounds(pool, ids)  # [n, H, D]
    assert (lo[:, :, None, :] <= k).all() and (k <= hi[:, :, None, :] * (1 + FP32_SLACK) + 1e-6).all()


def test_constant_block_is_exact() -> None:
    layout = ColdLayout(block_size=8, num_kv_heads=1, head_dim=8, bits=4, dtype=torch.float32)
    pool = layout.allocate(1, "cpu")
    x = torch.full((1, 8, 1, 8), 0.75)
    seal_blocks(pool, torch.tensor([0]), x, x, 4)
    kd, vd = dequantize_blocks(pool, torch.tensor([0]))
    assert torch.equal(kd, x.transpose(1, 2)) and torch.equal(vd, x.transpose(1, 2))


@pytest.mark.parametrize("d", [16, 32])
def test_requantize_int4_in_its_8bit_slot(d: int) -> None:
    pool, ids, k, v = _sealed(8, 3, 16, d, torch.float32)
    k8, _ = dequantize_blocks(pool, ids)
    scales8 = pool.k_scale[ids].clone(), pool.v_scale[ids].clone()
    untouched = pool.k[ids[1:]].clone(), pool.v_scale[ids[1:]].clone()
    requantize_int4(pool, ids[:1])
    requantize_int4(pool, ids[:1])  # a second time changes nothing
    assert pool.block_bits[ids].tolist() == [4, 8, 8]
    assert torch.equal(pool.k[ids[1:]], untouched[0]) and torch.equal(pool.v_scale[ids[1:]], untouched[1])
    assert (pool.k[ids[0], :, :, d // 2 :] == 0).all()
    k4, v4 = dequantize_blocks(pool, ids[:1])
    k_half = (scales8[0][:1].float() + pool.k_scale[ids[:1]].float())[:, :, None, :] / 2
    v_half = (scales8[1][:1].float() + pool.v_scale[ids[:1]].float())[..., None] / 2
    assert _within((k4 - k[:1]).abs(), k_half, k[:1])
    assert _within((v4 - v[:1]).abs(), v_half, v[:1])
    assert torch.equal(dequantize_blocks(pool, ids[1:])[0], k8[1:])


def test_requantize_int4_where_equals_the_listed_subset() -> None:
    """The masked reference (every block listed, ``where`` choosing; no host read) equals the reference on
    the chosen blocks alone, other blocks and block bits untouched."""
    a, ids, _, _ = _sealed(8, 5, 16, 16, torch.float32)
    b = type(a)(**{f: getattr(a, f).clone() if isinstance(getattr(a, f), torch.Tensor) else getattr(a, f)
                   for f in a.__dataclass_fields__})  # fmt: skip
    requantize_int4(a, ids[:1])  # already 4 bits
    requantize_int4(b, ids[:1])
    where = torch.tensor([True, False, True, False, True])
    requantize_int4_ref(a, ids, where=where)
    requantize_int4_ref(b, ids[where])
    for name in ("k", "v", "k_min", "k_scale", "v_min", "v_scale", "block_bits"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.block_bits[ids].tolist() == [4, 8, 4, 8, 4]
