"""Decode attention on one GPU: dense bf16 SDPA against the fused hybrid kernel (INT8, INT4, bf16 cold).

Llama-3-8B heads (32 query, 8 KV, head_dim 128), hot_tokens 64, block_size 64, bf16 model precision. For each
B x L: median times (``triton.testing.do_bench``), each kernel's ratio to SDPA, and achieved TB/s counting
every byte read (codes, fp16 scales and mins, block table, hot zone, q, split partials); the sparse tier
(sparse_top_k 2048: Quest bound over the L2 blocks + top-k + attention over L1 + selected L2) on the 16 x 32K
and 4 x 128K rows, with each part's time, bytes and bandwidth (the selection: Quest's key mins and scales of
the L2 blocks; the attention: the hot zone, the L1 blocks and the selected ones); the copy bandwidth (read +
write) of the same card. Writes ``results.json`` and ``table.md`` under ``--out`` and prints the table last.

``--quest`` times the sparse tier's selection (the table: the row split by tier, Quest's bound of every L2
block, the top-k) with the single-program kernel and with the split selection (``SelectOptions(split=True)``
and a few variants of it), at 16 x 32K and 4 x 128K, sparse INT8 (L2 blocks demoted to 4 bits), as graph
replays and as launches, after checking each split variant's table, counts and bytes against the single
kernel's bit for bit; both kernels again bounding the blocks from the float8 summary of their key bounds
(``single fp8``, ``split fp8``: :mod:`kvtune.kernels.quest_summary`, half the bytes), the split one checked
against the single one, each with the share of the fp16 single kernel's selected blocks it keeps; and the
whole sparse INT8 step both ways beside SDPA. It writes ``quest.json`` and ``quest.md``. ``--top N`` sets the
sparse tier's top-k in tokens (default 2048) for every mode.

``--mixed`` times only the sparse rows, sparse INT8 both ways (its mixed 8/4-bit table on the Triton split
kernel, the default, and on the Gluon kernel, ``gluon_mixed``), sparse INT4 and unquantized beside them and
SDPA, each as CUDA graph replays and as launches, after checking both INT8 ways against the fp32 reference
on a pool with demoted blocks; it writes ``mixed.json`` and ``mixed.md``.

    python benchmarks/decode_attention.py --out $OUT [--sweep] [--quick] [--graphs] [--mixed] [--quest] \\
        [--top N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kvtune.cache_impl.layout import summary_setting
from kvtune.kernels.layout import ColdLayout, ColdPool
from kvtune.kernels.quant import dequantize_blocks_ref
from kvtune.kernels.quest_summary import QuestSummary8, summary8
from kvtune.kernels.sparse_table import (
    L1,
    L2,
    ByteCount,
    loads_summary,
    sparse_block_table,
    sparse_block_table_parts,
)
from kvtune.kernels.sparse_table_choice import SelectOptions, split_plan
from kvtune.kernels.triton_decode import (
    PURE_INT8,
    DecodeKernelOptions,
    default_options,
    hybrid_decode_attention_triton,
    launch_plan,
)

HQ, H, D = 32, 8, 128
HOT, BS = 64, 64
SHAPES = [(8, 2048), (64, 2048), (64, 8192), (16, 32768), (128, 4096)]
SPARSE_TOKENS = 2048
SWEEP_SHAPE = (64, 8192)
SPARSE_SHAPES = [(16, 32768), (4, 131072)]  # the rows with the sparse tier
QUICK_SHAPES = [(64, 8192), (16, 32768), (4, 131072)]
PPS_SHAPES = [(64, 8192), (16, 32768)]
PPS_NAMES = ("int8", "int4")  # columns whose split count the sweep chooses (the others keep the default)
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: no bf16 tl.dot
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke under TRITON_INTERPRET=1 only


def log(msg: str) -> None:
    print(msg, flush=True)


GRAPHS = False  # --graphs: time replays of a captured CUDA graph (the GPU's time, without the host's)


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if GRAPHS:
        fn()  # compiles, and reads the build's occupancy, outside the capture
        torch.cuda.synchronize()  # the timing runs on a side stream: the inputs must be ready first
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_bandwidth() -> float:
    """TB/s of a device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    src = torch.randn(2**29 if DEVICE == "cuda" else 2**10, device=DEVICE)
    dst = torch.empty_like(src)
    if DEVICE == "cuda":  # one long kernel: no host cost to leave out (graph replays read 2.77 TB/s here)
        ms = float(triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median"))
    else:
        ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e9


@dataclass(frozen=True)
class Case:
    """One hybrid decode problem: B sequences of L tokens, cold blocks of `bits`."""

    batch: int
    length: int
    bits: int
    l1_blocks: int | None = None  # sparse: newest cold blocks kept in L1; the rest are L2 (None: all L1)

    @property
    def cold(self) -> int:
        return (self.length - HOT) // BS

    @property
    def hot_len(self) -> int:
        return self.length - self.cold * BS


def make_pool(num_blocks: int, bits: int, dtype: torch.dtype) -> ColdPool:
    """A random cold pool in the cold layout (codes, fp16 scales and mins), bits 0, 4 or 8."""
    pool = ColdLayout(BS, H, D, bits, dtype).allocate(num_blocks, DEVICE)
    if bits == 0:
        pool.k.normal_()
        pool.v.normal_()
    else:
        pool.k.random_(0, 256)
        pool.v.random_(0, 256)
    levels = 1 if bits == 0 else 2**bits - 1
    for lo, sc in ((pool.k_min, pool.k_scale), (pool.v_min, pool.v_scale)):
        lo.normal_().sub_(2)
        sc.uniform_(0.5, 1.5).mul_(4 / levels)
    return pool


def make_inputs(case: Case) -> dict:
    """q, hot zone, pool and block table; blocks scattered over the pool (a random permutation)."""
    B, nc = case.batch, case.cold
    pool = make_pool(B * nc, case.bits, DTYPE)
    ids = torch.randperm(B * nc, device=DEVICE).to(torch.int32).view(B, 1, nc).expand(B, H, nc).contiguous()
    hot_cap = HOT + BS
    return dict(
        q=torch.randn((B, HQ, D), device=DEVICE, dtype=DTYPE),
        hot_k=torch.randn((B, H, hot_cap, D), device=DEVICE, dtype=DTYPE),
        hot_v=torch.randn((B, H, hot_cap, D), device=DEVICE, dtype=DTYPE),
        hot_slot=torch.arange(B, device=DEVICE, dtype=torch.int32),
        hot_len=torch.full((B,), case.hot_len, device=DEVICE, dtype=torch.int32),
        pool=pool, block_table=ids, num_cold=torch.full((B, H), nc, device=DEVICE, dtype=torch.int32),
    )  # fmt: skip


def cold_block_bytes(bits: int, mixed: bool) -> int:
    """Bytes read per attended (block, KV head): K/V codes, key min+scale [D], value min+scale [BS], table."""
    codes = 2 * BS * (D * 2 if bits == 0 else D * bits // 8)
    meta = 0 if bits == 0 else 2 * D * 2 + 2 * BS * 2
    return codes + meta + 4 + (1 if mixed else 0)


def hybrid_bytes(case: Case, attended: int, splits: int, mixed: bool) -> int:
    B = case.batch
    hot = B * H * case.hot_len * D * 2 * 2
    cold = B * H * attended * cold_block_bytes(case.bits, mixed)
    q = B * HQ * D * 2
    partials = B * H * splits * (HQ // H) * (D + 2) * 4
    return hot + cold + q + partials


def run_hybrid(inp: dict, options: DecodeKernelOptions):
    return hybrid_decode_attention_triton(
        inp["q"], inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], inp["pool"],
        inp["block_table"], inp["num_cold"], 1 / math.sqrt(D), options=options,
    )  # fmt: skip


def reference(inp: dict) -> torch.Tensor:
    """Dequantize every listed block (fp32) + hot zone, then attention: [B, Hq, D] fp32 (small cases only)."""
    pool, table, B = inp["pool"], inp["block_table"], inp["q"].shape[0]
    outs = []
    for b in range(B):
        ids = table[b, 0, : int(inp["num_cold"][b, 0])].long()
        k, v = dequantize_blocks_ref(pool, ids)  # [n, H, BS, D]
        k = torch.cat(
            [k.permute(1, 0, 2, 3).reshape(H, -1, D), inp["hot_k"][b, :, : int(inp["hot_len"][b])].float()], 1
        )
        v = torch.cat(
            [v.permute(1, 0, 2, 3).reshape(H, -1, D), inp["hot_v"][b, :, : int(inp["hot_len"][b])].float()], 1
        )
        q = inp["q"][b].float().view(H, HQ // H, D)
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D), -1)
        outs.append((p @ v).reshape(HQ, D))
    return torch.stack(outs)


CHECK_SHAPE = (3, 1000 + 37)  # the checks' batch x length (--smoke: smaller, for the interpreter)


def check(options: DecodeKernelOptions, bits: int) -> float:
    """Relative error against the fp32 reference on a small case (fresh inputs)."""
    inp = make_inputs(Case(*CHECK_SHAPE, bits))
    out, mass, hot = run_hybrid(inp, options)
    ref = reference(inp)
    err = float((out.float() - ref).norm() / ref.norm())
    total = float(mass.sum(-1).mean() + hot.mean())
    return err if abs(total - 1) < 1e-3 else float("inf")


def check_mixed(options: DecodeKernelOptions) -> float:
    """:func:`check` on an 8-bit pool with a third of its blocks demoted to 4 bits (the sparse tier's L2)."""
    inp = make_inputs(Case(*CHECK_SHAPE, 8))
    pool = inp["pool"]
    pool.block_bits[torch.randperm(pool.num_blocks, device=DEVICE)[: pool.num_blocks // 3]] = 4
    out, mass, hot = run_hybrid(inp, options)
    ref = reference(inp)
    err = float((out.float() - ref).norm() / ref.norm())
    total = float(mass.sum(-1).mean() + hot.mean())
    return err if abs(total - 1) < 1e-3 else float("inf")


def sdpa_case(batch: int, length: int) -> tuple[float, float]:
    q = torch.randn((batch, HQ, 1, D), device=DEVICE, dtype=DTYPE)
    k = torch.randn((batch, H, length, D), device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return ms, nbytes / ms / 1e9


def hybrid_case(case: Case, options: DecodeKernelOptions) -> dict:
    inp = make_inputs(case)
    mixed = case.bits == 8 and options.mixed
    ms = bench(lambda: run_hybrid(inp, options))  # the warm-up launches read the build's occupancy
    splits = launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], options).splits
    nbytes = hybrid_bytes(case, case.cold, splits, mixed)
    return dict(ms=ms, tbs=nbytes / ms / 1e9, bytes=nbytes, splits=splits)


def select_table(q, pool, blocks, tier, k_blocks, count, selection: SelectOptions | None,
                 summary: QuestSummary8 | None = None) -> tuple:  # fmt: skip
    """The sparse tier's table as the cache builds it (``sparse_block_table``): the kernels ``selection``
    asks for (None: the default, split where the rows are few for the card); ``summary``: Quest's bounds
    from it instead of the pool's fp16 key mins and scales."""
    return sparse_block_table(q, pool, blocks, tier, k_blocks, count, selection, summary)


def select_parts(q, pool, blocks, tier, k_blocks, count, selection: SelectOptions | None,
                 summary: QuestSummary8 | None = None) -> tuple:  # fmt: skip
    """:func:`select_table` as the cache's step calls it (``sparse_block_table_parts``): the table, its
    counts, and the table split by bits where the split selection writes it (an 8-bit pool with demoted
    blocks), for the attention to read instead of splitting the table itself."""
    table, num_cold, _, parts = sparse_block_table_parts(q, pool, blocks, tier, k_blocks, count, selection,
                                                         summary)  # fmt: skip
    return table, num_cold, parts


def sparse_setup(case: Case) -> tuple[dict, torch.Tensor, torch.Tensor, ByteCount]:
    """:func:`make_inputs` with the sparse tier set up: the oldest cold blocks but the newest ``l1_blocks``
    in L2 (demoted to 4 bits in an 8-bit pool). Returns the inputs, each sequence's blocks [B, nc] (oldest
    first), the tiers and the step's byte counter, as :func:`select_table` takes them."""
    inp = make_inputs(case)
    nc, l1 = case.cold, case.l1_blocks or 0
    pool = inp["pool"]
    blocks = inp["block_table"][:, 0, :].long().contiguous()
    l2_blocks = blocks[:, : nc - l1].flatten()
    tier = torch.full((pool.num_blocks,), L1, device=DEVICE, dtype=torch.int8)
    tier[l2_blocks] = L2
    if case.bits == 8:
        pool.block_bits[l2_blocks] = 4
    return inp, blocks, tier, zero_count()


def zero_count() -> ByteCount:
    """A step's byte counter at zero: no bytes per bit width yet, Quest's bytes per L2 block of Llama-3-8B
    heads (fp16 key min and scale)."""
    return ByteCount(torch.zeros(9, device=DEVICE, dtype=torch.int64), H * 2 * 2 * D,
                     torch.zeros((), device=DEVICE, dtype=torch.int64))  # fmt: skip


def summary_default() -> bool:
    """Whether the cache's selection reads the e4m3 summary here: loadable (sm_89 or newer) and not turned
    off (``KVTUNE_QUEST_SUMMARY=0``)."""
    return summary_setting() != "0" and summary_loads()


def summary_loads() -> bool:
    """Whether the selection's kernels read an e4m3 summary here (a GPU of sm_89 or newer)."""
    return DEVICE == "cuda" and loads_summary(torch.device(DEVICE))


def sparse_case(
    case: Case, options: DecodeKernelOptions, selection: SelectOptions | None = None, summary: bool = False
) -> dict:
    """L1 = the newest `l1_blocks` cold blocks, the rest in L2 (4-bit in an 8-bit pool); attend L1 + top-k.

    The selection is the cache's per-layer one (``sparse_block_table``: each sequence's whole row of
    cold blocks split by tier, Quest's bound and top-k of the L2 ones, the table, its byte count), and the
    attention reads that table (L1 blocks, then the selected ones, -1 padded to the row's width + k);
    ``selection``: the selection's kernels (None: the default); ``summary``: Quest reads the pool's e4m3
    summary (as the cache's selection does on sm_89 and newer) instead of its fp16 key mins and scales."""
    inp, blocks, tier, count = sparse_setup(case)
    B, nc, l1 = case.batch, case.cold, case.l1_blocks or 0
    k_blocks = SPARSE_TOKENS // BS
    pool = inp["pool"]
    bounds = summary8(pool) if summary else None

    def select():
        return select_parts(inp["q"], pool, blocks, tier, k_blocks, count, selection, bounds)

    def attend(selected):
        table, num_cold, parts = selected
        return hybrid_decode_attention_triton(
            inp["q"], inp["hot_k"], inp["hot_v"], inp["hot_slot"], inp["hot_len"], pool, table, num_cold,
            1 / math.sqrt(D), options=options, partition=parts,
        )  # fmt: skip

    # The whole step, then its two parts alone: the selection (Quest bound, top-k, table) and the attention
    # over a fixed table. A step slower than its parts' sum waits on the host between launches.
    ms = bench(lambda: attend(select()))
    selection_ms = bench(select)
    selected = select()
    attention_ms = bench(lambda: attend(selected))
    quest_ms = selection_ms
    if selected[2] is not None:  # the selection also split the table by bits: Quest's selection alone too
        q = inp["q"]
        quest_ms = bench(lambda: select_table(q, pool, blocks, tier, k_blocks, count, selection, bounds))
    plan = launch_plan(inp["q"], inp["hot_k"], pool, selected[0], options)
    splits = plan.splits
    slots = plan.slots  # each build's partials
    attn = hybrid_bytes(case, 0, slots, False) + B * H * (
        l1 * cold_block_bytes(case.bits, case.bits == 8)
        + k_blocks * cold_block_bytes(4 if case.bits == 8 else case.bits, case.bits == 8)
    )
    quest = B * H * (nc - l1) * (2 * D * (1 if summary else 2) + 4)
    return dict(
        summary=summary, ms=ms, tbs=(attn + quest) / ms / 1e9, bytes=attn + quest, splits=splits,
        kernel=plan.kernel, selection_ms=selection_ms, quest_ms=quest_ms,
        attention_ms=attention_ms, selection_bytes=quest, selection_tbs=quest / selection_ms / 1e9,
        attention_bytes=attn, attention_tbs=attn / attention_ms / 1e9,
    )  # fmt: skip


def try_variant(opt: DecodeKernelOptions, bits: int, rows: list) -> tuple[float, DecodeKernelOptions] | None:
    """Check one compile-time variant, then time it at the sweep shape; None if it fails or is wrong."""
    t0 = time.time()
    try:
        err = check(opt, bits)
        res = hybrid_case(Case(*SWEEP_SHAPE, bits), opt)
    except Exception as exc:  # a variant that fails to compile is reported and skipped
        log(f"sweep bits={bits} {opt}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        return None
    ok = err < (2e-2 if bits else 1e-2)
    rows.append(dict(bits=bits, options=asdict(opt), err=err, ms=res["ms"], tbs=res["tbs"], ok=ok))
    log(f"sweep bits={bits} mixed={opt.mixed} kt={opt.k_transposed} cvt={opt.cvt} r={opt.maxnreg} "
        f"s={opt.num_stages} vp={opt.v_pairs} gluon={opt.gluon} st={opt.gluon_stages} pdl={opt.gluon_pdl} "
        f"kr={opt.gluon_key_rows} ta={opt.gluon_table_ahead} {res['ms']:.4f} ms "
        f"{res['tbs']:.2f} TB/s err={err:.2e} ok={ok} ({time.time() - t0:.1f}s)")  # fmt: skip
    return (res["ms"], opt) if ok else None


def defaults() -> dict[str, DecodeKernelOptions]:
    """The launcher's defaults per column; the INT8 column is a pure INT8 pool (nothing demoted)."""
    chosen = {f"{kind}{bits}": default_options(bits) for bits in (8, 4, 0) for kind in ("int", "sparse")}
    return {**chosen, "int8": PURE_INT8}


# Compile-time variants tried at the sweep shape, per pool bits, as changes to a base: the launcher's
# default for that width (``PURE_INT8`` for the pure 8-bit rows). The fastest correct one per column then
# gets its split count chosen.
SWEEP_GRIDS: dict[int, list[dict[str, Any]]] = {
    8: [
        {},
        dict(v_pairs=False),  # value codes gathered byte by byte
        dict(maxnreg=None),
        dict(maxnreg=96),  # 5 programs of 4 warps per SM instead of 4 (spills to be read in kernels.txt)
        dict(mixed=True),
        dict(mixed=True, maxnreg=96),
        dict(gluon=True),  # the Gluon cold kernel: one warp per program, registers placed by hand
        dict(gluon=True, gluon_pdl=False),  # the merge + hot zone launched after the Gluon kernel ends
        dict(gluon=True, gluon_stages=2),
        dict(gluon=True, gluon_stages=0),  # Gluon, each block loaded into registers (no cp.async ring)
        dict(gluon=True, gluon_key_rows=False),  # each lane copies the key pieces it loads (half lines)
        dict(gluon=True, gluon_table_ahead=False),  # each block id loaded one iteration ahead
    ],
    4: [
        {},
        dict(num_stages=3, maxnreg=None),  # 3 programs per SM instead of 4
        dict(gluon=True),
        dict(gluon=True, gluon_pdl=False),
        dict(gluon=True, gluon_stages=3),
        dict(gluon=True, gluon_stages=0),
        dict(gluon=True, gluon_table_ahead=False),
    ],
    0: [{}],
}


def sweep(results: dict) -> dict[str, DecodeKernelOptions]:
    """Try compile-time variants at 64x8K, then the split count; the fastest correct one per column."""
    rows: list = []
    best: dict[str, DecodeKernelOptions] = {}
    for bits, grid in SWEEP_GRIDS.items():
        base = PURE_INT8 if bits == 8 else default_options(bits)
        # an entry that does not name ``gluon`` is a variant of the Triton kernel
        scored = [x for g in grid if (x := try_variant(replace(base, **{"gluon": False, **g}), bits, rows))]
        names = ["int8", "sparse8"] if bits == 8 else [f"int{bits}", f"sparse{bits}"]
        for name in names:
            mixed_ok = [x for x in scored if x[1].mixed or bits != 8]
            pool = (mixed_ok if name == "sparse8" else scored) or [(0.0, default_options(bits))]
            top = min(pool, key=lambda x: x[0])[1]
            if name in PPS_NAMES:
                best[name] = pick_splits(top, bits, rows)
            elif name.startswith("sparse"):  # the best at 64x8K need not be the best on the sparse case
                best[name] = pick_sparse([top, default_options(bits)], bits, rows)
            else:
                best[name] = top
    results["sweep"] = rows
    return best


def pick_sparse(candidates: list[DecodeKernelOptions], bits: int, rows: list) -> DecodeKernelOptions:
    """The fastest of ``candidates`` on the sparse case itself (the 32K row's L1 1/8 + top-k)."""
    batch, length = SPARSE_SHAPES[0]
    case = sparse_rows(batch, length, bits)
    times = {}
    for opt in dict.fromkeys(candidates):
        res = sparse_case(case, opt)
        rows.append(dict(bits=bits, options=asdict(opt), sparse=res))
        log(f"sparse bits={bits} {opt}: {res['ms']:.4f} ms (selection {res['selection_ms']:.4f}, "
            f"attention {res['attention_ms']:.4f})")  # fmt: skip
        times[opt] = res["ms"]
    return min(times, key=lambda o: times[o])


def pick_splits(opt: DecodeKernelOptions, bits: int, rows: list) -> DecodeKernelOptions:
    """The programs-per-SM target of the split kernel with the lowest summed time at 64x8K and 16x32K. A
    Gluon build has nothing to choose: the launcher plans it by the wave model."""
    if opt.gluon:  # the Gluon build is always planned by the wave model with its measured occupancy
        return opt
    totals = {}
    for cand in [replace(opt, programs_per_sm=pps) for pps in (2, 4, 8, 16)]:
        times = [hybrid_case(Case(*shape, bits), cand)["ms"] for shape in PPS_SHAPES]
        rows.append(dict(bits=bits, options=asdict(cand), pps_ms=times))
        log(f"splits bits={bits} mixed={cand.mixed} pps={cand.programs_per_sm}: {times}")
        totals[cand] = sum(times)
    return min(totals, key=lambda k: totals[k])


# --mixed: the sparse columns timed, sparse INT8 both ways (its table mixes 8- and 4-bit blocks)
def mixed_variants() -> dict[str, DecodeKernelOptions]:
    split8 = default_options(8)
    return {
        "sparse8": split8,
        "sparse8_gluon_mixed": replace(split8, gluon_mixed=True),
        "sparse4": default_options(4),
        "sparse0": default_options(0),
    }


def compare_mixed(out: Path, smoke: bool = False) -> dict:
    """Sparse INT8 on the split kernel and on the mixed Gluon path, with sparse INT4, unquantized and SDPA,
    at the sparse shapes, as graph replays and as launches (``--mixed``; ``smoke``: one tiny shape)."""
    global GRAPHS, SPARSE_TOKENS, SPARSE_SHAPES, CHECK_SHAPE
    if smoke:
        SPARSE_TOKENS, SPARSE_SHAPES, CHECK_SHAPE = 128, [(1, 1024)], (1, 4 * BS + 37)
    variants = mixed_variants()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    results: dict = dict(device=name, torch=torch.__version__, triton=triton.__version__, rows=[],
                         options={k: asdict(o) for k, o in variants.items()})  # fmt: skip
    broken: dict[str, str] = {}  # a way that fails its check is reported, not timed
    for key in ("sparse8", "sparse8_gluon_mixed"):
        try:
            err = check_mixed(variants[key])
        except Exception as exc:  # a build that fails to compile or launch on this card
            err, broken[key] = float("inf"), f"{type(exc).__name__}: {str(exc)[:300]}"
        if not err < 2e-2:
            broken.setdefault(key, f"rel err {err:.2e}")
        results.setdefault("errors", {})[key] = err
        log(f"{key}: rel err {err:.2e} on an 8-bit pool with demoted blocks {broken.get(key, '')}")
    results["broken"] = broken
    for timing in ("graphs", "launches") if DEVICE == "cuda" else ("launches",):
        GRAPHS = timing == "graphs"
        for batch, length in SPARSE_SHAPES:
            row: dict = dict(timing=timing, batch=batch, length=length)
            row["sdpa_ms"], row["sdpa_tbs"] = sdpa_case(batch, length)
            for key, opt in variants.items():
                case = sparse_rows(batch, length, int(key[6]))
                row[key] = None if key in broken else sparse_case(case, opt)
            results["rows"].append(row)
            log(json.dumps(row))
    return _save(out, "mixed", results, format_mixed(results))


def _save(out: Path, name: str, results: dict, table: str) -> dict:
    """``results`` as ``name``.json and its table as ``name``.md under ``out``; the table printed."""
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return results


def format_mixed(results: dict) -> str:
    errors = results.get("errors", {})
    lines = [
        f"{results['device']}, torch {results['torch']}, triton {results['triton']}. Sparse tier (L1 1/8 + "
        f"top {SPARSE_TOKENS}): median ms of the whole step (selection + attention), (x SDPA); attention "
        "alone: ms, TB/s on its bytes; kernel that attended. Rel. err on a pool with demoted blocks: "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
        "",
        "| B x L | timing | SDPA bf16 | sparse INT8, split | sparse INT8, gluon_mixed | sparse INT4 "
        "| sparse unq. |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        cells = [f"{r['batch']} x {r['length'] // 1024}K", r["timing"], f"{r['sdpa_ms']:.3f}"]
        for key in ("sparse8", "sparse8_gluon_mixed", "sparse4", "sparse0"):
            x = r[key]
            if x is None:
                cells.append(f"not timed ({results['broken'][key]})")
                continue
            cells.append(
                f"{x['ms']:.3f} ({x['ms'] / r['sdpa_ms']:.2f}x); attn {x['attention_ms']:.3f} "
                f"{x['attention_tbs']:.2f} TB/s; {x['kernel']}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --quest: the sparse tier's selection with the single-program kernel and with the split selection
SINGLE = SelectOptions(split=False)
QUEST_VARIANTS: dict[str, SelectOptions | None] = {
    "single": SINGLE,  # one program per (sequence, KV head)
    "split": SelectOptions(split=True),  # the split selection's defaults
    "split pps 1": SelectOptions(split=True, programs_per_sm=1),
    "split pps 4": SelectOptions(split=True, programs_per_sm=4),
    "split pps 8": SelectOptions(split=True, programs_per_sm=8),  # one chunk per span at 16 x 32K
    "split no cap": SelectOptions(split=True, maxnreg=None),
}
QUEST_FP8: dict[str, SelectOptions] = {  # the same kernels bounding the blocks from the e4m3 summary
    "single fp8": SINGLE,
    "split fp8": SelectOptions(split=True),
}


def sparse_rows(batch: int, length: int, bits: int) -> Case:
    """The sparse rows' case: the newest eighth of each sequence's cold blocks in L1, the rest in L2."""
    return Case(batch, length, bits, l1_blocks=(length - HOT) // BS // 8)


def same_selection(got: tuple, got_count: ByteCount, want: tuple, want_count: ByteCount) -> bool:
    """Whether two selections gave the same table, counts and bytes (:func:`select_table`'s outputs)."""
    same = all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    return same and int(got_count.total) == int(want_count.total)


def quest_inputs(case: Case) -> tuple[torch.Tensor, ColdPool, torch.Tensor, torch.Tensor]:
    """q, the pool, the rows of cold blocks and the tiers of :func:`sparse_case` for an 8-bit case: the
    oldest blocks in L2, demoted to 4 bits."""
    inp = make_inputs(case)
    pool, nc, l1 = inp["pool"], case.cold, case.l1_blocks or 0
    blocks = inp["block_table"][:, 0, :].long().contiguous()  # [B, nc], oldest first
    l2_blocks = blocks[:, : nc - l1].flatten()
    tier = torch.full((pool.num_blocks,), L1, device=DEVICE, dtype=torch.int8)
    tier[l2_blocks] = L2
    pool.block_bits[l2_blocks] = 4
    return inp["q"], pool, blocks, tier


def shared_fraction(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], k_blocks: int) -> float:
    """Of the L2 blocks ``want`` selects in a (sequence, KV head) row (its table's places num_l1 ..
    num_cold), the share ``got`` selects too, averaged over the rows that select any; ``got`` and ``want``:
    (table, num_cold, num_l1) of the same rows."""
    picks = []
    for table, num, n1 in (got, want):
        places = n1[..., None].long() + torch.arange(k_blocks, device=table.device)  # within the row's width
        picks.append(torch.where(places < num[..., None], table.gather(2, places), -1))
    mine, theirs = picks
    kept = ((theirs[..., :, None] == mine[..., None, :]) & (theirs[..., :, None] >= 0)).any(-1).sum(-1)
    chosen = (theirs >= 0).sum(-1)
    return float((kept[chosen > 0] / chosen[chosen > 0]).mean()) if bool((chosen > 0).any()) else 1.0


def selection_case(case: Case, variants: dict[str, SelectOptions | None],
                   fp8_variants: dict[str, SelectOptions]) -> dict:  # fmt: skip
    """Each variant's selection on one case: µs and TB/s on what Quest reads of every L2 block and KV head
    (``variants``: the fp16 key mins and scales; ``fp8_variants``: the e4m3 summary's lo and span), its
    plan; not timed (the reason instead) where its table, counts or bytes differ from the single kernel's
    on the same bounds. An fp8 variant's table differs from the fp16 one's by design: ``shared`` is the
    share of the fp16 single kernel's selected blocks it keeps (:func:`shared_fraction`)."""
    q, pool, blocks, tier = quest_inputs(case)
    summary = summary8(pool)
    k_blocks = SPARSE_TOKENS // BS
    l2_blocks = case.batch * (case.cold - (case.l1_blocks or 0))
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE == "cuda" else 4

    def select(
        opt: SelectOptions | None, summ: QuestSummary8 | None
    ) -> tuple[tuple[torch.Tensor, ...], ByteCount]:
        count = ByteCount(torch.arange(9, device=DEVICE, dtype=torch.int64) * 1000 + 7, H * 2 * 2 * D,
                          torch.zeros((), device=DEVICE, dtype=torch.int64))  # fmt: skip
        return select_table(q, pool, blocks, tier, k_blocks, count, opt, summ), count

    fp16, fp8 = select(SINGLE, None), select(SINGLE, summary)
    ways = [(name, opt, None, fp16) for name, opt in variants.items()]
    ways += [(name, opt, summary, fp8) for name, opt in fp8_variants.items()]
    row: dict = {}
    for name, opt, summ, (want, want_count) in ways:
        got, got_count = select(opt, summ)
        if not same_selection(got, got_count, want, want_count):
            row[name] = dict(error="table, counts or bytes differ from the single kernel's")
            continue
        us = bench(lambda opt=opt, summ=summ: select(opt, summ)) * 1e3
        width = blocks.shape[1]
        split = opt.split is not False
        splits, span = split_plan(blocks.shape[0] * H, width, k_blocks, sms, opt) if split else (1, width)
        nbytes = l2_blocks * (H * 2 * D * 2 if summ is None else summ.bytes_per_block)
        row[name] = dict(us=us, bounds_bytes=nbytes, tbs=nbytes / us / 1e6, splits=splits, span=span)
        if summ is not None:
            row[name]["shared"] = shared_fraction(got, fp16[0], k_blocks)
    return row


def compare_quest(out: Path, smoke: bool = False) -> dict:
    """The selection both ways (and variants of the split one) at the sparse shapes, graph replays and
    launches; the whole sparse INT8 step both ways beside SDPA (graphs). ``smoke``: one tiny shape."""
    global GRAPHS, SPARSE_TOKENS, SPARSE_SHAPES
    if smoke:
        SPARSE_TOKENS, SPARSE_SHAPES = 128, [(1, 1024)]
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    variants = {k: asdict(o) if o else None for k, o in QUEST_VARIANTS.items()}
    variants |= {k: {**asdict(o), "summary": "e4m3"} for k, o in QUEST_FP8.items()}
    results: dict = dict(device=name, torch=torch.__version__, triton=triton.__version__, rows=[],
                         variants=variants)  # fmt: skip
    for timing in ("graphs", "launches") if DEVICE == "cuda" else ("launches",):
        GRAPHS = timing == "graphs"
        for batch, length in SPARSE_SHAPES:
            case = sparse_rows(batch, length, 8)
            row: dict = dict(timing=timing, batch=batch, length=length)
            row["selection"] = selection_case(case, QUEST_VARIANTS, QUEST_FP8)
            if timing == "graphs" or DEVICE == "cpu":
                row["sdpa_ms"], _ = sdpa_case(batch, length)
                for key, select in (("step_single", SINGLE), ("step_split", SelectOptions(split=True))):
                    row[key] = sparse_case(case, default_options(8), select)
            results["rows"].append(row)
            log(json.dumps(row))
    return _save(out, "quest", results, format_quest(results))


def format_quest(results: dict) -> str:
    names = [*QUEST_VARIANTS, *QUEST_FP8]
    lines = [
        f"{results['device']}, torch {results['torch']}, triton {results['triton']}. Quest selection of the "
        f"sparse INT8 tier (L1 1/8 + top {SPARSE_TOKENS}; L2 blocks 4-bit): median µs, (TB/s on the key "
        f"bounds, {4 * D} B per L2 block and KV head; fp8: on the e4m3 summary, {2 * D} B), [spans per row]; "
        "fp8: the share of the fp16 single kernel's selected blocks kept",
        "",
        "| B x L | timing | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in results["rows"]:
        cells = [f"{r['batch']} x {r['length'] // 1024}K", r["timing"]]
        for n in names:
            x = r["selection"][n]
            cell = x.get("error") or f"{x['us']:.1f} ({x['tbs']:.2f}) [{x['splits']}]"
            cells.append(f"{cell}; {x['shared']:.1%} kept" if "shared" in x else cell)
        lines.append("| " + " | ".join(cells) + " |")
    for r in results["rows"]:
        if "step_split" in r:
            ways = [
                f"{way} {x['ms']:.3f} ms ({x['ms'] / r['sdpa_ms']:.2f}x SDPA; selection "
                f"{x['selection_ms'] * 1e3:.1f} µs)"
                for way, x in (("single", r["step_single"]), ("split", r["step_split"]))
            ]
            lines.append(f"\nSparse INT8 step at {r['batch']} x {r['length'] // 1024}K ({r['timing']}): "
                         + ", ".join(ways))  # fmt: skip
    return "\n".join(lines)


def profile(args: argparse.Namespace) -> int:
    """One case, a few launches, for a profiler (ncu) to read: options from an earlier results.json."""
    chosen = json.loads(args.options_from.read_text())["chosen"][f"int{args.profile}"]
    known = {f.name for f in fields(DecodeKernelOptions)}  # files from before a knob was removed name it too
    opt = DecodeKernelOptions(**{k: v for k, v in chosen.items() if k in known})
    inp = make_inputs(Case(64, 8192, args.profile))
    for _ in range(3):
        run_hybrid(inp, opt)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    global SPARSE_TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sweep", action="store_true", help="try kernel variants at 64x8K first")
    ap.add_argument("--quick", action="store_true", help="only 64x8K, 16x32K and 4x128K")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="time CUDA graph replays (GPU time without the host's launch cost)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes (CPU, TRITON_INTERPRET=1): the script runs"
    )
    ap.add_argument(
        "--profile", type=int, choices=(0, 4, 8), help="only launch 64x8K with these bits (for ncu)"
    )
    ap.add_argument("--options-from", type=Path, help="results.json whose chosen options --profile uses")
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="only the sparse rows: sparse INT8 on the split kernel and on gluon_mixed, graphs and launches",
    )
    ap.add_argument(
        "--quest",
        action="store_true",
        help="only the selection: the single-program kernel against the split one, graphs and launches",
    )
    ap.add_argument(
        "--top",
        type=int,
        default=SPARSE_TOKENS,
        help=f"the sparse tier's top-k in tokens (default {SPARSE_TOKENS}; --smoke: 128)",
    )
    args = ap.parse_args()
    if args.top < BS or args.top % BS:
        ap.error(f"--top {args.top}: a positive multiple of the block size, {BS}")
    SPARSE_TOKENS = args.top
    if args.profile is not None:
        return profile(args)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.mixed:
        compare_mixed(args.out, args.smoke)
        return 0
    if args.quest:
        compare_quest(args.out, args.smoke)
        return 0
    global GRAPHS
    GRAPHS = args.graphs and DEVICE == "cuda"
    if args.smoke:
        global SWEEP_SHAPE, PPS_SHAPES, SPARSE_SHAPES, CHECK_SHAPE
        SWEEP_SHAPE, PPS_SHAPES, SPARSE_TOKENS, SPARSE_SHAPES = (2, 256), [(1, 512)], 128, [(1, 1024)]
        CHECK_SHAPE = (1, 4 * BS + 37)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    results: dict = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                         timing="CUDA graph replays" if GRAPHS else "launches")  # fmt: skip
    results["copy_tbs"] = copy_bandwidth()
    log(f"copy bandwidth {results['copy_tbs']:.2f} TB/s")
    chosen = sweep(results) if args.sweep else defaults()
    results["chosen"] = {name: asdict(o) for name, o in chosen.items()}
    for name, o in chosen.items():
        err = check(o, int(name[-1]))
        results.setdefault("errors", {})[name] = err
        log(f"chosen {name}: {o} rel err {err:.2e}")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.smoke:
        shapes = [(2, 256), (1, 1024)]
    rows = []
    summary = results["summary"] = summary_default()
    for batch, length in shapes:
        row: dict = dict(batch=batch, length=length)
        row["sdpa_ms"], row["sdpa_tbs"] = sdpa_case(batch, length)
        for bits in (8, 4, 0):
            row[f"int{bits}"] = hybrid_case(Case(batch, length, bits), chosen[f"int{bits}"])
        if (batch, length) in SPARSE_SHAPES:
            for bits in (8, 4, 0):
                case = sparse_rows(batch, length, bits)
                row[f"sparse{bits}"] = sparse_case(case, chosen[f"sparse{bits}"], summary=summary)
            for bits in (8, 4, 0) if summary_loads() else ():  # Quest's other bounds, same run
                other = sparse_case(
                    sparse_rows(batch, length, bits), chosen[f"sparse{bits}"], summary=not summary
                )
                row[f"sparse{bits}_other"] = other
        rows.append(row)
        log(json.dumps(row))
    results["rows"] = rows
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if DEVICE == "cuda":
        dump_kernels(args.out)
    table = format_table(results)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


def dump_kernels(out: Path) -> None:
    """Registers, spills, shared memory of every compiled split kernel; their TTGIR + PTX (for reading)."""
    from kvtune.kernels import triton_decode

    lines, asm = [], []
    for cache in triton_decode._split_kernel.device_caches.values():
        for key, kern in cache[0].items():
            try:
                meta = kern.metadata
                lines.append(
                    f"regs={kern.n_regs} spills={kern.n_spills} shared={meta.shared} warps={meta.num_warps} "
                    f"stages={meta.num_stages} key={str(key)[:600]}"
                )
                asm.append(
                    f"===== {str(key)[:600]}\n{kern.asm.get('ttgir', '')}\n{kern.asm.get('ptx', '')[:300000]}"
                )
            except Exception as exc:  # reporting only
                lines.append(f"unreadable: {exc}")
    (out / "kernels.txt").write_text("\n".join(lines) + "\n")
    (out / "kernels_asm.txt").write_text("\n".join(asm)[:15_000_000])


def format_table(results: dict) -> str:
    head = (
        f"{results['device']}, torch {results['torch']}, triton {results['triton']}; copy bandwidth "
        f"{results['copy_tbs']:.2f} TB/s (read + write). Times: median ms of "
        f"{results.get('timing', 'launches')}; (x SDPA); TB/s on bytes read.\n\n"
        "| B x L | SDPA bf16 | SDPA TB/s | INT8 | INT4 | unquantized "
        f"| sparse INT8 / INT4 / unq. (L1 1/8 + top 2048{'; e4m3 Quest' * bool(results.get('summary'))}) |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for r in results["rows"]:
        cells = [f"{r['batch']} x {r['length'] // 1024}K", f"{r['sdpa_ms']:.3f}", f"{r['sdpa_tbs']:.2f}"]
        for bits in (8, 4, 0):
            x = r[f"int{bits}"]
            cells.append(f"{x['ms']:.3f} ({x['ms'] / r['sdpa_ms']:.2f}x, {x['tbs']:.2f})")
        sparse = [r.get(f"sparse{b}") for b in (8, 4, 0)]
        cells.append(
            " / ".join(f"{s['ms']:.3f} ({s['ms'] / r['sdpa_ms']:.2f}x)" for s in sparse if s)
            if sparse[0]
            else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    for r in results["rows"]:
        parts = [
            f"{label} selection {x['selection_ms']:.3f} ({_mb(x, 'selection')}{_quest_alone(x)}) + attention "
            f"{x['attention_ms']:.3f} ({_mb(x, 'attention')})"
            for label, name in (("INT8", "sparse8"), ("INT4", "sparse4"), ("unq.", "sparse0"))
            if (x := r.get(name))
        ]
        if parts:
            lines.append(f"\nSparse step at {r['batch']} x {r['length'] // 1024}K, its parts alone (ms): "
                         + "; ".join(parts))  # fmt: skip
        other = [
            f"{label} {x['ms']:.3f} ({x['ms'] / r['sdpa_ms']:.3f}x; Quest {1e3 * _quest(x):.1f} µs)"
            for label, name in (
                ("INT8", "sparse8_other"),
                ("INT4", "sparse4_other"),
                ("unq.", "sparse0_other"),
            )
            if (x := r.get(name))
        ]
        if other:
            bounds = "the e4m3 summary" if r["sparse8_other"]["summary"] else "the fp16 bounds"
            lines.append(f"\nThe same sparse steps, Quest on {bounds}, same run, {r['batch']} x "
                         f"{r['length'] // 1024}K (ms): " + "; ".join(other))  # fmt: skip
    return "\n".join(lines)


def _quest(x: dict) -> float:
    """Quest's selection alone, ms: the step's selection, but where it also split the table by bits
    (sparse INT8) the selection without the split, timed beside it (older runs: the step's)."""
    return float(x.get("quest_ms", x["selection_ms"]))


def _quest_alone(x: dict) -> str:
    quest = _quest(x)
    return "" if quest == x["selection_ms"] else f"; with the split by bits; Quest alone {quest:.3f}"


def _mb(x: dict, part: str) -> str:
    """A part's bytes and bandwidth, where the run recorded them (results of older runs lack them)."""
    if f"{part}_bytes" not in x:
        return "bytes not recorded"
    return f"{x[f'{part}_bytes'] / 1e6:.1f} MB, {x[f'{part}_tbs']:.2f} TB/s"


if __name__ == "__main__":
    sys.exit(main())
