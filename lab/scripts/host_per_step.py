"""The host's bookkeeping of a static decode step against the number of running sequences.

Under CUDA graphs a decode step costs the host (a) ``DecodeGraphs.prepare``: which hot zones fill, fresh
blocks, lengths, the block-table rows, the byte accounting, staged and uploaded, and (c)
``cache.finish_step``: the sealed blocks' prefix registration; the replay (b) is the device's. This times (a)
+ (c) on the CPU, where they are the same Python and NumPy as on a GPU host (the upload a host copy here, a
few KB over PCIe there), for ``N`` sequences of ``--length`` tokens in a cache of the tiny random model, over
``--steps`` steps (the forward runs between them on the CPU, untimed, so each step sees the state a real one
does). Prints each batch's median and largest step, ms.

    python lab/scripts/host_per_step.py [--batches 8,32,128,512] [--steps 64] \
        [--config examples/configs/q_int8.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import kv_bytes_for
from kvtune.engine.graphs import DecodeGraphs
from kvtune.engine.model import load_model


def one(batch: int, length: int, steps: int, config_path: str) -> dict:
    tiny = load_model("random:tiny", torch.device("cpu"))
    config = HybridConfig.from_json_file(config_path)
    shape = tiny.model.kv_shape
    longest = length + steps + 64  # a sequence's tokens by the last step, with room for its hot zone
    budget = 2 * kv_bytes_for(config, shape, [longest] * batch)
    cache = HybridCache(config, shape, budget, torch.device("cpu"), max_seqs=batch)
    gen = torch.Generator().manual_seed(0)
    for seq_id in range(batch):  # a prompt of its own each: no prefix shared, every sequence its own blocks
        ids = torch.randint(0, tiny.spec.vocab_size, (length,), generator=gen)
        cache.add_sequence(seq_id, ids.tolist(), now_ms=0.0)
        tiny.model.prefill(cache, seq_id, ids, 0, last_only=True)
    graphs = DecodeGraphs(tiny.model, cache, batch, cache.layout.blocks_for(longest), capture=False)
    slots = np.asarray([cache.slot_of(i) for i in range(batch)])
    tokens = np.ones(batch, dtype=np.int64)
    host = []
    for t in range(steps):
        t0 = time.perf_counter()
        info = graphs.prepare(slots, tokens, 10.0 * (t + 1))
        t1 = time.perf_counter()
        graphs.run(info)
        t2 = time.perf_counter()
        cache.finish_step(info)
        t3 = time.perf_counter()
        host.append((t1 - t0 + t3 - t2) * 1e3)
    return dict(batch=batch, median_ms=statistics.median(host), max_ms=max(host))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32,128,512")
    ap.add_argument("--length", type=int, default=200)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--config", default="examples/configs/q_int8.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"{args.config}: {args.length}-token sequences, {args.steps} steps; host ms of prepare + finish_step"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        r = one(batch, args.length, args.steps, args.config)
        print(
            f"  batch {r['batch']:4d}: median {r['median_ms']:.3f} ms, largest {r['max_ms']:.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
