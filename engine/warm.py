"""Kernels compiled ahead: while a study measures one config, the host's idle cores compile the next ones'.

A config met for the first time makes Triton compile its cache's kernels inside the trial's set-up: a
worker of an H200 study spent 2-4 s of each new (bits, block size) pair there, 14-16 s for a 4-bit pool of
256-token blocks, about a fifth of its trials' wall, one kernel after the other on one core while the GPU
idled. Triton keeps every compiled kernel in its disk cache under a key of the kernel's source, its
specialization (argument types, 16-divisible ints and pointers, compile-time values), its options and the
target GPU; a later compilation with the same key only loads it.

:class:`KernelWarmer` fills that cache ahead of time. It starts processes that see no GPU (``nice`` 19, on
the host's spare cores); each runs the engine itself on CPU tensors, for a share of the configs given, with a
model of the worker's attention shape and width (one layer, a narrow MLP, a small vocabulary: none of
the cache's kernels is keyed on those), replaying a few requests through every path a replay takes (the
warm-up's kernels, prompts in chunks beside decode rows, the static decode step, seals). Every launch takes
the decision a CUDA process would for the worker's GPU (:func:`kvtune.kernels.backend.plan_ahead`: its
architecture's limits and multiprocessors, the Triton and Gluon kernels), and Triton's JIT compiles it for
the worker's target without launching it (a stand-in driver names the target; nothing runs). The worker's
own JIT then finds each kernel on disk.

Nothing depends on it: a kernel not compiled ahead (a config not listed yet, a launch only a GPU takes) is
compiled where it was before. ``KVTUNE_WARM=0`` turns it off; ``KVTUNE_WARM_PROCESSES`` sets the processes
(default: half the cores less two, at least one).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.engine.options import warm_processes
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.engine.traces import Request
from kvtune.engine.weights import ModelSpec

__all__ = [
    "KernelWarmer",
    "WarmSpec",
    "planning_mlp",
    "planning_spec",
    "spec_for",
    "warm_requests",
]

PLANNING_MLP = 1024  # the planning model's MLP width at most (about: planning_mlp)
PLANNING_VOCAB = 1024


@dataclass(frozen=True)
class WarmSpec:
    """What the planning processes compile for: the worker's GPU (``target``: Triton's ``GPUTarget`` fields,
    ``arch`` its :class:`~kvtune.kernels.arch.Arch`, ``sms`` its multiprocessors), its model, dtype and
    engine options, and the configs (as dicts, in the order they are wanted)."""

    target: tuple[str, int | str, int]
    arch: Any
    sms: int
    model: ModelSpec
    dtype: str
    scheduler: SchedulerConfig
    configs: tuple[dict[str, Any], ...]


def spec_for(
    device: torch.device,
    model: ModelSpec,
    dtype: str,
    scheduler: SchedulerConfig,
    configs: Sequence[dict[str, Any]],
) -> WarmSpec:
    """The :class:`WarmSpec` of a CUDA ``device`` (this process's current one) running ``model``."""
    from triton.runtime.driver import driver

    from kvtune.kernels.arch import arch_of, num_sms

    target = driver.active.get_current_target()
    return WarmSpec(
        (target.backend, target.arch, target.warp_size), arch_of(device), num_sms(device), model, dtype,
        scheduler, tuple(configs),
    )  # fmt: skip


def planning_spec(spec: ModelSpec) -> ModelSpec:
    """The model a planning process runs: ``spec``'s attention heads, head size and width (the kernels of
    its norms and RoPE are the worker's), one layer, a narrow MLP and a small vocabulary."""
    return replace(
        spec,
        name=f"{spec.name}, planning",
        num_layers=1,
        intermediate_size=planning_mlp(spec.intermediate_size),
        vocab_size=min(spec.vocab_size, PLANNING_VOCAB),
        tie_embeddings=False,
    )


def planning_mlp(width: int) -> int:
    """A narrow MLP width whose fused SiLU-multiply kernel specializes as ``width``'s does (its block,
    ``min(1024, next power of two)``, and its ints' residues mod 16): ``width`` itself up to
    :data:`PLANNING_MLP`, else :data:`PLANNING_MLP` plus ``width``'s residue. (A width of 256 compiled the
    kernel with a block of 256, and a Llama-3.1-8B worker compiled its own, of 1,024, on its first prime.)"""
    return width if width <= PLANNING_MLP else PLANNING_MLP + width % 16


def warm_requests(config: HybridConfig) -> tuple[Request, ...]:
    """Four requests that take every path of a replay under ``config``: prompts that seal blocks and one
    that does not, an output that fills a hot zone while decoding, arrivals that leave decode rows beside
    later prompts' chunks."""
    hot, bs = config.hot_tokens, config.block_size
    prompts = (hot + 2 * bs + 5, 37, hot + bs + 17, 2 * hot + 3 * bs + 1)
    outputs = (bs + 3, 12, 5, 9)
    return tuple(Request(i, float(i), n, o) for i, (n, o) in enumerate(zip(prompts, outputs, strict=True)))


def warm_replays(scheduler: SchedulerConfig) -> int:
    """How many times the planning replays :func:`warm_requests` on one engine: twice with mixed graphs,
    which run a shape op by op at its first use and as its graph's function from its second, so both paths'
    kernels are planned."""
    return 2 if scheduler.mixed_graphs else 1


def warm_scheduler(scheduler: SchedulerConfig) -> SchedulerConfig:
    """The worker's engine options, on the wall clock, with iterations small enough that prompts run in
    chunks beside decode rows."""
    return replace(scheduler, clock="wall", max_num_seqs=3, max_num_batched_tokens=128)


# ---- the planning process ------------------------------------------------------------------------------
class _Counts:
    """Triton's compilations and disk-cache loads, from its compilation listener."""

    def __init__(self) -> None:
        self.compiled = 0
        self.loaded = 0
        self.names: list[str] = []

    def __call__(self, *, src: Any, cache_hit: bool, **_: Any) -> None:
        if cache_hit:
            self.loaded += 1
        else:
            self.compiled += 1
        self.names.append(str(getattr(getattr(src, "fn", None), "__name__", "?")))


class _PlanningDriver:
    """What Triton's JIT asks of its driver to compile a launch, for a GPU that is not here."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def plan_for(spec: WarmSpec) -> _Counts:
    """Make this process plan and compile for ``spec``'s GPU: every launch is compiled (or loaded from the
    disk cache), never run. Returns the counts of what Triton did. For a process that does nothing else."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from kvtune.kernels.backend import Ahead, plan_ahead

    driver.set_active(_PlanningDriver(GPUTarget(*spec.target)))  # type: ignore[arg-type]
    plan_ahead(Ahead(spec.arch, spec.sms))
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only  # type: ignore[method-assign]
    counts = _Counts()
    knobs.compilation.listener = counts
    return counts


