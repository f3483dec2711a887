"""Where the sparse step's time goes: each kernel of ``attend(select())`` on the device's own clock.

The sparse rows of ``benchmarks/decode_attention.py`` (L1 1/8 + top 2,048; sparse INT8 with its L2 blocks
demoted to 4 bits, INT4, unquantized) at 16 x 32K and 4 x 128K: the whole step captured as one CUDA graph,
replayed ``--steps`` times under ``torch.profiler``; from the trace's kernel records (device timestamps),
per step: each kernel's duration (median over the steps), the step's span (first kernel's start to last
kernel's end), the union of the kernels' intervals (busy) and the span's idle part (gaps between kernels,
launch latency inside the graph). Kernels that overlap (a programmatic dependent launch) count once in busy.
With ``--summary`` Quest reads the e4m3 summary, as the cache does by default on sm_89 and newer.
The same step timed by ``do_bench_cudagraph`` beside it, and SDPA bf16 in the same process. With
``--ways`` the INT8 steps run each way its two builds can launch: ``default`` (as shipped), ``two`` (one
launch each), ``overlap`` (``gluon_overlap``: the 4-bit build started beside the 8-bit one), ``paired`` and
``by_id`` (``gluon_builds``: both in one launch), each optionally with ``:S``, the 4-bit ring's depth
(``gluon_stages4``, 0: the default), and ``:B``, the 4-bit build's busy blocks (``gluon_busy_blocks4``),
``--rounds`` times each, alternating, for an A/B in one process (``--overlap both`` is ``--ways
two,overlap``). A way ending in ``/own``: the selection writes no split by bits and the attention splits
the table itself (its partition launch: the step before the selection wrote the split), e.g.
``default/own``. A way ending in ``+tma`` fills the Gluon builds' rings by tensor copies (``gluon_tma``,
sm_90), e.g. ``default+tma``; ``+tmaN`` also sets the 8-bit ring's depth to N (``gluon_stages``), e.g.
``default+tma2``; ``+after`` launches the builds as programmatic dependents of the selection's merge
(``gluon_after_select``, sm_90), e.g. ``default+after`` or ``default+tma+after``.

    python lab/scripts/sparse_kernels.py --out $OUT [--steps 20] [--summary] [--shapes 16:32768,4:131072]
        [--ways two,paired,by_id,paired:4,paired:0:16] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels.decode_choice import DecodeKernelOptions, default_options
from kvtune.kernels.quest_summary import summary8
from kvtune.kernels.triton_decode import hybrid_decode_attention_triton


def way_options(bits: int, way: str) -> DecodeKernelOptions:
    """The default options of ``bits`` launched ``way`` (module docstring; INT8's builds only, ``+tma``
    every width's)."""
    way, *extras = way.split("+")
    if extras:
        opts = way_options(bits, way)
        for extra in extras:
            if extra == "after":
                opts = replace(opts, gluon_after_select=True)
            elif extra.startswith("tma") and (extra[3:] == "" or extra[3:].isdigit()):
                opts = replace(opts, gluon_tma=True)
                if extra[3:] and bits == 8:
                    opts = replace(opts, gluon_stages=int(extra[3:]))
            else:
                raise SystemExit(f"--ways: {extra!r} after + is not 'tma', 'tmaN' or 'after'")
        return opts
    way, _, own = way.partition("/")
    name, *rest = way.split(":")
    if own not in ("", "own"):
        raise SystemExit(f"--ways: {own!r} after / is not 'own'")
    known = ("default", "two", "overlap", "paired", "by_id")
    if name not in known or len(rest) > 2 or not all(x.isdigit() for x in rest):
        raise SystemExit(f"--ways: {way!r} is not one of {', '.join(known)}, each with optional :S[:B]")
    base = default_options(bits)
    if bits != 8:
        return base
    stages4, busy4 = (int(x) for x in [*rest, "0", "0"][:2])
    builds = {"default": base.gluon_builds, "overlap": "two"}.get(name, name)
    return replace(base, gluon_overlap=name == "overlap", gluon_builds=builds, gluon_stages4=stages4,
                   gluon_busy_blocks4=busy4 or base.gluon_busy_blocks4)  # fmt: skip


def step_fn(case: da.Case, summary: bool, way: str = "default"):
    inp, blocks, tier, count = da.sparse_setup(case)
    pool = inp["pool"]
    k_blocks = da.SPARSE_TOKENS // da.BS
    bounds = summary8(pool) if summary else None
    options = way_options(case.bits, way)

    own = "/own" in way  # the attention's own partition, not the selection's split

    def step():
        if own:
            table, num_cold, _ = da.select_table(inp["q"], pool, blocks, tier, k_blocks, count, None, bounds)
            parts = None
        else:
            table, num_cold, parts = da.select_parts(inp["q"], pool, blocks, tier, k_blocks, count, None,
                                                     bounds)  # fmt: skip
        return hybrid_decode_attention_triton(
            inp["q"], inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], pool, table, num_cold,
            1 / math.sqrt(da.D), options=options, partition=parts,
        )  # fmt: skip

    return step


