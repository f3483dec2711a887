"""Whether Triton casts float32 to float8 e4m3 as PyTorch does (round to nearest even), and whether one code's
nudge after the cast gives the outward rounding of :func:`kvtune.kernels.quest_summary.outward`: the building
blocks a seal kernel would need to write the e4m3 Quest summary.

Under ``TRITON_INTERPRET=1`` (Triton 3.6, on the CPU) the cast is wrong where the rounding carries into
the exponent: of 1,024 values of N(0, 10) some differ (7.86 -> 4.0, -1.98 -> -1.0, where PyTorch gives 8.0
and -2.0), so the outward codes miss too. The seal kernels' ``_outward_e4m3``
(:mod:`kvtune.kernels.triton_quant`) rounds on the float32 bits instead (integer operations: the truncated
code from the exponent and the top 3 mantissa bits, or from ``|x| * 2^9`` below e4m3's normals, one code
further where inexact and away from zero is the direction), the same in the interpreter and compiled.
On a GPU, run it to see the compiled cast.

    TRITON_INTERPRET=1 python lab/scripts/f8_cast_check.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.quest_summary import outward
from kvtune.kernels.triton_quant import _outward_e4m3

E4M3 = torch.float8_e4m3fn


@triton.jit
def _cast(x_ptr, y_ptr, lo_ptr, up_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = x.to(tl.float8e4nv)
    yf = y.to(tl.float32)
    code = y.to(tl.uint8, bitcast=True)
    down = tl.where(yf > x, tl.where(x > 0, code - 1, code + 1), code)  # one code towards -inf
    up = tl.where(yf < x, tl.where(x > 0, code + 1, code - 1), code)  # one code towards +inf
    tl.store(y_ptr + i, yf)
    tl.store(lo_ptr + i, down.to(tl.float8e4nv, bitcast=True))
    tl.store(up_ptr + i, up.to(tl.float8e4nv, bitcast=True))


@triton.jit
def _bits(x_ptr, lo_ptr, up_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(lo_ptr + i, _outward_e4m3(x, False)[0])
    tl.store(up_ptr + i, _outward_e4m3(x, True)[0])


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1024
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).mul(10)
    x[:64] = torch.randn(64, generator=gen).mul(0.01)  # e4m3's subnormals
    x[64:72] = torch.tensor([0.0, -0.0, 448.0, -448.0, 8.0, -2.0, 0.001953125, -0.0009])  # edges
    x = x.to(device)
    y = torch.empty(n, device=device)
    lo, up = torch.empty(n, dtype=E4M3, device=device), torch.empty(n, dtype=E4M3, device=device)
    _cast[(1,)](x, y, lo, up, N=n)
    rtne = x.to(E4M3).float()
    bad = y != rtne
    print(f"cast: {int(bad.sum())} of {n} differ from PyTorch's", end="")
    if bad.any():
        ex = [t[bad][:3].tolist() for t in (x, y, rtne)]
        print(f" (e.g. {ex[0]} -> {ex[1]}, PyTorch {ex[2]})", end="")
    print()
    want = {"down": outward(x, E4M3, up=False), "up": outward(x, E4M3, up=True)}
    lo_b, up_b = torch.empty_like(lo), torch.empty_like(up)
    _bits[(1,)](x, lo_b.view(torch.uint8), up_b.view(torch.uint8), N=n)
    for how, got in (("cast and nudge, down", lo), ("cast and nudge, up", up), ("on the bits, down", lo_b),
                     ("on the bits, up", up_b)):  # fmt: skip
        miss = int((got.float() != want[how.rsplit(" ", 1)[1]]).sum())
        print(f"{how}: {miss} of {n} differ from outward()")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
