"""Triton compilations timed while a replay runs, so that its clock can leave them out.

A Triton kernel is compiled the first time it is launched with a new specialization (a new constexpr, or an
integer argument that turns divisible by 16). A replay's warm-up launches what it can reach, but a new
window of requests (other lengths, other batch compositions) can still meet a new specialization inside a
measured forward. The host then stands still for the compilation (tens of milliseconds to seconds) while the
device idles, and both clocks count it: the wall clock directly, the device clock because the idle device
lies between the forward's two CUDA events. One such stall inside a capacity probe delays every request
queued behind it and fails a rate the engine serves. A production server compiles (or loads from its
cache) before it takes traffic, so the replay's clock leaves the stall out, as it leaves out CUDA graph
captures, and the replay reports how many compilations fell inside it and how long they took.

:class:`CompileWatch` times ``JITFunction._do_compile``, the one method through which Triton's JIT (and
Gluon's, a subclass) compiles a kernel or loads it from its disk cache, by wrapping it while the watch is
entered. Triton's public ``jit_cache_hook`` / ``jit_post_compile_hook`` would be the obvious handles, but
with a hook installed Triton 3.6 serializes every compilation's constants to JSON first, which fails for Gluon
kernels (their layouts are constants): the wrap leaves the compilation itself untouched. Without Triton, or
with a Triton that has no such method, nothing is timed and the clock is as before. Of those calls, the ones
that only loaded a kernel from the disk cache (compiled ahead, :mod:`kvtune.engine.warm`, or by an earlier
process) are counted apart (``loaded``), from Triton's compilation listener, which a watch chains to any
listener already set.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CompileWatch"]


def _jit_class() -> Any:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton (a CPU-only install): nothing compiles
        return None
    return JITFunction if callable(getattr(JITFunction, "_do_compile", None)) else None


class CompileWatch:
    """Counts and times the Triton compilations inside a ``with`` block (host milliseconds)."""

    def __init__(self) -> None:
        self.count = 0
        self.loaded = 0  # of ``count``, loads from the disk cache
        self.ms = 0.0
        self._saved: tuple[Any, Any] | None = None
        self._listener: tuple[Any, Any] | None = None

    def __enter__(self) -> CompileWatch:
        jit = _jit_class()
        if jit is not None:
            from triton import knobs

            before = knobs.compilation.listener

            def listen(**kwargs: Any) -> None:
                self.loaded += bool(kwargs.get("cache_hit"))
                if before is not None:
                    before(**kwargs)

            self._listener = (knobs.compilation, before)
            knobs.compilation.listener = listen
            original = jit._do_compile

            def _do_compile(fn: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(fn, *args, **kwargs)
                finally:
                    self.count += 1
                    self.ms += (time.perf_counter() - t0) * 1000.0

            self._saved = (jit, original)
            jit._do_compile = _do_compile
        return self

    def __exit__(self, *exc: object) -> None:
        if self._listener is not None:
            compilation, before = self._listener
            compilation.listener = before
            self._listener = None
        if self._saved is not None:
            jit, original = self._saved
            jit._do_compile = original
            self._saved = None
