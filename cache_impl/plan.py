"""The immutable plan of one decode step, built by ``HybridCache.begin_step`` and passed to every layer; and
the static buffers of a step that can be replayed as a CUDA graph (:class:`StepBuffers`).

Two ways to plan a decode step:

* eager (``HybridCache.begin_step``): the plan's tensors are made for this step; a hot zone that fills seals
  inside ``decode`` (append → seal → attend).
* static (``HybridCache.prepare_step``): the host writes the step into :class:`StepBuffers` (one
  host-to-device copy), whose views are the plan of every step of the same shape (rows, table width), so a
  captured forward over them can be replayed. A hot zone that would fill seals *before* the step
  (``HybridCache.seal_static``, its own small captured graph), so no seal happens inside the forward: it holds
  ``hot_tokens + block_size − 1`` tokens, the oldest ``block_size`` of them (which the new token would not be
  part of) become the block, the rest move to the front, and the step appends the new token behind them.
  Attention sees the same hot tokens and blocks as in the eager order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class DecodePlan:
    """One new token for each of ``B`` sequences; tensors live on the cache's device.

    slots: [B] int64 hot-zone slot per sequence · write_pos: [B] int64 hot position the new token goes to ·
    hot_slot / hot_len: [B] int32 slot and hot length after append + seal (what attention reads) ·
    seal_slots / seal_blocks: [n] int64 slots that seal this step and the fresh block each seals into ·
    blocks: [B, M] int64 every sealed block of each sequence after this step, oldest first, -1 padded ·
    cold_table / cold_count: ``blocks`` and their number per (sequence, KV head), [B, H, M] and [B, H] int32,
    the attention's table when no block is in L2 · lengths: tokens per sequence after this step (host) ·
    hot_tokens: Σ hot_len (host) · cold_blocks: Σ sealed blocks (host).

    A static plan (:meth:`StepBuffers.plan`) has ``static=True``: its tensors are views of the step buffers,
    ``now_t`` (float64 device scalar) is the clock, it never seals (``HybridCache.seal_static`` did before),
    its host fields are empty (the host accounting happened in ``HybridCache.prepare_step``), and a sparse
    config always builds its table through the sparse path (fixed shapes whatever the tiers hold).
    """

    seq_ids: tuple[int, ...]
    step: int
    now_ms: float
    slots: torch.Tensor
    write_pos: torch.Tensor
    hot_slot: torch.Tensor
    hot_len: torch.Tensor
    seal_slots: torch.Tensor
    seal_blocks: torch.Tensor
    blocks: torch.Tensor
    cold_table: torch.Tensor
    cold_count: torch.Tensor
    lengths: tuple[int, ...]
    hot_tokens: int
    cold_blocks: int
    sealed_seq_ids: tuple[int, ...]
    now_t: torch.Tensor | None = None
    static: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0]) if self.static else len(self.seq_ids)

    @property
    def seals(self) -> bool:
        return bool(self.sealed_seq_ids)

    @property
    def now(self) -> float | torch.Tensor:
        """The clock as the kernels take it: the device scalar of a static plan, else ``now_ms``."""
        return self.now_t if self.now_t is not None else self.now_ms


class StepShape(Protocol):
    """How a static step is shaped: rows for a batch, table width for its longest row, entries of a seal.

    The CUDA-graph runner rounds each up to a captured bucket (padding rows, -1 table columns, repeated seal
    entries); an uncaptured run takes them as they are.
    """

    def rows_for(self, batch: int) -> int: ...

    def width_for(self, blocks: int) -> int: ...

    def seals_for(self, seals: int) -> int: ...


@dataclass(frozen=True)
class StepInfo:
    """What ``HybridCache.prepare_step`` staged: the real batch, its padded shape, the seals, the host side
    (slots and sealing slots, for ``HybridCache.finish_step``)."""

    batch: int
    rows: int
    width: int
    num_seals: int
    seal_rows: int
    slots: np.ndarray
    sealed_slots: np.ndarray
    now_ms: float


class StagedCopy:
    """Copies from a host staging buffer (pinned on CUDA) to the device that do not make the host wait:
    :meth:`wait` blocks until the last one has read the staging buffer, before the host writes it again."""

    def __init__(self) -> None:
        self._copied: Any = None  # a CUDA event after the last copy

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def copy(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        if dev.device.type == "cuda":
            dev.copy_(host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            dev.copy_(host)


class StepBuffers:
    """The static inputs and outputs of a decode step (device), and their pinned host staging.

    One int64 device buffer holds, for up to ``rows`` rows: hot-zone slots, write positions, hot lengths
    after the append, token positions, sealed-block counts, input tokens (-1: the token the previous step
    left on the device, see :class:`~kvtune.engine.graphs.DecodeGraphs`), the seal entries (slots, fresh
    blocks), the clock (float64 bits), the batch (rows in use before padding), the tier threshold (float64
    bits) and whether the step plans the tiers, then the block table
    ``[rows, width]`` of this step's shape. The host
    fills the staging array and copies the prefix in use once (:meth:`upload`); the plan of a (rows, width)
    shape is a set of views of that buffer (:meth:`plan`), the same tensors on every replay. Padding rows
    (beyond the batch) are harmless: slot 0, write position ``hot_capacity - 1`` (a position no hot zone ever
    holds between steps), hot length 1, no cold block; padding seal entries repeat the first entry (sealing a
    block twice from the same tokens writes the same bytes).
    """

    FIELDS = (
        "slots",
        "write_pos",
        "hot_len",
        "positions",
        "num_blocks",
        "tokens",
        "seal_slots",
        "seal_blocks",
    )

    def __init__(self, rows: int, width: int, device: torch.device | str, pinned: bool = False) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"`rows >= 1 and width >= 1` must hold, but got rows={rows}, width={width}")
        self.rows, self.width, self.device = rows, width, torch.device(device)
        # every field starts 16-byte aligned (an even number of int64s): a kernel argument's alignment is part
        # of what Triton specializes on, so the seal kernel gets the same build as in an eager step
        stride = rows + rows % 2
        self.offset = {name: i * stride for i, name in enumerate(self.FIELDS)}
        self.now_offset = len(self.FIELDS) * stride
        self.table_offset = self.now_offset + 4
        size = self.table_offset + rows * width
        self.dev = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.host = self.staging.numpy()
        self.tokens_out = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._copy = StagedCopy()

    def field(self, name: str, rows: int) -> np.ndarray:
        """The staging array of one per-row field (first ``rows`` entries)."""
        start = self.offset[name]
        return self.host[start : start + rows]

    def table(self, rows: int, width: int) -> np.ndarray:
        """The staging block table of a (rows, width) shape, [rows, width]."""
        return self.host[self.table_offset : self.table_offset + rows * width].reshape(rows, width)

    def set_now(self, now_ms: float, batch: int, thr_ms: float = 0.0, due: bool = False) -> None:
        """Stage the clock, the batch (the rows before padding), the tier threshold and whether the step
        plans the tiers."""
        self.host[self.now_offset] = np.float64(now_ms).view(np.int64)
        self.host[self.now_offset + 1] = batch
        self.host[self.now_offset + 2] = np.float64(thr_ms).view(np.int64)
        self.host[self.now_offset + 3] = int(due)

    def wait_staging(self) -> None:
        """Block until the last upload has left the staging array (normally long done)."""
        self._copy.wait()

    def upload(self, rows: int, width: int) -> None:
        """Copy the staged step (header + a [rows, width] table) to the device buffer in one copy."""
        n = self.table_offset + rows * width
        self._copy.copy(self.dev[:n], self.staging[:n])

    def now_tensor(self) -> torch.Tensor:
        """The clock as a float64 device scalar (a view of the buffer)."""
        return self.dev[self.now_offset : self.now_offset + 1].view(torch.float64)[0]

    def thr_tensor(self) -> torch.Tensor:
        """The tier threshold (ms) as a float64 device scalar (a view of the buffer)."""
        return self.dev[self.now_offset + 2 : self.now_offset + 3].view(torch.float64)[0]

    def due_tensor(self) -> torch.Tensor:
        """Whether the staged step plans the tiers, as a bool device scalar (computed from the buffer)."""
        return self.dev[self.now_offset + 3] != 0

    def batch_tensor(self) -> torch.Tensor:
        """The batch of the staged step as an int64 device scalar (a view of the buffer)."""
        return self.dev[self.now_offset + 1]

    def view(self, name: str, rows: int) -> torch.Tensor:
        start = self.offset[name]
        return self.dev[start : start + rows]

    def plan(self, rows: int, width: int, num_kv_heads: int) -> DecodePlan:
        """The static plan of a (rows, width) step: views of the buffer plus the conversions the attention
        takes (int32 slots and lengths, the table per KV head), which run inside a captured forward."""
        if not (1 <= rows <= self.rows and 1 <= width <= self.width):
            raise ValueError(f"shape ({rows}, {width}) exceeds the buffers ({self.rows}, {self.width})")
        slots = self.view("slots", rows)
        blocks = self.dev[self.table_offset : self.table_offset + rows * width].view(rows, width)
        num_blocks = self.view("num_blocks", rows).to(torch.int32)
        empty = self.dev[:0]
        return DecodePlan(
            seq_ids=(),
            step=-1,
            now_ms=math.nan,
            slots=slots,
            write_pos=self.view("write_pos", rows),
            hot_slot=slots.to(torch.int32),
            hot_len=self.view("hot_len", rows).to(torch.int32),
            seal_slots=empty,
            seal_blocks=empty,
            blocks=blocks,
            cold_table=blocks.to(torch.int32)[:, None].expand(rows, num_kv_heads, width).contiguous(),
            cold_count=num_blocks[:, None].expand(rows, num_kv_heads).contiguous(),
            lengths=(),
            hot_tokens=0,
            cold_blocks=0,
            sealed_seq_ids=(),
            now_t=self.now_tensor(),
            static=True,
        )
