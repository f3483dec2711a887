"""The CUDA attention backend ``KVTUNE`` (``--attention-backend KVTUNE``; imports vLLM).

Written against vLLM 0.32's backend interfaces (``vllm/v1/attention/backend.py``, following
``vllm/v1/attention/backends/triton_attn.py`` for what a CUDA backend declares) and sharing the CPU backend's
pages and step (:mod:`kvtune.vllm_plugin.backend`): the same opaque cold page per layer (``customize_spec``),
the same hot companion layer (a sliding window of ``hot_tokens + block_size`` tokens), the same step.

* :class:`KvtuneCudaBackend` is selected by name only, and only serves a kvtune block:
  :meth:`~KvtuneCudaBackend.validate_configuration` refuses a run without one, without ``--block-size``
  equal to its ``block_size``, or with a field vLLM cannot serve (the contract's line; see
  :func:`kvtune.vllm_plugin.settings.cuda_refusals`), besides vLLM's own checks (fp16/bf16, ``auto`` KV
  dtype, decoder self-attention, block sizes a multiple of 16).
* Each step, :func:`kvtune.vllm_plugin.decode.layer_step` runs per layer: a decode batch (one token per
  request) as device work only (the hot window gathered, kvtune's Triton seal, the fused decode kernel);
  a batch with a prefill through the CPU backend's host plan (kvtune's Triton seal on CUDA tensors; the
  prefill's attention PyTorch's over the dequantized blocks, its one-token requests the decode kernel's).
* CUDA graphs: :class:`KvtuneCudaBuilder` declares ``UNIFORM_SINGLE_TOKEN_DECODE``: vLLM captures whole
  decode steps (the decode path reads no device value on the host and keeps fixed shapes) and runs the
  other batches' attention eagerly between piecewise graphs.

vLLM itself cannot run where this was written and tested: the step and its kernels are tested on a GPU
without vLLM (``tests/test_vllm_plugin.py -m gpu``); the vLLM CUDA path is not exercised end to end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheLayout

from kvtune.vllm_plugin.backend import (
    _PROCESS,
    HotLayer,
    KvtuneBuilder,
    KvtuneHotBackend,
    KvtuneImpl,
    KvtuneMetadata,
    page_layout,
)
from kvtune.vllm_plugin.decode import layer_step
from kvtune.vllm_plugin.pages import cold_pool_view, hot_views
from kvtune.vllm_plugin.settings import cuda_refusals

NAME = "KVTUNE"
MODEL_DTYPES: list[torch.dtype] = [torch.float16, torch.bfloat16]


class KvtuneCudaBuilder(KvtuneBuilder):
    """Both groups' metadata as vLLM hands it over (its persistent buffers: what a captured graph reads)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class KvtuneCudaHotBackend(KvtuneHotBackend):
    """The hot companion layers of ``KVTUNE`` layers."""

    supported_dtypes: ClassVar[list[torch.dtype]] = MODEL_DTYPES

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_builder_cls() -> Any:
        return KvtuneCudaBuilder


class KvtuneCudaHotLayer(HotLayer):
    def get_attn_backend(self) -> type[AttentionBackend]:
        return KvtuneCudaHotBackend


class KvtuneCudaImpl(KvtuneImpl):
    """One attention layer over the hybrid cache on CUDA: :func:`kvtune.vllm_plugin.decode.layer_step`."""

    hot_layer_cls: ClassVar[type[HotLayer]] = KvtuneCudaHotLayer

    def run(
        self,
        cold_meta: KvtuneMetadata,
        hot_meta: KvtuneMetadata,
        kv_cache: torch.Tensor,
        hot_cache: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        hot_k, hot_v = hot_views(hot_cache, self.head_size)
        layer_step(
            self.batch(cold_meta, hot_meta),
            cold_pool_view(self.page, kv_cache),
            hot_k,
            hot_v,
            query,
            key,
            value,
            self.scale,
            output,
        )


class KvtuneCudaBackend(AttentionBackend):
    """``--attention-backend KVTUNE``: kvtune's hybrid cache on CUDA (see the module docstring)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = MODEL_DTYPES
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]
    forward_includes_kv_cache_update: bool = True  # new tokens go to the hot pages inside forward

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> Any:
        return KvtuneCudaImpl

    @staticmethod
    def get_builder_cls() -> Any:
        return KvtuneCudaBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 2 == 0  # INT4 packs channel pairs; others than 64/128 take slower kernels

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # block-compact: each page's bytes contiguous

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return int(capability.major) >= 8  # Triton's bf16 matrix units

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        settings = _PROCESS.resolve()
        if settings is None or type(spec) is not FullAttentionSpec:
            return spec
        page = page_layout(settings, spec.num_kv_heads, spec.head_size, spec.dtype)
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=page.bytes_per_token)

    @classmethod
    def validate_configuration(cls, **selector: Any) -> list[str]:
        """vLLM's checks (:class:`AttentionBackend`), then kvtune's (one line each): vLLM calls this with
        its selector's fields as keywords, inside its config context."""
        reasons: list[str] = super().validate_configuration(**selector)
        config = get_current_vllm_config_or_none()
        additional = config.additional_config if config is not None else None
        return reasons + cuda_refusals(additional, selector.get("block_size"))
