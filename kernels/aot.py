"""Compile the kernels a launcher would launch, for a GPU that is not here (ahead of time, on any machine).

A launcher is called on CPU tensors with ``JITFunction.run`` replaced by a recorder, so nothing runs; each
recorded launch is rebuilt the way Triton's JIT specializes it (Triton's own specialization of each
argument: types, constexprs, ints equal to 1, 16-divisible pointers and ints) and compiled by
``triton.compile`` for the target (``ptxas`` and ``cuobjdump`` ship with Triton). Used by the CI test that
every kernel compiles for Hopper, and by ``benchmarks/kernel_resources.py`` to read registers, stack and
shared memory of kernel variants offline. :func:`specialization` is the JIT's cache key of a launch: the CI
test that sizes changing at run time (batch, blocks per sequence) never make the JIT compile a kernel again.

Nothing at run time imports this module. It is in the package, not in ``tests/``, because a test
(``tests/test_triton_compile.py``) and a benchmark (``benchmarks/kernel_resources.py``) both need it, and the
benchmarks do not import the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import JITFunction

from kvtune.kernels.arch import Arch

HOPPER = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "maxnreg")


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch."""

    fn: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs per program."""

    name: str
    registers: int
    stack_bytes: int
    shared_bytes: int
    num_warps: int
    loop_instructions: int = 0  # SASS instructions of the longest loop (the block loop of a decode kernel)


def record_launches(launcher: Callable[[], Any]) -> list[Launch]:
    """Run ``launcher`` (on CPU tensors) with every kernel launch recorded instead of run."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        launcher()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return launches


def _arguments(launch: Launch) -> list[tuple[int, str, tuple[Any, Any]]]:
    """Each parameter of the launched kernel: its index, its name and how the JIT specializes the value
    passed: ``("constexpr", value)``, or Triton's own ``(type, attribute)`` (``("i32", "D")`` for a
    16-divisible int, ``("constexpr", 1)`` for an int equal to 1, ``("*bf16", "D")`` for a 16-byte aligned
    pointer, ...)."""
    fn, bound = launch.fn, dict(zip(launch.fn.arg_names, launch.args))
    bound.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    out = []
    for i, p in enumerate(fn.params):
        value = bound.get(p.name, p.default)
        spec = (
            ("constexpr", value)
            if p.is_constexpr
            else native_specialize_impl(
                BaseBackend, value, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment
            )
        )
        out.append((i, p.name, tuple(spec)))
    return out


def _options(launch: Launch) -> dict[str, Any]:
    return {k: v for k, v in launch.kwargs.items() if k in OPTIONS}


def source(launch: Launch) -> tuple[ASTSource, dict[str, Any]]:
    """The kernel specialized as the JIT would for this launch, and the launch's compile options."""
    sig: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name, (kind, attr) in _arguments(launch):
        sig[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    kind = GluonASTSource if isinstance(launch.fn, GluonJITFunction) else ASTSource
    return kind(fn=launch.fn, signature=sig, constexprs=constexprs, attrs=attrs), _options(launch)


def specialization(launch: Launch) -> tuple[Any, ...]:
    """What the JIT keys its compiled kernels on for this launch besides the source: each argument as
    :func:`_arguments` gives it, and the compile options. Two launches with different keys compile twice."""
    key = tuple((name, *spec) for _, name, spec in _arguments(launch))
    return launch.fn.__name__, key, tuple(sorted(_options(launch).items()))


def target_of(arch: Arch) -> GPUTarget:
    """The compiler's target for an architecture of :mod:`kvtune.kernels.arch`."""
    return GPUTarget("cuda", arch.target, 32)


def compile_launch(launch: Launch, target: GPUTarget = HOPPER) -> Any:
    """The compiled kernel (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata``) of one recorded launch."""
    src, options = source(launch)
    return triton.compile(src, target, options)


def resources(launch: Launch, target: GPUTarget = HOPPER, compiled: Any = None) -> Resources:
    """Registers and stack (``cuobjdump --dump-resource-usage``), shared memory and the longest loop's
    SASS instructions (:func:`longest_loop`) of one launch (``compiled``: its :func:`compile_launch`, where
    the caller has it already)."""
    compiled = compile_launch(launch, target) if compiled is None else compiled
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", "-sass", f.name], capture_output=True,
                               text=True).stdout  # fmt: skip
    reg, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    if reg is None or stack is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {launch.fn.__name__}: {usage[:200]!r}")
    warps = int(launch.kwargs.get("num_warps", 4))
    shared = int(compiled.metadata.shared)
    loop = longest_loop(usage)
    return Resources(launch.fn.__name__, int(reg.group(1)), int(stack.group(1)), shared, warps, loop)


def longest_loop(sass: str) -> int:
    """Instructions between the target of a conditional backward branch and the branch, for the longest such
    span of a ``cuobjdump -sass`` listing: a decode kernel's block loop, whose length per block is what an
    issue-bound kernel pays (0 where the listing has none). An unconditional backward branch is no loop's
    back edge: it returns from code placed out of line (an mbarrier wait's retry after ``EXIT``) into the
    middle of the loop."""
    seen: list[int] = []
    best = 0
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m is None:
            continue
        addr = int(m.group(1), 16)
        seen.append(addr)
        branch = re.search(r"^@!?U?P\w*\s+BRA\b[^;]*?0x([0-9a-f]+)", m.group(2))
        if branch is not None and int(branch.group(1), 16) < addr:
            start = int(branch.group(1), 16)
            best = max(best, sum(1 for a in seen if start <= a <= addr))
    return best
