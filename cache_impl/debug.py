"""Debug statistics of the hybrid cache (``kv_cache_debug``): accumulated on the device, read on request.

Attention shares are per decode call the mean over sequences and KV heads of the softmax mass on the hot zone,
on L1 blocks and on L2 blocks (they sum to 1); reported as means over all decode calls and for the last step.
The quantization error of a newly sealed block is ``‖x − deq(x)‖ / ‖x‖`` over the block, for keys and values.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant import dequantize_blocks

_HOT, _L1, _L2, _CALLS, _K_ERR, _V_ERR, _SEALED = range(7)


class DebugStats:
    """Accumulators (no host synchronization until :meth:`report`); everything is a no-op when disabled."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.total = torch.zeros(7, dtype=torch.float64, device=device)
        self._step_start = self.total.clone()
        self.last_step = self.total.clone()
        self.steps = 0

    def attention(self, block_mass: torch.Tensor, hot_mass: torch.Tensor, num_l1: torch.Tensor) -> None:
        """block_mass [B, H, M] (L1 entries first, ``num_l1`` [B, H] of them), hot_mass [B, H]."""
        if not self.enabled or hot_mass.numel() == 0:
            return
        first = torch.arange(block_mass.shape[-1], device=block_mass.device) < num_l1[..., None]
        l1 = torch.where(first, block_mass, 0.0).sum(-1)
        l2 = block_mass.sum(-1) - l1
        self.total[_HOT] += hot_mass.double().mean()
        self.total[_L1] += l1.double().mean()
        self.total[_L2] += l2.double().mean()
        self.total[_CALLS] += 1

    def sealed(self, pool: ColdPool, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks just sealed from k, v [n, bs, H, D]."""
        if not self.enabled or block_ids.numel() == 0:
            return
        kd, vd = dequantize_blocks(pool, block_ids)
        for slot, deq, x in ((_K_ERR, kd, k), (_V_ERR, vd, v)):
            ref = x.transpose(1, 2).float()
            err = (deq - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp(min=1e-30)
            self.total[slot] += err.double().sum()
        self.total[_SEALED] += block_ids.numel()

    def end_step(self) -> None:
        if not self.enabled:
            return
        self.last_step = self.total - self._step_start
        self._step_start = self.total.clone()
        self.steps += 1

    @staticmethod
    def _shares(acc: list[float], prefix: str) -> dict[str, float]:
        calls, sealed = max(acc[_CALLS], 1.0), max(acc[_SEALED], 1.0)
        return {
            f"{prefix}hot_attention_share": acc[_HOT] / calls,
            f"{prefix}l1_attention_share": acc[_L1] / calls,
            f"{prefix}l2_attention_share": acc[_L2] / calls,
            f"{prefix}seal_key_rel_error": acc[_K_ERR] / sealed,
            f"{prefix}seal_value_rel_error": acc[_V_ERR] / sealed,
            f"{prefix}sealed_blocks": acc[_SEALED],
        }

    def report(self) -> dict[str, Any]:
        return {
            "debug_enabled": self.enabled,
            "debug_steps": self.steps,
            **self._shares(self.total.tolist(), ""),
            **self._shares(self.last_step.tolist(), "last_step_"),
        }
