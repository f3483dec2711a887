"""The read ceiling of the cold pool's access pattern: how fast any kernel can merely read the bytes that
decode attention reads, laid out as the pool lays them out.

A Triton kernel that only loads and XORs, one program per (split, sequence x KV head) as in the attention
kernels, reads per attended block the K and V codes and, where asked, the fp16 key scales and mins [D] and
value scales and mins [T] (four more arrays): the same bytes as ``decode_attention.py``'s cold blocks, with
the same block tables (a random permutation of the pool, or each sequence's blocks in order). The best of a
few launch shapes is kept; the rows differ only in what is read and where it lies:

    pool, scattered  codes + scales and mins, random block order (what the INT8 / INT4 columns read)
    codes, scattered codes alone, random block order
    pool, in order   codes + scales and mins, each sequence's blocks consecutive
    bf16, in order   unquantized codes (SDPA's bytes per token), consecutive: the dense stream
    attention        the launcher's default for the width (GPU), its time on the same byte count

Against the same run's SDPA, it says how much of the attention kernels' gap to SDPA's bandwidth is the
access pattern itself (no kernel can read these bytes faster) and how much is the kernel.

    python benchmarks/pool_read.py --out $OUT [--smoke | --rings]

``--rings``: at 64x8K only, the attention with 2, 3 and 4 stages in the Gluon kernel's ring per width, the
block ids carried in the ring or loaded an iteration ahead, beside the read ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_attention as da  # the benchmark's shapes, pools, tables and timing

from kvtune.kernels.layout import ColdPool


@triton.jit
def _read_kernel(
    k_ptr, v_ptr, ks_ptr, km_ptr, vs_ptr, vm_ptr, table_ptr, out_ptr,
    per, M, s_n, s_h, s_sn, s_sh, s_tn, s_th,
    H: tl.constexpr, WORDS: tl.constexpr, DW: tl.constexpr, TW: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """XOR of every 32-bit word this program reads: its split of its row's blocks (codes [WORDS] per block
    and head; scales/mins [DW] and [TW] words where SCALES)."""
    pid_s = tl.program_id(0)
    bh = tl.program_id(1)
    h = bh % H
    w = tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], tl.int32)
    if SCALES:
        dw = tl.arange(0, DW)
        tw = tl.arange(0, TW)
        acc_d = tl.zeros([DW], tl.int32)
        acc_t = tl.zeros([TW], tl.int32)
    j0 = pid_s * per
    for j in range(j0, tl.minimum(j0 + per, M)):
        bid = tl.load(table_ptr + bh.to(tl.int64) * M + j).to(tl.int64)
        base = bid * s_n + h * s_h
        acc ^= tl.load(k_ptr + base + w) ^ tl.load(v_ptr + base + w)
        if SCALES:
            acc_d ^= tl.load(ks_ptr + bid * s_sn + h * s_sh + dw) ^ tl.load(
                km_ptr + bid * s_sn + h * s_sh + dw
            )
            acc_t ^= tl.load(vs_ptr + bid * s_tn + h * s_th + tw) ^ tl.load(
                vm_ptr + bid * s_tn + h * s_th + tw
            )
    x = tl.xor_sum(acc, 0)
    if SCALES:
        x ^= tl.xor_sum(acc_d, 0) ^ tl.xor_sum(acc_t, 0)
    tl.store(out_ptr + bh * tl.num_programs(0) + pid_s, x)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (its last dimension must hold a multiple of 4 bytes)."""
    return t.view(torch.int32)


def read_pass(pool: ColdPool, table: torch.Tensor, scales: bool, splits: int, num_warps: int, stages: int):
    """A closure launching one read pass over ``table``'s blocks [B, H, M] (``splits`` per row) and the
    buffer it writes."""
    B, H, M = table.shape
    k, v = _words(pool.k), _words(pool.v)
    ks, km, vs, vm = (_words(x) for x in (pool.k_scale, pool.k_min, pool.v_scale, pool.v_min))
    per = triton.cdiv(M, splits)
    out = torch.empty((B * H, splits), dtype=torch.int32, device=table.device)
    words = k.shape[2] * k.shape[3]

    def run() -> None:
        _read_kernel[(splits, B * H)](
            k, v, ks, km, vs, vm, table, out, per, M, k.stride(0), k.stride(1),
            ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
            H=H, WORDS=words, DW=ks.shape[2], TW=vs.shape[2], SCALES=scales, num_warps=num_warps,
            num_stages=stages,
        )  # fmt: skip

    return run, out


def xor_all(t: torch.Tensor) -> int:
    """XOR of every int32 word of ``t`` (folded in halves on its device)."""
    x = t.reshape(-1)
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        half = x.numel() // 2
        x = x[:half] ^ x[half:]
    return int(x.item()) if x.numel() else 0


def expected_xor(pool: ColdPool, table: torch.Tensor, scales: bool) -> int:
    """What the read pass's outputs XOR to (indexing the same words with torch)."""
    B, H, M = table.shape
    ids = table.reshape(-1).long()
    heads = torch.arange(H, device=table.device).repeat_interleave(M).repeat(B)
    parts = [pool.k, pool.v] + ([pool.k_scale, pool.k_min, pool.v_scale, pool.v_min] if scales else [])
    x = 0
    for p in parts:
        x ^= xor_all(_words(p)[ids, heads])
    return x


