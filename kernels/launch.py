"""Kernel launches without the JIT's per-call work, where a launch specializes as an earlier one did.

``kernel[grid](*args, **kwargs)`` makes Triton bind every argument, specialize each (a tensor's dtype and
16-byte alignment, an int's width, whether it is 1 and whether 16 divides it), build the cache key from all of
that and the compile-time values (for a Gluon kernel, its layouts hashed at every launch), and only then call
the compiled kernel's launcher. On an H200's host Triton's launch path was the largest single part of a
mixed iteration's host time (18 of 50 profiled ms; the decode attention's launches alone 0.4-0.5 ms a layer).

:func:`launch` does the same launch and keeps what the JIT returned under a key of its own: per runtime
argument what Triton's specialization reads (for a tensor its dtype and whether its address is 16-byte
aligned; for an int whether it is 1, whether 16 divides it and its width; for a float or bool its type) and
the compile-time values (by value, or by identity for objects such as layouts, which the entry keeps alive).
A later launch with the same key calls the compiled kernel's launcher directly. The key is never coarser than
Triton's (it keys ints on 1 and 16 also where the kernel does not specialize them), so a hit launches the
kernel the JIT itself would pick (the JIT's check that the kernel's global constants have not changed since
it compiled is not repeated: kvtune's do not change). Anything else takes the JIT's own path: a launch hook
installed, an argument of another type, a runtime argument passed by keyword, a grid given as a function,
the interpreter, a CPU tensor.

``KVTUNE_FAST_LAUNCH=0`` in the environment turns this off (read once per process).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

MAX_ENTRIES = 4096  # kept compiled launches, all kernels together; beyond it launches take the JIT's path
_I32 = 1 << 31
_I64 = 1 << 63

_Key = tuple[Any, ...]
_entries: dict[_Key, tuple[Any, tuple[Any, ...]]] = {}


@functools.cache
def enabled() -> bool:
    """Fast launches on (``KVTUNE_FAST_LAUNCH``, default on; never under the Triton interpreter)."""
    return os.environ.get("KVTUNE_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


@functools.cache
def _params(fn: JITFunction) -> tuple[tuple[bool, ...], tuple[tuple[str, Any], ...], frozenset[str]]:
    """Per parameter whether it is a compile-time value; per parameter, its name and default; the names of
    the runtime parameters."""
    runtime = frozenset(p.name for p in fn.params if not p.is_constexpr)
    return tuple(p.is_constexpr for p in fn.params), tuple((p.name, p.default) for p in fn.params), runtime


def arg_key(arg: Any, constexpr: bool) -> Any:
    """What the JIT's specialization reads of one argument (None: a type this module does not key)."""
    if constexpr:
        return ("c", _value_key(arg))
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return bool
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, 0 if -_I32 <= arg < _I32 else (1 if -_I64 <= arg < _I64 else 2))
    if isinstance(arg, float):
        return float
    if arg is None:
        return ("c", None)
    return None


_SCALARS = frozenset({bool, int, float, str, type(None)})
_INTS = frozenset({int})


def _value_key(value: Any) -> Any:
    """A compile-time value as a key: ints, floats, strings, bools and None (and tuples of them) by value
    (with their type: True and 1 compile apart), anything else by identity. A tuple of ints only (the
    Gluon builds' orders and bit lists) is keyed as a whole, without a call per element."""
    t = type(value)
    if t in _SCALARS or isinstance(value, (bool, int, float, str)):
        return (t, value)
    if isinstance(value, tuple):
        if set(map(type, value)) <= _INTS:
            return (tuple, value)
        return tuple(_value_key(v) for v in value)
    return (t, id(value))


def _runtime_key(args: tuple[Any, ...], constexpr: tuple[bool, ...], cuda_only: bool = True) -> _Key | None:
    """:func:`arg_key` of each positional argument in one loop (tensors and ints by their exact type, without
    a call each); None where one is not keyed or (``cuda_only``) is a tensor off the GPU: the JIT's path."""
    keys: list[Any] = []
    append = keys.append
    for a, c in zip(args, constexpr):
        t = type(a)
        if c:
            append(("c", _value_key(a)))
        elif t is torch.Tensor:
            if cuda_only and not a.is_cuda:
                return None
            append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is int:
            append((a == 1, a % 16 == 0, 0 if -_I32 <= a < _I32 else (1 if -_I64 <= a < _I64 else 2)))
        else:
            k = arg_key(a, c)
            if k is None or (cuda_only and isinstance(a, torch.Tensor) and not a.is_cuda):
                return None
            append(k)
    return tuple(keys)


def _kwargs_key(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The compile-time keyword values as a key (:func:`_value_key`'s, scalars without a call each)."""
    out: list[Any] = []
    append = out.append
    for n, v in kwargs.items():
        t = type(v)
        append((n, (t, v)) if t in _SCALARS else (n, _value_key(v)))
    return tuple(out)


def _hooked(hook: Any) -> bool:
    """A launch hook is installed: Triton 3.6 keeps an empty chain (its ``calls``) where none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(fn: JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``fn[grid](*args, **kwargs)``; returns the compiled kernel as the JIT does (module docstring)."""
    hooks = knobs.runtime
    if not enabled() or _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
        return fn[grid](*args, **kwargs)  # (under the interpreter ``fn`` is not a JITFunction)
    constexpr, names, runtime = _params(fn)
    # a runtime argument by keyword would be kept by value with the launch
    if not isinstance(grid, tuple) or not runtime.isdisjoint(kwargs):
        return fn[grid](*args, **kwargs)
    keys = _runtime_key(args, constexpr)
    if keys is None:
        return fn[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    key = (fn, device, keys, _kwargs_key(kwargs))
    entry = _entries.get(key)
    if entry is None:
        kernel = fn[grid](*args, **kwargs)
        if kernel is None or len(_entries) >= MAX_ENTRIES:
            return kernel
        # the parameters after the positional ones, in order, as the JIT binds them (kwargs, else defaults)
        tail = tuple(kwargs.get(n, d) for n, d in names[len(args) :])
        _entries[key] = (kernel, tail)
        return kernel
    kernel, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = driver.active.get_current_stream(device)  # as the JIT reads it
    run, fn_handle, meta = kernel.run, kernel.function, kernel.packed_metadata
    run(grid[0], g1, g2, stream, fn_handle, meta, None, None, None, *args, *tail)
    return kernel


def clear() -> None:
    """Forget every kept launch (tests)."""
    _entries.clear()
