"""Registers, stack and shared memory of the decode-attention kernel variants, the programs per SM they
allow on an H100/H200 (:func:`kvtune.kernels.triton_decode.resident_programs`) and the SASS instructions of
their block loop (:func:`kvtune.kernels.aot.longest_loop`; for the pair of sparse INT8's builds in one launch,
the longer of the two builds' loops), read from a sm_90 compile on any machine (no
GPU needed: :mod:`kvtune.kernels.aot`), sparse INT8's builds (``gluon_mixed``) among them; then the merge that
follows the Gluon kernel, with 4, 8 or 16 splits' partials in flight at the padded 16 rows or at the group's
own (``MERGE_TILE``, ``MERGE_GROUP_ROWS``).

Llama-3-8B heads (32 query, 8 KV, d128), block_size 64, bf16, as ``benchmarks/decode_attention.py`` launches
them.

    python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvtune.kernels import triton_decode as td
from kvtune.kernels.aot import record_launches, resources
from kvtune.kernels.layout import ColdLayout

# Changes to the launcher's default options per width; ``GLUON`` marks the Gluon cold kernel's builds (on a
# GPU the launcher takes it for pure 8-bit and 4-bit pools; here it is told so). The others are the Triton
# split kernel's.
GLUON = "gluon build"
MIXED = "gluon mixed"  # an 8-bit pool with demoted blocks: gluon_mixed's first launch
VARIANTS: dict[int, dict[str, dict[str, Any]]] = {
    8: {"Gluon, 3 stages (default)": {GLUON: True}, "Gluon, 2 stages": {GLUON: True, "gluon_stages": 2},
        "Gluon, direct loads": {GLUON: True, "gluon_stages": 0},
        "Gluon, tensor copies": {GLUON: True, "gluon_tma": True},
        "Triton, pure INT8": {}, "Triton, byte values (no v_pairs)": {"v_pairs": False},
        "Triton, cap 96": {"maxnreg": 96}, "Triton, mixed 8/4-bit pool": {"mixed": True},
        "Gluon mixed, both builds (default)": {MIXED: True},
        "Gluon mixed, 8-bit build alone": {MIXED: True, "gluon_builds": "two"},
        "Gluon mixed, both, paired": {MIXED: True, "gluon_builds": "paired"},
        "Gluon mixed, both, tensor copies": {MIXED: True, "gluon_tma": True}},
    4: {"Gluon, 2 stages (default)": {GLUON: True}, "Gluon, 3 stages": {GLUON: True, "gluon_stages": 3},
        "Gluon, direct loads": {GLUON: True, "gluon_stages": 0},
        "Gluon, tensor copies": {GLUON: True, "gluon_tma": True},
        "Gluon, tensor copies, 3 stages": {GLUON: True, "gluon_tma": True, "gluon_stages": 3},
        "Triton (2 stages, cap 128)": {}, "Triton, 2 stages, no cap": {"maxnreg": None},
        "Triton, 3 stages, cap 128": {"num_stages": 3}},
    0: {"Triton (default)": {}},
}  # fmt: skip


def split_launch(bits: int, options: td.DecodeKernelOptions, gluon: bool = False, merge: bool = False,
                 mixed: bool = False) -> Any:  # fmt: skip
    """The launch that reads the cold blocks: the Gluon kernel's (``gluon``; ``mixed``: ``gluon_mixed``'s over
    an 8-bit pool with demoted blocks, its first build or the pair) or the Triton split kernel's; ``merge``:
    the merge that follows it instead."""
    b, heads, group, d, m = 3, 8, 4, 128, 9
    pool = ColdLayout(64, heads, d, bits, torch.bfloat16).allocate(40, "cpu")
    pool.may_demote = options.mixed or mixed
    hot = torch.zeros(4, heads, 128, d, dtype=torch.bfloat16)
    table = torch.arange(b * heads * m, dtype=torch.int32).view(b, heads, m) % 40
    launches = record_launches(lambda: td.hybrid_decode_attention_triton(
        torch.zeros(b, heads * group, d, dtype=torch.bfloat16), hot, hot.clone(),
        torch.arange(b, dtype=torch.int32), torch.full((b,), 64, dtype=torch.int32), pool, table,
        torch.full((b, heads), m, dtype=torch.int32), 1 / math.sqrt(d), options=options,
        kernel="gluon_mixed" if mixed else "gluon" if gluon else "split",
    ))  # fmt: skip
    if merge:
        return launches[-1]  # the merge comes last
    return launches[1] if mixed else launches[0]  # (mixed: after the bits partition)


def main() -> None:
    print(f"{'bits':>4} {'variant':<34} {'warps':>5} {'regs':>5} {'stack B':>7} {'smem KB':>7} "
          f"{'programs/SM':>11} {'loop SASS':>9}")  # fmt: skip
    for bits, variants in VARIANTS.items():
        for name, changes in variants.items():
            mixed = changes.get(MIXED, False)
            base = td.PURE_INT8 if bits == 8 and not mixed else td.default_options(bits)
            opts = {k: v for k, v in changes.items() if k not in (GLUON, MIXED)}
            r = resources(
                split_launch(bits, replace(base, **opts), gluon=changes.get(GLUON, False), mixed=mixed)
            )
            resident = td.resident_programs(r.registers, r.num_warps, r.shared_bytes)
            print(f"{bits:>4} {name:<34} {r.num_warps:>5} {r.registers:>5} {r.stack_bytes:>7} "
                  f"{r.shared_bytes / 1024:>7.1f} {resident:>11} {r.loop_instructions:>9}")  # fmt: skip
    # the merge after the Gluon kernel: partials in flight, at the padded 16 rows or at the group's own
    default = (td.MERGE_TILE, td.MERGE_GROUP_ROWS)
    for tile, group_rows in ((4, False), (8, False), (8, True), (16, True)):
        td.MERGE_TILE, td.MERGE_GROUP_ROWS = tile, group_rows
        r = resources(split_launch(4, td.default_options(4), gluon=True, merge=True))
        name = f"merge {tile}, {'group' if group_rows else '16'} rows" + (
            " (default)" if (tile, group_rows) == default else ""
        )
        resident = td.resident_programs(r.registers, r.num_warps, r.shared_bytes)
        print(f"{4:>4} {name:<34} {r.num_warps:>5} {r.registers:>5} {r.stack_bytes:>7} "
              f"{r.shared_bytes / 1024:>7.1f} {resident:>11} {r.loop_instructions:>9}")  # fmt: skip
    td.MERGE_TILE, td.MERGE_GROUP_ROWS = default


if __name__ == "__main__":
    main()
