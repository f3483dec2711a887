"""Where a prompt's first layer spends the host's time: each prompt of a new length through the model's
prefill (the engine's eager path), the host time of every layer and of the calls inside it, layer 0 against
the rest.

A gated eager prefill leaked in its first segment (set-up and layer 0: 58 ms of host time against ~1.4 ms for
a later layer, run 29a), so something costs the host once per new prompt length. Each variant runs prompts of
lengths no other variant used (a per-shape cache would otherwise hide the cost): ``default`` (PyTorch's SDPA
backends as they are), ``no-cudnn`` (its cuDNN backend off), ``flash`` (FlashAttention only). A last pass
repeats the default variant's lengths (the per-shape cost, if any, gone). From the repository root on the GPU:

    python lab/scripts/first_layer.py [--model random:llama-3.1-8b] [--prompts 8]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtune.cache_impl import hybrid_cache as hc
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.engine import model as mdl
from kvtune.engine.engine import DEFAULT_BASELINE
from kvtune.engine.model import load_model

p = argparse.ArgumentParser()
p.add_argument("--model", default="random:llama-3.1-8b")
p.add_argument("--prompts", type=int, default=8)
p.add_argument("--device", default="cuda")
args = p.parse_args()

layer = [0]
host: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)  # (call, layer 0): host ms


def timed(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = inner(*a, **k)
        host[(label, layer[0] == 0)].append((time.perf_counter() - t) * 1000.0)
        return out

    setattr(owner, name, call)


timed(F, "scaled_dot_product_attention", "sdpa")
timed(F, "linear", "linear")
timed(F, "embedding", "embedding")
timed(mdl, "add_rms_norm", "add_rms_norm")
timed(mdl, "rope_qkv", "rope_qkv")
timed(mdl, "silu_mul", "silu_mul")
timed(mdl, "rope_cos_sin", "rope_cos_sin")
timed(hc, "seal_blocks", "seal_blocks")
timed(hc, "upload", "upload")
timed(HybridCache, "prefill", "HybridCache.prefill")

device = torch.device(args.device)
loaded = load_model(args.model, device, dtype=torch.bfloat16)
model = loaded.model
cache = HybridCache(DEFAULT_BASELINE, model.kv_shape, 4 << 30, device)
gen = torch.Generator().manual_seed(0)
seq_ids = iter(range(1 << 30))


def prefill(length: int) -> list[float]:
    """Host ms of each layer of one prompt's prefill (the device synchronized before and after)."""
    seq_id = next(seq_ids)
    ids = torch.randint(0, loaded.spec.vocab_size, (length,), generator=gen)
    cache.add_sequence(seq_id, ids.tolist())
    tokens = ids.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    marks = [time.perf_counter()]
    layer[0] = 0

    def between() -> None:
        marks.append(time.perf_counter())
        layer[0] += 1

    model.prefill(cache, seq_id, tokens, 0, True, between)
    marks.append(time.perf_counter())
    if device.type == "cuda":
        torch.cuda.synchronize()
    cache.free_sequence(seq_id)
    return [(b - a) * 1000.0 for a, b in itertools.pairwise(marks)]


n = args.prompts


def lengths(k: int) -> list[int]:
    """The k-th set of prompt lengths, none shared with another set."""
    return [300 + (37 * n + 5) * k + 37 * i for i in range(n)]


NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
variants: list[tuple[str, Callable[[], Any], list[int]]] = [
    ("default", nullcontext, lengths(0)),
    ("no-cudnn", lambda: sdpa_kernel(NO_CUDNN), lengths(1)),
    ("flash", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]), lengths(2)),
    ("default, lengths again", nullcontext, lengths(0)),
]
prefill(256)  # first calls of everything
for name, ctx, sizes in variants:
    host.clear()
    try:
        with ctx():
            layers = [prefill(t) for t in sizes]
    except RuntimeError as e:
        print(f"{name}: {str(e).splitlines()[0]}")
        continue
    first = statistics.median(t[0] for t in layers)
    rest = statistics.median(statistics.median(t[1:-1] or t[1:]) for t in layers)
    print(f"{name}: {n} prompts of {sizes[0]}-{sizes[-1]} tokens; host ms: layer 0 (+ set-up) "
          f"median {first:.2f} (max {max(t[0] for t in layers):.2f}), a later layer {rest:.2f}, "
          f"the whole prefill {statistics.median(sum(t) for t in layers):.1f}")  # fmt: skip
    for call in sorted({c for c, _ in host}):
        at0, later = host.get((call, True), []), host.get((call, False), [])
        cell0 = f"{statistics.median(at0):.3f} (max {max(at0):.2f}, {len(at0)})" if at0 else "-"
        cell1 = f"{statistics.median(later):.3f} (max {max(later):.2f}, {len(later)})" if later else "-"
        print(f"  {call:<22} layer 0 {cell0:<28} later {cell1}")
