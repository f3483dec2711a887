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
QUEST_SUMMARY_ENV = "KVTUNE_QUEST_SUMMARY"  # auto (default), 1 or 0: keep the e4m3 summary (keeps_summary)
QUEST_SUMMARY_VALUES = ("auto", "1", "0")


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


def keeps_summary(config: HybridConfig, device: torch.device | str | None = None) -> bool:
    """Whether a cache on ``device`` keeps Quest's key bounds in e4m3 too
    (:class:`~kvtune.kernels.layout.QuestSummary8`), which its selection then reads on sm_89 and newer. Only
    with the sparse tier; ``KVTUNE_QUEST_SUMMARY`` decides: ``auto`` (the default) keeps it where ``device``
    is a GPU of sm_89 or newer (None: the process's current GPU, if it has one; never on the CPU), ``1``
    on every device, ``0`` nowhere. Through the cache's sparse step it is 2-5 µs a layer shorter on an H100
    at 16 x 32K and 4 x 128K, and on the real SmolLM2 weights the aggregation probe recalled as many facts
    from it as from the fp16 bounds, 117 of 576 over four sparse configs (``docs/RESULTS.md``)."""
    if config.sparse_top_k <= 0:
        return False
    setting = summary_setting()
    return summary_loads_on(device) if setting == "auto" else setting == "1"


def summary_setting() -> str:
    """``KVTUNE_QUEST_SUMMARY``: ``auto`` when unset; ``ValueError`` for anything but auto, 1 or 0."""
    value = os.environ.get(QUEST_SUMMARY_ENV, "").strip() or "auto"
    if value not in QUEST_SUMMARY_VALUES:
        raise ValueError(f"{QUEST_SUMMARY_ENV}={value!r}: must be auto, 1 or 0")
    return value


def summary_loads_on(device: torch.device | str | None) -> bool:
    """Whether ``device`` is a GPU whose kernels load e4m3 (sm_89 or newer); None: the process's current GPU
    (False without one)."""
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def cold_layout(config: HybridConfig, shape: ModelKVShape, summary: bool | None = None) -> ColdLayout:
    """The cold pool's layout; ``summary``: whether it keeps the e4m3 bounds (None: :func:`keeps_summary` for
    the process's current GPU)."""
    return ColdLayout(
        config.block_size, shape.num_kv_heads, shape.head_dim, config.quantization_bits, shape.dtype,
        summary=keeps_summary(config) if summary is None else summary,
    )  # fmt: skip


def hot_capacity(config: HybridConfig) -> int:
    """Tokens a hot zone holds at most (between append and seal)."""
    return config.hot_tokens + config.block_size


def hot_bytes_per_seq(config: HybridConfig, shape: ModelKVShape) -> int:
    elems = 2 * shape.num_layers * shape.num_kv_heads * hot_capacity(config) * shape.head_dim
    return elems * shape.element_size + SLOT_META_BYTES


def block_bytes(config: HybridConfig, shape: ModelKVShape, summary: bool | None = None) -> int:
    """Bytes of one physical block over all layers, its metadata included (``summary``: as
    :func:`cold_layout`)."""
    per_layer = cold_layout(config, shape, summary).bytes_per_block + TIER_BYTES_PER_LAYER
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
    summary: bool = False  # the cold pool keeps the e4m3 bounds too (keeps_summary)

    @property
    def total_bytes(self) -> int:
        """Bytes the cache allocates (<= budget_bytes)."""
        return self.num_slots * self.hot_bytes_per_seq + self.num_blocks * self.block_bytes

    @property
    def cold(self) -> ColdLayout:
        return cold_layout(self.config, self.shape, self.summary)

    def blocks_for(self, length: int) -> int:
        return blocks_for(self.config, length)

    def max_sequences(self, length: int) -> int:
        """How many sequences of ``length`` tokens fit at once (no prefix sharing)."""
        need = self.blocks_for(length)
        return self.num_slots if need == 0 else min(self.num_slots, self.num_blocks // need)


def cache_layout(
    config: HybridConfig,
    shape: ModelKVShape,
    budget_bytes: int,
    max_seqs: int | None = None,
    device: torch.device | str | None = None,
) -> CacheLayout:
    """The layout ``budget_bytes`` buys for a cache on ``device`` (None: the process's current GPU, for
    :func:`keeps_summary`); ``ValueError`` if it cannot hold one hot zone."""
    hot = hot_bytes_per_seq(config, shape)
    if budget_bytes < hot:
        raise ValueError(
            f"`budget_bytes >= {hot}` (one hot zone) must hold, but got budget_bytes={budget_bytes}"
        )
    if max_seqs is not None and max_seqs < 1:
        raise ValueError(f"`max_seqs >= 1` must hold, but got max_seqs={max_seqs}")
    wanted = DEFAULT_MAX_SEQS if max_seqs is None else max_seqs
    slots = min(wanted, max(1, budget_bytes // (2 * hot)))
    summary = keeps_summary(config, device)
    blk = block_bytes(config, shape, summary)
    blocks = (budget_bytes - slots * hot) // blk
    return CacheLayout(config, shape, int(budget_bytes), slots, int(blocks), hot, blk, summary)


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
