"""The cold-block layout shared by the reference code and the Triton kernels (docs/DESIGN.md §1).

One pool per layer. ``N`` = blocks, ``H`` = KV heads, ``bs`` = block_size, ``D`` = head_dim::

    hot zone (per sequence slot, model dtype)      cold pool (per layer, one row per physical block)
    ┌──────────────────────────────────────┐       k, v     [N, H, bs, code_dim]   uint8 codes (bits 8/4)
    │ newest tokens, hot_tokens ≤ len <    │  seal            or model dtype (bits 0)
    │ hot_tokens + block_size              │ ────►  k_min, k_scale [N, H, D]   fp16  keys: per channel
    └──────────────────────────────────────┘       v_min, v_scale [N, H, bs]  fp16  values: per token
                                                   block_bits    [N]          uint8 (8, 4 or 0)
                                                   summary lo, span [N, H, D] e4m3 (where asked)

* ``x ≈ min + code · scale`` with ``code ∈ [0, 2^bits − 1]``; min is rounded down and scale up to fp16 so that
  ``|x − deq| ≤ scale / 2`` (up to fp32 rounding) for every element of the block.
* INT4 rows hold two codes per byte: byte ``c`` = channel ``c`` (low nibble) | channel ``c + D/2`` (high
  nibble), for keys and values alike (``D`` = head_dim).
* A block demoted to 4 bits inside an 8-bit pool keeps its 8-bit slot: its packed 4-bit codes fill the first
  ``D/2`` bytes of each row (the rest is zero), its min/scale are the 4-bit ones and ``block_bits`` is 4.
* Unquantized pools (bits 0) keep K/V in model precision; ``v_min``/``v_scale`` are unused (zero),
  ``k_min`` holds the key min per channel and ``k_scale`` holds ``max − min`` (so ``max = min + scale ·
  levels`` with ``levels = 1`` for bits 0, the same formula as the quantized pools with ``levels = 2^bits −
  1``).
* The key min and max of a block (:func:`key_bounds`) are its metadata for Quest's sparse selection. A
  layout with ``summary`` also keeps them in float8 e4m3 (:class:`QuestSummary8`, written where the fp16
  ones are: at the seal and at a demotion), 2 bytes a channel that the selection reads instead of 4
  (:mod:`kvtune.kernels.quest_summary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POOL_BITS: tuple[int, ...] = (0, 4, 8)
SCALE_DTYPE = torch.float16


def levels_for_bits(bits: int) -> int:
    """Largest code of a ``bits``-bit block (1 for unquantized blocks, see the module docstring)."""
    return (1 << bits) - 1 if bits else 1


@dataclass(frozen=True)
class ColdLayout:
    """Shapes and byte counts of one layer's cold pool."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    bits: int
    dtype: torch.dtype
    summary: bool = False  # keep Quest's key bounds in e4m3 too (QuestSummary8)

    def __post_init__(self) -> None:
        if self.bits not in POOL_BITS:
            raise ValueError(f"bits={self.bits} must be one of {list(POOL_BITS)}")
        if self.head_dim % 2:
            raise ValueError(
                f"`head_dim % 2 == 0` must hold (INT4 packing), but got head_dim={self.head_dim}"
            )

    @property
    def code_dim(self) -> int:
        """Bytes (bits 4/8) or elements (bits 0) per row of codes."""
        return self.head_dim * self.bits // 8 if self.bits else self.head_dim

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.uint8 if self.bits else self.dtype

    @property
    def code_bytes_per_block(self) -> int:
        """Bytes of the K and V codes of one block (all heads)."""
        elem = torch.empty(0, dtype=self.code_dtype).element_size()
        return 2 * self.num_kv_heads * self.block_size * self.code_dim * elem

    @property
    def summary_bytes_per_block(self) -> int:
        """Bytes of one block's e4m3 key bounds (lo and span, every KV head); 0 without a summary."""
        return 2 * self.num_kv_heads * self.head_dim if self.summary else 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block in one layer: codes, key min/scale, value min/scale, block_bits, and the
        e4m3 summary where kept."""
        h, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        return self.code_bytes_per_block + 2 * 2 * h * d + 2 * 2 * h * bs + 1 + self.summary_bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device | str) -> ColdPool:
        """A zeroed pool of ``num_blocks`` blocks; ``block_bits`` = the pool's bits."""
        n, h, d, bs, cd = num_blocks, self.num_kv_heads, self.head_dim, self.block_size, self.code_dim
        cdt, sdt = self.code_dtype, SCALE_DTYPE
        return ColdPool(
            layout=self,
            k=torch.zeros((n, h, bs, cd), dtype=cdt, device=device),
            v=torch.zeros((n, h, bs, cd), dtype=cdt, device=device),
            k_min=torch.zeros((n, h, d), dtype=sdt, device=device),
            k_scale=torch.zeros((n, h, d), dtype=sdt, device=device),
            v_min=torch.zeros((n, h, bs), dtype=sdt, device=device),
            v_scale=torch.zeros((n, h, bs), dtype=sdt, device=device),
            block_bits=torch.full((n,), self.bits, dtype=torch.uint8, device=device),
            summary=self._summary((n, h, d), device),
        )

    def _summary(self, shape: tuple[int, ...], device: torch.device | str) -> QuestSummary8 | None:
        """A zeroed e4m3 summary of ``shape`` ([N, H, D], or [layers, N, H, D]), None without one."""
        if not self.summary:
            return None
        lo, span = (torch.zeros(shape, dtype=torch.uint8, device=device).view(E4M3) for _ in range(2))
        return QuestSummary8(lo, span)

    def allocate_layers(self, num_layers: int, num_blocks: int, device: torch.device | str) -> list[ColdPool]:
        """One zeroed pool per layer, each field of every layer a slice of one allocation at a constant
        stride, so a kernel can reach every layer's block from layer 0's pointers (the device-side
        demotion does); ``block_bits`` rows are padded to 16 bytes (each layer's starts aligned)."""
        n, h, d, bs, cd = num_blocks, self.num_kv_heads, self.head_dim, self.block_size, self.code_dim
        cdt, sdt, lay = self.code_dtype, SCALE_DTYPE, num_layers
        k = torch.zeros((lay, n, h, bs, cd), dtype=cdt, device=device)
        v = torch.zeros((lay, n, h, bs, cd), dtype=cdt, device=device)
        k_min = torch.zeros((lay, n, h, d), dtype=sdt, device=device)
        k_scale = torch.zeros((lay, n, h, d), dtype=sdt, device=device)
        v_min = torch.zeros((lay, n, h, bs), dtype=sdt, device=device)
        v_scale = torch.zeros((lay, n, h, bs), dtype=sdt, device=device)
        bits = torch.full((lay, -(-n // 16) * 16), self.bits, dtype=torch.uint8, device=device)
        summ = self._summary((lay, n, h, d), device)
        return [
            ColdPool(
                self, k[i], v[i], k_min[i], k_scale[i], v_min[i], v_scale[i], bits[i, :n],
                summary=None if summ is None else QuestSummary8(summ.lo[i], summ.span[i]),
            )
            for i in range(lay)
        ]  # fmt: skip


E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448: the largest finite e4m3 value


@dataclass(frozen=True)
class QuestSummary8:
    """One layer's Quest bounds in float8 e4m3 (:mod:`kvtune.kernels.quest_summary`): ``lo`` and ``span``
    [num_blocks, H, D], the pool's block ids and KV heads."""

    lo: torch.Tensor
    span: torch.Tensor

    @property
    def bytes_per_block(self) -> int:
        """Bytes Quest reads of one L2 block, every KV head: ``lo`` and ``span``, a byte each per channel."""
        return 2 * math.prod(self.lo.shape[1:])


@dataclass
class ColdPool:
    """One layer's cold blocks (see the module docstring for the meaning of each field).

    k, v: [N, H, bs, code_dim] uint8 (bits 4/8) or model dtype (bits 0)
    k_min, k_scale: [N, H, D] fp16 · v_min, v_scale: [N, H, bs] fp16 · block_bits: [N] uint8
    summary: lo, span [N, H, D] e4m3, or None
    """

    layout: ColdLayout
    k: torch.Tensor
    v: torch.Tensor
    k_min: torch.Tensor
    k_scale: torch.Tensor
    v_min: torch.Tensor
    v_scale: torch.Tensor
    block_bits: torch.Tensor
    may_demote: bool = True  # 8-bit pools may hold demoted 4-bit blocks; False lets kernels skip block_bits
    summary: QuestSummary8 | None = None  # the e4m3 key bounds, where the layout keeps them

    @property
    def bits(self) -> int:
        return self.layout.bits

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[0])


def block_levels(pool: ColdPool, block_ids: torch.Tensor) -> torch.Tensor:
    """Largest code per listed block, float32 ``[*block_ids.shape]`` (255, 15 or 1 for unquantized)."""
    bits = pool.block_bits[block_ids].to(torch.int32)
    return torch.where(bits > 0, (1 << bits) - 1, 1).to(torch.float32)


def key_bounds(pool: ColdPool, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key (min, max) per channel of the listed blocks: float32 ``[*block_ids.shape, H, D]`` each.

    ``max = min + scale · levels`` (levels 2^bits − 1 for quantized blocks, 1 for unquantized ones).
    """
    lo = pool.k_min[block_ids].float()
    hi = lo + pool.k_scale[block_ids].float() * block_levels(pool, block_ids)[..., None, None]
    return lo, hi
