"""A prompt forward's device time op by op and in pieces (``kvtune.engine.piecewise``), as the gated clock
reads it.

For each prompt length ``N``: a dense causal forward of ``N`` tokens (the model's own attention, no cache;
the last row's logits), enqueued behind a sleep long enough for the host to enqueue all of it, and timed
with CUDA events from the sleep's end to the forward's end: the device's time alone. Op by op; through the
pieces of the smallest bucket ``>= N`` (whose dense parts compute the bucket's rows, the padding included)
run directly, uncaptured; and through the same pieces replayed as CUDA graphs. So the padding and the static
buffers' copies show apart from what capturing changes. The three alternate, ``--repeats`` times each, after
one unmeasured forward of each. ``--idle S``:
the device idles ``S`` seconds before each timed forward (what an unloaded replay's prompts meet), so a
clock that has dropped shows. Prints one line per length (medians, min-max, pieces ÷ op by op, the
bucket's padding) and, with ``--json``, writes every time. ``--device cpu`` runs the pieces uncaptured and
times the host's wall (a smoke run on tiny shapes, no measurement). On the GPU, from the repository root:

    python benchmarks/prompt_forward.py --lengths 254,328,573,1018 [--repeats 10] [--idle 0.5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvtune.engine.engine import DeviceTimer
from kvtune.engine.model import causal_attention, load_model
from kvtune.engine.options import DTYPES
from kvtune.engine.piecewise import PIECE_BUCKETS, PiecewiseForward


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--lengths", default="254,328,573,1018", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--idle", type=float, default=0.0, help="seconds the device idles before each forward")
    p.add_argument("--sleep-ms", type=float, default=150.0, help="the sleep the forward is enqueued behind")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def main() -> None:
    args = _args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("prompt_forward.py: --device cuda needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",")]
    if not lengths or min(lengths) < 1 or max(lengths) > PIECE_BUCKETS[-1]:
        raise SystemExit(f"--lengths: each in 1..{PIECE_BUCKETS[-1]}, got {args.lengths!r}")
    loaded = load_model(args.model, device=device, dtype=DTYPES[args.dtype])
    model = loaded.model
    pieces = PiecewiseForward(model, PIECE_BUCKETS[-1], capture=device.type == "cuda")
    pieces.capture_all()
    direct = PiecewiseForward(model, PIECE_BUCKETS[-1], capture=False)
    timer = DeviceTimer(device)
    attend = lambda i, q, k, v: causal_attention(q, k, v)
    vocab = loaded.spec.vocab_size

    def forward(n: int, way: str) -> None:
        ids = torch.randint(0, vocab, (n,), device=device)
        if way == "eager":
            model.forward_dense(ids, rows=torch.tensor([n - 1], device=device))
        else:
            runner = pieces if way == "pieces" else direct
            runner.forward(ids, torch.arange(n, device=device), attend, last_only=True)

    def timed(n: int, way: str) -> float:
        if args.idle:
            timer.synchronize()
            time.sleep(args.idle)
        start = timer.gate(args.sleep_ms)
        forward(n, way)
        end = timer.mark()
        return timer.elapsed_ms(start, end)

    rows = []
    with torch.inference_mode():
        for n in lengths:
            bucket = pieces.bucket(n)
            ways = ("eager", "direct", "pieces")
            for way in ways:
                forward(n, way)  # unmeasured: plans, allocator
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way in ways:
                    times[way].append(timed(n, way))
            med = {k: statistics.median(v) for k, v in times.items()}
            cells = {w: f"{med[w]:.3f} ms ({min(t):.3f}-{max(t):.3f})" for w, t in times.items()}
            print(
                f"N {n:5d} (bucket {bucket}, padding {100 * (bucket / n - 1):.1f} %): op by op "
                f"{cells['eager']}, pieces uncaptured {cells['direct']} {med['direct'] / med['eager']:.3f}x, "
                f"captured {cells['pieces']} {med['pieces'] / med['eager']:.3f}x",
                flush=True,
            )
            rows.append({"n": n, "bucket": bucket, **times})
    if args.json:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        meta = {"device": name, "torch": torch.__version__, "model": args.model,
                "idle_s": args.idle, "sleep_ms": args.sleep_ms}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
