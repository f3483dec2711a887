"""The decode step's Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

``triton.compile`` lowers a kernel through Triton IR, LLVM and PTX to a cubin (``ptxas`` ships with Triton)
for a target given by hand, so a kernel that the interpreter accepts but the compiler rejects fails here, in
CI, not on the GPU. Signatures are those the launchers produce for bf16 Llama-3-8B / SmolLM2 shapes.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _sig(names: str, types: str) -> dict[str, str]:
    return dict(zip(names.split(), types.split(), strict=True))


# (module, kernel, signature, constexprs)
CASES: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "add_rms_norm": ("triton_elementwise", "_add_rms_norm_kernel",
                     _sig("x_ptr d_ptr w_ptr sum_ptr out_ptr n_cols eps s_x s_d s_s s_o",
                          "*bf16 *bf16 *bf16 *bf16 *bf16 i32 fp32 i32 i32 i32 i32"),
                     {"HAS_DELTA": True, "BLOCK": 4096}),
    "rms_norm": ("triton_elementwise", "_add_rms_norm_kernel",
                 _sig("x_ptr d_ptr w_ptr sum_ptr out_ptr n_cols eps s_x s_d s_s s_o",
                      "*fp32 *fp32 *fp32 *fp32 *fp32 i32 fp32 i32 i32 i32 i32"),
                 {"HAS_DELTA": False, "BLOCK": 1024}),
    "rope_qkv": ("triton_elementwise", "_rope_qkv_kernel",
                 _sig("qkv_ptr cos_ptr sin_ptr q_ptr k_ptr v_ptr s_n s_cn",
                      "*bf16 *fp32 *fp32 *bf16 *bf16 *bf16 i32 i32"),
                 {"HQ": 32, "H": 8, "D": 128, "HALF": 64}),
    "silu_mul": ("triton_elementwise", "_silu_mul_kernel",
                 _sig("gu_ptr out_ptr n_cols s_g s_o", "*bf16 *bf16 i32 i32 i32"), {"BLOCK": 1024}),
    "access_mark": ("triton_access", "_mark_kernel",
                    _sig("mass_ptr table_ptr ncold_ptr flags_ptr M", "*fp32 *i32 *i32 *i32 i32"), {"MB": 64}),
    "access_update": ("triton_access", "_update_kernel",
                      _sig("table_ptr ncold_ptr flags_ptr last_ptr ema_ptr now_bits M",
                           "*i32 *i32 *i32 *fp64 *fp64 i64 i32"),
                      {"EMA_W": 0.25, "MB": 64}),
    "sparse_split": ("triton_sparse_table", "_split_kernel",
                     _sig("blocks_ptr tier_ptr l1_ptr l2_ptr n1_ptr n2_ptr bytes_ptr M quest_cost",
                          "*i64 *i8 *i32 *i32 *i32 *i32 *i64 i32 i32"),
                     {"T1": 1, "T2": 2, "MB": 64}),
    "sparse_merge": ("triton_sparse_table", "_merge_kernel",
                     _sig("l1_ptr n1_ptr l2_ptr val_ptr idx_ptr bits_ptr cost_ptr table_ptr num_ptr "
                          "bytes_ptr M K W", "*i32 *i32 *i32 *fp32 *i64 *u8 *i64 *i32 *i32 *i64 i32 i32 i32"),
                     {"H": 8, "MB": 64}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case: str) -> None:
    module, name, signature, constexprs = CASES[case]
    fn = getattr(importlib.import_module(f"kvtune.kernels.{module}"), name)
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER)
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
