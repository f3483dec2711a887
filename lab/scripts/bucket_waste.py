"""What padding to the pieces' token buckets costs, and how many mixed-graph shapes a replay meets, for
candidate bucket lists (CPU, the tiny model, rows and widths padded as on a GPU):

    python lab/scripts/bucket_waste.py TRACE [TIME_SCALE ...]

Every forward with prompt tokens is recorded (its decode rows' bucket R and its prompt tokens T, and the rest
of its mixed-graph key). For each bucket list it prints the rows the dense pieces compute over the rows the
forward has (``rows``), the same with every forward costing at least 256 rows (``cost``: below about 256 rows
a forward of an 8B model reads its weights once whatever its rows, so padding there is nearly free), the
worst single forward's padding, and the mixed-graph shapes (keys with N from that list). The unloaded replay's
prompts (each alone) are counted the same way (``alone``).
"""

import collections
import sys

import torch

import kvtune.engine.graphs as graphs_module
from kvtune.cache_impl.config import HybridConfig
from kvtune.engine import engine as engine_module
from kvtune.engine.engine import Engine, load_workload
from kvtune.engine.mixed_graphs import MixedGraphs
from kvtune.engine.model import load_model
from kvtune.engine.piecewise import PIECE_BUCKETS
from kvtune.engine.scheduler import SchedulerConfig

graphs_module.ahead = lambda: object()  # type: ignore[assignment,return-value]  # pad as on a GPU
engine_module.MIXED_CAPTURE_ON = 1
seen: list[tuple[int, int, tuple[int, ...]]] = []  # (R, T, key)


def wants(self: MixedGraphs, slots, chunks) -> bool:  # type: ignore[no-untyped-def]
    key = self.key_for(slots, chunks)  # (N, R, width, packed rows, chunk entries, seals)
    seen.append((key[1], sum(t for _, t in chunks), key))
    return True


CANDIDATES = {
    "doubling": (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048),  # the buckets before run 41
    "quarter": (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048),
    "eighth": (16, 32, 64, 128, 192, *range(256, 512, 32), *range(512, 1024, 64), *range(1024, 2049, 128)),
    "sixteenth": PIECE_BUCKETS,  # today's: steps of 32 from 256 to 1,024, of 64 to 2,048
}


def report(label: str, forwards: list[tuple[int, int, tuple[int, ...]]]) -> None:
    print(f"{label}: {len(forwards)} forwards with prompt tokens")
    real = [r + t for r, t, _ in forwards]
    for name, buckets in CANDIDATES.items():
        padded = [next(b for b in buckets if b >= n) for n in real]
        rows = sum(padded) / max(sum(real), 1)
        cost = sum(max(p, 256) for p in padded) / max(sum(max(n, 256) for n in real), 1)
        worst = max((p / max(n, 256) for p, n in zip(padded, real)), default=1.0)
        keys = collections.Counter((p, *k[1:]) for p, (_, _, k) in zip(padded, forwards))
        once = sum(1 for u in keys.values() if u == 1)
        print(
            f"  {name:8s} ({len(buckets)} buckets): rows {rows:.3f}x, cost {cost:.3f}x, "
            f"worst {worst:.2f}x; {len(keys)} mixed shapes, {once} met once, a second use serves "
            f"{sum(keys.values()) - once}"
        )


MixedGraphs.wants = wants  # type: ignore[method-assign]
model = load_model("random:tiny", torch.device("cpu"))
requests, _, _ = load_workload(sys.argv[1], model.spec.max_context, 96, 0, 0.25)
config = HybridConfig("hybrid_v2", hot_tokens=32, block_size=64, quantization_bits=8)
options = SchedulerConfig(mixed_graphs=True, max_num_batched_tokens=8192)
engine = Engine(model, config, 1 << 26, torch.device("cpu"), options)
report("alone (each prompt its own forward)", [(0, r.input_length, (0,)) for r in requests])
for scale in [float(a) for a in sys.argv[2:]] or [0.05]:
    seen.clear()
    engine.replay(requests, scale, warmup_requests=4)
    report(f"time scale {scale:g}", list(seen))
