"""The immutable plan of one decode step, built by ``HybridCache.begin_step`` and passed to every layer."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def seals(self) -> bool:
        return bool(self.sealed_seq_ids)
