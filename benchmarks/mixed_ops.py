"""Launches per mixed iteration, counted with the PyTorch profiler on a CPU: where the host's work goes.

A cache holds ``--decode`` sequences that decode and ``--chunks`` prompts in flight: half of them start
(no token cached yet), half continue (a chunk already cached). One mixed iteration is what the engine runs
when prompt chunks share the forward with the decode rows: ``begin_step_slots`` → ``forward_mixed`` (decode
rows through ``cache.decode``, each chunk through the cache's prefill) → ``argmax`` → ``end_step``. It is run
once unmeasured (allocations, first calls), then once under the profiler; printed: what would launch device
work, in all, per layer and the most frequent: each call of a kernel function (``kvtune.kernels``: a Triton
kernel on a GPU, its PyTorch reference on a CPU, counted as one) and each top-level operator outside them
that is not a view or a no-op conversion.

    python benchmarks/mixed_ops.py examples/configs/q_int8.json --decode 16 --chunks 4 --chunk 64
    python benchmarks/mixed_ops.py examples/configs/q_int8.json --decode 16 --chunks 4 --chunk 64 --piecewise

``--mixed-graphs``: the iteration as the engine's mixed graphs run it (``kvtune.engine.mixed_graphs``).

``--host N`` times instead where the host's time goes, on the device given (a GPU's host is what the capacity
probes wait for): N iterations, each from an idle device, the host's launch time (from the step's plan to its
last enqueued op, before the tokens are read back) and the whole iteration's wall, in all and per layer; then
one more under ``cProfile``, its 25 costliest functions by their own time, then kvtune's and Triton's
launchers' 40 costliest by cumulative time.

    python benchmarks/mixed_ops.py examples/configs/q_int8.json --model random:llama-3.1-8b --device cuda \
        --dtype bfloat16 --host 20 [--piecewise | --mixed-graphs]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import pstats
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.engine.graphs import DecodeGraphs
from kvtune.engine.mixed_graphs import MixedGraphs
from kvtune.engine.model import load_model
from kvtune.engine.options import DTYPES
from kvtune.engine.piecewise import PiecewiseForward

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", type=Path, default=CONFIGS / "q_int8.json")
    p.add_argument("--model", default="random:tiny", help="the count per layer does not depend on the shape")
    p.add_argument("--decode", type=int, default=16, help="sequences that decode in the iteration")
    p.add_argument("--chunks", type=int, default=4, help="prompt chunks in the iteration")
    p.add_argument("--chunk", type=int, default=64, help="tokens per chunk")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of the decoding sequences")
    p.add_argument(
        "--piecewise",
        action="store_true",
        help="the dense parts as pieces (kvtune.engine.piecewise), each piece counted as one graph launch",
    )
    p.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="the whole iteration as the engine's mixed graphs run it (kvtune.engine.mixed_graphs): one "
        "graph replay where the host is timed on a GPU; counted, the operators that graph holds",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument(
        "--host",
        type=int,
        default=0,
        metavar="N",
        help="instead of counting launches: time N iterations' host launch time and wall, then profile one",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.mixed_graphs and args.chunks < 1:
        p.error("--mixed-graphs: an iteration of at least one chunk (--chunks >= 1)")
    return args


class Scene:
    """A cache with ``decode`` ready sequences and ``chunks`` prompts, half of them one chunk in."""

    def __init__(self, loaded: Any, config: HybridConfig, args: argparse.Namespace) -> None:
        self.model, self.args = loaded.model, args
        self.device = torch.device(args.device)
        prompt = 2 * args.chunk
        lengths = [args.context + 64] * args.decode + [prompt + 64] * (2 * args.chunks)
        budget = 2 * kv_bytes_for(config, self.model.kv_shape, lengths)
        self.cache = HybridCache(config, self.model.kv_shape, budget, self.device, max_seqs=len(lengths))
        self.gen = torch.Generator().manual_seed(0)
        self.next_id = 0
        vocab = loaded.spec.vocab_size
        self.vocab = vocab
        self.decoding = [self._add(args.context, prefill=args.context) for _ in range(args.decode)]
        self.slots = np.asarray([self.cache.slot_of(i) for i in self.decoding], dtype=np.int64)
        self.pieces = None
        if args.piecewise:  # replayed as graphs where the host is timed on a GPU, run directly where counted
            capture = bool(args.host) and self.device.type == "cuda"
            self.pieces = PiecewiseForward(self.model, 2048, capture=capture)
            self.pieces.capture_all()
        self.mixed = None
        if args.mixed_graphs:  # captured where the host is timed on a GPU, run directly where counted
            capture = bool(args.host) and self.device.type == "cuda"
            blocks = self.cache.layout.blocks_for(args.context + 128)
            decode = DecodeGraphs(self.model, self.cache, max(1, args.decode), blocks, capture, padded=True)
            pieces = self.pieces or PiecewiseForward(self.model, 2048, capture=False)
            self.mixed = MixedGraphs(self.model, self.cache, decode, pieces, args.chunks, 8192, capture)

    def _add(self, n: int, prefill: int) -> int:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        ids = torch.randint(0, self.vocab, (n,), generator=self.gen)
        self.cache.add_sequence(seq_id, ids.tolist(), now_ms=0.0)
        if prefill:
            self.model.prefill(self.cache, seq_id, ids[:prefill].to(self.device), 0, last_only=True)
        return seq_id

    def chunks(self) -> list[tuple[int, int, int]]:
        """(seq_id, start position, tokens) of the iteration's chunks: fresh prompts, half one chunk in."""
        c, out = self.args.chunk, []
        for j in range(self.args.chunks):
            started = j % 2 == 1
            seq_id = self._add(2 * c, prefill=c if started else 0)
            out.append((seq_id, c if started else 0, c))
        return out

    def release(self, chunks: list[tuple[int, int, int]]) -> None:
        """Free the chunks' sequences (so that iterations can repeat within the budget)."""
        for seq_id, _, _ in chunks:
            self.cache.free_sequence(seq_id)

    def iteration(self, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """One mixed iteration as the engine runs it (``Engine._forward``)."""
        return self.launch(chunks).cpu()

    def launch(self, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """The iteration's work enqueued; its tokens on the device (not yet read)."""
        cache, b = self.cache, len(self.slots)
        ids = [np.full(b, 3, dtype=np.int64)] + [np.full(n, 5, dtype=np.int64) for _, _, n in chunks]
        positions = [cache.lengths(self.slots)] + [np.arange(s, s + n) for _, s, n in chunks]
        segments = [(seq_id, n) for seq_id, _, n in chunks]
        if self.mixed is not None:  # as Engine._graph_forward
            chunk_ids, chunk_positions = np.concatenate(ids[1:]), np.concatenate(positions[1:])
            info = self.mixed.prepare(
                self.slots, ids[0], positions[0], segments, chunk_ids, chunk_positions, 1.0
            )
            tokens = self.mixed.run(info)
            self.mixed.finish(info)
            return tokens
        plan = cache.begin_step_slots(self.slots, 1.0)
        inputs = torch.from_numpy(np.stack([np.concatenate(ids), np.concatenate(positions)]))
        inputs = inputs.to(self.device)
        logits = self.model.forward_mixed(cache, plan, inputs[0], inputs[1], b, segments, pieces=self.pieces)
        tokens = logits.argmax(dim=-1)
        cache.end_step(plan)
        return tokens


# functions of kvtune.kernels the cache and the model call that are one Triton kernel (or a few) each on a GPU
# and their PyTorch references on a CPU: each call counts as one unit, whatever its reference runs
# (dequantize_blocks is not one of them: it runs its reference on a GPU too, so its operators count)
KERNELS = {
    "kvtune.cache_impl.hybrid_cache": (
        "update_access", "hybrid_decode_attention", "seal_blocks", "requantize_int4",
        "sparse_block_table_parts",
        "chunks_attention",  # one FlashAttention call on a GPU; chunk by chunk on a CPU
        "pack_kv", "hot_write",
    ),
    "kvtune.engine.model": ("add_rms_norm", "rope_qkv", "silu_mul"),
    # the final norm (eager); the pieces' own where they run uncaptured (the mixed graphs' function)
    "kvtune.engine.piecewise": ("add_rms_norm", "rope_qkv", "silu_mul"),
    "kvtune.engine.mixed_graphs": ("add_rms_norm",),  # the final norm
}  # fmt: skip
# operators that launch nothing (views, metadata, allocation)
NO_LAUNCH = {
    "aten::view", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::transpose",
    "aten::t", "aten::permute", "aten::expand", "aten::reshape", "aten::flatten", "aten::as_strided",
    "aten::chunk", "aten::split", "aten::narrow", "aten::alias", "aten::detach", "aten::empty",
    "aten::empty_like", "aten::lift_fresh", "aten::_reshape_alias", "aten::unbind", "aten::view_as",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty_strided", "aten::result_type",
}  # fmt: skip


@contextmanager
def kernels_marked() -> Iterator[None]:
    """Each kernel function runs inside a ``kernel::<name>`` profiler range (restored on exit)."""
    saved = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name)
            saved.append((module, name, fn))
            setattr(module, name, _marked(name, fn))
    saved.append((PiecewiseForward, "_piece", PiecewiseForward._piece))  # a graph replay on a GPU
    PiecewiseForward._piece = _marked("piece", PiecewiseForward._piece)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"kernel::{name}"):
            return fn(*args, **kwargs)

    return call


