"""The host time of a prompt's first layer's big calls at a token count the process has not met before,
against the same calls at a count it has: the four GEMMs of a Llama-3.1-8B layer (bf16, token count x
hidden) and the prompt's causal attention (the cache's prefill backends), each timed on the host without
synchronizing, in the order of the unloaded replay's prompts (``gate_syncs.py``'s "every prompt in
order"), then again.

A first call that takes milliseconds where a repeat takes microseconds is the host's set-up of a kernel the
process had not used (CUDA's lazy module loading, a library's plan), not the device's work. From the
repository root on the GPU (``CUDA_MODULE_LOADING=EAGER`` loads every module at the start instead):

    python lab/scripts/first_calls.py [--warm-ladder 16]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kvtune.cache_impl.hybrid_cache import PREFILL_SDPA_BACKENDS

# the 97 prompt token counts of gate_syncs.py's unloaded replay (Azure later window, 0.25x), in its order
REPLAY = (
    "287 270 221 42 274 250 98 1020 271 266 268 243 275 245 264 270 268 96 20 103 257 286 248 212 285 265 "
    "338 42 448 10 102 266 45 328 45 41 1 328 264 244 304 264 238 308 329 276 222 281 274 270 268 287 53 103 "
    "95 630 248 276 279 287 32 255 270 276 287 100 282 192 268 23 230 328 262 262 295 48 266 52 271 254 240 "
    "23 84 224 251 48 250 238 1021 51 245 23 107 220 1022 53 287"
)

p = argparse.ArgumentParser()
p.add_argument("--lengths", default=REPLAY, help="token counts in order (space-separated)")
p.add_argument("--warm-ladder", type=int, default=0, help="first run every call at 1, then every multiple of "
               "this up to the longest count (0: no warm-up)")  # fmt: skip
p.add_argument("--spike-ms", type=float, default=2.0)
args = p.parse_args()
lengths = [int(x) for x in args.lengths.split()]
dev, bf = torch.device("cuda"), torch.bfloat16
hidden, heads, kv_heads, head_dim, ffn = 4096, 32, 8, 128, 14336
g = torch.Generator(device=dev).manual_seed(0)
weights = {
    "qkv": torch.randn((heads + 2 * kv_heads) * head_dim, hidden, device=dev, dtype=bf, generator=g) * 0.02,
    "o": torch.randn(hidden, heads * head_dim, device=dev, dtype=bf, generator=g) * 0.02,
    "gate_up": torch.randn(2 * ffn, hidden, device=dev, dtype=bf, generator=g) * 0.02,
    "down": torch.randn(hidden, ffn, device=dev, dtype=bf, generator=g) * 0.02,
}
inputs = {t: torch.randn(t, ffn, device=dev, dtype=bf, generator=g) for t in sorted(set(lengths))}


def calls(t: int) -> dict[str, float]:
    """Each call's host ms at ``t`` tokens (queued, not waited for)."""
    x, ms = inputs[t], {}
    for name, w in weights.items():
        a = x[:, : w.shape[1]]
        t0 = time.perf_counter()
        F.linear(a, w)
        ms[name] = (time.perf_counter() - t0) * 1000
    q = x[:, : heads * head_dim].view(t, heads, head_dim).transpose(0, 1)[None]
    kv = x[:, : kv_heads * head_dim].view(t, kv_heads, head_dim).transpose(0, 1)[None]
    t0 = time.perf_counter()
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    ms["attention"] = (time.perf_counter() - t0) * 1000
    return ms


torch.cuda.synchronize()
if args.warm_ladder:
    t0 = time.perf_counter()
    for t in [1, *range(args.warm_ladder, max(lengths) + args.warm_ladder, args.warm_ladder)]:
        inputs.setdefault(t, torch.randn(t, ffn, device=dev, dtype=bf, generator=g))
        calls(t)
    torch.cuda.synchronize()
    print(f"warm ladder every {args.warm_ladder} tokens: {(time.perf_counter() - t0) * 1000:.0f} ms")
for rnd in ("first pass", "second pass"):
    seen: set[int] = set()
    spikes: dict[str, list[int]] = collections.defaultdict(list)
    host: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
    slow: list[tuple[int, float]] = []
    for t in lengths:
        ms = calls(t)
        torch.cuda.synchronize()
        for name, v in ms.items():
            host[(name, t in seen)].append(v)
            if v > args.spike_ms:
                spikes[name].append(t)
        slow.append((t, sum(ms.values())))
        seen.add(t)
    print(f"{rnd}: {len(lengths)} prompts, {len(seen)} distinct token counts")
    for name in ("qkv", "o", "gate_up", "down", "attention"):
        cells = []
        for before in (False, True):
            v = sorted(host[(name, before)])
            cells.append(
                f"{'seen' if before else 'new'} {v[len(v) // 2]:.3f}/{v[-1]:.1f} ms ({len(v)})" if v else "-"
            )
        print(f"  {name:<9} median/max host ms: {cells[0]:<28} {cells[1]:<28} > {args.spike_ms} ms at: "
              f"{' '.join(map(str, spikes[name])) or 'none'}")  # fmt: skip
    total = sorted(v for _, v in slow)
    print(f"  a layer's five calls: median {total[len(total) // 2]:.2f} ms, "
          f"{sum(v > 10 for v in total)} prompts over 10 ms: "
          + " ".join(f"{t}:{v:.0f}" for t, v in slow if v > 10))  # fmt: skip
