"""Whether bulk (TMA) copies would lift the Gluon cold kernel's ring: the dense INT4 (and INT8) pool's blocks
streamed through a ring of shared-memory stages by TMA tensor copies, one lane issuing a block's six copies
against the stage's mbarrier, with no arithmetic, beside the shipped attention and SDPA in the same run.

The shipped kernel (``kvtune.kernels.gluon_decode``) copies each block with ``cp.async``, every lane issuing
16-byte pieces. Run 10 measured its ring alone (no arithmetic) at 87-89 % (INT4) and 94-95 % (INT8) of the
pool's read ceiling on an H200, under the ~0.31x line dense INT4 aims at. Here the same bytes (codes, key
scales and mins per channel, value scales and mins per token) of the same block tables travel by
``cp.async.bulk.tensor`` (2-D descriptors over the pool: a block's ``[T, C]`` codes, one ``[1, D]`` / ``[1,
T]`` row of each scale array), one program of one warp per (split, sequence x KV head) as the shipped kernel
plans its splits. ``load``: the warp also reads each stage back into registers (a byte XOR), as the
attention would. Checked first against the same XOR computed by PyTorch on a small table.

If the ring alone reads near the ceiling (SDPA's bytes per second), the attention built on it could reach
0.31x; if it is no faster than run 10's ring, bulk copies are not the lever.

The attention built on it (``DecodeKernelOptions.gluon_tma``: the same kernel, its ring filled by these
copies over ``gluon_decode.descriptors``) is timed beside the shipped one in the same run, with the relative
difference of its outputs from the shipped kernel's (the split plans may differ: the TMA build needs fewer
registers, so more of its programs fit a multiprocessor).

The attention on tensor copies is timed at its default ring depth and at one more (INT4: 3 stages, 8
programs a multiprocessor where 2 fit 10) or one fewer (INT8: 2 stages, 6 programs where 3 fit 4).

    python lab/scripts/tma_ring.py --out $OUT [--shapes 64:8192,16:32768] [--bits 4,8] [--stages 2,3,4]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as da

from kvtune.kernels import gluon_decode, triton_decode
from kvtune.kernels.decode_choice import PURE_INT8, default_options


@gluon.jit
def _issue(kd, vd, ksd, kmd, vsd, vmd, bar, kb, vb, ksb, kmb, vsb, vmb, bid, h,
           H: gl.constexpr, T: gl.constexpr, NBYTES: gl.constexpr):  # fmt: skip
    """Block ``bid``'s six copies (KV head ``h``) into one stage, counted on its mbarrier."""
    mbarrier.expect(bar, NBYTES)
    r = (bid * H + h).to(gl.int32)
    tma.async_copy_global_to_shared(kd, [r * T, 0], bar, kb)
    tma.async_copy_global_to_shared(vd, [r * T, 0], bar, vb)
    tma.async_copy_global_to_shared(ksd, [r, 0], bar, ksb)
    tma.async_copy_global_to_shared(kmd, [r, 0], bar, kmb)
    tma.async_copy_global_to_shared(vsd, [r, 0], bar, vsb)
    tma.async_copy_global_to_shared(vmd, [r, 0], bar, vmb)


