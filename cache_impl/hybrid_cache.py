"""The hybrid_v2 KV cache: hot zone in model precision + cold blocks (INT8/INT4/unquantized) in tiers L1/L2.

Per sequence::

    tokens: [ block 0 | block 1 | ... | block n-1 ][ hot zone: hot_tokens ≤ len < hot_tokens + block_size ]
             cold (layout: kvtune.kernels.layout)    model precision, newest tokens

Decode step: ``begin_step`` (allocates the blocks that seal this step, returns the immutable
:class:`DecodePlan`) → ``decode`` per layer (append the new K/V to the hot zone → seal the oldest
``block_size`` hot tokens when the zone holds ``hot_tokens + block_size`` → attend over hot + L1 +
Quest-selected L2 blocks, then update the layer's access statistics from the per-block attention mass) →
``end_step`` (prefix registration, tier planning every ``migration_interval`` steps, the migration queue,
debug statistics). Tier planning and migrations run on the device (:mod:`kvtune.cache_impl.tiers`), and
only in a cache with the sparse tier (without it no block can reach L2).

Static decode step (what a CUDA graph replays, :mod:`kvtune.cache_impl.plan`): ``prepare_step`` (vectorized
host bookkeeping: the same allocation and lengths as ``begin_step``, written into :class:`StepBuffers` in
one copy) → ``seal_static`` for the zones that would fill (before the step: the oldest ``block_size`` of
their ``hot_tokens + block_size − 1`` tokens, every layer at once) → ``decode`` per layer on the static
plan (append → attend) → ``migrate_static`` (the tier planning and migrations, inside the captured step)
→ ``finish_step`` (the host's share of ``end_step``). Both orders give attention the same hot
tokens and blocks; a sequence may take either from one step to the next.

Per-sequence decode state (length, hot length, block table) lives in numpy arrays indexed by hot-zone slot,
so a step's bookkeeping is a few array operations whatever the batch; ``_Seq`` reads and writes them.

Choices where docs/DESIGN.md is silent: query head ``j`` uses KV head ``j // G``; the softmax scale is
``1/sqrt(head_dim)``; prefill attention is dense and causal over the dequantized cached prefix + the new
tokens (scaled-dot-product attention in the model dtype); a prefix hit is limited to the blocks the prompt
itself would seal (so the hot zone keeps at least ``hot_tokens`` tokens); blocks become findable for prefix
reuse once the owning sequence has prefilled every layer (prompt blocks sealed later, during decode, at the
end of their step); blocks holding generated tokens are never shared; blocks sealed by a prefill get
``last_access`` = the latest clock the cache was given (or the ``now_ms`` passed to ``add_sequence``);
without the sparse tier (``sparse_top_k`` 0) nothing is demoted, so no decision reads the access statistics
and decode does not update them (two launches a layer fewer in every step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvtune.cache_impl.block_pool import BlockPool, CacheFullError, chain_hashes
from kvtune.cache_impl.chunks import (
    ChunkPad,
    ChunkPlan,
    ChunkSpec,
    ChunkStaging,
    build_chunk_plan,
    upload,
    upload_aligned,
)
from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.debug import DebugStats
from kvtune.cache_impl.layout import CacheLayout, ModelKVShape, cache_layout, hot_capacity, kv_bytes_for
from kvtune.cache_impl.plan import DecodePlan, StepBuffers, StepInfo, StepShape
from kvtune.cache_impl.tiers import L2, TierState, threshold_ms
from kvtune.kernels.access import update_access
from kvtune.kernels.backend import on_gpu
from kvtune.kernels.bits_partition_ref import BitsPartition
from kvtune.kernels.chunk_kv import hot_write, pack_kv
from kvtune.kernels.decode_attention import hybrid_decode_attention
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quant import dequantize_blocks, seal_blocks
from kvtune.kernels.requant import requantize_int4, requantize_int4_masked
from kvtune.kernels.sparse_table import ByteCount, selection_summary, sparse_block_table_parts
from kvtune.kernels.sparse_table_choice import CHUNK, SelectOptions, build_spans

# a prompt chunk's attention: PyTorch's SDPA backends but cuDNN's, which builds an execution plan for each
# new pair of lengths on the host (H200, torch 2.11: 59 ms median, up to 856 ms, for a prompt's first layer
# against 0.06 ms with FlashAttention; a gated iteration's first gate then opened early; lab/scripts/
# first_layer.py)
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

__all__ = ["CacheFullError", "CacheLayout", "DecodePlan", "HybridCache", "ModelKVShape", "kv_bytes_for"]


class _SlotArrays:
    """Decode state per hot-zone slot (numpy): tokens, hot-zone tokens, sealed blocks and their ids."""

    def __init__(self, num_slots: int, width: int = 16) -> None:
        self.length = np.zeros(num_slots, dtype=np.int64)
        self.hot_len = np.zeros(num_slots, dtype=np.int64)
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)
        self.table = np.full((num_slots, width), -1, dtype=np.int64)

    def ensure_width(self, width: int) -> None:
        """Room for ``width`` blocks per slot (the table grows by doubling, padded with -1)."""
        if width > self.table.shape[1]:
            grown = np.full((self.table.shape[0], max(width, 2 * self.table.shape[1])), -1, dtype=np.int64)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def clear(self, slot: int) -> None:
        self.length[slot] = self.hot_len[slot] = self.num_blocks[slot] = 0
        self.table[slot] = -1


@dataclass(eq=False)
class _Seq:
    """Host state of one sequence; its length, hot length and blocks are the slot's row of ``arrays``."""

    seq_id: int
    slot: int
    token_ids: list[int]
    hashes: list[int]
    hits: int
    sealed: int  # blocks of ``blocks`` that hold K/V (the hits, then what prefill chunks sealed)
    prefilled: int  # tokens whose K/V are cached in every layer
    arrays: _SlotArrays = field(repr=False)
    chunk: int = 0  # tokens of the prefill chunk in flight (0: none)
    layers_done: int = 0  # layers of that chunk done
    # that chunk's block ids on the device, the same in every layer: (the ``sealed`` blocks before it, those
    # it seals), uploaded once per chunk, not once per layer (a copy from the host waits for the device)
    chunk_blocks: Any = None
    ready: bool = False
    registered: set[int] = field(default_factory=set)

    @property
    def length(self) -> int:
        return int(self.arrays.length[self.slot])

    @length.setter
    def length(self, value: int) -> None:
        self.arrays.length[self.slot] = value

    @property
    def hot_len(self) -> int:
        """Tokens in the hot zone now (during prefill: of the chunks done so far)."""
        return int(self.arrays.hot_len[self.slot])

    @hot_len.setter
    def hot_len(self, value: int) -> None:
        self.arrays.hot_len[self.slot] = value

    @property
    def num_blocks(self) -> int:
        return int(self.arrays.num_blocks[self.slot])

    @property
    def blocks(self) -> list[int]:
        """Block ids, oldest first (a copy)."""
        return self.arrays.table[self.slot, : self.num_blocks].tolist()

    def set_blocks(self, blocks: Sequence[int]) -> None:
        self.arrays.ensure_width(len(blocks))
        self.arrays.table[self.slot] = -1
        self.arrays.table[self.slot, : len(blocks)] = blocks
        self.arrays.num_blocks[self.slot] = len(blocks)