def warm_config(loaded: Any, config: dict[str, Any], spec: WarmSpec, counts: _Counts) -> dict[str, Any]:
    """Replay :func:`warm_requests` under ``config`` on the CPU (the process plans ahead): one result line."""
    from kvtune.engine.engine import Engine

    started, compiled, hits, named = time.perf_counter(), counts.compiled, counts.loaded, len(counts.names)
    error = None
    try:
        cfg = HybridConfig.from_dict(config)
        requests = warm_requests(cfg)
        lengths = [r.input_length + r.output_length for r in requests]
        budget = 2 * kv_bytes_for(cfg, loaded.model.kv_shape, lengths)
        engine = Engine(loaded, cfg, budget, torch.device("cpu"), warm_scheduler(spec.scheduler))
        for _ in range(warm_replays(spec.scheduler)):
            engine.replay(requests, 0.0, warmup_requests=2)
    except Exception as e:  # a config this cannot warm is compiled by the worker, as without it
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {
        "config": config,
        "compiled": counts.compiled - compiled,
        "loaded": counts.loaded - hits,
        "kernels": sorted(set(counts.names[named:])),
        "seconds": round(time.perf_counter() - started, 3),
        "error": error,
    }


def _exit_with_parent() -> None:
    """Exit when the parent closes this process's stdin (it stopped, or its process ended)."""
    sys.stdin.buffer.read()
    os._exit(0)


