"""One engine decode step, timed: host wall time, GPU kernel time and launches per step, eager and as graphs.

B sequences of L prompt tokens are prefilled into a hybrid cache, then the decode steps the engine runs are
timed on it, path after path (each continues the same sequences; a few hundred tokens on thousands):

* ``eager``: ``begin_step`` → ``model.decode`` → ``end_step`` → argmax to the host, every kernel launched
  from Python (the engine with ``--no-graphs``);
* ``graph``: the static step (:mod:`kvtune.engine.graphs`) as the engine runs it: ``prepare_step`` (host
  bookkeeping, one upload) → the seal graph when a zone fills → the forward's CUDA graph → ``finish_step`` →
  tokens copied to the host, read one step later: each step feeds its tokens on the device, so the host
  stages step t + 1 while the GPU runs step t; captured during the warm-up;
* ``graph_sync``: the same, but each step waits for its own tokens before the next is staged (the host's
  work then adds to the GPU's);
* ``torch`` (optional): eager with the PyTorch references for every operation but attention.

Every step's tokens reach the host (as in the engine), so the wall time per step includes the host's work
wherever it does not overlap the GPU's; a graph first needed inside the timed steps (a table-width bucket
reached there) is captured there, and its capture time is left out of the wall time, as the engine leaves it
out of a replay's clock. The first config is measured once, unreported, before the reported runs
(``--prime``): a process's first measured steps run slower whatever the config (seen on an H200). GPU ms: for
the graph paths, CUDA events around each step's seal and forward replays (the device time of the step, idle
gaps before it excluded), averaged over the timed steps; for eager, the sum of the step's kernel times
(profiler, 3 steps). Kernel ms: that profiler sum for every path (the profiler's view of a graph replay is
approximate); launches are the host's kernel and graph launch calls per step. Ratios: wall / GPU per path, and
each config's wall time against the first config's (unquantized) for the same path.

    python benchmarks/decode_step.py --shape llama-3.1-8b --batch 32 --context 8192
    python benchmarks/decode_step.py --shape smollm2-135m --batch 64 --context 2048 --json step.json

Without configs: unquantized, INT8, INT4 and INT8 with a sparse tier (examples/configs). ``--host-profile
DIR`` also writes, per config and path, the functions where the host spends its time (cProfile, 5 steps).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.cache_impl.tiers import Migrations
from kvtune.engine.engine import l2_share
from kvtune.engine.graphs import DecodeGraphs
from kvtune.engine.model import LoadedModel, load_model
from kvtune.kernels import decode_attention
from kvtune.kernels.backend import HAS_TRITON, kernel_choice
from kvtune.kernels.sparse_table import L2

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
DEFAULT_CONFIGS = ("q_unquantized", "q_int8", "q_int4", "q_int8_sparse512_fast")
LAUNCH_CALLS = ("LaunchKernel", "GraphLaunch")  # host API calls that start device work (memcpy counted apart)


@contextmanager
def kernels_choice(choice: str) -> Iterator[None]:
    """``KVTUNE_KERNELS=choice``, but attention always takes its Triton kernel."""
    old = os.environ.get("KVTUNE_KERNELS")
    os.environ["KVTUNE_KERNELS"] = choice
    kernel_choice.cache_clear()  # the backend is read once per process
    triton_attention = decode_attention.use_triton
    decode_attention.use_triton = lambda t: t.is_cuda and HAS_TRITON  # type: ignore[assignment]
    try:
        yield
    finally:
        decode_attention.use_triton = triton_attention  # type: ignore[assignment]
        if old is None:
            del os.environ["KVTUNE_KERNELS"]
        else:
            os.environ["KVTUNE_KERNELS"] = old
        kernel_choice.cache_clear()


def held(config: HybridConfig, hold: bool) -> HybridConfig:
    """``config`` without tier planning in a benchmark's steps (``--hold-tiers``), for a sparse config."""
    return replace(config, migration_interval=10**6) if hold and config.sparse_top_k else config


