"""What compiling ahead (``kvtune.engine.warm``) leaves of a new config's set-up on the GPU.

For each config, two fresh processes each prime an engine on the GPU as a study's worker primes a new cache
(32 requests of 64-1,024 prompt tokens served all at once, outputs of 16 tokens, the warm-up's kernels
first): ``cold`` with an empty Triton disk cache, ``ahead`` with one that the planning processes filled for
that config just before (:class:`~kvtune.engine.warm.KernelWarmer`, their seconds reported). A process
keeps what it compiled in memory, so each measurement starts its own. Each reports the prime's wall,
Triton's calls inside it (compiled, loaded from the disk) with their seconds, and the kernels it still had to
compile. Prints one line per config and writes every figure with ``--json``. On the GPU, from the
repository root:

    python benchmarks/warm_ahead.py [--model random:llama-3.1-8b] [--configs 4:32,8:64,0:32,4:256] [--json F]

``--configs``: ``bits:block_size`` pairs (hot zone ``--hot`` tokens). ``--check``: exit 1 if an ``ahead``
prime compiled any kernel of the cache (the GPU test's use).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the model's own kernels: compiled once per worker (its first replay), whatever the config; the planning
# model's narrow MLP gives its SiLU kernel other keys
MODEL_KERNELS = frozenset({"_add_rms_norm_kernel", "_rope_qkv_kernel", "_silu_mul_kernel"})


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--configs", default="4:32,8:64,0:32,4:256", help="bits:block_size pairs, comma-separated")
    p.add_argument("--hot", type=int, default=32)
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--check", action="store_true", help="exit 1 if an ahead prime compiled a cache kernel")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a measuring child: its config as JSON
    p.add_argument("--warm-first", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def _requests() -> tuple[Any, ...]:
    from kvtune.engine.traces import Request

    lengths = [64 + (i * 617) % 961 for i in range(32)]
    return tuple(Request(i, 0.0, n, 16) for i, n in enumerate(lengths))


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """A child: (optionally) warm the config ahead, then prime an engine on the GPU and count compilations."""
    import torch
    from triton import knobs

    from kvtune.cache_impl.config import HybridConfig
    from kvtune.engine.compiles import CompileWatch
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import load_model
    from kvtune.engine.scheduler import SchedulerConfig
    from kvtune.engine.warm import KernelWarmer, spec_for

    device = torch.device("cuda")
    config = json.loads(args.one)
    loaded = load_model(args.model, device=device, dtype=torch.bfloat16)
    scheduler = SchedulerConfig(clock="gated")
    out: dict[str, Any] = {"config": config, "ahead": args.warm_first}
    if args.warm_first:
        spec = spec_for(device, loaded.spec, "bfloat16", scheduler, [config])
        t0 = time.perf_counter()
        warmer = KernelWarmer(spec, processes=1)
        warmer.wait()
        out["warm_s"], out["warm"] = time.perf_counter() - t0, warmer.report()
    names: list[tuple[str, bool]] = []
    knobs.compilation.listener = lambda *, src, cache_hit, **_: names.append((src.fn.__name__, cache_hit))
    engine = Engine(loaded, HybridConfig.from_dict(config), int(args.budget_gib * 2**30), device, scheduler)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with CompileWatch() as watch:
        engine.replay(_requests(), 0.0, warmup_requests=4)
    torch.cuda.synchronize()
    out |= {
        "prime_s": time.perf_counter() - t0,
        "compile_s": watch.ms / 1e3,
        "calls": watch.count,
        "loaded": watch.loaded,
        "compiled_kernels": sorted({n for n, hit in names if not hit}),
        "loaded_kernels": sorted({n for n, hit in names if hit}),
    }
    return out


def _child(args: argparse.Namespace, config: dict[str, Any], warm_first: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvtune-triton-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        cmd = [sys.executable, __file__, "--model", args.model, "--budget-gib", str(args.budget_gib),
               "--one", json.dumps(config)] + (["--warm-first"] if warm_first else [])  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"warm_ahead.py: the measuring process for {config} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _args()
    if args.one is not None:
        print(json.dumps(_measure(args)))
        return
    import torch

    from kvtune.cache_impl.config import HybridConfig

    if not torch.cuda.is_available():
        raise SystemExit("warm_ahead.py: needs a CUDA GPU (each prime runs on it)")
    results, missed = [], []
    for pair in args.configs.split(","):
        bits, block = (int(x) for x in pair.split(":"))
        config = HybridConfig("hybrid_v2", args.hot, block, bits).to_dict()
        cold, ahead = _child(args, config, False), _child(args, config, True)
        results.append({"cold": cold, "ahead": ahead})
        misses = sorted(set(ahead["compiled_kernels"]) - MODEL_KERNELS)
        missed += misses
        c, a = cold, ahead
        print(
            f"INT{bits or 16} block {block}: prime {c['prime_s']:.2f} s cold ({c['compile_s']:.2f} s in "
            f"Triton, {c['calls'] - c['loaded']} compiled) -> {a['prime_s']:.2f} s ahead "
            f"({a['compile_s']:.2f} s, {a['calls'] - a['loaded']} compiled, {a['loaded']} loaded; "
            f"planning {a['warm_s']:.1f} s); "
            f"cache kernels still compiled: {misses or 'none'}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.check and missed:
        raise SystemExit(f"warm_ahead.py: compiled in the worker despite the planning: {sorted(set(missed))}")


if __name__ == "__main__":
    main()
