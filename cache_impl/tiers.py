"""Tiers per (layer, physical block): access statistics, planning, the throttled migration queue
(docs/DESIGN.md §1).

* A sealed block starts in L1 (always attended) with ``last_access = now`` and no interval yet.
* Statistics are device tensors ``[layers, blocks]`` updated by :func:`kvtune.kernels.access.update_access`
  from each layer's attention pass.
* Planning (every ``migration_interval`` decode steps): ``threshold = migration_threshold_ms · (1 + 0.2 ·
  load_factor)``, ``load_factor = geometric mean of the running sequences' lengths / 512``; in-use L1
  blocks with ``IAI > 1.5 · threshold`` go to L2 (only when ``sparse_top_k > 0``); in-use L2 blocks with
  ``IAI < threshold`` go back to L1. Promotions are queued before demotions, each in (layer, block) order.
* Demotion of a block of an 8-bit pool re-quantizes it to 4 bits in its 8-bit slot (``block_bits = 4``); a
  promoted block keeps its precision. INT4 and unquantized blocks change tier only.
* Queue: without throttling the whole plan is applied in the planning step; with it at most
  ``max_migrations_per_step`` (default ``ceil(planned / migration_interval)``) per engine step, all layers
  together; a new plan replaces what is left; entries whose block is no longer in use are dropped.

The cache plans and migrates **on the device** (:meth:`TierState.plan_pending`,
:meth:`TierState.apply_pending`): the queue is a ``[layers, blocks]`` tensor of pending targets, its order
a prefix sum, the demoted 8-bit blocks re-quantized by one kernel over a compacted list; the host passes
the clock, the threshold and whether the step plans (a captured decode step reads them from its staged
buffer), and the in-use mask when it changed. Nothing reads the device back, so a decode step with its
tier work is one CUDA graph. The host versions (:meth:`TierState.plan`, :class:`MigrationQueue`,
:meth:`TierState.apply`) are the executable spec the device queue is tested against, and
:meth:`TierState.apply` also sets tiers up explicitly (benchmarks, tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtune.cache_impl.chunks import upload
from kvtune.cache_impl.config import HybridConfig
from kvtune.kernels.access import inter_access_interval
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.requant import requantize_int4, requantize_int4_masked
from kvtune.kernels.sparse_table import L1, L2

LOAD_FACTOR_TOKENS = 512.0
NONE = -1  # no migration pending for a (layer, block)


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
    """Tier, access statistics and the migration queue of every (layer, block), on the device."""

    def __init__(self, num_layers: int, num_blocks: int, device: torch.device) -> None:
        self.device = device
        # Rows padded to 16 entries: each layer's row starts 16-byte aligned whatever the block count (the
        # alignment of a kernel's pointer is part of its JIT key; caches of other sizes share the kernels).
        row = -(-num_blocks // 16) * 16
        self.tier = torch.full((num_layers, row), L1, dtype=torch.int8, device=device)[:, :num_blocks]
        self.last_access = torch.zeros(num_layers, row, dtype=torch.float64, device=device)[:, :num_blocks]
        self.ema = torch.full((num_layers, row), math.nan, dtype=torch.float64, device=device)[:, :num_blocks]
        self.flags = torch.zeros(num_blocks, dtype=torch.int32, device=device)  # update_access's scratch
        # the device queue: each (layer, block)'s pending target tier (NONE: nothing pending), the plan's
        # per-step budget, migrations applied, the in-use mask (uploaded when the host's refcounts changed),
        # the largest share of in-use pairs in L2 seen at a step, and a switch that capture warm-ups turn off
        self.pending = torch.full((num_layers, row), NONE, dtype=torch.int8, device=device)[:, :num_blocks]
        self.budget = torch.zeros((), dtype=torch.int64, device=device)
        self.done = torch.zeros((), dtype=torch.int64, device=device)
        self.in_use = torch.zeros(num_blocks, dtype=torch.bool, device=device)
        self.l2_peak = torch.zeros((), dtype=torch.float64, device=device)
        self.enabled = torch.ones((), dtype=torch.bool, device=device)
        self._in_use_of: tuple[int, int] | None = None  # (pool id, its version) last uploaded

    @property
    def tier_host(self) -> np.ndarray:
        """The tiers ``[layers, blocks]`` on the host (synchronizes with the device)."""
        return self.tier.cpu().numpy()

    @property
    def l2_blocks(self) -> np.ndarray:
        """Blocks in L2 per layer, in use or not (synchronizes with the device)."""
        return (self.tier == L2).sum(dim=1).cpu().numpy()

    def reset(self, blocks: Sequence[int], now_ms: float) -> None:
        """Fresh blocks (sealed now, all layers): L1, ``last_access = now``, no interval yet."""
        if not len(blocks):
            return
        self.reset_device(upload(torch.from_numpy(np.asarray(blocks, dtype=np.int64)), self.device), now_ms)

    def reset_device(self, idx: torch.Tensor, now_ms: float | torch.Tensor) -> None:
        """:meth:`reset` for block ids ``idx`` (int64 on the device; repeats allowed) at ``now_ms`` (a float,
        or a float64 device scalar: capturable in a CUDA graph, no host read)."""
        # index_fill_ with a Python number, never ``t[idx] = number`` (a host tensor: no copy under capture)
        self.tier.index_fill_(1, idx, L1)
        if isinstance(now_ms, torch.Tensor):
            self.last_access[:, idx] = now_ms.to(self.last_access.dtype)
        else:
            self.last_access.index_fill_(1, idx, now_ms)
        self.ema.index_fill_(1, idx, math.nan)

    def clear(self) -> None:
        """Every block back to L1 with no statistics and nothing queued, in place (the tensors keep their
        addresses)."""
        self.tier.fill_(L1)
        self.last_access.zero_()
        self.ema.fill_(math.nan)
        self.flags.zero_()
        self.pending.fill_(NONE)
        self.budget.zero_()
        self.done.zero_()
        self.in_use.zero_()
        self.l2_peak.zero_()
        self.enabled.fill_(True)
        self._in_use_of = None

    # ---- the device queue ----------------------------------------------------------------------------------
    def sync_in_use(self, refcount: np.ndarray, pool_id: int, version: int) -> None:
        """Upload ``refcount > 0`` when the pool (``pool_id``, ``version``) changed since the last upload (an
        asynchronous copy, ordered before the next step's work)."""
        if self._in_use_of == (pool_id, version):
            return
        self._in_use_of = (pool_id, version)
        mask = torch.from_numpy(refcount > 0)
        self.in_use.copy_(mask, non_blocking=self.device.type == "cuda")

    def plan_pending(
        self,
        config: HybridConfig,
        now_ms: float | torch.Tensor,
        thr: float | torch.Tensor,
        due: torch.Tensor | None = None,
    ) -> None:
        """Plan by the IAI rule into the device queue, replacing what is left (:meth:`plan`'s rule). ``due``
        (a bool device scalar): plan only where it is set (a captured step plans at every replay and keeps
        the result only on planning steps); None: the host knows this step plans."""
        iai = inter_access_interval(self.last_access, self.ema, now_ms)
        live = self.in_use[None, :]
        promote = live & (self.tier == L2) & (iai < thr)
        if config.sparse_top_k > 0:
            demote = live & (self.tier == L1) & (iai > 1.5 * thr)
            new = torch.where(promote, L1, torch.where(demote, L2, NONE)).to(torch.int8)
        else:
            new = torch.where(promote, L1, NONE).to(torch.int8)
        explicit = config.max_migrations_per_step
        if explicit:
            budget: torch.Tensor | int = explicit
        else:
            interval = config.migration_interval
            budget = ((new != NONE).sum() + (interval - 1)) // interval
        if due is None:
            self.pending.copy_(new)
            self.budget.copy_(torch.as_tensor(budget, device=self.device))
            return
        self.pending.copy_(torch.where(due, new, self.pending))
        self.budget.copy_(torch.where(due, budget, self.budget))

    def apply_pending(self, config: HybridConfig, pools: Sequence[ColdPool]) -> None:
        """This step's share of the queue (:class:`MigrationQueue`'s rule), applied on the device: entries of
        blocks no longer in use are dropped, then promotions before demotions in (layer, block) order up to
        the plan's budget (all of them without throttling); demoted 8-bit blocks are re-quantized."""
        live = self.in_use[None, :]
        pending = torch.where(live, self.pending, NONE)
        queued = pending != NONE
        if config.migration_throttling:
            to_l1 = (pending == L1).flatten()
            to_l2 = (pending == L2).flatten()
            rank = torch.where(to_l1, to_l1.cumsum(0), to_l1.sum() + to_l2.cumsum(0)).view(queued.shape)
            take = queued & (rank <= self.budget)
        else:
            take = queued
        take &= self.enabled
        changed = take & (self.tier != pending)
        self.done += changed.sum()
        if pools and pools[0].bits == 8 and pools[0].num_blocks:
            requantize_int4_masked(pools, changed & (pending == L2))
        self.tier.copy_(torch.where(take, pending, self.tier))
        self.pending.copy_(torch.where(take, NONE, pending))
        pairs = live.sum() * self.tier.shape[0]
        share = ((self.tier == L2) & live).sum() / pairs.clamp(min=1)
        self.l2_peak.copy_(torch.maximum(self.l2_peak, share.to(self.l2_peak.dtype)))

    def queued(self) -> int:
        """Migrations still queued for blocks in use (synchronizes)."""
        return int(((self.pending != NONE) & self.in_use[None, :]).sum())

    # ---- the host spec ---------------------------------------------------------------------------------
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
        """Apply the migrations that still change something; returns how many did (reads the tiers back:
        for tests, benchmarks and explicit set-ups)."""
        current = self.tier_host[migrations.layers, migrations.blocks]
        todo = migrations.keep(current != migrations.targets)
        for layer in np.unique(todo.layers).tolist():
            sel = todo.keep(todo.layers == layer)
            self._apply_layer(layer, sel.blocks, sel.targets, pools[layer])
        return len(todo)

    def _apply_layer(self, layer: int, blocks: np.ndarray, targets: np.ndarray, pool: ColdPool) -> None:
        self.tier[layer, torch.as_tensor(blocks, device=self.device)] = torch.as_tensor(
            targets, dtype=torch.int8, device=self.device
        )
        demoted = blocks[targets == L2]
        if pool.bits == 8 and demoted.size:
            requantize_int4(pool, torch.as_tensor(demoted, device=self.device))

    def check(self) -> None:
        tiers, pending = self.tier_host, self.pending.cpu().numpy()
        assert np.isin(tiers, (L1, L2)).all(), "a tier other than L1 or L2"
        assert np.isin(pending, (NONE, L1, L2)).all(), "a pending target other than L1 or L2"


class MigrationQueue:
    """The planned migrations not applied yet (see the module docstring for the throttling rule): the host
    spec of :meth:`TierState.apply_pending`."""

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