def _launches(event: Any) -> str | None:
    """What a profiler event counts as: a kernel call, an operator that launches work, or nothing (inside
    another counted event, a view, a conversion to the same dtype)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "kernel::")):
            return None
        parent = parent.cpu_parent
    if event.name.startswith("kernel::"):
        return event.name
    if not event.name.startswith("aten::") or event.name in NO_LAUNCH:
        return None
    if event.name in ("aten::to", "aten::contiguous", "aten::clone") and not event.cpu_children:
        return None  # no copy made
    return event.name


def count_ops(scene: Scene) -> Counter[str]:
    """Operators and kernel calls of one profiled mixed iteration (after one unmeasured)."""
    with kernels_marked():
        scene.iteration(scene.chunks())
        chunks = scene.chunks()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            scene.iteration(chunks)
    return Counter(name for e in prof.events() if (name := _launches(e)) is not None)


def host_times(scene: Scene, n: int) -> dict[str, Any]:
    """``n`` iterations after two unmeasured, each from an idle device: the host's launch time and the
    iteration's wall (ms); then one under cProfile (its stats, as text)."""
    sync = torch.cuda.synchronize if scene.device.type == "cuda" else (lambda: None)
    for _ in range(2):
        chunks = scene.chunks()
        scene.iteration(chunks)
        scene.release(chunks)
    launch, wall = [], []
    for _ in range(n):
        chunks = scene.chunks()
        sync()
        t0 = time.perf_counter()
        tokens = scene.launch(chunks)
        t1 = time.perf_counter()
        tokens.cpu()
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        scene.release(chunks)
    chunks = scene.chunks()
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    scene.iteration(chunks)
    profiler.disable()
    scene.release(chunks)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    text.write("kvtune's and the launchers' functions by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(r"kvtune|jit\.py|driver\.py", 40)
    return {"launch_ms": launch, "wall_ms": wall, "profile": text.getvalue()}


def main() -> None:
    args = _args()
    loaded = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    config = HybridConfig.from_json_file(args.config)
    if args.host:
        with torch.inference_mode():
            host = host_times(Scene(loaded, config, args), args.host)
        layers = loaded.spec.num_layers
        launch, wall = statistics.median(host["launch_ms"]), statistics.median(host["wall_ms"])
        pieces = " (one graph)" if args.mixed_graphs else " (pieces)" if args.piecewise else ""
        print(
            f"{args.model} · {args.config.stem} · {args.decode} decode rows + {args.chunks} chunks of "
            f"{args.chunk} on {args.device}{pieces}: host launch {launch:.2f} ms "
            f"({1e3 * launch / layers:.0f} us a layer), wall {wall:.2f} ms (medians of {args.host}; launch "
            f"{min(host['launch_ms']):.2f}-{max(host['launch_ms']):.2f} ms)"
        )
        print(host["profile"])
        if args.json:
            args.json.write_text(json.dumps(host | {"layers": layers}, indent=1))
        return
    with torch.inference_mode():
        ops = count_ops(Scene(loaded, config, args))
    layers = loaded.spec.num_layers
    total = sum(ops.values())
    print(
        f"{args.model} · {args.config.stem} · {args.decode} decode rows + {args.chunks} chunks of "
        f"{args.chunk}: "
        f"{total} launches per mixed iteration, {total / layers:.1f} per layer"
    )
    for name, n in ops.most_common(args.top):
        print(f"  {name:<40} {n:>6} ({n / layers:.1f} per layer)")
    if args.json:
        args.json.write_text(json.dumps({"total": total, "layers": layers, "ops": dict(ops)}, indent=1))


if __name__ == "__main__":
    main()
