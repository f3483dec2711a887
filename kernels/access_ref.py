"""Access statistics of cold blocks, updated from the attention pass (docs/DESIGN.md §1; all tensor ops
on the device).

For each sequence and KV head, the attention mass on cold blocks is ``cold = Σ_j block_mass[b, h, j]`` over
the ``num_cold[b, h]`` listed blocks; block ``j`` is accessed for that head when ``block_mass > cold /
num_cold`` (more than its uniform share). A block is accessed at this step when any head of any sequence
that lists it accesses it (sharing sequences are pooled). For an accessed block: ``interval = now −
last_access``, ``ema ← interval`` on the first interval, else ``ema ← 0.25 · interval + 0.75 · ema``; then
``last_access ← now``.

This module is the PyTorch reference (the executable spec); :mod:`kvtune.kernels.access` dispatches to it or
to the Triton kernels (:mod:`kvtune.kernels.triton_access`), which import only its constant from here.
"""

from __future__ import annotations

import torch

EMA_WEIGHT = 0.25


def accessed_blocks_ref(
    num_blocks: int, block_mass: torch.Tensor, block_table: torch.Tensor, num_cold: torch.Tensor
) -> torch.Tensor:
    """bool [num_blocks]: blocks accessed at this step (block_mass, block_table: [B, H, M]; num_cold: [B,
    H])."""
    m = block_table.shape[-1]
    valid = torch.arange(m, device=block_mass.device) < num_cold[..., None]
    mass = torch.where(valid, block_mass, 0.0)
    share = mass.sum(-1, keepdim=True) / num_cold.clamp(min=1)[..., None].to(mass.dtype)
    hit = (valid & (mass > share)).flatten().to(torch.int32)
    ids = block_table.long().clamp(min=0).flatten()
    acc = torch.zeros(num_blocks, dtype=torch.int32, device=block_mass.device)
    return acc.scatter_reduce_(0, ids, hit, reduce="amax").bool()


def next_ema(interval: torch.Tensor, ema: torch.Tensor) -> torch.Tensor:
    """EMA_0.25 of the intervals after one more ``interval`` (the first interval starts it)."""
    return torch.where(torch.isnan(ema), interval, EMA_WEIGHT * interval + (1 - EMA_WEIGHT) * ema)


def update_access_ref(
    last_access: torch.Tensor,
    ema: torch.Tensor,
    block_mass: torch.Tensor,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    now_ms: float | torch.Tensor,
) -> torch.Tensor:
    """Update one layer's statistics in place; returns the accessed mask (bool [N]).

    last_access, ema: [N] float64 (ms; ``ema`` is NaN until a block's first interval); block_mass: [B, H, M]
    float32; block_table: [B, H, M] int32 (-1 padding); num_cold: [B, H] int32.
    """
    acc = accessed_blocks_ref(last_access.shape[0], block_mass, block_table, num_cold)
    new_ema = next_ema(now_ms - last_access, ema)
    ema.copy_(torch.where(acc, new_ema, ema))
    last_access.masked_fill_(acc, now_ms)
    return acc