def bytes_read(pool: ColdPool, table: torch.Tensor, scales: bool) -> int:
    """Bytes a read pass reads: per (block, KV head) the K and V codes, its table entry and, with
    ``scales``, the key scales and mins [D] and value scales and mins [T] (fp16)."""
    B, H, M = table.shape
    per_block = 2 * pool.k[0, 0].numel() * pool.k.element_size() + table.element_size()
    if scales:
        per_block += (
            2 * (pool.k_scale[0, 0].numel() + pool.v_scale[0, 0].numel()) * pool.k_scale.element_size()
        )
    return B * H * M * per_block


LAUNCHES = [(pps, nw, st) for pps in (4, 8, 16) for nw in (4, 8) for st in (3, 4)]


def best_read(pool: ColdPool, table: torch.Tensor, scales: bool, launches) -> dict:
    """The fastest launch shape (its XOR checked first) of a read pass: ms and TB/s."""
    want = expected_xor(pool, table, scales)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if da.DEVICE == "cuda" else 1
    B, H, M = table.shape
    best: dict = {}
    for pps, nw, st in launches:
        splits = max(1, min(M, triton.cdiv(pps * sms, B * H)))
        run, out = read_pass(pool, table, scales, splits, nw, st)
        out.fill_(0x5A5A5A5A)
        run()
        got = xor_all(out)
        if got != want:
            raise AssertionError(f"read pass pps={pps} warps={nw} stages={st}: xor {got:#x} != {want:#x}")
        ms = da.bench(run)
        if not best or ms < best["ms"]:
            best = dict(ms=ms, splits=splits, num_warps=nw, stages=st)
    best["tbs"] = bytes_read(pool, table, scales) / best["ms"] / 1e9
    return best


def ring_depths(out: Path) -> int:
    """64x8K: the attention with 2, 3 and 4 stages in the Gluon kernel's ring per width, the block ids in the
    ring or not (``gluon_table_ahead``), against SDPA and the read ceiling of the same run (TB/s on the pool
    bytes)."""
    batch, length = 64, 8192
    sdpa_ms, sdpa_tbs = da.sdpa_case(batch, length)
    head = "| bits | stages | ids in the ring | read ceiling | attention |"
    lines = [f"SDPA {sdpa_ms:.4f} ms {sdpa_tbs:.2f} TB/s", head, "| --- | --- | --- | --- | --- |"]
    for bits in (8, 4):
        inp = da.make_inputs(da.Case(batch, length, bits))
        pool, table = inp["pool"], inp["block_table"]
        nbytes = bytes_read(pool, table, True)
        ceiling = best_read(pool, table, True, LAUNCHES)["tbs"]
        for stages in (2, 3, 4):
            for ahead in (False, True):
                opts = replace(da.defaults()[f"int{bits}"], gluon_stages=stages, gluon_table_ahead=ahead)
                tbs = nbytes / da.bench(lambda o=opts, inp=inp: da.run_hybrid(inp, o)) / 1e9
                lines.append(f"| {bits} | {stages} | {ahead} | {ceiling:.2f} | {tbs:.2f} |")
            print(lines[-1], flush=True)
        del inp, pool
    (out / "ring_depths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--rings", action="store_true", help="GPU: the Gluon ring's depth at 64x8K only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    da.GRAPHS = da.DEVICE == "cuda"
    if args.rings:
        return ring_depths(args.out)
    shapes = [(2, 256)] if args.smoke else [(64, 8192), (16, 32768)]
    launches = LAUNCHES[:1] if args.smoke else LAUNCHES
    rows = []
    for batch, length in shapes:
        row: dict = dict(batch=batch, length=length)
        row["sdpa_ms"], row["sdpa_tbs"] = da.sdpa_case(batch, length) if da.DEVICE == "cuda" else (0.0, 0.0)
        for bits in (8, 4):
            inp = da.make_inputs(da.Case(batch, length, bits))
            pool, scattered = inp["pool"], inp["block_table"]
            nc = scattered.shape[2]
            ordered = (torch.arange(batch * nc, device=scattered.device, dtype=torch.int32).view(batch, 1, nc)
                       .expand_as(scattered).contiguous())  # fmt: skip
            row[f"int{bits}"] = {
                "pool, scattered": best_read(pool, scattered, True, launches),
                "codes, scattered": best_read(pool, scattered, False, launches),
                "pool, in order": best_read(pool, ordered, True, launches),
            }
            if da.DEVICE == "cuda":  # the attention itself, on the same bytes
                opts = da.defaults()[f"int{bits}"]
                nbytes = bytes_read(pool, scattered, True)
                ms = da.bench(lambda o=opts, inp=inp: da.run_hybrid(inp, o))
                row[f"int{bits}"]["attention"] = dict(ms=ms, tbs=nbytes / ms / 1e9)
            del inp, pool
        dense = da.make_pool(batch * nc, 0, da.DTYPE)
        row["bf16, in order"] = best_read(dense, ordered, False, launches)
        del dense
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if da.DEVICE == "cuda" else "cpu"
    (args.out / "pool_read.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    lines = [
        "| B x L | SDPA TB/s | bf16, in order | bits | pool, scattered | codes, scattered | pool, in order "
        "| attention |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        size = f"{r['length'] // 1024}K" if r["length"] >= 1024 else str(r["length"])
        for bits in (8, 4):
            c = r[f"int{bits}"]
            names = ("pool, scattered", "codes, scattered", "pool, in order", "attention")
            cells = [c[name]["tbs"] if name in c else float("nan") for name in names]
            lines.append(
                f"| {r['batch']} x {size} | {r['sdpa_tbs']:.2f} | {r['bf16, in order']['tbs']:.2f} | {bits} "
                "| " + " | ".join(f"{x:.2f}" for x in cells) + " |"
            )
    table = "\n".join(lines)
    (args.out / "pool_read.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