@gluon.jit
def _tma_ring_kernel(kd, vd, ksd, kmd, vsd, vmd, table_ptr, out_ptr, per, M,
                     H: gl.constexpr, T: gl.constexpr, C: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, LOAD: gl.constexpr):  # fmt: skip
    """Split ``program_id(0)`` of row ``program_id(1)``: its blocks through a ring of STAGES stages (block j +
    STAGES - 1 copied while block j is read); stores the sum of the bytes of XOR(k ^ v) over its blocks."""
    pid_s = gl.program_id(0)
    bh = gl.program_id(1)
    h = bh % H
    j0 = pid_s * per
    j1 = gl.minimum(j0 + per, M)
    row = bh.to(gl.int64) * M
    kbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, T, C], kd.layout)
    vbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, T, C], vd.layout)
    ksb = gl.allocate_shared_memory(gl.float16, [STAGES, 1, D], ksd.layout)
    kmb = gl.allocate_shared_memory(gl.float16, [STAGES, 1, D], kmd.layout)
    vsb = gl.allocate_shared_memory(gl.float16, [STAGES, 1, T], vsd.layout)
    vmb = gl.allocate_shared_memory(gl.float16, [STAGES, 1, T], vmd.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    NBYTES: gl.constexpr = 2 * T * C + 4 * D + 4 * T
    for i in gl.static_range(STAGES - 1):
        if j0 + i < j1:
            bid = gl.load(table_ptr + row + j0 + i)
            _issue(kd, vd, ksd, kmd, vsd, vmd, bars.index(i), kbuf.index(i), vbuf.index(i), ksb.index(i),
                   kmb.index(i), vsb.index(i), vmb.index(i), bid, h, H, T, NBYTES)  # fmt: skip
    L: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // C, C // 16], [1, 1], [1, 0])
    acc = gl.zeros([T, C], gl.uint8, layout=L)
    for j in range(j0, j1):
        st = (j - j0) % STAGES
        if j + STAGES - 1 < j1:  # its stage was read in iteration j - 1, before that iteration's barrier
            sn = (st + STAGES - 1) % STAGES
            bid = gl.load(table_ptr + row + j + STAGES - 1)
            _issue(kd, vd, ksd, kmd, vsd, vmd, bars.index(sn), kbuf.index(sn), vbuf.index(sn), ksb.index(sn),
                   kmb.index(sn), vsb.index(sn), vmb.index(sn), bid, h, H, T, NBYTES)  # fmt: skip
        mbarrier.wait(bars.index(st), ((j - j0) // STAGES) & 1)
        if LOAD:
            acc = acc ^ kbuf.index(st).load(L) ^ vbuf.index(st).load(L)
        gl.thread_barrier()
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    gl.store(out_ptr + bh * gl.num_programs(0) + pid_s, gl.sum(gl.sum(acc.to(gl.int32), 1), 0))


def tma_ring(pool, table: torch.Tensor, splits: int, stages: int, load: bool, descs=None) -> torch.Tensor:
    """One launch over ``table`` [B, H, M] (every entry a block) in ``splits`` splits a row."""
    B, H, M = table.shape
    T, C, D = pool.k.shape[2], pool.k.shape[3], pool.k_scale.shape[2]
    per = -(-M // splits)
    out = torch.empty(B * H * splits, dtype=torch.int32, device=table.device)
    descs = descs or gluon_decode.descriptors(pool, pool.bits)
    _tma_ring_kernel[(splits, B * H)](*descs, table, out, per, M, H=H, T=T, C=C, D=D, STAGES=stages,
                                      LOAD=load, num_warps=1)  # fmt: skip
    return out


def reference(pool, table: torch.Tensor, splits: int) -> torch.Tensor:
    """``tma_ring``'s outputs by PyTorch."""
    B, H, M = table.shape
    per = -(-M // splits)
    out = torch.zeros(B * H * splits, dtype=torch.int32, device=table.device)
    for bh in range(B * H):
        for s in range(splits):
            ids = table.view(B * H, M)[bh, s * per : min((s + 1) * per, M)].long()
            acc = torch.zeros(pool.k.shape[2:], dtype=torch.uint8, device=table.device)
            for bid in ids.tolist():
                acc ^= pool.k[bid, bh % H] ^ pool.v[bid, bh % H]
            out[bh * splits + s] = acc.int().sum()
    return out


def shape_row(batch: int, length: int, bits: int, stages: list[int]) -> dict:
    case = da.Case(batch, length, bits)
    inp = da.make_inputs(case)
    pool, table = inp["pool"], inp["block_table"]
    n = table.numel()
    per_block = 2 * pool.k[0, 0].numel() + 2 * 2 * (pool.k_scale.shape[2] + pool.k.shape[2])
    nbytes = n * per_block
    sdpa_ms, sdpa_tbs = da.sdpa_case(batch, length)
    opts = PURE_INT8 if bits == 8 else default_options(bits)  # the dense rows, as decode_attention.py
    attn_ms = da.bench(lambda: da.run_hybrid(inp, opts))
    shipped = da.run_hybrid(inp, opts)[0].float()
    tma_opts = replace(opts, gluon_tma=True)
    attn_tma_ms = da.bench(lambda: da.run_hybrid(inp, tma_opts))
    diff = float((da.run_hybrid(inp, tma_opts)[0].float() - shipped).norm() / shipped.norm())
    if not diff < 1e-2:
        raise SystemExit(f"INT{bits} {batch} x {length}: the TMA build's output differs from the shipped "
                         f"one's by {diff:.2e} (relative)")  # fmt: skip
    other = replace(tma_opts, gluon_stages=opts.gluon_stages + (1 if bits == 4 else -1))
    other_ms = da.bench(lambda: da.run_hybrid(inp, other))
    # planned after the attention's first launch, which reads its build's occupancy (the wave model's input)
    plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], pool, table, opts)
    plan_tma = triton_decode.launch_plan(inp["q"], inp["hot_k"], pool, table, tma_opts)
    row: dict = dict(batch=batch, length=length, bits=bits, splits=plan.splits, kernel=plan.kernel,
                     sdpa_ms=sdpa_ms, sdpa_tbs=sdpa_tbs, attention_ms=attn_ms, ring_bytes=nbytes,
                     attention_tma_ms=attn_tma_ms, tma_splits=plan_tma.splits,
                     tma_used=plan_tma.options.gluon_tma and gluon_decode.tma_ready(pool),
                     tma_relative_diff=diff,
                     attention_tma_other=dict(stages=other.gluon_stages, ms=other_ms), rings={})  # fmt: skip
    descs = gluon_decode.descriptors(pool, pool.bits)
    for st in stages:
        for load in (False, True):
            ms = da.bench(lambda st=st, load=load: tma_ring(pool, table, plan.splits, st, load, descs))
            row["rings"][f"{st} stages{' + loads' if load else ''}"] = dict(ms=ms, tbs=nbytes / ms / 1e9)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shapes", default="64:8192,16:32768")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    args = ap.parse_args()
    if da.DEVICE != "cuda":
        raise SystemExit("tma_ring.py needs a CUDA GPU of sm_90 (TMA)")
    da.GRAPHS = True
    small = da.make_inputs(da.Case(2, 64 * 9 + da.HOT, 4))
    got = tma_ring(small["pool"], small["block_table"], 2, 3, True)
    want = reference(small["pool"], small["block_table"], 2)
    if not torch.equal(got, want):
        raise SystemExit(f"the TMA ring read other bytes than PyTorch: {got.tolist()} / {want.tolist()}")
    print("check: the TMA ring's XOR equals PyTorch's", flush=True)
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        for shape in args.shapes.split(","):
            b, n = (int(x) for x in shape.split(":"))
            r = shape_row(b, n, bits, [int(s) for s in args.stages.split(",")])
            rows.append(r)
            rings = ", ".join(f"{k} {v['ms']:.4f} ms ({v['tbs']:.2f} TB/s)" for k, v in r["rings"].items())
            attn, mb = r["attention_ms"], r["ring_bytes"] / 1e6
            sdpa = r["sdpa_ms"]
            tma = r["attention_tma_ms"]
            print(f"INT{bits} {b} x {n // 1024}K ({mb:.1f} MB, {r['splits']} splits): SDPA {sdpa:.4f} ms "
                  f"({r['sdpa_tbs']:.2f} TB/s); attention {attn:.4f} ms ({attn / sdpa:.3f}x, "
                  f"{mb / attn / 1e3:.2f} TB/s on the ring's bytes); attention on the TMA ring "
                  f"({'used' if r['tma_used'] else 'NOT used'}, {r['tma_splits']} splits) {tma:.4f} ms "
                  f"({tma / sdpa:.3f}x, {mb / tma / 1e3:.2f} TB/s; outputs {r['tma_relative_diff']:.1e} "
                  f"from the shipped kernel's), at {r['attention_tma_other']['stages']} stages "
                  f"{r['attention_tma_other']['ms']:.4f} ms; TMA ring alone {rings}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tma_ring.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                       indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