class HybridCache:
    """The cache of one model under a byte budget (see the module docstring)."""

    def __init__(
        self,
        config: HybridConfig,
        shape: ModelKVShape,
        budget_bytes: int,
        device: torch.device | str,
        max_seqs: int | None = None,
    ) -> None:
        self.config, self.shape, self.device = config, shape, torch.device(device)
        self.layout = cache_layout(config, shape, budget_bytes, max_seqs, self.device)
        lay, n_layers = self.layout, shape.num_layers
        hot_shape = (n_layers, lay.num_slots, shape.num_kv_heads, hot_capacity(config), shape.head_dim)
        # K and V hot zones in one tensor [layers, 2, slots, H, C, D], so one copy shifts both after a seal
        self.hot_kv = torch.zeros((n_layers, 2, *hot_shape[1:]), dtype=shape.dtype, device=self.device)
        self.hot_k, self.hot_v = self.hot_kv[:, 0], self.hot_kv[:, 1]
        self.pools: list[ColdPool] = lay.cold.allocate_layers(n_layers, lay.num_blocks, self.device)
        for pool in self.pools:
            pool.may_demote = config.sparse_top_k > 0  # demotion is the only way a block's bits change
        self.blocks = BlockPool(lay.num_blocks)
        self.tiers = TierState(n_layers, lay.num_blocks, self.device)
        self.sparse = config.sparse_top_k > 0  # tiers are planned and migrated only with the sparse tier
        self._planned = False  # a plan was made since the cache was emptied (an eager step applies then)
        self._l2_layers: np.ndarray | None = None  # blocks in L2 per layer at the eager step's start
        self.debug = DebugStats(self.device, enabled=config.kv_cache_debug)
        # every decode call's (layer, table, num_cold) while a list (None: off); uncaptured steps only (tests)
        self.table_log: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
        self.sm_scale = shape.head_dim**-0.5
        self._seqs: dict[int, _Seq] = {}
        self._chunk_plan: ChunkPlan | None = None  # the chunks prefill_chunks runs layer by layer
        self._free_slots = list(range(lay.num_slots - 1, -1, -1))
        self._st = _SlotArrays(lay.num_slots)
        self._seq_at: list[_Seq | None] = [None] * lay.num_slots
        self._ready = np.zeros(lay.num_slots, dtype=bool)  # slots whose sequence can decode
        self._step = 0
        self._now = 0.0
        self._bytes_dev = torch.zeros((), dtype=torch.int64, device=self.device)
        self._bytes_host = 0
        cost = self._bytes_per_entry()
        self._cost = cost.to(self.device)
        self._cost_host = cost.tolist()  # Python ints: a decode layer reads one without a tensor op
        self._quest_cost = shape.num_kv_heads * 2 * 2 * shape.head_dim  # an L2 block's key mins + scales
        self.counters = {"prefix_lookup_blocks": 0, "prefix_hit_blocks": 0, "plans": 0}

    def compile_kernels(self) -> None:
        """Launch once, on every layer, the kernels that a short warm-up may not reach: the seal of a block
        from its hot zone during decode, and once blocks have moved to L2 the sparse tier's table, Quest and
        the demotion to 4 bits; Triton then compiles them before anything is timed. Arguments are shaped,
        typed and aligned as the step's, so the JIT keys match. Only on a cache that holds nothing yet (it
        writes a free block)."""
        if self._seqs or self.blocks.num_free() < self.layout.num_blocks:
            raise ValueError("compile_kernels: the cache must be empty (it writes a free block)")
        if self.layout.num_blocks == 0:
            return
        s, bs = self.shape, self.config.block_size
        block = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        q = torch.zeros((1, s.num_q_heads, s.head_dim), dtype=s.dtype, device=self.device)
        scratch = ByteCount(self._cost, self._quest_cost, torch.zeros_like(self._bytes_dev))
        for layer, pool in enumerate(self.pools):
            k = self.hot_k[layer][:, :, :bs].transpose(1, 2)  # as in _seal
            v = self.hot_v[layer][:, :, :bs].transpose(1, 2)
            seal_blocks(pool, block[0], k, v, self.config.quantization_bits, block[0])
            if self.config.sparse_top_k == 0:
                continue
            summary, k_blocks = selection_summary(pool, q), self.config.sparse_blocks
            for split in (True, False):  # the selection is split where rows are few (the step's size)
                select = SelectOptions(split=split)
                sparse_block_table_parts(
                    q, pool, block, self.tiers.tier[layer], k_blocks, scratch, select, summary
                )  # fmt: skip
            if on_gpu(self.device):  # the split selection's other builds (its spans' warps, its merge's width
                # follow a row's span count, which the step's rows and lengths set): one row of as many spans
                for spans in build_spans(k_blocks, summary is not None)[1:]:
                    row = block.new_zeros((1, spans * CHUNK))
                    select = SelectOptions(split=True, splits=spans)
                    sparse_block_table_parts(
                        q, pool, row, self.tiers.tier[layer], k_blocks, scratch, select, summary
                    )  # fmt: skip
            if pool.bits == 8:
                requantize_int4(pool, block[0])
        if self.sparse and self.pools[0].bits == 8:  # the device queue's demotion (an empty list: no change)
            requantize_int4_masked(self.pools, torch.zeros_like(self.tiers.tier, dtype=torch.bool))
        for pool in self.pools:
            pool.block_bits[0] = pool.bits
        if self.sparse and on_gpu(self.device):  # the access update with a device clock (static steps)
            mass = torch.zeros((1, s.num_kv_heads, 1), dtype=torch.float32, device=self.device)
            table = torch.zeros((1, s.num_kv_heads, 1), dtype=torch.int32, device=self.device)
            count = torch.zeros((1, s.num_kv_heads), dtype=torch.int32, device=self.device)
            now = torch.zeros((), dtype=torch.float64, device=self.device)
            for layer in range(s.num_layers):  # no block listed: nothing changes
                tiers = self.tiers
                update_access(
                    tiers.last_access[layer], tiers.ema[layer], mass, table, count, now, tiers.flags
                )

    def reset(self) -> None:
        """Forget every sequence and statistic, keeping every tensor (and its address: graphs captured over
        this cache stay valid). The cold pools' contents are left as they are (unreferenced)."""
        lay = self.layout
        self._seqs.clear()
        self._chunk_plan = None
        self._free_slots = list(range(lay.num_slots - 1, -1, -1))
        self._st = _SlotArrays(lay.num_slots, self._st.table.shape[1])
        self._seq_at = [None] * lay.num_slots
        self._ready[:] = False
        self.blocks = BlockPool(lay.num_blocks)
        self.tiers.clear()
        self._planned, self._l2_layers = False, None
        self.debug = DebugStats(self.device, enabled=self.config.kv_cache_debug)
        for pool in self.pools:
            pool.block_bits.fill_(pool.bits)
        self._step, self._now = 0, 0.0
        self._bytes_dev.zero_()
        self._bytes_host = 0
        self.counters = dict.fromkeys(self.counters, 0)

    # ---- capacity -------------------------------------------------------------------------------------
    def blocks_free(self) -> int:
        return self.blocks.num_free()

    def fits_ever(self, num_tokens: int) -> bool:
        """Could a sequence of ``num_tokens`` tokens live in an empty cache."""
        return self.layout.blocks_for(num_tokens) <= self.layout.num_blocks

    def can_allocate(
        self, num_tokens: int, token_ids: list[int] | None = None, reserved_blocks: int = 0
    ) -> bool:
        """Would a new sequence with this prompt fit now (a slot, and blocks for what prefix reuse cannot
        give), leaving ``reserved_blocks`` free blocks (e.g. those this iteration's decode step seals)."""
        if not self._free_slots:
            return False
        n_total = self.layout.blocks_for(num_tokens)
        hits = self._match(token_ids, n_total) if token_ids is not None else []
        from_lru = sum(self.blocks.in_lru(b) for b in hits)
        return n_total - len(hits) <= self.blocks.num_free() - from_lru - reserved_blocks

    def blocks_needed_for_step(self, seq_ids: Sequence[int]) -> int:
        """Blocks the next ``begin_step(seq_ids)`` allocates (sequences whose hot zone fills)."""
        return self.blocks_needed_for_slots(np.asarray([self._seq(s).slot for s in seq_ids], dtype=np.int64))

    def blocks_needed_for_slots(self, slots: np.ndarray) -> int:
        """Blocks a step of the sequences in hot-zone ``slots`` allocates (vectorized)."""
        full = self.config.hot_tokens + self.config.block_size
        return int(np.count_nonzero(self._st.hot_len[slots] + 1 == full))

    def slot_of(self, seq_id: int) -> int:
        """The hot-zone slot of a registered sequence (its row in the step's arrays)."""
        return self._seq(seq_id).slot

    def lengths(self, slots: np.ndarray) -> np.ndarray:
        """Tokens cached per slot (a copy)."""
        return self._st.length[slots].copy()

    # ---- sequences ------------------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Seq:
        if seq_id not in self._seqs:
            raise ValueError(f"unknown seq_id={seq_id}; known: {sorted(self._seqs)[:16]}")
        return self._seqs[seq_id]

    def _match(self, token_ids: list[int], n_total: int) -> list[int]:
        return self.blocks.match(chain_hashes(token_ids, self.config.block_size, n_total))

    def add_sequence(self, seq_id: int, token_ids: list[int], now_ms: float | None = None) -> int:
        """Register a sequence with its prompt; returns the prompt tokens already cached (whole blocks, <
        len).

        Reuses registered prefix blocks at their current precision and tier, allocates the blocks its prefill
        will seal and a hot-zone slot. Raises :class:`CacheFullError` when it does not fit (``can_allocate``).
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id} is already registered")
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if not self.can_allocate(len(token_ids), token_ids):
            raise CacheFullError(f"a prompt of {len(token_ids)} tokens does not fit now")
        now = self._now if now_ms is None else now_ms
        bs, n_total = self.config.block_size, self.layout.blocks_for(len(token_ids))
        hashes = chain_hashes(token_ids, bs, len(token_ids) // bs)
        hits = self.blocks.match(hashes[:n_total])
        self.blocks.acquire(hits)
        fresh = self.blocks.allocate(n_total - len(hits))
        self.tiers.reset(fresh, now)
        self.counters["prefix_lookup_blocks"] += n_total
        self.counters["prefix_hit_blocks"] += len(hits)
        slot = self._free_slots.pop()
        seq = _Seq(seq_id, slot, list(token_ids), hashes, len(hits), len(hits), len(hits) * bs, self._st)
        seq.set_blocks(hits + fresh)
        seq.length, seq.hot_len = len(token_ids), 0
        self._seqs[seq_id] = seq
        self._seq_at[slot] = seq
        return len(hits) * bs

    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence: its slot is free, its blocks lose a reference (registered ones go to the LRU)."""
        seq = self._seq(seq_id)
        self.blocks.release(seq.blocks)
        self._free_slots.append(seq.slot)
        self._st.clear(seq.slot)
        self._seq_at[seq.slot] = None
        self._ready[seq.slot] = False
        del self._seqs[seq_id]

    # ---- prefill ---------------------------------------------------------------------------------------
    def prefill(
        self, layer: int, seq_id: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None:
        """Write one layer of the next ``T`` prompt tokens (a chunk, or all the uncached rest) and attend.

        q: [T, Hq, D], k, v: [T, H, D]; returns [T, Hq, D] (q.dtype). Attention is dense and causal over the
        tokens cached so far (sealed blocks dequantized, the hot zone) and the chunk. The hot zone and the
        chunk then seal as many blocks as leave at least ``hot_tokens`` tokens in the hot zone (after the last
        chunk: every block the prompt fills); the rest is the new hot zone. Every layer of a chunk gets the
        same ``T``, layer 0 first; after the last layer of the last chunk the sequence is ready for decode and
        its prompt blocks become reusable. ``q`` None: the writes alone, no attention (returns None): keys
        and values computed elsewhere (a dense forward over the same tokens) put in the cache as a prefill
        would.
        """
        seq = self._seq(seq_id)
        t, start = k.shape[0], seq.layers_done == 0
        fits = 0 < t <= seq.length - seq.prefilled if start else t == seq.chunk
        if seq.ready or layer != seq.layers_done or not fits:
            want = f"1..{seq.length - seq.prefilled}" if start else str(seq.chunk)
            raise ValueError(
                f"prefill(layer={layer}) of seq_id={seq_id} expects layer {seq.layers_done} and {want} "
                f"tokens, got {t}" + (" (already prefilled)" if seq.ready else "")
            )
        seq.chunk = t
        if start:
            seq.chunk_blocks = self._chunk_blocks(seq, t)
        out, n_seal, hot_len = self._prefill_layer(layer, seq, q, k, v)
        seq.layers_done += 1
        if seq.layers_done == self.shape.num_layers:
            seq.prefilled += t
            seq.sealed += n_seal
            seq.hot_len, seq.chunk, seq.layers_done, seq.chunk_blocks = hot_len, 0, 0, None
            if seq.prefilled == seq.length:
                assert seq.sealed == seq.num_blocks, f"{seq.sealed} of {seq.num_blocks} blocks sealed"
                seq.ready = True
                self._ready[seq.slot] = True
                self._register(seq, range(seq.hits, seq.num_blocks))
        return out

    def _prefill_layer(
        self, layer: int, seq: _Seq, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor | None, int, int]:
        """One layer of a chunk: attend (not where ``q`` is None), seal, refill the hot zone; (output, blocks
        sealed, hot length)."""
        bs, pool, dt = self.config.block_size, self.pools[layer], self.shape.dtype
        zone = slice(0, seq.hot_len)
        hot_k = self.hot_k[layer, seq.slot, :, zone].transpose(0, 1)  # [hot_len, H, D]
        hot_v = self.hot_v[layer, seq.slot, :, zone].transpose(0, 1)
        keys, values = k, v
        prefix, sealing = seq.chunk_blocks
        if seq.prefilled and q is not None:  # the tokens cached so far: sealed blocks, then the hot zone
            prefix_k, prefix_v = self._prefix_kv(pool, prefix)
            keys = torch.cat([prefix_k.to(k.dtype), hot_k.to(k.dtype), k])
            values = torch.cat([prefix_v.to(v.dtype), hot_v.to(v.dtype), v])
        out = None if q is None else _causal_attention(q, keys, values, seq.prefilled, self.sm_scale)
        new_k, new_v = k.to(dt), v.to(dt)
        if seq.hot_len:  # a later chunk: the hot zone goes first (a whole prompt starts with it empty)
            new_k, new_v = torch.cat([hot_k.to(dt), new_k]), torch.cat([hot_v.to(dt), new_v])
        n_seal = sealing.shape[0]  # the chunk's blocks to seal, counted once in _chunk_blocks
        if n_seal:
            k_new = new_k[: n_seal * bs].reshape(n_seal, bs, *k.shape[1:])
            v_new = new_v[: n_seal * bs].reshape(n_seal, bs, *v.shape[1:])
            seal_blocks(pool, sealing, k_new, v_new, self.config.quantization_bits)
            self.debug.sealed(pool, sealing, k_new, v_new)
        hot_len = new_k.shape[0] - n_seal * bs
        self.hot_k[layer, seq.slot, :, :hot_len] = new_k[n_seal * bs :].transpose(0, 1)
        self.hot_v[layer, seq.slot, :, :hot_len] = new_v[n_seal * bs :].transpose(0, 1)
        return out, n_seal, hot_len

    def prefill_chunks(
        self, layer: int, chunks: Sequence[tuple[int, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`prefill` of several sequences' chunks at one layer, their writes fused
        (:mod:`kvtune.cache_impl.chunks`): ``chunks`` (seq_id, T) in the order of the rows of q [ΣT, Hq, D],
        k, v [ΣT, H, D]; returns [ΣT, Hq, D]. The same rules as :meth:`prefill` per sequence (layer 0
        first, every layer the same chunks); the same outputs and cache contents as one :meth:`prefill` per
        chunk, with a fixed number of operations per layer besides each chunk's attention."""
        if layer == 0:
            if sum(t for _, t in chunks) != q.shape[0]:
                raise ValueError(f"prefill_chunks: chunks {list(chunks)} for {q.shape[0]} rows")
            self._chunk_plan = self.plan_chunks(chunks)
        plan = self._chunk_plan
        if (
            plan is None
            or [(self._seq(i).slot, t) for i, t in chunks] != [(s.slot, s.tokens) for s in plan.specs]
            or any(self._seq(i).layers_done != layer for i, _ in chunks)
        ):
            raise ValueError(f"prefill_chunks(layer={layer}): the chunks of layer 0 must come layer by layer")
        out = self.chunks_layer(layer, plan, q, k, v)
        for seq_id, _ in chunks:
            self._seq(seq_id).layers_done += 1
        if layer == self.shape.num_layers - 1:
            self.finish_chunks(plan, chunks)
            self._chunk_plan = None
        return out

    def plan_chunks(
        self,
        chunks: Sequence[tuple[int, int]],
        pad: ChunkPad | Callable[[ChunkPad], ChunkPad] | None = None,
        staging: ChunkStaging | None = None,
    ) -> ChunkPlan:
        """The plan of an iteration's prompt chunks ``chunks`` (seq_id, T), each checked as :meth:`prefill`
        checks it (:func:`~kvtune.cache_impl.chunks.build_chunk_plan`: ``pad``, ``staging``). Then
        :meth:`chunks_layer` at every layer and :meth:`finish_chunks` (what :meth:`prefill_chunks` does)."""
        if not chunks or len({i for i, _ in chunks}) != len(chunks):
            raise ValueError(f"prefill_chunks: chunks {list(chunks)} (distinct sequences, at least one)")
        specs = []
        for seq_id, t in chunks:
            seq = self._seq(seq_id)
            if seq.ready or seq.layers_done or not 0 < t <= seq.length - seq.prefilled:
                raise ValueError(
                    f"prefill_chunks of seq_id={seq_id}: expects layer {seq.layers_done} and "
                    f"1..{seq.length - seq.prefilled} tokens, got layer 0 and {t}"
                    + (" (already prefilled)" if seq.ready else "")
                )
            n_seal = self._chunk_seals(seq, t)
            blocks = self._st.table[seq.slot, : seq.sealed + n_seal].copy()
            specs.append(ChunkSpec(seq.slot, seq.hot_len, seq.sealed, t, n_seal, blocks))
            seq.chunk = t
        bs = self.config.block_size
        return build_chunk_plan(specs, bs, hot_capacity(self.config), self.device, pad, staging)

    def chunk_sizes(self, chunks: Sequence[tuple[int, int]]) -> ChunkPad:
        """The exact sizes of the plan :meth:`plan_chunks` would build for ``chunks`` (its tokens, packed
        rows, chunks, seals and hot writes), with no check and nothing changed."""
        bs = self.config.block_size
        rows = seals = tails = 0
        for seq_id, t in chunks:
            seq = self._seq(seq_id)
            n_seal = self._chunk_seals(seq, t)
            rows += seq.sealed * bs + seq.hot_len + t
            seals += n_seal
            tails += seq.hot_len + t - n_seal * bs
        return ChunkPad(sum(t for _, t in chunks), rows, len(chunks), seals, tails)

    def step_blocks(self, slots: np.ndarray) -> int:
        """The most blocks a row of ``slots`` will have in the static step :meth:`prepare_step` would stage
        for them (its seals counted), with nothing changed."""
        st = self._st
        seals = st.hot_len[slots] + 1 == self.config.hot_tokens + self.config.block_size
        return int((st.num_blocks[slots] + seals).max())

    def chunks_layer(
        self, layer: int, plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """One layer of every chunk of ``plan``: the packed keys and values (one kernel), one attention, the
        seal read straight from the packed rows, the new hot zones (one kernel)
        (:mod:`kvtune.cache_impl.chunks`). K and V are packed as two planes [2, K, H, D], so each is
        contiguous where the attention reads it. q [N, Hq, D], k, v [N, H, D]: the chunks' rows, then (a
        padded plan's) rows no chunk reads; → [N, Hq, D]. Reads nothing back on the host: capturable."""
        bs, pool, dt = self.config.block_size, self.pools[layer], self.shape.dtype
        hot = self.hot_kv[layer]
        packed = pack_kv(pool, hot, k, v, plan.pack_kind, plan.pack_src, dt)  # [2, K, H, D]
        out = chunks_attention(q, packed[0].to(q.dtype), packed[1].to(q.dtype), plan, self.sm_scale)
        if plan.seal_blocks.numel():  # block i: the bs packed rows from seal_starts[i], read in place
            rows, h, d = packed.shape[1:]
            k_win, v_win = (
                x.as_strided((rows - bs + 1, bs, h, d), (h * d, h * d, d, 1), x.storage_offset())
                for x in packed
            )
            seal_blocks(pool, plan.seal_blocks, k_win, v_win, self.config.quantization_bits, plan.seal_starts)
            if self.debug.enabled:
                self.debug.sealed(pool, plan.seal_blocks, k_win[plan.seal_starts], v_win[plan.seal_starts])
        if plan.hot_rows.numel():
            hot_write(hot, packed[0], packed[1], plan.hot_slots, plan.hot_pos, plan.hot_rows)
        return out

    def finish_chunks(self, plan: ChunkPlan, chunks: Sequence[tuple[int, int]]) -> None:
        """After the last layer of ``plan``'s ``chunks``: what :meth:`prefill` records per sequence when its
        chunk is done."""
        bs = self.config.block_size
        for (seq_id, t), spec in zip(chunks, plan.specs):
            seq = self._seq(seq_id)
            seq.prefilled += t
            seq.sealed += spec.n_seal
            seq.hot_len = spec.hot_len + t - spec.n_seal * bs
            seq.chunk, seq.layers_done, seq.chunk_blocks = 0, 0, None
            if seq.prefilled == seq.length:
                assert seq.sealed == seq.num_blocks, f"{seq.sealed} of {seq.num_blocks} blocks sealed"
                seq.ready = True
                self._ready[seq.slot] = True
                self._register(seq, range(seq.hits, seq.num_blocks))

    def _chunk_seals(self, seq: _Seq, t: int) -> int:
        """The blocks a prompt chunk of ``t`` tokens seals: as many as leave ``hot_tokens`` hot."""
        return max(0, (seq.hot_len + t - self.config.hot_tokens) // self.config.block_size)

    def _chunk_blocks(self, seq: _Seq, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block ids a prompt chunk of ``t`` tokens reads and seals, int64 on the device: (the ``sealed``
        blocks before it, the blocks it seals: as many as leave ``hot_tokens`` in the hot zone), uploaded in
        one copy, the second starting 16-byte aligned (Triton specializes a kernel on its pointers'
        alignment: the seal is one build whatever the chunk's place). On CUDA the copy leaves from pinned
        memory without waiting for the device."""
        row = self._st.table[seq.slot, : seq.sealed + self._chunk_seals(seq, t)]
        prefix, sealing = upload_aligned([row[: seq.sealed], row[seq.sealed :]], self.device)
        return prefix, sealing

    def _prefix_kv(self, pool: ColdPool, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [n·bs, H, D] float32 of cached prefix blocks ``ids`` (int64 on the device)."""
        k, v = dequantize_blocks(pool, ids)
        return k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1)

    def _register(self, seq: _Seq, indices: Sequence[int]) -> None:
        row = self._st.table[seq.slot]
        for i in indices:
            if i < len(seq.hashes) and i not in seq.registered:
                self.blocks.register(int(row[i]), seq.hashes[i])
                seq.registered.add(i)

    # ---- decode ----------------------------------------------------------------------------------------
    def begin_step(self, seq_ids: Sequence[int], now_ms: float) -> DecodePlan:
        """Plan one decode step (one new token per sequence) at clock ``now_ms``."""
        if len(set(seq_ids)) != len(seq_ids) or not all(self._seq(s).ready for s in seq_ids):
            raise ValueError(f"begin_step needs distinct, fully prefilled sequences, got {list(seq_ids)}")
        return self.begin_step_slots(
            np.asarray([self._seqs[s].slot for s in seq_ids], dtype=np.int64), now_ms
        )

    def begin_step_slots(self, slots: np.ndarray, now_ms: float) -> DecodePlan:
        """:meth:`begin_step` of the sequences in hot-zone ``slots`` (distinct, ready; not checked)."""
        st, bs = self._st, self.config.block_size
        sealing, fresh = self._allocate_seals(slots)
        self.tiers.reset(fresh, now_ms)
        self._now = float(now_ms)
        # an eager step attends densely in layers whose L2 is empty: read the counts once (synchronizes)
        self._l2_layers = self.tiers.l2_blocks if self.sparse else None
        write_pos = st.hot_len[slots].copy()
        st.hot_len[slots] += 1
        st.length[slots] += 1
        st.hot_len[sealing] -= bs
        return self._plan(slots, write_pos, sealing, fresh)

    def _allocate_seals(self, slots: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The slots of ``slots`` whose hot zone fills at this step, and a fresh block each, appended to their
        tables (CacheFullError when too few blocks are free)."""
        st = self._st
        full = self.config.hot_tokens + self.config.block_size
        sealing = slots[st.hot_len[slots] + 1 == full]
        if len(sealing) > self.blocks.num_free():
            raise CacheFullError(f"step needs {len(sealing)} blocks, {self.blocks.num_free()} free")
        fresh = self.blocks.allocate(len(sealing))
        if len(sealing):
            st.ensure_width(int(st.num_blocks[sealing].max()) + 1)
            st.table[sealing, st.num_blocks[sealing]] = fresh
            st.num_blocks[sealing] += 1
        return sealing, fresh

    def _plan(
        self, slots: np.ndarray, write_pos: np.ndarray, sealing: np.ndarray, fresh: list[int]
    ) -> DecodePlan:
        """The step's index tensors, packed on the host and sent to the device in one copy. Every segment
        starts 16 bytes aligned (lengths rounded up to even): a kernel argument's alignment is part of what
        Triton specializes on, and an offset that followed the batch's parity would compile kernels again."""
        st = self._st
        b, n_seal, h = len(slots), len(sealing), self.shape.num_kv_heads
        bp, sp = b + b % 2, n_seal + n_seal % 2
        num_blocks = st.num_blocks[slots]
        width = int(num_blocks.max()) if b else 0
        packed = np.full(4 * bp + 2 * sp + b * width, -1, dtype=np.int64)
        packed[0:b] = slots
        packed[bp : bp + b] = write_pos
        packed[2 * bp : 2 * bp + b] = st.hot_len[slots]
        packed[3 * bp : 3 * bp + b] = num_blocks
        seal0, table0 = 4 * bp, 4 * bp + 2 * sp
        packed[seal0 : seal0 + n_seal] = sealing
        packed[seal0 + sp : seal0 + sp + n_seal] = fresh
        packed[table0:] = st.table[slots, :width].reshape(-1)
        dev = upload(torch.from_numpy(packed), self.device)
        small = dev[: 4 * bp].to(torch.int32)
        blocks = dev[table0:].view(b, width)
        num_blocks_t = small[3 * bp : 3 * bp + b]
        seq_at = self._seq_at
        return DecodePlan(
            seq_ids=tuple(seq_at[i].seq_id for i in slots.tolist()),  # type: ignore[union-attr]
            step=self._step,
            now_ms=self._now,
            slots=dev[0:b],
            write_pos=dev[bp : bp + b],
            hot_slot=small[0:b],
            hot_len=small[2 * bp : 2 * bp + b],
            seal_slots=dev[seal0 : seal0 + n_seal],
            seal_blocks=dev[seal0 + sp : seal0 + sp + n_seal],
            blocks=blocks,
            cold_table=blocks.to(torch.int32)[:, None].expand(b, h, width).contiguous(),
            cold_count=num_blocks_t[:, None].expand(b, h).contiguous(),
            lengths=tuple(st.length[slots].tolist()),
            hot_tokens=int(st.hot_len[slots].sum()),
            cold_blocks=int(num_blocks.sum()),
            sealed_seq_ids=tuple(seq_at[i].seq_id for i in sealing.tolist()),  # type: ignore[union-attr]
        )

    # ---- static step (CUDA-graph replay) ---------------------------------------------------------------
    def prepare_step(
        self, slots: np.ndarray, tokens: np.ndarray, now_ms: float, buffers: StepBuffers, shape: StepShape
    ) -> StepInfo:
        """Host half of a static decode step of the sequences in ``slots`` (distinct, ready), feeding
        ``tokens``: allocate the blocks that seal, advance lengths, count the bytes attention will read, and
        stage everything in ``buffers`` (one upload). A token of -1 is read from the device where the
        previous static step left it (:class:`~kvtune.engine.graphs.DecodeGraphs`). The caller then runs
        :meth:`seal_static` (``seal_rows`` entries, when ``num_seals``), the forward on
        ``buffers.plan(rows, width)``, then :meth:`finish_step`. Vectorized: no per-sequence Python work
        besides one block per sealing sequence."""
        st, bs, b = self._st, self.config.block_size, len(slots)
        rows = shape.rows_for(b)
        if not (b <= rows <= buffers.rows) or len(tokens) != b or b == 0:
            raise ValueError(
                f"prepare_step: batch {b} (tokens {len(tokens)}) must fit {rows} <= {buffers.rows}"
            )
        if not self._ready[slots].all():
            raise ValueError("prepare_step needs fully prefilled sequences")
        sealing, fresh = self._allocate_seals(slots)
        self._now = float(now_ms)
        st.hot_len[sealing] -= bs  # sealed before the step (seal_static): the zone keeps hot_tokens - 1
        positions = st.length[slots]  # of the fed tokens (the length before this step)
        write_pos = st.hot_len[slots]
        st.hot_len[slots] += 1
        st.length[slots] += 1
        num_blocks = st.num_blocks[slots]
        width = shape.width_for(int(num_blocks.max()))
        if width > buffers.width:
            raise ValueError(
                f"prepare_step: {int(num_blocks.max())} blocks exceed the buffers' width {buffers.width}"
            )
        st.ensure_width(width)
        n_seal = len(sealing)
        seal_rows = shape.seals_for(n_seal) if n_seal else 0
        buffers.wait_staging()
        pad = slice(b, rows)
        for name, values, filler in (
            ("slots", slots, 0),
            ("write_pos", write_pos, hot_capacity(self.config) - 1),  # no zone holds this between steps
            ("hot_len", st.hot_len[slots], 1),
            ("positions", positions, 0),
            ("num_blocks", num_blocks, 0),
            ("tokens", tokens, 0),
        ):
            row = buffers.field(name, rows)
            row[:b] = values
            row[pad] = filler
        if n_seal:
            repeat = np.resize(np.arange(n_seal), seal_rows)  # padding repeats real entries
            buffers.field("seal_slots", seal_rows)[:] = sealing[repeat]
            buffers.field("seal_blocks", seal_rows)[:] = np.asarray(fresh, dtype=np.int64)[repeat]
        table = buffers.table(rows, width)
        table[:b] = st.table[slots, :width]
        table[pad] = -1
        due = self.sparse and (self._step + 1) % self.config.migration_interval == 0
        thr = threshold_ms(self.config, st.length[slots].tolist()) if due else 0.0
        buffers.set_now(now_ms, b, thr, due)
        buffers.upload(rows, width)
        if self.sparse:  # after this step's allocations, ordered before its work
            self.tiers.sync_in_use(self.blocks.refcount, id(self.blocks), self.blocks.version)
        self._count_bytes_host(int(st.hot_len[slots].sum()), int(num_blocks.sum()))
        return StepInfo(b, rows, width, n_seal, seal_rows, slots, sealing, float(now_ms))

    def seal_static(self, buffers: StepBuffers, rows: int) -> None:
        """Seal the ``rows`` staged seal entries before a static step, every layer (device work only, no
        host read: capturable): the oldest ``block_size`` tokens of each zone become its fresh block, the
        ``hot_tokens - 1`` after them move to the front, the fresh blocks' statistics start now."""
        bs, hot, bits = self.config.block_size, self.config.hot_tokens, self.config.quantization_bits
        slots, blocks = buffers.view("seal_slots", rows), buffers.view("seal_blocks", rows)
        for layer, pool in enumerate(self.pools):
            k = self.hot_k[layer][:, :, :bs].transpose(1, 2)  # [slots, bs, H, D] views, read at ``slots``
            v = self.hot_v[layer][:, :, :bs].transpose(1, 2)
            seal_blocks(pool, blocks, k, v, bits, slots)
        zone = self.hot_kv  # [layers, 2, slots, H, C, D]: every layer's K and V zones in one gather + scatter
        zone[:, :, slots, :, : hot - 1] = zone[:, :, slots, :, bs : bs + hot - 1]
        self.tiers.reset_device(blocks, buffers.now_tensor())

    def migrate_static(self, buffers: StepBuffers) -> None:
        """The tier planning (kept on planning steps only) and this step's migrations of a static step, from
        the staged clock, threshold and planning flag: device work only, captured with the step."""
        if not self.sparse:
            return
        now, thr, due = buffers.now_tensor(), buffers.thr_tensor(), buffers.due_tensor()
        self.tiers.plan_pending(self.config, now, thr, due)
        self.tiers.apply_pending(self.config, self.pools)

    def save_step_effects(self, slots: torch.Tensor, write_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a static step changes besides its own outputs: the hot positions it writes (``slots``,
        ``write_pos``), the access statistics and the byte count. For running a step once and undoing it
        (the warm-up before a CUDA-graph capture)."""
        tiers = self.tiers
        written = self.hot_kv[:, :, slots, :, write_pos].clone()
        tiers.enabled.fill_(False)  # the warm-up plans but migrates nothing (a demotion cannot be undone)
        return (
            slots,
            write_pos,
            written,
            tiers.last_access.clone(),
            tiers.ema.clone(),
            self._bytes_dev.clone(),
        )

    def restore_step_effects(self, saved: tuple[torch.Tensor, ...]) -> None:
        slots, write_pos, written, last_access, ema, nbytes = saved
        self.hot_kv[:, :, slots, :, write_pos] = written
        self.tiers.last_access.copy_(last_access)
        self.tiers.ema.copy_(ema)
        self.tiers.enabled.fill_(True)
        self._bytes_dev.copy_(nbytes)

    def finish_step(self, info: StepInfo) -> None:
        """End of a static step: the host's share of :meth:`end_step` (prefix registration of the sealed
        blocks; the step's tier work ran on the device, :meth:`migrate_static`)."""
        self._end_step(info.sealed_slots, info.now_ms, lambda: (), static=True)

    def decode(
        self, layer: int, plan: DecodePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Append → seal → attend for one layer. q: [B, Hq, D], k, v: [B, H, D] → out [B, Hq, D] (q.dtype).

        A static plan never seals here, and reads nothing from the device on the host: capturable."""
        hk, hv, pool = self.hot_k[layer], self.hot_v[layer], self.pools[layer]
        hot_write(self.hot_kv[layer], k, v, plan.slots, plan.write_pos)
        if plan.seals:
            self._seal(layer, plan)
        table, num_cold, num_l1, counted, parts = self._block_table(layer, plan, q)
        if self.table_log is not None:
            self.table_log.append((layer, table.clone(), num_cold.clone()))
        if pool.num_blocks == 0:  # a budget the hot zones fill: every entry of the table is padding
            table, parts = table[..., :0], None
        out, mass, hot_mass = hybrid_decode_attention(
            q, hk, hv, plan.hot_slot, plan.hot_len, pool, table, num_cold, self.sm_scale, parts
        )
        if self.sparse:  # without the sparse tier no decision reads the access statistics
            update_access(
                self.tiers.last_access[layer],
                self.tiers.ema[layer],
                mass,
                table,
                num_cold,
                plan.now,
                self.tiers.flags,
            )
        self._count_bytes(pool, plan, table, counted)
        self.debug.attention(mass, hot_mass, num_l1)
        return out

    def _seal(self, layer: int, plan: DecodePlan) -> None:
        """The oldest ``block_size`` hot tokens of the sealing slots become their fresh blocks."""
        bs, hot = self.config.block_size, self.config.hot_tokens
        pool, rows = self.pools[layer], plan.seal_slots
        k = self.hot_k[layer][:, :, :bs].transpose(1, 2)  # [slots, bs, H, D] views, read at ``rows``
        v = self.hot_v[layer][:, :, :bs].transpose(1, 2)
        seal_blocks(pool, plan.seal_blocks, k, v, self.config.quantization_bits, rows)
        if self.debug.enabled:
            self.debug.sealed(pool, plan.seal_blocks, k[rows], v[rows])
        zone = self.hot_kv[layer]
        zone[:, rows, :, :hot] = zone[:, rows, :, bs : bs + hot]

    def _block_table(
        self, layer: int, plan: DecodePlan, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, BitsPartition | None]:
        """Cold blocks attended per (sequence, KV head): L1 then Quest-selected L2; [B, H, M] int32, counts,
        whether the bytes they read are already counted (the sparse path counts them itself), and the table
        split by bits where the selection wrote it (an 8-bit pool with demoted blocks, the split selection).
        A static plan of a sparse config always takes the sparse path (the same shapes whatever the tiers
        hold)."""
        if not self.sparse or (not plan.static and (self._l2_layers is None or self._l2_layers[layer] == 0)):
            return plan.cold_table, plan.cold_count, plan.cold_count, False, None
        count = ByteCount(self._cost, self._quest_cost, self._bytes_dev)
        pool = self.pools[layer]
        table, num, n1, parts = sparse_block_table_parts(
            q, pool, plan.blocks, self.tiers.tier[layer], self.config.sparse_blocks, count,
            summary=selection_summary(pool, q),
        )  # fmt: skip
        return table, num, n1, True, parts

    def _bytes_per_entry(self) -> torch.Tensor:
        """Bytes attention reads per (block, KV head) entry, indexed by block_bits (0..8)."""
        bs, d, elem = self.config.block_size, self.shape.head_dim, self.shape.element_size
        cost = torch.zeros(9, dtype=torch.int64)
        cost[0] = 2 * bs * d * elem
        for bits in (4, 8):
            cost[bits] = 2 * bs * d * bits // 8 + 2 * 2 * d + 2 * 2 * bs
        return cost

    def _count_bytes(self, pool: ColdPool, plan: DecodePlan, table: torch.Tensor, counted: bool) -> None:
        h, d, elem = self.shape.num_kv_heads, self.shape.head_dim, self.shape.element_size
        if not plan.static:  # a static step counted its host share in prepare_step
            self._bytes_host += 2 * plan.hot_tokens * h * d * elem
        if counted:
            return
        if not pool.may_demote:  # every block has the pool's bits and every head reads all of them
            if not plan.static:
                self._bytes_host += plan.cold_blocks * h * self._cost_host[pool.bits]
            return
        bits = pool.block_bits[table.long().clamp(min=0)].long()
        self._bytes_dev += torch.where(table >= 0, self._cost[bits], 0).sum()

    def _count_bytes_host(self, hot_tokens: int, cold_blocks: int) -> None:
        """The host share of :meth:`_count_bytes` for every layer of a static step."""
        h, d, elem = self.shape.num_kv_heads, self.shape.head_dim, self.shape.element_size
        per_layer = 2 * hot_tokens * h * d * elem
        if self.config.sparse_top_k == 0 and not self.pools[0].may_demote:
            per_layer += cold_blocks * h * self._cost_host[self.pools[0].bits]
        self._bytes_host += self.shape.num_layers * per_layer

    @property
    def attention_bytes_read(self) -> int:
        """Bytes the decode attention read so far (hot zone, codes, scales, mins; Quest's metadata)."""
        return self._bytes_host + int(self._bytes_dev.item())

    # ---- end of step ----------------------------------------------------------------------------------
    def end_step(self, plan: DecodePlan) -> None:
        """Prefix registration, tier planning every ``migration_interval`` steps, the migration queue."""
        sealed = [self._seqs[s].slot for s in plan.sealed_seq_ids if s in self._seqs]
        self._end_step(np.asarray(sealed, dtype=np.int64), plan.now_ms, lambda: plan.lengths)

    def _end_step(
        self,
        sealed_slots: np.ndarray,
        now_ms: float,
        lengths: Callable[[], Sequence[int]],
        static: bool = False,
    ) -> None:
        """:meth:`end_step`: ``sealed_slots`` sealed a block at this step; ``lengths()`` of the step's
        sequences (asked only when the tiers are planned); ``static``: the tier work ran inside the step."""
        self._step += 1
        for slot in sealed_slots.tolist():
            seq = self._seq_at[slot]
            if seq is not None:
                self._register(seq, [seq.num_blocks - 1])
        due = self.sparse and self._step % self.config.migration_interval == 0
        if due:
            self.counters["plans"] += 1
        if self.sparse and not static and (due or self._planned):
            tiers = self.tiers
            tiers.sync_in_use(self.blocks.refcount, id(self.blocks), self.blocks.version)
            if due:
                tiers.plan_pending(self.config, now_ms, threshold_ms(self.config, lengths()))
            tiers.apply_pending(self.config, self.pools)
        self._planned = self._planned or due
        self.debug.end_step()

    @property
    def migrations_done(self) -> int:
        """Tier migrations applied since the cache was emptied (synchronizes with the device)."""
        return int(self.tiers.done)

    def l2_share(self) -> float:
        """The share of the in-use (layer, block) pairs that sit in L2 now (a freed block keeps its tier until
        it is sealed again; reads the tiers back)."""
        in_use = self.blocks.refcount > 0
        pairs = int(in_use.sum()) * self.shape.num_layers
        return float((self.tiers.tier_host[:, in_use] == L2).sum()) / pairs if pairs else 0.0

    @property
    def l2_peak_share(self) -> float | None:
        """The largest share of in-use (layer, block) pairs in L2 after any step since the cache was emptied
        (None without the sparse tier; synchronizes)."""
        return float(self.tiers.l2_peak) if self.sparse else None

    # ---- reports ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        lay, c = self.layout, self.counters
        in_use = self.blocks.num_in_use()
        return {
            "budget_bytes": lay.budget_bytes,
            "total_bytes": lay.total_bytes,
            "kv_bytes_in_use": self.kv_bytes_in_use(),
            "num_slots": lay.num_slots,
            "num_blocks": lay.num_blocks,
            "blocks_in_use": in_use,
            "blocks_free": self.blocks.num_free(),
            "blocks_cached_free": self.blocks.num_cached_free(),
            "block_evictions": self.blocks.evictions,
            "sequences": len(self._seqs),
            "steps": self._step,
            "prefix_lookup_blocks": c["prefix_lookup_blocks"],
            "prefix_hit_blocks": c["prefix_hit_blocks"],
            "prefix_hit_tokens": c["prefix_hit_blocks"] * self.config.block_size,
            "migrations_done": self.migrations_done,
            "migrations_queued": self.tiers.queued(),
            "plans": c["plans"],
            "l2_blocks": int(self.tiers.l2_blocks.sum()),
            "attention_bytes_read": self.attention_bytes_read,
        }

    def kv_bytes_in_use(self) -> int:
        """Bytes of the budget held for live data: hot zones of registered sequences + blocks in use."""
        lay = self.layout
        return len(self._seqs) * lay.hot_bytes_per_seq + self.blocks.num_in_use() * lay.block_bytes

    def debug_stats(self) -> dict[str, Any]:
        """Attention shares (hot, L1, L2; means over decode calls), L2 occupancy, migrations, seal errors."""
        return {
            **self.debug.report(),
            "l2_occupancy": self.l2_share(),
            "migrations_done": self.migrations_done,
            "migrations_queued": self.tiers.queued(),
        }

    def check_integrity(self) -> None:
        """Assert the invariants: refcounts, slots, hot lengths, block counts, tier mirror."""
        expected = np.zeros(self.layout.num_blocks, dtype=np.int32)
        for s in self._seqs.values():
            np.add.at(expected, np.asarray(s.blocks, dtype=np.int64), 1)
            assert s.num_blocks == self.layout.blocks_for(s.length), f"seq {s.seq_id}: block count"
            done = s.length if s.ready else s.prefilled
            sealed = s.num_blocks if s.ready else s.sealed
            assert done - sealed * self.config.block_size == s.hot_len, f"seq {s.seq_id}: hot_len"
            assert self._seq_at[s.slot] is s and self._ready[s.slot] == s.ready, f"seq {s.seq_id}: slot maps"
        self.blocks.check_integrity(expected)
        slots = sorted([s.slot for s in self._seqs.values()] + self._free_slots)
        assert slots == list(range(self.layout.num_slots)), "hot-zone slots leaked or doubled"
        free = np.asarray(self._free_slots, dtype=np.int64)
        assert not self._ready[free].any() and not self._st.num_blocks[free].any(), "a free slot holds state"
        self.tiers.check()


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, sm_scale: float
) -> torch.Tensor:
    """q [T, Hq, D] at positions offset..offset+T-1 over k, v [P, H, D] (P = offset + T), causal → [T, Hq, D].

    One ``scaled_dot_product_attention`` in q's dtype with grouped-query heads and a lower-right causal mask
    (query ``i`` sees keys ``0 … offset + i``): flash/memory-efficient kernels on a GPU, no [T, P] score
    matrix in float32. Never cuDNN's (:data:`PREFILL_SDPA_BACKENDS`).
    """
    square = q.shape[0] == k.shape[0]  # a whole prompt: the plain causal mask, without a bias object
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.to(q.dtype).transpose(0, 1)[None],
            v.to(q.dtype).transpose(0, 1)[None],
            attn_mask=None if square else causal_lower_right(q.shape[0], k.shape[0]),
            is_causal=square,
            scale=sm_scale,
            enable_gqa=True,
        )
    return out[0].transpose(0, 1)


def chunks_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ChunkPlan,
    sm_scale: float,
    flash: bool | None = None,
) -> torch.Tensor:
    """Every chunk's causal attention over its packed keys: q [ΣT, Hq, D] (the chunks' rows in order), k, v
    [K, H, D] (each chunk's segment: cached tokens, then its own) → [ΣT, Hq, D].

    On a GPU in half precision (the engine's case) one FlashAttention call over all chunks, its
    variable-length form with grouped-query heads, whose causal mask is aligned to each segment's end
    (query ``i`` of a chunk with ``done`` tokens before it sees keys ``0 … done + i``). Elsewhere (a CPU,
    float32) :func:`_causal_attention` chunk by chunk over the same packed keys. ``flash``: force either
    (None: the first where it runs; where the FlashAttention call is refused, a PyTorch built without it
    say, the other from then on, with a warning).
    """
    if flash or (flash is None and _flash_varlen(q) and q.device not in _FLASH_REFUSED):
        try:
            return _flash_chunks(q, k, v, plan, sm_scale)
        except RuntimeError as e:
            if flash:
                raise
            _FLASH_REFUSED.add(q.device)
            warnings.warn(
                f"prompt chunks: FlashAttention's variable-length kernel refused ({str(e).splitlines()[0]}); "
                "attending chunk by chunk on this device from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    outs = [
        _causal_attention(q[a:b], k[c:d], v[c:d], done, sm_scale)
        for (a, b), (c, d), done in zip(plan.bounds, plan.key_bounds, plan.done)
    ]
    rows = plan.bounds[-1][1]
    if rows < q.shape[0]:  # a padded plan's rows no chunk reads
        outs.append(q.new_zeros((q.shape[0] - rows, *q.shape[1:])))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# devices where the variable-length FlashAttention call was refused (chunks_attention falls back there)
_FLASH_REFUSED: set[torch.device] = set()


def _flash_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan, sm_scale: float
) -> torch.Tensor:
    """One FlashAttention variable-length call over every chunk, causal at each segment's end."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True, False, scale=sm_scale
    )[0]


def _flash_varlen(q: torch.Tensor) -> bool:
    """Whether FlashAttention's variable-length kernel takes ``q``: CUDA, fp16/bf16, an Ampere or later
    card, a head size it was built for (multiples of 8 up to 256)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )
