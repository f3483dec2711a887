"""One engine decode step, timed: host wall time, GPU kernel time and kernel launches per step.

B sequences of L prompt tokens are prefilled into a hybrid cache, then the same decode steps the engine runs
(``begin_step`` → ``model.decode`` → ``end_step`` → ``argmax``) are timed with the Triton kernels
(``KVTUNE_KERNELS=triton``, the default) and with the PyTorch references for every operation but attention
(``KVTUNE_KERNELS=torch`` for the per-token operations and the access update; attention stays Triton so that
the comparison isolates the launch overhead). The two paths' first-step logits are compared.

    python benchmarks/decode_step.py --model smollm2 --batch 32 --length 2048 examples/configs/q_int8.json

Prints a table and writes it as JSON to ``--json``; ``--host-profile DIR`` also writes, per config and path,
the functions where the host spends its time (cProfile over 5 steps).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.engine.model import LoadedModel, load_model
from kvtune.kernels import decode_attention
from kvtune.kernels.backend import HAS_TRITON


@contextmanager
def kernels_choice(choice: str):
    """``KVTUNE_KERNELS=choice``, but attention always takes its Triton kernel."""
    old = os.environ.get("KVTUNE_KERNELS")
    os.environ["KVTUNE_KERNELS"] = choice
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


def prefilled(loaded: LoadedModel, config: HybridConfig, batch: int, length: int, seed: int) -> HybridCache:
    model, dev = loaded.model, loaded.model.device
    budget = int(batch * (length + 2048) * model.kv_shape.num_layers * model.kv_shape.num_kv_heads * 4
                 * model.kv_shape.head_dim * 1.2)  # fmt: skip
    cache = HybridCache(config, model.kv_shape, budget, dev, max_seqs=batch)
    gen = torch.Generator().manual_seed(seed)
    for s in range(batch):
        ids = torch.randint(0, loaded.spec.vocab_size, (length,), generator=gen)
        cache.add_sequence(s, ids.tolist())
        model.prefill(cache, s, ids.to(dev), 0, last_only=True)
    return cache


def step(loaded: LoadedModel, cache: HybridCache, batch: int, t: int) -> torch.Tensor:
    plan = cache.begin_step(list(range(batch)), now_ms=50.0 * t)  # a virtual 50 ms per step, as quality runs
    tokens = torch.full((batch,), 7, dtype=torch.long, device=loaded.model.device)
    positions = torch.tensor(plan.lengths, device=loaded.model.device) - 1
    logits = loaded.model.decode(cache, plan, tokens, positions)
    cache.end_step(plan)
    logits.argmax(-1).tolist()
    return logits


def config_name(config: HybridConfig) -> str:
    return f"q{config.quantization_bits}-hot{config.hot_tokens}-bs{config.block_size}-k{config.sparse_top_k}"


def host_profile(path: Path, loaded: LoadedModel, cache: HybridCache, batch: int) -> None:
    """Where the host's time goes: cProfile over 5 steps, the 40 functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    for t in range(5):
        step(loaded, cache, batch, 20_000 + t)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())


def measure(loaded: LoadedModel, config: HybridConfig, args: argparse.Namespace, choice: str) -> dict:
    with kernels_choice(choice):
        cache = prefilled(loaded, config, args.batch, args.length, args.seed)
        # Warm-up: one seal cycle by default, so that every kernel of the step (the seal from the hot zones
        # included) has compiled before the timed steps; a compilation there would cost seconds.
        warmup = config.hot_tokens + config.block_size if args.warmup is None else args.warmup
        first = step(loaded, cache, args.batch, 0)
        for t in range(1, warmup):
            step(loaded, cache, args.batch, t)
        sync = torch.cuda.synchronize if first.is_cuda else lambda: None
        sync()
        t0 = time.perf_counter()
        for t in range(args.steps):
            step(loaded, cache, args.batch, warmup + t)
        sync()
        wall = (time.perf_counter() - t0) * 1000 / args.steps
        with profile(activities=[ProfilerActivity.CUDA if first.is_cuda else ProfilerActivity.CPU]) as prof:
            for t in range(3):
                step(loaded, cache, args.batch, 10_000 + t)
            sync()
        if args.host_profile is not None:
            host_profile(args.host_profile / f"{config_name(config)}-{choice}.txt", loaded, cache, args.batch)
    if first.is_cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.device_time for e in kernels) / 3000
    else:  # a CPU run counts the top-level operators instead of kernels
        kernels = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        gpu_ms = 0.0
    return {"first_logits": first.cpu(), "wall_ms": wall, "gpu_ms": gpu_ms, "kernels": len(kernels) / 3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", type=Path)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default hot_tokens + block_size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--host-profile", type=Path, default=None, help="folder for cProfile reports of the host")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loaded = load_model(args.model, args.device, dtype, args.seed)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name} · {args.model} {dtype} · {args.batch} sequences × {args.length} tokens")
    print(f"{'config':<28} {'kernels':>8} {'ms/step':>8} {'GPU ms':>7} {'launches':>8} {'max |Δlogit|':>12}")
    rows = []
    measure(loaded, HybridConfig.from_json_file(args.configs[0]), args, "triton")  # compiles the kernels
    for path in args.configs:
        config = HybridConfig.from_json_file(path)
        res = {c: measure(loaded, config, args, c) for c in ("torch", "triton")}
        diff = float((res["torch"]["first_logits"] - res["triton"]["first_logits"]).abs().max())
        agree = float((res["torch"]["first_logits"].argmax(-1) == res["triton"]["first_logits"].argmax(-1))
                      .float().mean())  # fmt: skip
        for choice, r in res.items():
            r.pop("first_logits")
            rows.append(
                {"config": path.stem, "kernels": choice, **r, "max_logit_diff": diff, "argmax_agree": agree}
            )
            cells = f"{r['wall_ms']:>8.2f} {r['gpu_ms']:>7.2f} {r['kernels']:>8.0f}"
            print(f"{path.stem:<28} {choice:>8} {cells} "
                  f"{diff:>12.3g}")  # fmt: skip
        print(f"{'':<28} speed-up {res['torch']['wall_ms'] / res['triton']['wall_ms']:.2f}×, "
              f"argmax agreement {agree:.3f}")  # fmt: skip
    if args.json:
        meta = {"device": name, "torch": torch.__version__, **vars(args)}
        meta["configs"] = [str(c) for c in args.configs]
        meta.pop("json")
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
