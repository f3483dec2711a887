"""Tiers per (layer, physical block): access statistics, planning, the throttled migration queue
(docs/DESIGN.md §1).

* A sealed block starts in L1 (always attended) with ``last_access = now`` and no interval yet.
* Statistics are device tensors ``[layers, blocks]`` updated by :func:`kvtune.kernels.access.update_access`
  from each layer's attention pass; the host reads them only when planning.
* Planning (every ``migration_interval`` decode steps): ``threshold = migration_threshold_ms · (1 + 0.2 ·
  load_factor)``, ``load_factor = geometric mean of the running sequences' lengths / 512``; in-use L1
  blocks with ``IAI > 1.5 · threshold`` go to L2 (only when ``sparse_top_k > 0``); in-use L2 blocks with
  ``IAI < threshold`` go back to L1. Promotions are queued before demotions, each in (layer, block) order.
* Demotion of a block of an 8-bit pool re-quantizes it to 4 bits in its 8-bit slot (``block_bits = 4``); a
  promoted block keeps its precision. INT4 and unquantized blocks change tier only.
* Queue: without throttling the whole plan is applied in the planning step; with it at most
  ``max_migrations_per_step`` (default ``ceil(planned / migration_interval)``) per engine step, all layers
  together; a new plan replaces what is left; entries whose block is no longer in use are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.kernels.access import inter_access_interval
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.requant import requantize_int4
from kvtune.kernels.sparse_table import L1, L2

LOAD_FACTOR_TOKENS = 512.0


def load_factor(lengths: Sequence[int]) -> float:
    """Geometric mean of the sequences' lengths / 512 (0 without sequences)."""
    positive = [n for n in lengths if n > 0]
    if not positive:
        return 0.0
    return math.exp(sum(math.log(n) for n in positive) / len(positive)) / LOAD_FACTOR_TOKENS


def threshold_ms(config: HybridConfig, lengths: Sequence[int]) -> float:
    return config.migration_threshold_ms * (1.0 + 0.2 * load_factor(lengths))


@dataclass(frozen=True)
class Migrations:
    """Parallel arrays: migrate ``blocks[i]`` of layer ``layers[i]`` to tier ``targets[i]``."""

    layers: np.ndarray
    blocks: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return int(self.layers.shape[0])

    def take(self, n: int) -> tuple[Migrations, Migrations]:
        return self._slice(slice(0, n)), self._slice(slice(n, None))

    def keep(self, mask: np.ndarray) -> Migrations:
        return Migrations(self.layers[mask], self.blocks[mask], self.targets[mask])

    def _slice(self, s: slice) -> Migrations:
        return Migrations(self.layers[s], self.blocks[s], self.targets[s])

    @staticmethod
    def empty() -> Migrations:
        z = np.zeros(0, dtype=np.int64)
        return Migrations(z, z, z)


