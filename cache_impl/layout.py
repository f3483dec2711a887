"""How a byte budget becomes hot-zone slots and cold blocks (derived; never written back into the config).

Everything the cache holds is counted:

* per sequence slot: the hot zone, ``2 · layers · H · (hot_tokens + block_size) · D`` elements of model dtype
  (the zone momentarily holds ``hot_tokens + block_size`` tokens between append and seal), plus
  ``SLOT_META_BYTES`` of bookkeeping;
* per physical block: in every layer its codes, key/value mins and scales, ``block_bits`` and, with the
  sparse tier where asked, the keys' e4m3 bounds (:attr:`ColdLayout.bytes_per_block`,
  :func:`keeps_summary`) plus ``TIER_BYTES_PER_LAYER`` of tier state (tier, last access, EMA), and
  ``BLOCK_META_BYTES`` of pool bookkeeping (refcount, chained hash, LRU links). Freed blocks kept for prefix
  reuse (the LRU) are ordinary blocks of this pool, so they are inside the budget too.

Slots: ``max_seqs`` (default ``DEFAULT_MAX_SEQS``), but hot zones take at most half the budget (at least
one slot); the rest is blocks. A sequence of ``n`` tokens holds ``max(0, (n − hot_tokens) // block_size)``
sealed blocks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.kernels.layout import ColdLayout

DEFAULT_MAX_SEQS = 256
SLOT_META_BYTES = 64
BLOCK_META_BYTES = 32
TIER_BYTES_PER_LAYER = 1 + 8 + 8
QUEST_SUMMARY_ENV = "KVTUNE_QUEST_SUMMARY"  # 1: keep the e4m3 summary (Quest reads it on sm_89+)


@dataclass(frozen=True)
class ModelKVShape:
    """What the cache needs to know of a model: its KV shape and precision."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_q_heads % num_kv_heads == 0` must hold, but got num_q_heads={self.num_q_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


def keeps_summary(config: HybridConfig) -> bool:
    """Whether the cache keeps Quest's key bounds in e4m3 too (:class:`~kvtune.kernels.layout.QuestSummary8`),
    which its selection then reads on sm_89 and newer: with the sparse tier where ``KVTUNE_QUEST_SUMMARY=1``.
    Off by default until its speed through the cache is timed on a GPU (run 52a, an H100, timed the
    selection alone: 1.5-3.5 µs a layer shorter); on the real SmolLM2 weights the aggregation probe recalled
    as many facts from the e4m3 bounds as from the fp16 ones, 117 of 576 over four sparse configs
    (``docs/RESULTS.md``)."""
    return config.sparse_top_k > 0 and summary_asked()


def summary_asked() -> bool:
    """Whether ``KVTUNE_QUEST_SUMMARY=1`` asks sparse configs to keep the e4m3 summary."""
    return os.environ.get(QUEST_SUMMARY_ENV, "0") == "1"


def cold_layout(config: HybridConfig, shape: ModelKVShape) -> ColdLayout:
    return ColdLayout(
        config.block_size, shape.num_kv_heads, shape.head_dim, config.quantization_bits, shape.dtype,
        summary=keeps_summary(config),
    )  # fmt: skip


def hot_capacity(config: HybridConfig) -> int:
    """Tokens a hot zone holds at most (between append and seal)."""
    return config.hot_tokens + config.block_size


def hot_bytes_per_seq(config: HybridConfig, shape: ModelKVShape) -> int:
    elems = 2 * shape.num_layers * shape.num_kv_heads * hot_capacity(config) * shape.head_dim
    return elems * shape.element_size + SLOT_META_BYTES


def block_bytes(config: HybridConfig, shape: ModelKVShape) -> int:
    """Bytes of one physical block over all layers, its metadata included."""
    per_layer = cold_layout(config, shape).bytes_per_block + TIER_BYTES_PER_LAYER
    return shape.num_layers * per_layer + BLOCK_META_BYTES


def blocks_for(config: HybridConfig, length: int) -> int:
    """Sealed blocks of a sequence of ``length`` tokens."""
    return max(0, (length - config.hot_tokens) // config.block_size)


@dataclass(frozen=True)
class CacheLayout:
    """Slots and blocks a budget buys (see the module docstring for what is counted)."""

    config: HybridConfig
    shape: ModelKVShape
    budget_bytes: int
    num_slots: int
    num_blocks: int
    hot_bytes_per_seq: int
    block_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes the cache allocates (<= budget_bytes)."""
        return self.num_slots * self.hot_bytes_per_seq + self.num_blocks * self.block_bytes

    @property
    def cold(self) -> ColdLayout:
        return cold_layout(self.config, self.shape)

    def blocks_for(self, length: int) -> int:
        return blocks_for(self.config, length)

    def max_sequences(self, length: int) -> int:
        """How many sequences of ``length`` tokens fit at once (no prefix sharing)."""
        need = self.blocks_for(length)
        return self.num_slots if need == 0 else min(self.num_slots, self.num_blocks // need)


def cache_layout(
    config: HybridConfig, shape: ModelKVShape, budget_bytes: int, max_seqs: int | None = None
) -> CacheLayout:
    """The layout ``budget_bytes`` buys; ``ValueError`` if it cannot hold one hot zone."""
    hot = hot_bytes_per_seq(config, shape)
    if budget_bytes < hot:
        raise ValueError(
            f"`budget_bytes >= {hot}` (one hot zone) must hold, but got budget_bytes={budget_bytes}"
        )
    if max_seqs is not None and max_seqs < 1:
        raise ValueError(f"`max_seqs >= 1` must hold, but got max_seqs={max_seqs}")
    wanted = DEFAULT_MAX_SEQS if max_seqs is None else max_seqs
    slots = min(wanted, max(1, budget_bytes // (2 * hot)))
    blk = block_bytes(config, shape)
    blocks = (budget_bytes - slots * hot) // blk
    return CacheLayout(config, shape, int(budget_bytes), slots, int(blocks), hot, blk)


def sequences_for_budget(config: HybridConfig, shape: ModelKVShape, budget_bytes: int, length: float) -> int:
    """How many sequences of ``length`` tokens (hot zone + sealed blocks at the config's bits) the budget
    holds at once, at least 1: the engine's default ``max_num_seqs``, so that a config that stores more tokens
    runs bigger batches and its hot-zone slots do not take what its blocks need."""
    blocks = blocks_for(config, round(length))
    return max(
        1, int(budget_bytes) // (hot_bytes_per_seq(config, shape) + blocks * block_bytes(config, shape))
    )


def kv_bytes_for(config: HybridConfig, shape: ModelKVShape, seq_lens: Sequence[int]) -> int:
    """Bytes that sequences of these lengths occupy at once (hot zones + their blocks, metadata included).

    As a budget with ``max_seqs=len(seq_lens)`` it holds them all whenever their hot zones are at most half
    of it (always for a single sequence).
    """
    blocks = sum(blocks_for(config, n) for n in seq_lens)
    return len(seq_lens) * hot_bytes_per_seq(config, shape) + blocks * block_bytes(config, shape)
