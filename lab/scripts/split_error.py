"""How the cold kernels' error against the float32 reference grows with the blocks one program reads.

Full rows of ``--blocks`` cold blocks (Llama-3-8B heads: 8 KV heads, 4 query heads each, head_dim 128, block
64), random K/V sealed by the reference, no demoted blocks; the split count forced (every split holds the
same number of blocks), so each program folds ``blocks / splits`` blocks into one running accumulator. For
the Gluon kernel (INT4: ``default_options(4)``; INT8: ``PURE_INT8``) and, as a control, the Triton split
kernel (``gluon=False``), each at fp16 and bf16: the relative L2 error of the output against the reference
computed in float32 from the same codes, beside the floor (the reference's own output rounded to the model
dtype). ``--planned B:L,...``: then, at those batch x context shapes, bf16, the launcher's own plan (after
a first launch, so the Gluon kernel's wave model plans from its occupancy, as in serving): the error the
decode-attention table's dense launches carry. Writes ``split_error.json`` and prints a table. GPU only.

    python lab/scripts/split_error.py --out $OUT [--blocks 512] [--per 1,4,16,64,256]
        [--planned 16:32768,4:131072]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from merge_tile import forced_plan  # lab/scripts, beside this file

from kvtune.kernels import triton_decode
from kvtune.kernels.decode_ref import hybrid_decode_attention_ref
from kvtune.kernels.layout import ColdLayout
from kvtune.kernels.quant import seal_blocks_ref

B, H, G, D, BS, HOT = 2, 8, 4, 128, 64, 64


def inputs(bits: int, dtype: torch.dtype, blocks: int, B: int = B) -> dict:
    n = B * H * blocks + 1
    pool = ColdLayout(BS, H, D, bits, dtype).allocate(n, "cuda")
    for lo in range(0, n, 4096):  # sealed in chunks: the float32 K/V of a 16 x 32K pool alone is 34 GB
        hi = min(n, lo + 4096)
        kv = torch.randn(2, hi - lo, BS, H, D, device="cuda") * 2 + 0.5
        seal_blocks_ref(pool, torch.arange(lo, hi, device="cuda"), kv[0].to(dtype), kv[1].to(dtype), bits)
    table = torch.randperm(n, device="cuda")[: B * H * blocks].view(B, H, blocks).to(torch.int32)
    return dict(
        q=torch.randn(B, H * G, D, device="cuda").to(dtype),
        hot_k=torch.randn(B, H, HOT, D, device="cuda").to(dtype),
        hot_v=torch.randn(B, H, HOT, D, device="cuda").to(dtype),
        hot_slot=torch.arange(B, device="cuda", dtype=torch.int32),
        hot_len=torch.full((B,), HOT, device="cuda", dtype=torch.int32),
        pool=pool, block_table=table, num_cold=torch.full((B, H), blocks, device="cuda", dtype=torch.int32),
        sm_scale=1 / math.sqrt(D),
    )  # fmt: skip


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def reference(inp: dict) -> tuple[torch.Tensor, float]:
    """The reference output computed in float32 from the pool's codes, and the floor: the error of the
    reference's own output in the model dtype."""
    exact = hybrid_decode_attention_ref(
        **{**inp, "q": inp["q"].float(), "hot_k": inp["hot_k"].float(), "hot_v": inp["hot_v"].float()}
    )[0]
    return exact, rel(hybrid_decode_attention_ref(**inp)[0], exact)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--per", type=lambda x: [int(v) for v in x.split(",")], default=[1, 4, 16, 64, 256])
    ap.add_argument("--planned", type=lambda x: [tuple(int(v) for v in p.split(":")) for p in x.split(",")],
                    default=[], help="batch:context shapes, each split as planned")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    planned = triton_decode.plan_splits
    rows = []
    for bits in (4, 8):
        for dtype in (torch.float16, torch.bfloat16):
            inp = inputs(bits, dtype, args.blocks)
            exact, floor = reference(inp)
            base = triton_decode.PURE_INT8 if bits == 8 else triton_decode.default_options(bits)
            for kernel, opts in (("gluon", replace(base, gluon=True)), ("split", replace(base, gluon=False))):
                for per in args.per:
                    triton_decode.plan_splits = forced_plan(max(1, args.blocks // per))
                    try:
                        out = triton_decode.hybrid_decode_attention_triton(**inp, options=opts)[0]
                        table = inp["block_table"]
                        plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], table, opts)
                    finally:
                        triton_decode.plan_splits = planned
                    name = str(dtype).split(".")[1]
                    err = rel(out, exact)
                    rows.append(dict(bits=bits, dtype=name, kernel=plan.kernel, asked=kernel, per=plan.per,
                                     splits=plan.splits, err=err, floor=floor))  # fmt: skip
                    print(f"INT{bits} {name:8s} {plan.kernel:6s} {plan.per:4d} blocks a program "
                          f"({plan.splits:3d} splits): rel. error {err:.2e} (floor {floor:.2e})")  # fmt: skip
    for batch, context in args.planned:
        for bits in (4, 8):
            inp = inputs(bits, torch.bfloat16, context // BS, batch)
            exact, floor = reference(inp)
            opts = triton_decode.PURE_INT8 if bits == 8 else triton_decode.default_options(bits)
            triton_decode.hybrid_decode_attention_triton(**inp, options=opts)  # the build's occupancy
            out = triton_decode.hybrid_decode_attention_triton(**inp, options=opts)[0]
            plan = triton_decode.launch_plan(inp["q"], inp["hot_k"], inp["pool"], inp["block_table"], opts)
            err = rel(out, exact)
            rows.append(dict(bits=bits, dtype="bfloat16", kernel=plan.kernel, batch=batch, context=context,
                             per=plan.per, splits=plan.splits, err=err, floor=floor))  # fmt: skip
            print(f"INT{bits} bfloat16 {plan.kernel:6s} {batch} x {context}, planned: {plan.per} blocks a "
                  f"program ({plan.splits} splits): rel. error {err:.2e} (floor {floor:.2e})")  # fmt: skip
            del inp, exact, out
            torch.cuda.empty_cache()
    (args.out / "split_error.json").write_text(json.dumps(rows, indent=1))
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
