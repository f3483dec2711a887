"""Whether Triton casts float32 to float8 e4m3 as PyTorch does (round to nearest even), and whether one code's
nudge after the cast gives the outward rounding of :func:`kvtune.kernels.quest_summary.outward`: the building
blocks a seal kernel would need to write the e4m3 Quest summary.

Under ``TRITON_INTERPRET=1`` (Triton 3.6, on the CPU) the cast is wrong where the rounding carries into
the exponent: of 1,024 values of N(0, 10) some differ (7.86 -> 4.0, -1.98 -> -1.0, where PyTorch gives 8.0
and -2.0), so the outward codes miss too. A kernel meant to be checked in the interpreter should round on the
float32 bits (integer operations) instead. On a GPU, run it to see the compiled cast.

    TRITON_INTERPRET=1 python lab/scripts/f8_cast_check.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.quest_summary import outward

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


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1024
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).mul(10).to(device)
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
    for name, got, want in (("down", lo, outward(x, E4M3, up=False)), ("up", up, outward(x, E4M3, up=True))):
        print(f"outward {name}: {int((got.float() != want).sum())} of {n} differ from outward()")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
