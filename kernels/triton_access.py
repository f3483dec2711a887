"""The access-statistics update of :mod:`kvtune.kernels.access` in two Triton launches, no host sync.

1. ``_mark_kernel``, one program per (sequence, KV head): its cold mass, its uniform share, and ``flags[block]
   = 1`` for every listed block above the share (several programs may write the same 1).
2. ``_update_kernel``, one program per (sequence, KV head): for every listed block,
   ``atomic_xchg(flags[block], 0)``; the one entry that reads 1 owns the block and writes its interval EMA
   and ``last_access = now``. Afterwards ``flags`` is all zeros again (every flagged block is listed),
   ready for the next call.

``now_ms`` travels as the bits of a float64 in an int64 argument, so the clock keeps its float64 precision
without a host-to-device copy; or, given as a float64 device scalar, it is read from device memory
(``NOW_PTR``: a step replayed as a CUDA graph takes its clock from a static buffer).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from kvtune.kernels.access_ref import EMA_WEIGHT
from kvtune.kernels.launch import launch
from kvtune.kernels.triton_common import require

MB = 64


@triton.jit(do_not_specialize=["M"])  # the table width follows the sequence lengths
def _mark_kernel(mass_ptr, table_ptr, ncold_ptr, flags_ptr, M, MB: tl.constexpr):
    """Flag the blocks of row (b, h) whose mass exceeds the row's uniform share of its cold mass."""
    bh = tl.program_id(0)
    n = tl.load(ncold_ptr + bh)
    row = bh.to(tl.int64) * M
    total = tl.zeros([MB], tl.float32)
    for j0 in range(0, n, MB):
        j = j0 + tl.arange(0, MB)
        total += tl.load(mass_ptr + row + j, mask=j < n, other=0.0)
    share = tl.sum(total, 0) / tl.maximum(n, 1).to(tl.float32)
    for j0 in range(0, n, MB):
        j = j0 + tl.arange(0, MB)
        valid = j < n
        mass = tl.load(mass_ptr + row + j, mask=valid, other=0.0)
        bid = tl.load(table_ptr + row + j, mask=valid, other=0).to(tl.int64)
        tl.store(flags_ptr + bid, tl.full([MB], 1, tl.int32), mask=valid & (mass > share))


@triton.jit(do_not_specialize=["now_lo", "now_hi", "M"])
def _update_kernel(table_ptr, ncold_ptr, flags_ptr, last_ptr, ema_ptr, now_ptr, now_lo, now_hi, M,
                   EMA_W: tl.constexpr, MB: tl.constexpr, NOW_PTR: tl.constexpr):  # fmt: skip
    """Claim each flagged listed block once (flag 1 → 0) and update its EMA and last access. The float64
    clock arrives as the two int32 halves of its bits (one int would be i32 or i64 by its value: two
    compiled kernels), or with ``NOW_PTR`` as a float64 at ``now_ptr``."""
    bh = tl.program_id(0)
    n = tl.load(ncold_ptr + bh)
    row = bh.to(tl.int64) * M
    if NOW_PTR:
        now = tl.load(now_ptr)
    else:
        bits = (now_hi.to(tl.int64) << 32) | (now_lo.to(tl.int64) & 0xFFFFFFFF)
        now = bits.to(tl.float64, bitcast=True)
    for j0 in range(0, n, MB):
        j = j0 + tl.arange(0, MB)
        valid = j < n
        bid = tl.load(table_ptr + row + j, mask=valid, other=0).to(tl.int64)
        won = valid & (tl.atomic_xchg(flags_ptr + bid, tl.zeros([MB], tl.int32), mask=valid) == 1)
        last = tl.load(last_ptr + bid, mask=won, other=0.0)
        ema = tl.load(ema_ptr + bid, mask=won, other=0.0)
        interval = now - last
        new_ema = tl.where(ema != ema, interval, EMA_W * interval + (1.0 - EMA_W) * ema)
        tl.store(ema_ptr + bid, new_ema, mask=won)
        tl.store(last_ptr + bid, tl.zeros([MB], tl.float64) + now, mask=won)


def update_access_triton(
    last_access: torch.Tensor,
    ema: torch.Tensor,
    block_mass: torch.Tensor,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    now_ms: float | torch.Tensor,
    flags: torch.Tensor,
) -> None:
    """The contract of :func:`kvtune.kernels.access_ref.update_access_ref`; ``flags`` int32 [N], all zeros;
    ``now_ms`` a float, or a float64 scalar on the device (read by the kernel, no host value baked in)."""
    b, h, m = block_table.shape
    rules = {
        "last_access, ema float64 [N] contiguous": last_access.dtype == ema.dtype == torch.float64
        and last_access.is_contiguous()
        and ema.is_contiguous(),
        "flags int32 [N] contiguous": flags.dtype == torch.int32 and flags.shape == last_access.shape,
        "block_table int32 [B, H, M], block_mass float32 [B, H, M], num_cold int32 [B, H], contiguous":
            block_table.dtype == torch.int32 and block_mass.dtype == torch.float32
            and num_cold.dtype == torch.int32 and block_mass.shape == block_table.shape
            and tuple(num_cold.shape) == (b, h)
            and all(t.is_contiguous() for t in (block_table, block_mass, num_cold)),
    }  # fmt: skip
    require("update_access", rules, lambda: f"block_table {tuple(block_table.shape)}")
    if b * h == 0 or m == 0:
        return
    on_device = isinstance(now_ms, torch.Tensor)
    if on_device:
        assert isinstance(now_ms, torch.Tensor)  # for mypy
        if now_ms.dtype != torch.float64 or now_ms.numel() != 1 or now_ms.device != last_access.device:
            raise ValueError("update_access: a device `now_ms` must be one float64 on the statistics' device")
        now_t, now_lo, now_hi = now_ms, 0, 0
    else:
        now_t = last_access  # unused pointer
        now_lo, now_hi = struct.unpack("<ii", struct.pack("<d", float(now_ms)))
    launch(_mark_kernel, (b * h,), block_mass, block_table, num_cold, flags, m, MB=MB, num_warps=2)
    launch(_update_kernel, (b * h,),
        block_table, num_cold, flags, last_access, ema, now_t, now_lo, now_hi, m, EMA_W=EMA_WEIGHT, MB=MB,
        NOW_PTR=on_device, num_warps=2,
    )  # fmt: skip
