"""vLLM's side of the plugin: the CPU attention backend, its impl and builder, and the hot companion layer.

Imported only by :func:`kvtune.vllm_plugin.register` inside a vLLM process (this module imports vLLM).

* :class:`KvtuneCPUBackend` overrides ``CPU_ATTN`` (the CPU platform always picks it). Without a ``kvtune``
  block in ``additional_config`` it hands vLLM the stock CPU impl, builder and page unchanged.
* With one, each attention layer's page becomes a kvtune cold block (``customize_spec``; see
  :mod:`kvtune.vllm_plugin.pages`) and its impl (:class:`KvtuneImpl`) registers a companion layer
  (:class:`HotLayer`) whose sliding-window spec holds the hot window in model precision: vLLM allocates,
  frees, counts and prefix-caches both from its one block pool.
* Each step, :mod:`kvtune.vllm_plugin.step` runs per layer over the two groups' block tables.

``customize_spec`` and the builder are called where vLLM has no current config, so the settings read when
the first impl is built (inside vLLM's config context) are kept for the process in :data:`_PROCESS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheLayout, SlidingWindowSpec

from kvtune.cache_impl.layout import ModelKVShape, cold_layout
from kvtune.vllm_plugin.decode import Batch, Geometry
from kvtune.vllm_plugin.pages import PageLayout, cold_pool_view, hot_views
from kvtune.vllm_plugin.settings import PluginSettings, settings_from
from kvtune.vllm_plugin.step import run_layer

HOT_SUFFIX = ".kvtune_hot"


@dataclass
class _Process:
    """The settings of this vLLM process, read once from the first config seen (see the module docstring)."""

    read: bool = False
    settings: PluginSettings | None = None
    model_dtype: torch.dtype | None = None

    def resolve(self) -> PluginSettings | None:
        if not self.read:
            config = get_current_vllm_config_or_none()
            if config is not None:
                self.settings = settings_from(config.additional_config, config.cache_config.block_size)
                self.model_dtype = config.model_config.dtype
                self.read = True
        return self.settings


_PROCESS = _Process()


def page_layout(settings: PluginSettings, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
    shape = ModelKVShape(1, num_kv_heads, head_dim, num_kv_heads, dtype)
    # vLLM's pages hold no e4m3 summary (``pages.PageLayout.fields``): Quest reads the fp16 bounds there
    return PageLayout(cold_layout(settings.config, shape, summary=False))


class KvtuneCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN``: vLLM's own CPU attention, or kvtune's hybrid cache when the config has a kvtune block."""

    @staticmethod
    def get_impl_cls() -> Any:
        return KvtuneImpl if _PROCESS.resolve() is not None else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> Any:
        return KvtuneBuilder if _PROCESS.resolve() is not None else CPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        settings = _PROCESS.resolve()
        if settings is None or type(spec) is not FullAttentionSpec:
            return super().customize_spec(spec)
        page = page_layout(settings, spec.num_kv_heads, spec.head_size, spec.dtype)
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=page.bytes_per_token)


@dataclass
class KvtuneMetadata:
    """One group's metadata of one step; ``batches`` memoizes the step's :class:`Batch` (and with it the host
    plan) for the layers after the first, keyed by the hot group's metadata."""

    common: CommonAttentionMetadata
    batches: dict[int, Batch] = field(default_factory=dict)


class KvtuneBuilder(AttentionMetadataBuilder[KvtuneMetadata]):
    """Hands each group's common metadata (block table, slot mapping, lengths) to the impl."""

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KvtuneMetadata:
        return KvtuneMetadata(common_attn_metadata)


class _HotImpl(AttentionImpl):
    """The companion layer computes nothing: the attention layer it belongs to reads and writes its pages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the kvtune hot layer is never called")


class KvtuneHotBackend(AttentionBackend):
    """The backend of the hot companion layers: model-precision pages of any block size, kvtune's builder."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # vLLM looks backend names up in its enum; the companion serves CPU_ATTN layers

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> Any:
        return _HotImpl

    @staticmethod
    def get_builder_cls() -> Any:
        return KvtuneBuilder