class TierState:
    """Tier and access statistics of every (layer, block); a host mirror of the tiers for cheap counting."""

    def __init__(self, num_layers: int, num_blocks: int, device: torch.device) -> None:
        self.device = device
        # Rows padded to 16 entries: each layer's row starts 16-byte aligned whatever the block count (the
        # alignment of a kernel's pointer is part of its JIT key; caches of other sizes share the kernels).
        row = -(-num_blocks // 16) * 16
        self.tier = torch.full((num_layers, row), L1, dtype=torch.int8, device=device)[:, :num_blocks]
        self.last_access = torch.zeros(num_layers, row, dtype=torch.float64, device=device)[:, :num_blocks]
        self.ema = torch.full((num_layers, row), math.nan, dtype=torch.float64, device=device)[:, :num_blocks]
        self.flags = torch.zeros(num_blocks, dtype=torch.int32, device=device)  # update_access's scratch
        self.tier_host = np.full((num_layers, num_blocks), L1, dtype=np.int8)
        self.l2_blocks = np.zeros(num_layers, dtype=np.int64)

    def reset(self, blocks: Sequence[int], now_ms: float) -> None:
        """Fresh blocks (sealed now, all layers): L1, ``last_access = now``, no interval yet."""
        if not len(blocks):
            return
        self.reset_host(blocks)
        self.reset_device(torch.as_tensor(np.asarray(blocks, dtype=np.int64), device=self.device), now_ms)

    def reset_host(self, blocks: Sequence[int] | np.ndarray) -> None:
        """The host mirror's half of :meth:`reset` (L1, L2 counts)."""
        if not len(blocks):
            return
        ids = np.asarray(blocks, dtype=np.int64)
        self.l2_blocks -= (self.tier_host[:, ids] == L2).sum(axis=1)
        self.tier_host[:, ids] = L1

    def reset_device(self, idx: torch.Tensor, now_ms: float | torch.Tensor) -> None:
        """The device half of :meth:`reset` for block ids ``idx`` (int64 on the device; repeats allowed) at
        ``now_ms`` (a float, or a float64 device scalar: capturable in a CUDA graph, no host read)."""
        # index_fill_ with a Python number, never ``t[idx] = number`` (a host tensor: no copy under capture)
        self.tier.index_fill_(1, idx, L1)
        if isinstance(now_ms, torch.Tensor):
            self.last_access[:, idx] = now_ms.to(self.last_access.dtype)
        else:
            self.last_access.index_fill_(1, idx, now_ms)
        self.ema.index_fill_(1, idx, math.nan)

    def clear(self) -> None:
        """Every block back to L1 with no statistics, in place (the tensors keep their addresses)."""
        self.tier.fill_(L1)
        self.last_access.zero_()
        self.ema.fill_(math.nan)
        self.flags.zero_()
        self.tier_host.fill(L1)
        self.l2_blocks[:] = 0

    def plan(
        self, config: HybridConfig, now_ms: float, in_use: np.ndarray, lengths: Sequence[int]
    ) -> Migrations:
        """Migrations of in-use blocks (``in_use`` bool [N]) by the IAI rule; synchronizes with the device."""
        thr = threshold_ms(config, lengths)
        iai = inter_access_interval(self.last_access, self.ema, now_ms)
        live = torch.as_tensor(in_use, device=self.device)[None, :]
        promote = (live & (self.tier == L2) & (iai < thr)).nonzero().cpu().numpy()
        if config.sparse_top_k > 0:
            demote = (live & (self.tier == L1) & (iai > 1.5 * thr)).nonzero().cpu().numpy()
        else:
            demote = np.zeros((0, 2), dtype=np.int64)
        both = np.concatenate([promote, demote]).astype(np.int64).reshape(-1, 2)
        targets = np.concatenate([np.full(len(promote), L1), np.full(len(demote), L2)]).astype(np.int64)
        return Migrations(both[:, 0], both[:, 1], targets)

    def apply(self, migrations: Migrations, pools: Sequence[ColdPool]) -> int:
        """Apply the migrations that still change something; returns how many did."""
        current = self.tier_host[migrations.layers, migrations.blocks]
        todo = migrations.keep(current != migrations.targets)
        for layer in np.unique(todo.layers).tolist():
            sel = todo.keep(todo.layers == layer)
            self._apply_layer(layer, sel.blocks, sel.targets, pools[layer])
        return len(todo)

    def _apply_layer(self, layer: int, blocks: np.ndarray, targets: np.ndarray, pool: ColdPool) -> None:
        self.tier_host[layer, blocks] = targets
        self.l2_blocks[layer] += int((targets == L2).sum()) - int((targets == L1).sum())
        self.tier[layer, torch.as_tensor(blocks, device=self.device)] = torch.as_tensor(
            targets, dtype=torch.int8, device=self.device
        )
        demoted = blocks[targets == L2]
        if pool.bits == 8 and demoted.size:
            requantize_int4(pool, torch.as_tensor(demoted, device=self.device))

    def check(self) -> None:
        host = torch.as_tensor(self.tier_host, device=self.device)
        assert torch.equal(self.tier, host), "device tiers differ from the host mirror"
        counts = (self.tier_host == L2).sum(axis=1)
        assert np.array_equal(counts, self.l2_blocks), f"L2 counts {self.l2_blocks} != {counts}"


class MigrationQueue:
    """The planned migrations not applied yet (see the module docstring for the throttling rule)."""

    def __init__(self, config: HybridConfig) -> None:
        self.config = config
        self.pending = Migrations.empty()
        self.budget = 0

    def __len__(self) -> int:
        return len(self.pending)

    def replace(self, plan: Migrations) -> None:
        self.pending = plan
        explicit = self.config.max_migrations_per_step
        self.budget = explicit or math.ceil(len(plan) / self.config.migration_interval)

    def drop_unused(self, refcount: np.ndarray) -> None:
        self.pending = self.pending.keep(refcount[self.pending.blocks] > 0)

    def take(self, refcount: np.ndarray) -> Migrations:
        """This step's share of the queue (entries of blocks no longer in use are dropped first)."""
        self.drop_unused(refcount)
        n = self.budget if self.config.migration_throttling else len(self.pending)
        now, self.pending = self.pending.take(n)
        return now
