"""Access statistics of cold blocks, updated from the attention pass: the launcher and the IAI.

The rule and its PyTorch reference are in :mod:`kvtune.kernels.access_ref`; on CUDA the update takes the
Triton kernels of :mod:`kvtune.kernels.triton_access` (imported on first use).
"""

from __future__ import annotations

import torch

from kvtune.kernels.access_ref import accessed_blocks_ref, next_ema, update_access_ref
from kvtune.kernels.backend import use_triton

__all__ = ["accessed_blocks_ref", "inter_access_interval", "update_access", "update_access_ref"]


def update_access(
    last_access: torch.Tensor,
    ema: torch.Tensor,
    block_mass: torch.Tensor,
    block_table: torch.Tensor,
    num_cold: torch.Tensor,
    now_ms: float | torch.Tensor,
    flags: torch.Tensor | None = None,
) -> None:
    """See :func:`update_access_ref`; touches only the listed blocks' statistics (O(B·H·M), not O(N)).

    ``now_ms``: a float, or a float64 scalar tensor on the statistics' device (a step captured in a CUDA
    graph reads its clock from a static buffer, so no host value is baked into the graph).

    On CUDA two Triton launches (:mod:`kvtune.kernels.triton_access`; ``flags``, int32 [N] zeros, is their
    scratch and is zero again afterwards). Elsewhere: entries that list the same block gather the same old
    statistics and the same pooled ``accessed`` flag, so they write identical values and the scatter is
    deterministic (padding entries alias block 0 the same way).
    """
    if use_triton(block_mass):
        from kvtune.kernels.triton_access import update_access_triton

        if flags is None:
            flags = torch.zeros(last_access.shape, dtype=torch.int32, device=last_access.device)
        update_access_triton(last_access, ema, block_mass, block_table, num_cold, now_ms, flags)
        return
    acc = accessed_blocks_ref(last_access.shape[0], block_mass, block_table, num_cold)
    ids = block_table.long().clamp(min=0).flatten()
    hit = acc[ids]
    last, old = last_access[ids], ema[ids]
    new_ema = next_ema(now_ms - last, old)
    ema.index_put_((ids,), torch.where(hit, new_ema, old))
    now = torch.as_tensor(now_ms, dtype=last.dtype, device=last.device)
    last_access.index_put_((ids,), torch.where(hit, now.expand_as(last), last))


def inter_access_interval(
    last_access: torch.Tensor, ema: torch.Tensor, now_ms: float | torch.Tensor
) -> torch.Tensor:
    """IAI = max(EMA_0.25(intervals), now − last_access); ``now − last_access`` alone before any interval
    (``now_ms`` a float, or a device scalar inside a captured step)."""
    since = now_ms - last_access
    return torch.where(torch.isnan(ema), since, torch.maximum(ema, since))