class HotLayer(AttentionLayerBase):
    """The hot window of one attention layer: a sliding window of ``hot_tokens + block_size`` tokens in
    model precision, its page padded to the cold page."""

    def __init__(self, name: str, page: PageLayout, window: int) -> None:
        self.layer_name = name
        self.page = page
        self.window = window
        self.impl = _HotImpl()
        self.kv_cache = torch.tensor([])
        self.attn_type = AttentionType.DECODER
        self.kv_sharing_target_layer_name = None

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KvtuneHotBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> SlidingWindowSpec:
        cold = self.page.cold
        return SlidingWindowSpec(
            block_size=self.page.hot_block_size,
            num_kv_heads=cold.num_kv_heads,
            head_size=cold.head_dim,
            dtype=cold.dtype,
            sliding_window=self.window,
            page_size_padded=self.page.page_bytes,
        )


class KvtuneImpl(AttentionImpl):
    """One attention layer over kvtune's hybrid cache (decoder self-attention, no ALiBi, soft cap or
    sliding window of the model's own)."""

    hot_layer_cls: ClassVar[type[HotLayer]] = HotLayer  # the companion's class (its backend's name)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        settings = _PROCESS.resolve()
        assert settings is not None and _PROCESS.model_dtype is not None
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap or None,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            "kv_cache_dtype": None if kv_cache_dtype == "auto" else kv_cache_dtype,
            "attn_type": None if attn_type == AttentionType.DECODER else attn_type,
            **{k: v for k, v in extra.items() if v is not None},
        }
        for key, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(
                    f"kvtune's vLLM plugin serves decoder self-attention with --kv-cache-dtype auto only; "
                    f"this layer has {key}={value!r}"
                )
        self.settings = settings
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.page = page_layout(settings, num_kv_heads, head_size, _PROCESS.model_dtype)
        self.hot_name: str | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Register this layer's hot companion beside it in vLLM's forward context."""
        config = get_current_vllm_config_or_none()
        assert config is not None, "kvtune: no vLLM config while loading weights"
        context = config.compilation_config.static_forward_context
        names = [name for name, layer in context.items() if getattr(layer, "impl", None) is self]
        assert len(names) == 1, f"kvtune: the layer of an impl is not found once: {names}"
        self.hot_name = names[0] + HOT_SUFFIX
        if self.hot_name not in context:
            context[self.hot_name] = self.hot_layer_cls(self.hot_name, self.page, self.settings.window_tokens)

    def do_kv_cache_update(self, *args: Any, **kwargs: Any) -> None:
        """New tokens go to the hot pages in :meth:`forward` (step 1 of :mod:`kvtune.vllm_plugin.step`)."""

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvtuneMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "kvtune's impl writes into vLLM's output buffer"
        if attn_metadata is None:  # the profiling run: no cache yet
            return output.fill_(0)
        context = get_forward_context()
        hot_meta = context.attn_metadata[self.hot_name]  # type: ignore[index]
        hot_cache = context.no_compile_layers[self.hot_name].kv_cache
        self.run(attn_metadata, hot_meta, kv_cache, hot_cache, query, key, value, output)
        return output

    def batch(self, cold_meta: KvtuneMetadata, hot_meta: KvtuneMetadata) -> Batch:
        """The step's :class:`~kvtune.vllm_plugin.decode.Batch`, built by the first layer (host values and
        vLLM's tensors only) and kept in the cold group's metadata for the others."""
        key = id(hot_meta)
        if key not in cold_meta.batches:
            c, h, s = cold_meta.common, hot_meta.common, self.settings
            r = c.num_reqs
            cold_meta.batches[key] = Batch(
                geo=Geometry(s.hot_tokens, s.block_size, self.page.hot_block_size, s.bits),
                query_start_cpu=c.query_start_loc_cpu[: r + 1],
                seq_lens=c.seq_lens[:r],
                cold_table=c.block_table_tensor[:r],
                hot_table=h.block_table_tensor[:r],
                hot_slots=h.slot_mapping,
                max_query_len=int(c.max_query_len),
                num_tokens=int(c.num_actual_tokens),
            )
        return cold_meta.batches[key]

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
        """The step of this layer over its pages (``kv_cache``: cold, ``hot_cache``: hot) given both groups'
        metadata: :func:`kvtune.vllm_plugin.step.run_layer`."""
        plan = self.batch(cold_meta, hot_meta).plan
        hot_k, hot_v = hot_views(hot_cache, self.head_size)
        n = cold_meta.common.num_actual_tokens
        run_layer(
            plan,
            cold_pool_view(self.page, kv_cache),
            hot_k,
            hot_v,
            query[:n],
            key[:n],
            value[:n],
            self.scale,
            output[:n],
        )
