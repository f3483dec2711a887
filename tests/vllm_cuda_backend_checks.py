"""The CUDA backend's checks that need vLLM but no GPU, in one process: ``python THIS_FILE OUT.json``.

Run by ``tests/test_vllm_plugin.py`` (marker ``vllm``) with vLLM's Python, from outside the repository root
(a checkout's ``kernels/`` folder would shadow the ``kernels`` package transformers imports), with kvtune on
``PYTHONPATH``. Writes one JSON object: the backend the registry resolves, ``validate_configuration``'s
answers for several configs, the builder's CUDA-graph support, and how far the CUDA impl's step over the
plugin's pages (vLLM's ``CommonAttentionMetadata`` through its builder, the impl built by vLLM's signature)
is from the CPU impl's, for bits 0 / 8 / 4.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm_step_testlib import Run, page_layout, schedule

from kvtune.vllm_plugin import backend as cpu
from kvtune.vllm_plugin import cuda, register
from kvtune.vllm_plugin.settings import settings_from

HOT, BLOCK, HEADS, GROUP, DIM, DTYPE = 16, 16, 2, 2, 64, torch.bfloat16


def kvtune_block(bits: int = 8, **extra: Any) -> dict[str, Any]:
    base = {"kv_cache_strategy": "hybrid_v2", "hot_tokens": HOT, "block_size": BLOCK}
    return base | {"quantization_bits": bits} | extra


def validate(additional: dict[str, Any], block: int | None, dtype: torch.dtype = DTYPE) -> list[str]:
    config = VllmConfig(cache_config=CacheConfig(block_size=block or BLOCK), additional_config=additional)
    with set_current_vllm_config(config):
        return cuda.KvtuneCudaBackend.validate_configuration(
            head_size=DIM,
            dtype=dtype,
            kv_cache_dtype="auto",
            block_size=block,
            use_mla=False,
            has_sink=False,
            use_sparse=False,
            use_mm_prefix=False,
            use_per_head_quant_scales=False,
            device_capability=DeviceCapability(9, 0),
            attn_type="decoder",
        )


def common(batch: Any, table: torch.Tensor, slots: torch.Tensor) -> CommonAttentionMetadata:
    starts = batch.query_start_cpu
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        seq_lens=batch.seq_lens,
        num_reqs=batch.num_reqs,
        num_actual_tokens=batch.num_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=slots,
    )


def impl(cls: type, bits: int) -> Any:
    """An impl as vLLM builds one (its fixed signature), the process settings set as the first config
    would set them."""
    cpu._PROCESS.read, cpu._PROCESS.model_dtype = True, DTYPE
    cpu._PROCESS.settings = settings_from({"kvtune": kvtune_block(bits)}, BLOCK)
    return cls(HEADS * GROUP, DIM, DIM**-0.5, HEADS, None, None, "auto")


def step_gap(bits: int) -> dict[str, Any]:
    """Prefill chunks then decode steps through the CPU impl and the CUDA impl (on the CPU: reference
    kernels), each over its own pages and both groups' metadata built by its backend's builder."""
    page = page_layout(bits, DTYPE, HOT, BLOCK, HEADS, DIM)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=DTYPE)
    impls = {"cpu": impl(cpu.KvtuneImpl, bits), "cuda": impl(cuda.KvtuneCudaImpl, bits)}
    builders = {"cpu": cpu.KvtuneBuilder, "cuda": cuda.KvtuneCudaBuilder}
    runs = {name: Run(page, HOT, 160, "cpu") for name in impls}
    gap, decode_steps = 0.0, 0
    g = torch.Generator().manual_seed(bits)
    for new in schedule((70, 45, 100), 32, 40):
        t = sum(new)
        q, k, v = (torch.randn(t, h, DIM, generator=g).to(DTYPE) for h in (HEADS * GROUP, HEADS, HEADS))
        outs = {}
        for name, run in runs.items():
            b = run.step(new)
            build = builders[name](spec, ["layer"], None, torch.device("cpu")).build  # type: ignore[arg-type]
            cold_meta = build(0, common(b, b.cold_table, torch.zeros_like(b.hot_slots)))
            hot_meta = build(0, common(b, b.hot_table, b.hot_slots))
            out = torch.zeros_like(q)
            impls[name].run(cold_meta, hot_meta, run.cold_cache(), run.hot_cache(), q, k, v, out)
            outs[name] = out.float()
            decode_steps += int(name == "cuda" and b.is_decode)
        gap = max(gap, float((outs["cuda"] - outs["cpu"]).abs().max()))
    same_pages = bool(torch.equal(runs["cpu"].raw[1:], runs["cuda"].raw[1:]))
    return {"max_abs_gap": gap, "decode_steps": decode_steps, "same_pages": same_pages}


def main(out: str) -> None:
    register()
    register()
    result = {
        "resolved": AttentionBackendEnum["KVTUNE"].get_class().__name__,
        "cpu_attn": AttentionBackendEnum.CPU_ATTN.get_class().__name__,
        "cudagraph": cuda.KvtuneCudaBuilder._cudagraph_support.name,
        "hot_cudagraph": cuda.KvtuneCudaHotBackend.get_builder_cls()._cudagraph_support.name,
        "validate": {
            "ok": validate({"kvtune": kvtune_block()}, BLOCK),
            "no_block": validate({}, BLOCK),
            "no_block_size": validate({"kvtune": kvtune_block()}, None),
            "other_block_size": validate({"kvtune": kvtune_block()}, 2 * BLOCK),
            "sparse": validate({"kvtune": kvtune_block(sparse_top_k=64)}, BLOCK),
            "throttling": validate({"kvtune": kvtune_block(migration_throttling=True)}, BLOCK),
            "broken": validate({"kvtune": kvtune_block(hot_tokens=30)}, BLOCK),
            "float32": validate({"kvtune": kvtune_block()}, BLOCK, torch.float32),
        },
        "steps": {bits: step_gap(bits) for bits in (0, 8, 4)},
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