def main() -> None:
    """A planning process: reads ``(WarmSpec, part, parts)`` pickled on stdin and warms every ``parts``-th
    config from ``part``, one JSON line each on stdout. It ends through ``os._exit``: the interpreter's
    shutdown aborts on the stdin that the watching thread still reads."""
    try:
        spec, part, parts = pickle.load(sys.stdin.buffer)
        threading.Thread(target=_exit_with_parent, daemon=True).start()
        if hasattr(os, "nice"):
            os.nice(19)  # the host's idle cores only: the worker's own launches come first
        torch.set_num_threads(1)
        counts = plan_for(spec)
        from kvtune.engine.model import LlamaModel, LoadedModel
        from kvtune.engine.weights import random_tensors

        model_spec = planning_spec(spec.model)
        dtype = getattr(torch, spec.dtype)
        model = LlamaModel(model_spec, random_tensors(model_spec, torch.device("cpu"), dtype))
        loaded = LoadedModel(model, model_spec, None, False)
        for config in spec.configs[part::parts]:
            print(json.dumps(warm_config(loaded, config, spec, counts)), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


# ---- the worker's side ---------------------------------------------------------------------------------
class KernelWarmer:
    """Planning processes compiling ``spec``'s configs into Triton's disk cache, in the background (module
    docstring); :meth:`report` says how far they are."""

    def __init__(self, spec: WarmSpec, processes: int | None = None) -> None:
        self.configs = len(spec.configs)
        self.processes = warm_processes(self.configs) if processes is None else max(1, processes)
        self.started = time.monotonic()
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ended: float | None = None
        self.crashed: list[str] = []  # a line for each process that ended with an error
        # the folder this process imported the package from first (a checkout, a Ray worker's path)
        import kvtune

        root = str(Path(kvtune.__file__).parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0", "PYTHONPATH": path}
        self._children = []
        errs = []
        for part in range(self.processes):
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the reader of this process's output)
            child = subprocess.Popen(
                [sys.executable, "-m", "kvtune.engine.warm"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env=env,
            )  # fmt: skip
            errs.append(err)
            assert child.stdin is not None
            child.stdin.write(pickle.dumps((spec, part, self.processes)))
            child.stdin.flush()  # stdin stays open: the child exits when it closes
            self._children.append(child)
        self._readers = [
            threading.Thread(target=self._read, args=(c, e), daemon=True)
            for c, e in zip(self._children, errs, strict=True)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, child: subprocess.Popen[bytes], err: Any) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            try:
                result = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.results.append(result)
        code = child.wait()
        with err:
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines()
        if code not in (0, -signal.SIGKILL):  # killed: stopped
            with self._lock:
                self.crashed.append(f"a planning process exited with {code}: {lines[-1] if lines else ''}")
        with self._lock:
            if all(c.poll() is not None for c in self._children):
                self._ended = time.monotonic()

    @property
    def running(self) -> bool:
        return any(c.poll() is None for c in self._children) and len(self.results) < self.configs

    def report(self) -> dict[str, Any]:
        """Configs warmed of those given, Triton's compilations and disk loads, the configs that failed (a
        line each, at most three), seconds since the start (or until the end), and whether it still runs."""
        with self._lock:
            results, crashed, ended = list(self.results), list(self.crashed), self._ended
        failed = [f"{r['config']}: {r['error']}" for r in results if r.get("error")]
        return {
            "configs": self.configs,
            "warmed": len(results) - len(failed),
            "compiled": sum(int(r.get("compiled", 0)) for r in results),
            "loaded": sum(int(r.get("loaded", 0)) for r in results),
            "failed": len(failed),
            "errors": (crashed + failed)[:3],
            "processes": self.processes,
            "seconds": round((ended if ended is not None else time.monotonic()) - self.started, 1),
            "running": self.running,
        }

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every process ended (True) or ``timeout`` seconds passed (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(r.is_alive() for r in self._readers)

    def stop(self) -> None:
        """End every planning process (what they compiled stays in the disk cache)."""
        for child in self._children:
            if child.poll() is None:
                child.kill()
            if child.stdin is not None:
                with contextlib.suppress(OSError):
                    child.stdin.close()
        for child in self._children:
            child.wait()


if __name__ == "__main__":
    main()