def profile_steps(step, steps: int, trace: Path) -> list[dict]:
    """Replays of one captured step under the profiler; each step's kernels as (name, start, end) in µs."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm on the side stream, as the capture will run
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.synchronize()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
            torch.cuda.synchronize()  # one replay at a time: a step's kernels lie between syncs
    prof.export_chrome_trace(str(trace))
    return step_kernels(json.loads(trace.read_text())["traceEvents"], steps)


def step_kernels(events: list[dict], steps: int) -> list[dict]:
    """A trace's kernel records cut into ``steps`` equal steps: each step's span, busy time (the union of
    its kernels' intervals) and kernels (name, duration), in µs."""
    kernels = sorted(
        ((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel"),
        key=lambda k: k[0],
    )
    if not kernels:
        raise SystemExit("the trace holds no kernel records (graph kernels untraced by this CUPTI?)")
    per = len(kernels) // steps
    if per * steps != len(kernels):
        raise SystemExit(f"{len(kernels)} kernels over {steps} steps: not a whole number a step")
    out = []
    for i in range(steps):
        ks = kernels[i * per : (i + 1) * per]
        busy, end = 0.0, -math.inf
        for s, e, _ in ks:  # union of intervals (sorted by start)
            if e > end:
                busy += e - max(s, end)
                end = e
        out.append(dict(span=max(e for _, e, _ in ks) - ks[0][0], busy=busy,
                        kernels=[(n, e - s) for s, e, n in ks]))  # fmt: skip
    return out


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:48]


def summarise(steps: list[dict]) -> dict:
    med = statistics.median
    names = [short(n) for n, _ in steps[0]["kernels"]]
    per_kernel = defaultdict(list)
    for st in steps:
        for j, (_, d) in enumerate(st["kernels"]):
            per_kernel[j].append(d)
    return dict(
        span_us=med(s["span"] for s in steps), busy_us=med(s["busy"] for s in steps),
        sum_us=med(sum(d for _, d in s["kernels"]) for s in steps),
        kernels=[dict(name=names[j], us=med(per_kernel[j])) for j in range(len(names))],
    )  # fmt: skip


def variants(bits: str, ways: list[str], rounds: int) -> list[tuple[int, str, int]]:
    """(bits, way, round) in the order run: per bits, the rounds, each with every way in turn (INT8 only:
    the other pools have one build)."""
    out = []
    for b in (int(x) for x in bits.split(",")):
        for r in range(rounds):
            out += [(b, o, r) for o in (ways if b == 8 else ways[:1])]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--summary", action="store_true", help="Quest from the e4m3 summary (sm_89+)")
    ap.add_argument("--shapes", default="16:32768,4:131072")
    ap.add_argument("--bits", default="8,4,0")
    ap.add_argument(
        "--overlap",
        choices=["off", "on", "both"],
        default=None,
        help="INT8: the 4-bit build beside the 8-bit one (gluon_overlap): --ways two, overlap, two,overlap",
    )
    ap.add_argument("--ways", default="default", help="INT8: how its builds launch (module docstring)")
    ap.add_argument("--rounds", type=int, default=1, help="each (step, overlap) this many times, alternating")
    args = ap.parse_args()
    if args.overlap:
        args.ways = {"off": "two", "on": "overlap", "both": "two,overlap"}[args.overlap]
    ways = args.ways.split(",")
    for w in ways:
        way_options(8, w)  # refuses a bad way before the first step
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU (device timestamps of graph replays)")
    args.out.mkdir(parents=True, exist_ok=True)
    da.GRAPHS = True
    torch.manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split(":"))
        sdpa_ms, _ = da.sdpa_case(b, length)
        for bits, way, rnd in variants(args.bits, ways, args.rounds):
            case = da.sparse_rows(b, length, bits)
            step = step_fn(case, args.summary, way)
            ms = da.bench(step)
            tag = (f"{b}x{length // 1024}K_b{bits}{'_e4m3' if args.summary else ''}"
                   f"{'' if way == 'default' else '_' + way.replace(':', '-').replace('/', '-')}"
                   f"{f'_r{rnd}' if args.rounds > 1 else ''}")  # fmt: skip
            res = summarise(profile_steps(step, args.steps, args.out / f"trace_{tag}.json"))
            res.update(shape=shape, bits=bits, summary=args.summary, way=way, round=rnd, graph_ms=ms,
                       sdpa_ms=sdpa_ms)  # fmt: skip
            results.append(res)
            print(f"{tag}: graph {ms * 1e3:.1f} µs ({ms / sdpa_ms:.3f}x SDPA {sdpa_ms:.4f} ms); span "
                  f"{res['span_us']:.1f}, busy {res['busy_us']:.1f}, kernels' sum {res['sum_us']:.1f} µs",
                  flush=True)  # fmt: skip
            for k in res["kernels"]:
                print(f"    {k['us']:7.1f} µs  {k['name']}", flush=True)
            (args.out / f"trace_{tag}.json").unlink()  # large; the summary keeps what it showed
    (args.out / "sparse_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
