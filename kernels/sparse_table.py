"""A layer's attention table when some of its blocks are in L2: the launcher (rule, reference, tier codes and
:class:`ByteCount`: :mod:`kvtune.kernels.sparse_table_ref`; on CUDA the Triton kernel of
:mod:`kvtune.kernels.triton_sparse_table`, or the split selection of :mod:`kvtune.kernels.triton_sparse_split`
where the options ask for it (:mod:`kvtune.kernels.sparse_table_choice`), imported on first use).
"""

from __future__ import annotations

import torch

from kvtune.kernels.arch import arch_of, num_sms
from kvtune.kernels.backend import use_triton
from kvtune.kernels.bits_partition_ref import BitsPartition, empty_partition
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.quest_summary import QuestSummary8
from kvtune.kernels.sparse_table_choice import SelectOptions, select_kernel
from kvtune.kernels.sparse_table_ref import L1, L2, ByteCount, compact, sparse_block_table_ref

__all__ = [
    "L1", "L2", "ByteCount", "compact", "loads_summary", "selection_summary", "sparse_block_table",
    "sparse_block_table_parts", "sparse_block_table_ref",
]  # fmt: skip


def sparse_block_table(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    options: SelectOptions | None = None,
    summary: QuestSummary8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`sparse_block_table_ref`; Triton on CUDA (``options``: which Triton kernels,
    :func:`kvtune.kernels.sparse_table_choice.select_kernel`; None: the default). ``summary``: select from
    the pool's float8 key bounds (:mod:`kvtune.kernels.quest_summary`) instead of its fp16 ones."""
    table, num, n1, _ = _select(q, pool, blocks, tier, k_blocks, count, options, summary, by_bits=False)
    return table, num, n1


def sparse_block_table_parts(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    options: SelectOptions | None = None,
    summary: QuestSummary8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BitsPartition | None]:
    """:func:`sparse_block_table`, and where the split selection builds the table of an 8-bit pool that may
    hold demoted blocks, the table split by bits (:mod:`kvtune.kernels.bits_partition_ref`) that the mixed
    Gluon attention reads, written by the selection's merge launch (``hybrid_decode_attention``'s
    ``partition``: the attention then launches no partition of its own); None elsewhere."""
    return _select(q, pool, blocks, tier, k_blocks, count, options, summary, by_bits=True)


def _select(
    q: torch.Tensor,
    pool: ColdPool,
    blocks: torch.Tensor,
    tier: torch.Tensor,
    k_blocks: int,
    count: ByteCount,
    options: SelectOptions | None,
    summary: QuestSummary8 | None,
    by_bits: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BitsPartition | None]:
    """The one dispatcher of both launchers: the kernel ``options`` pick for the rows and the device, and
    (``by_bits``) the split by bits where the split selection writes one."""
    _check_summary(summary, q.device)
    rows = q.shape[0] * pool.layout.num_kv_heads
    kernel = use_triton(q) and select_kernel(
        k_blocks, q.shape[2], options, rows, num_sms(q.device), summary is not None
    )
    if kernel == "split":
        from kvtune.kernels.triton_sparse_split import sparse_block_table_split_triton

        parts = None
        if by_bits and pool.bits == 8 and pool.may_demote:
            w = blocks.shape[1] + k_blocks
            parts = empty_partition(blocks.shape[0], pool.layout.num_kv_heads, w, q.device)
        table, num, n1 = sparse_block_table_split_triton(
            q, pool, blocks, tier, k_blocks, count, options, summary, parts
        )
        return table, num, n1, parts
    if use_triton(q):
        from kvtune.kernels.triton_sparse_table import sparse_block_table_triton

        return (*sparse_block_table_triton(q, pool, blocks, tier, k_blocks, count, summary), None)
    return (*sparse_block_table_ref(q, pool, blocks, tier, k_blocks, count, summary), None)


def _check_summary(summary: QuestSummary8 | None, device: torch.device) -> None:
    """A ValueError where a summary is given that ``device`` cannot load (:func:`loads_summary`)."""
    if summary is not None and not loads_summary(device):
        raise ValueError(
            f"the float8 Quest summary needs sm_89 or newer (e4m3 loads), but {device} is "
            f"{arch_of(device).name}: select from the pool's fp16 key bounds (summary=None)"
        )


def loads_summary(device: torch.device) -> bool:
    """Whether the selection can read an e4m3 summary on ``device``: the reference anywhere, the Triton
    kernels on sm_89 or newer (e4m3 loads)."""
    return not use_triton(device) or arch_of(device).fp8


def selection_summary(pool: ColdPool, q: torch.Tensor) -> QuestSummary8 | None:
    """The summary the selection reads for ``q``'s device: the pool's e4m3 bounds where it keeps them and the
    device loads them (:func:`loads_summary`), else None (the fp16 bounds)."""
    return pool.summary if pool.summary is not None and loads_summary(q.device) else None
