"""Attention-output error of the hybrid cache on K/V of a real model (SmolLM2-135M, real text).

The unquantized cache drives the model; every layer's decode call is also sent, with the very same q/k/v,
to an INT8 and an INT4 cache that saw the same prefill. So each layer's error is the cache's own (no
propagation from earlier layers). Prints, per config, the mean over decode steps, layers and rows of
``‖out − out_unquantized‖ / ‖out_unquantized‖`` and the worst layer.

    python benchmarks/kv_error_real.py [--tokens 2048] [--steps 64] [--text FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.engine.model import load_model

SEQ = 0
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "examples" / "text" / "wikitext2_excerpt.txt"


class TeeCache:
    """Forwards to ``main``; sends the same calls to ``others`` and records their decode errors per layer."""

    def __init__(self, main: HybridCache, others: dict[str, HybridCache]) -> None:
        self.main, self.others = main, others
        self.errors: dict[str, dict[int, list[float]]] = {name: {} for name in others}
        self.plans: dict[str, object] = {}

    def prefill(self, layer: int, seq_id: int, q, k, v):  # type: ignore[no-untyped-def]
        for cache in self.others.values():
            cache.prefill(layer, seq_id, q, k, v)
        return self.main.prefill(layer, seq_id, q, k, v)

    def decode(self, layer: int, plan, q, k, v):  # type: ignore[no-untyped-def]
        out = self.main.decode(layer, plan, q, k, v)
        for name, cache in self.others.items():
            other = cache.decode(layer, self.plans[name], q, k, v)
            err = (other.float() - out.float()).norm(dim=-1) / out.float().norm(dim=-1)
            self.errors[name].setdefault(layer, []).extend(err.flatten().tolist())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    args = parser.parse_args()
    loaded = load_model("smollm2")
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens + args.steps]
    base = HybridConfig.from_dict(
        {"kv_cache_strategy": "hybrid_v2", "hot_tokens": 32, "block_size": 64, "quantization_bits": 0}
    )
    budget = 1 << 30
    shape = loaded.model.kv_shape
    make = lambda bits: HybridCache(base.replace(quantization_bits=bits), shape, budget, "cpu", 1)
    tee = TeeCache(make(0), {"int8": make(8), "int4": make(4)})
    for cache in (tee.main, *tee.others.values()):
        cache.add_sequence(SEQ, ids[: args.tokens], now_ms=0.0)
    with torch.no_grad():
        loaded.model.prefill(tee, SEQ, torch.tensor(ids[: args.tokens]), 0, last_only=True)
        for step in range(args.steps):
            pos = args.tokens + step
            now = 50.0 * step
            plan = tee.main.begin_step([SEQ], now)
            tee.plans = {n: c.begin_step([SEQ], now) for n, c in tee.others.items()}
            loaded.model.decode(tee, plan, torch.tensor([ids[pos]]), torch.tensor([pos]))
            tee.main.end_step(plan)
            for name, cache in tee.others.items():
                cache.end_step(tee.plans[name])  # type: ignore[arg-type]
    print(f"SmolLM2-135M (GGUF Q4_1), {args.text.name}, prefill {args.tokens}, {args.steps} decode steps,")
    print("hot_tokens 32, block_size 64; per-layer attention-output relative error vs the unquantized cache:")
    for name, per_layer in tee.errors.items():
        means = {layer: statistics.fmean(v) for layer, v in per_layer.items()}
        worst = max(means, key=means.__getitem__)
        mean = statistics.fmean(means.values())
        print(f"  {name}: mean {mean:.4%}, worst layer {worst}: {means[worst]:.4%}")


if __name__ == "__main__":
    main()
