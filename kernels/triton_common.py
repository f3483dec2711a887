"""Host-side helpers shared by the Triton launchers (``triton_decode``, ``triton_quant``, ``triton_quest``,
``triton_sparse_table``, ``triton_elementwise``) and the decode dispatcher (``decode_attention``).

Plain Python, no Triton import: a launcher uses them without importing another launcher (and its kernels),
and the dispatcher without Triton installed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (at least 1), for host ints (``triton.next_power_of_2``: ~4 µs)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` is a JIT function: ~4 µs a call from Python)."""
    return -(-a // b)


def tileable_head_dim(d: int) -> bool:
    """Head dims the kernels tile: two halves of a power of two >= 16 (others take the reference)."""
    half = d // 2
    return d % 2 == 0 and half >= 16 and half & (half - 1) == 0


def require(name: str, rules: dict[str, bool], detail: Callable[[], str]) -> None:
    """ValueError ``name: `rule` must hold (detail)`` naming the first rule that fails (``detail()``, the
    inputs' shapes, is formatted only then)."""
    for rule, ok in rules.items():
        if not ok:
            raise ValueError(f"{name}: `{rule}` must hold ({detail()})")


@functools.lru_cache(maxsize=256)
def replaced(options: Any, **changes: Any) -> Any:
    """``dataclasses.replace(options, **changes)`` of frozen (hashable) options, kept per (options, changes):
    a launcher that derives the same options on every call pays a dict lookup, not a ``replace`` (a large
    part of a launch's host time)."""
    return dataclasses.replace(options, **changes)
