"""The decode step's small Triton kernels (RMSNorm + residual, RoPE of the fused qkv, SiLU·up, the access
update) against their PyTorch references.

As in ``test_triton_kernels.py`` (whose ``test_interpreted_suite`` also runs this file's ``interpreted`` tests
in its TRITON_INTERPRET=1 child process): tiny shapes under the interpreter on the CPU, larger ones, bf16
included, on a GPU. Fresh random inputs each time; outputs are fresh ``torch.empty`` buffers of a poisoned
allocator on the GPU.
"""

from __future__ import annotations

import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

from kvtune.kernels.access import accessed_blocks_ref, update_access_ref
from kvtune.kernels.elementwise import add_rms_norm_ref, rope_qkv_ref, silu_mul_ref

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# model dtype -> (rtol, atol) against the reference (RoPE and SiLU·up: the float32 reference rounded once)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _load() -> SimpleNamespace:
    names = ("triton_elementwise", "triton_access")
    return SimpleNamespace(**{n: importlib.import_module(f"kvtune.kernels.{n}") for n in names})


@pytest.fixture(scope="module")
def kernels() -> SimpleNamespace:
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of test_interpreted_suite")
    return _load()


@pytest.fixture(scope="module")
def gpu_kernels() -> SimpleNamespace:
    if not HAS_CUDA or INTERPRETING:
        pytest.skip("needs a CUDA GPU (and no TRITON_INTERPRET)")
    torch.full((1 << 26,), float("nan"), device="cuda")  # freed cache memory is NaN: unwritten outputs show
    return _load()


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
    flags = torch.zeros(n_blocks, dtype=torch.int32, device=device)
    k.triton_access.update_access_triton(last, ema, mass, table, num_cold, 1234567.125, flags)
    assert accessed_blocks_ref(n_blocks, mass, table, num_cold).any() == (m > 1)  # one block: never above
    assert torch.equal(last, ref_last) and not flags.any()
    torch.testing.assert_close(ema, ref_ema, equal_nan=True, rtol=1e-14, atol=0)


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
