"""How kvtune's hybrid cache lies in vLLM's pages (no vLLM import: the layout is plain torch).

Every attention layer gets two caches from vLLM's one block pool::

    cold group (the layer itself)                    hot group (its companion layer)
    one page = one kvtune cold block of bs tokens    sliding window of hot_tokens + bs tokens, model dtype
    ┌──────────────────────────────────────────┐     ┌──────────────────────────────────────┐
    │ k codes [H, bs, code_dim] │ v codes      │     │ [H, hot_block, 2·D]: K | V per token │
    │ k_min, k_scale [H, D] fp16 (per channel) │     │ hot_block = bs / 2^j, the largest    │
    │ v_min, v_scale [H, bs] fp16 (per token)  │     │ whose page fits in the cold page     │
    │ block_bits [1] uint8 │ padding           │     └──────────────────────────────────────┘
    └──────────────────────────────────────────┘

The cold page is :attr:`kvtune.kernels.layout.ColdLayout.bytes_per_block` bytes rounded up to a whole
number of bytes per token and to a multiple of :data:`PAGE_ALIGN` bytes: every field's block stride is then
a multiple of 16 elements, so the Gluon decode kernel's async copies of the fp16 scales can be 4 bytes or
wider. vLLM pads the hot page to the cold page (``page_size_padded``), so both groups share one pool of
equal pages and ``num_blocks = kv_cache_memory_bytes // (num_layers · page_bytes)`` (one page per layer
and block). :func:`cold_pool_view` returns a :class:`~kvtune.kernels.layout.ColdPool` whose fields are
strided views of the page bytes, so kvtune's own seal and dequantize run on vLLM's memory unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtune.kernels.layout import SCALE_DTYPE, ColdLayout, ColdPool

PAGE_ALIGN = 32
"""Bytes a page is a multiple of: fp16 fields then have block strides divisible by 16 elements."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PageLayout:
    """The cold page and the hot block of one layer (see the module docstring)."""

    cold: ColdLayout

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, cold and hot alike."""
        return self.cold.block_size * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """``C`` of vLLM's ``[B, 1, bs, C]`` uint8 view of a cold page: whole bytes per token, ``bs · C`` a
        multiple of :data:`PAGE_ALIGN`."""
        bs = self.cold.block_size
        step = PAGE_ALIGN // math.gcd(bs, PAGE_ALIGN)
        return step * _cdiv(_cdiv(self.cold.bytes_per_block, bs), step)

    @property
    def hot_token_bytes(self) -> int:
        """Bytes of one token of one layer in the hot window (K and V, all heads, model dtype)."""
        elem = torch.empty(0, dtype=self.cold.dtype).element_size()
        return 2 * self.cold.num_kv_heads * self.cold.head_dim * elem

    @property
    def hot_block_size(self) -> int:
        """Tokens per hot page: ``bs / 2^j`` for the smallest ``j`` whose page fits in :attr:`page_bytes`."""
        size = self.cold.block_size
        while size > 1 and size * self.hot_token_bytes > self.page_bytes:
            size //= 2
        assert size * self.hot_token_bytes <= self.page_bytes, (size, self.hot_token_bytes, self.page_bytes)
        return size

    def fields(self) -> dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]:
        """name -> (byte offset, byte length, dtype, per-block shape), in page order."""
        c = self.cold
        h, d, bs, cd = c.num_kv_heads, c.head_dim, c.block_size, c.code_dim
        code_elem = torch.empty(0, dtype=c.code_dtype).element_size()
        shapes: list[tuple[str, torch.dtype, tuple[int, ...], int]] = [
            ("k", c.code_dtype, (h, bs, cd), code_elem),
            ("v", c.code_dtype, (h, bs, cd), code_elem),
            ("k_min", SCALE_DTYPE, (h, d), 2),
            ("k_scale", SCALE_DTYPE, (h, d), 2),
            ("v_min", SCALE_DTYPE, (h, bs), 2),
            ("v_scale", SCALE_DTYPE, (h, bs), 2),
            ("block_bits", torch.uint8, (), 1),
        ]
        out, offset = {}, 0
        for name, dtype, shape, elem in shapes:
            length = elem * max(1, int(torch.Size(shape).numel()))
            out[name] = (offset, length, dtype, shape)
            offset += length
        assert offset == c.bytes_per_block, (offset, c.bytes_per_block)
        return out


def num_blocks_for(page: PageLayout, num_layers: int, kv_cache_memory_bytes: int) -> int:
    """Blocks vLLM's pool holds: one page per layer and block, cold and hot groups alike."""
    return kv_cache_memory_bytes // (num_layers * page.page_bytes)


def cold_pool_view(page: PageLayout, pages: torch.Tensor) -> ColdPool:
    """kvtune's cold pool over vLLM's pages of one layer, ``pages`` ``[B, ..., C]`` uint8 with each block's
    :attr:`PageLayout.page_bytes` bytes contiguous. No copy: writes land in vLLM's memory."""
    flat = pages.view(pages.shape[0], -1)
    if flat.shape[1] != page.page_bytes:
        raise ValueError(f"a page holds {flat.shape[1]} bytes, but the layout needs {page.page_bytes}")
    views: dict[str, torch.Tensor] = {}
    for name, (offset, length, dtype, shape) in page.fields().items():
        raw = flat[:, offset : offset + length]
        views[name] = raw[:, 0] if name == "block_bits" else raw.view(dtype).view(-1, *shape)
    v = views
    return ColdPool(
        page.cold,
        v["k"],
        v["v"],
        v["k_min"],
        v["k_scale"],
        v["v_min"],
        v["v_scale"],
        v["block_bits"],
        may_demote=False,
    )


def hot_views(hot_pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[B, H, hot_block, D]`` of vLLM's hot pages ``[B, H, hot_block, 2·D]``."""
    return hot_pages[..., :head_dim], hot_pages[..., head_dim:]