def prefilled(
    loaded: LoadedModel, config: HybridConfig, batch: int, length: int, seed: int, fast: bool
) -> HybridCache:
    """``batch`` sequences of ``length`` random tokens in a fresh cache: prefilled by the model, or (``fast``,
    for random weights, where K/V contents do not matter to a step's time) by the cache alone from random
    q/k/v, which skips the model's projections."""
    model, dev = loaded.model, loaded.model.device
    s = model.kv_shape
    # room for 1,024 more tokens a sequence, at the config's own bytes a token: a quantized cache's pool is
    # as big as its sequences need, so INT8 and INT4 fit shapes whose unquantized cache does not
    budget = int(kv_bytes_for(config, s, [length + 1024] * batch) * 1.05)
    cache = HybridCache(config, s, budget, dev, max_seqs=batch)
    gen = torch.Generator().manual_seed(seed)
    for seq in range(batch):
        ids = torch.randint(0, loaded.spec.vocab_size, (length,), generator=gen)
        cache.add_sequence(seq, ids.tolist())
        if not fast:
            model.prefill(cache, seq, ids.to(dev), 0, last_only=True)
            continue
        q = torch.randn((length, s.num_q_heads, s.head_dim), dtype=s.dtype, device=dev)
        k = torch.randn((length, s.num_kv_heads, s.head_dim), dtype=s.dtype, device=dev)
        for layer in range(s.num_layers):
            cache.prefill(layer, seq, q, k, k)
    return cache


class Stepper:
    """One path's decode step on a prefilled cache; ``step(t)`` runs step ``t`` (a virtual 50 ms each, as
    quality runs) and brings its tokens to the host."""

    def __init__(self, loaded: LoadedModel, cache: HybridCache, batch: int, path: str, max_len: int) -> None:
        self.loaded, self.cache, self.batch, self.path = loaded, cache, batch, path
        self.slots = np.asarray([cache.slot_of(s) for s in range(batch)], dtype=np.int64)
        self.graphs: DecodeGraphs | None = None
        self.cuda = cache.device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []  # (start, end) of each graph step's device work
        self._pending: tuple[torch.Tensor, Any] | None = None
        if path in ("graph", "graph_sync"):
            blocks = min(cache.layout.num_blocks, cache.layout.blocks_for(max_len))
            self.graphs = DecodeGraphs(loaded.model, cache, batch, blocks, capture=self.cuda, padded=True)

    def step(self, t: int) -> None:
        now, dev = 50.0 * t, self.loaded.model.device
        if self.graphs is not None:
            # after the first step, every row feeds the token its previous step left on the device
            fed = -1 if self._pending is not None else 7
            info = self.graphs.prepare(self.slots, np.full(self.batch, fed, dtype=np.int64), now)
            start = torch.cuda.Event(enable_timing=True) if self.cuda else None
            if start is not None:
                start.record()
            self.graphs.run(info)
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((start, end))
            self.cache.finish_step(info)
            tokens = self.graphs.tokens_to_host(info)
            self.land()
            self._pending = tokens
            if self.path == "graph_sync":
                self.land()
            return
        positions = torch.as_tensor(self.cache.lengths(self.slots), device=dev)
        plan = self.cache.begin_step(list(range(self.batch)), now_ms=now)
        tokens = torch.full((self.batch,), 7, dtype=torch.long, device=dev)
        logits = self.loaded.model.decode(self.cache, plan, tokens, positions)
        self.cache.end_step(plan)
        logits.argmax(-1).tolist()

    def land(self) -> None:
        """The tokens of the step in flight reach the host (the engine's ``_land``)."""
        if self._pending is not None:
            host, ready = self._pending
            if ready is not None:
                ready.synchronize()
            host.tolist()

    def device_ms(self) -> float | None:
        """Mean device time of the graph steps timed since the last call (all completed)."""
        if not self.events:
            return None
        ms = sum(a.elapsed_time(b) for a, b in self.events) / len(self.events)
        self.events.clear()
        return float(ms)


def demote_oldest(cache: HybridCache, batch: int, l1_share: float) -> None:
    """Every layer's cold blocks of each sequence but the newest ``l1_share`` of them into L2, through the
    cache's own migration (an 8-bit pool re-quantizes them to 4 bits), as decode_attention.py sets the
    sparse tier up. The engine's access rule keeps a block in L1 while its attention mass is above its
    row's mean, which random weights spread evenly, so without this a sparse config's step reads every
    block and measures only its machinery (run 21b: no block in L2 after 126 steps)."""
    blocks = []
    for seq in range(batch):
        owned = list(cache._seqs[seq].blocks)
        keep = math.ceil(len(owned) * l1_share)
        blocks.extend(owned[: len(owned) - keep])
    if not blocks:
        return
    ids = np.asarray(sorted(set(blocks)), dtype=np.int64)
    layers = cache.shape.num_layers
    todo = Migrations(
        np.repeat(np.arange(layers), len(ids)), np.tile(ids, layers), np.full(layers * len(ids), L2)
    )
    cache.tiers.apply(todo, cache.pools)


