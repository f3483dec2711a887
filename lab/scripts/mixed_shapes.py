"""How many mixed-graph shapes a replay meets, and how many graphs it would capture on a shape's first or
second use (CPU, the tiny model, rows and widths padded as on a GPU):

    python lab/scripts/mixed_shapes.py TRACE [BLOCK] [TIME_SCALE ...]
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
from kvtune.engine.scheduler import SchedulerConfig

graphs_module.ahead = lambda: object()  # type: ignore[assignment,return-value]  # pad as on a GPU
engine_module.MIXED_CAPTURE_ON = 1
uses: collections.Counter[tuple[int, ...]] = collections.Counter()


def wants(self: MixedGraphs, slots, chunks) -> bool:  # type: ignore[no-untyped-def]
    uses[self.key_for(slots, chunks)] += 1
    return True


MixedGraphs.wants = wants  # type: ignore[method-assign]
model = load_model("random:tiny", torch.device("cpu"))
requests, _, _ = load_workload(sys.argv[1], model.spec.max_context, 96, 0, 0.25)
block = int(sys.argv[2]) if len(sys.argv) > 2 else 64
config = HybridConfig("hybrid_v2", hot_tokens=32, block_size=block, quantization_bits=8)
options = SchedulerConfig(mixed_graphs=True, max_num_batched_tokens=2048)
engine = Engine(model, config, 1 << 26, torch.device("cpu"), options)
for scale in [float(a) for a in sys.argv[3:]] or [0.2]:
    uses.clear()
    engine.replay(requests, scale, warmup_requests=4)
    once = sum(1 for u in uses.values() if u == 1)
    print(
        f"time scale {scale:g}: {sum(uses.values())} mixed forwards, {len(uses)} shapes ({once} met once): "
        f"{len(uses)} captures on first use, {len(uses) - once} on second, whose graphs serve "
        f"{sum(uses.values()) - once} forwards"
    )
    for i, name in enumerate(("tokens N", "decode rows R", "width", "packed rows", "chunk entries", "seals")):
        print(f"  {name}: {sorted(collections.Counter(k[i] for k in uses.elements()).items())}")