def config_name(config: HybridConfig) -> str:
    return f"q{config.quantization_bits}-hot{config.hot_tokens}-bs{config.block_size}-k{config.sparse_top_k}"


def host_profile(path: Path, run: Callable[[int], None], t0: int) -> None:
    """Where the host's time goes: cProfile over 5 steps, the 40 functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    for t in range(5):
        run(t0 + t)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())


def measure(stepper: Stepper, config: HybridConfig, args: argparse.Namespace, t0: int) -> dict:
    """Warm-up (one seal cycle by default: every kernel compiled, every graph of these shapes captured),
    then the timed steps, then 3 profiled steps."""
    cuda = stepper.cache.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    warmup = config.hot_tokens + config.block_size if args.warmup is None else args.warmup
    for t in range(warmup):
        stepper.step(t0 + t)
    stepper.land()
    sync()
    stepper.events.clear()
    t0 += warmup
    if config.sparse_top_k and args.l1_share < 1:
        demote_oldest(stepper.cache, stepper.batch, args.l1_share)
    l2_timed = l2_share(stepper.cache) or 0.0
    graphs = stepper.graphs
    if graphs is not None:
        graphs.take_capture_ms()
    captures = graphs.captures if graphs is not None else 0
    start = time.perf_counter()
    for t in range(args.steps):
        stepper.step(t0 + t)
    stepper.land()
    sync()
    # a table-width bucket first reached inside the timed steps is captured there: its capture is left
    # out of the wall time, as the engine leaves it out of a replay's clock
    captured_ms = graphs.take_capture_ms() if graphs is not None else 0.0
    wall = ((time.perf_counter() - start) * 1000 - captured_ms) / args.steps
    device_ms = stepper.device_ms()
    l2_timed_end = l2_share(stepper.cache) or 0.0
    t0 += args.steps
    if config.sparse_top_k and config.migration_interval <= 1000:  # a planning step among the profiled
        while (stepper.cache.stats()["steps"] + 2) % config.migration_interval:
            stepper.step(t0)
            t0 += 1
        stepper.land()
        sync()
    plans_before = stepper.cache.counters["plans"]
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for t in range(3):
            stepper.step(t0 + t)
        stepper.land()
        sync()
    stepper.events.clear()
    plans_after = stepper.cache.counters["plans"]
    t0 += 3
    if args.host_profile is not None:
        name = f"{config_name(config)}-{stepper.path}.txt"
        host_profile(args.host_profile / name, stepper.step, t0)
        t0 += 5
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.device_time for e in kernels) / 3000
    else:  # a CPU run counts the top-level operators instead of kernels
        kernels = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
        kernel_ms = 0.0
    launched = [e for e in events if any(c in e.name for c in LAUNCH_CALLS)]
    launches = len(launched)
    # what launched them: the operator (or the graph launch itself) directly above each launch call
    by_op: dict[str, int] = {}
    for e in launched:
        name = e.cpu_parent.name if e.cpu_parent is not None else e.name
        by_op[name] = by_op.get(name, 0) + 1
    gpu_ms = device_ms if device_ms is not None else kernel_ms
    return {
        "wall_ms": wall,
        "gpu_ms": gpu_ms,
        "kernel_ms": kernel_ms,
        "wall_over_gpu": wall / gpu_ms if gpu_ms > 0 else None,
        "kernels": len(kernels) / 3,
        "launches": launches / 3,
        "launches_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),  # over the 3 profiled steps
        "tier_plans_profiled": plans_after - plans_before,  # tier planning steps among the 3 profiled
        "l2_share": l2_timed,  # of the blocks in use, every layer, when the timed steps start
        "l2_share_timed_end": l2_timed_end,  # ... when they end (planning promotes what is read)
        "l2_share_after": l2_share(stepper.cache) or 0.0,  # ... after the profiled steps
        "captures": graphs.captures if graphs is not None else 0,
        "captures_timed": (graphs.captures if graphs is not None else 0) - captures,  # left out of wall_ms
        "captured_ms_timed": captured_ms,
        "next_t": t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "configs", nargs="*", type=Path, help=f"config JSONs (default: {', '.join(DEFAULT_CONFIGS)})"
    )
    p.add_argument("--model", default=None, help="a model name (default: random:<--shape>)")
    p.add_argument(
        "--shape", default="smollm2-135m", help="random weights of this shape (default smollm2-135m)"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", "--length", dest="length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default hot_tokens + block_size)")
    p.add_argument("--paths", default="eager,graph", help="comma-separated: eager, graph, graph_sync, torch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--host-profile", type=Path, default=None, help="folder for cProfile reports of the host")
    p.add_argument(
        "--l1-share",
        type=float,
        default=0.125,
        help="sparse configs: the newest share of each sequence's cold blocks left in L1 before the timed "
        "steps, the rest demoted to L2 (default 1/8, as decode_attention.py; 1: as the access rule leaves "
        "them)",
    )
    p.add_argument(
        "--prime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the first config once, unreported, before the reported runs (default on)",
    )
    p.add_argument(
        "--hold-tiers",
        action="store_true",
        help="sparse configs: no tier planning in the measured steps (migration_interval 10^6), so they run "
        "at the L2 share --l1-share set up; the planning and queue still run inside each step",
    )
    args = p.parse_args()
    if not 0 <= args.l1_share <= 1:
        p.error(f"--l1-share: expected a share in [0, 1], got {args.l1_share}")
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not set(paths) <= {"eager", "graph", "graph_sync", "torch"}:
        p.error(f"--paths: expected eager, graph, graph_sync or torch, got {paths}")
    configs = args.configs or [CONFIGS / f"{c}.json" for c in DEFAULT_CONFIGS]
    model = args.model or f"random:{args.shape}"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loaded = load_model(model, args.device, dtype, args.seed)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name} · {model} {dtype} · {args.batch} sequences × {args.length} tokens · paths {paths}")
    header = f"{'config':<26} {'path':>10} {'ms/step':>8} {'GPU ms':>7} {'wall/GPU':>8} {'kernel ms':>9}"
    print(header + f" {'kernels':>8} {'launches':>8} {'vs first':>8}")
    rows: list[dict] = []
    first: dict[str, float] = {}
    max_len = args.length + 2048  # room for every path's steps
    if args.prime:  # a process's first measured steps run slower (seen on an H200): spend them unmeasured
        config = held(HybridConfig.from_json_file(configs[0]), args.hold_tiers)
        cache = prefilled(loaded, config, args.batch, args.length, args.seed, model.startswith("random:"))
        for choice in paths:
            with kernels_choice("torch" if choice == "torch" else "triton"):
                kind = "eager" if choice == "torch" else choice
                stepper = Stepper(loaded, cache, args.batch, kind, max_len)
                measure(stepper, config, argparse.Namespace(**{**vars(args), "host_profile": None}), 0)
        del cache, stepper  # the stepper's graphs hold the cache: both go before the next one is made
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for path in configs:
        config = held(HybridConfig.from_json_file(path), args.hold_tiers)
        cache = prefilled(loaded, config, args.batch, args.length, args.seed, model.startswith("random:"))
        t0, res = 0, {}
        for choice in paths:
            with kernels_choice("torch" if choice == "torch" else "triton"):
                stepper = Stepper(
                    loaded, cache, args.batch, "eager" if choice == "torch" else choice, max_len
                )
                r = measure(stepper, config, args, t0)
            t0 = r.pop("next_t")
            first.setdefault(choice, r["wall_ms"])
            r["vs_first"] = r["wall_ms"] / first[choice]
            res[choice] = r
            rows.append({"config": path.stem, "path": choice, **r})
            ratio = f"{r['wall_over_gpu']:.2f}" if r["wall_over_gpu"] else "n/a"
            cells = f"{r['wall_ms']:>8.2f} {r['gpu_ms']:>7.2f} {ratio:>8} {r['kernel_ms']:>9.2f}"
            print(
                f"{path.stem:<26} {choice:>10} {cells} {r['kernels']:>8.0f} {r['launches']:>8.0f} "
                f"{r['vs_first']:>7.2f}×",
                flush=True,
            )
        if "eager" in res and "graph" in res:
            speedup = res["eager"]["wall_ms"] / res["graph"]["wall_ms"]
            print(f"{'':<26} speed-up of the graph step {speedup:.2f}×")
        del cache, stepper
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        meta = {"device": name, "torch": torch.__version__, "model": model, **vars(args)}
        meta["configs"] = [str(c) for c in configs]
        meta.pop("json")
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
