"""The name ``--attention-backend KVTUNE`` for CUDA, reserved for the plugin's GPU backend (imports vLLM).

The GPU read path is not written yet: selecting the name stops vLLM at start with the reason below, so a GPU
run never serves a kvtune block silently with vLLM's own cache. kvtune's Triton seal and decode kernels over
the plugin's page-strided cold blocks are tested standalone on a GPU
(``tests/test_vllm_plugin.py::test_triton_kernels_over_the_plugins_pages``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backend import AttentionBackend

NAME = "KVTUNE"
NOT_YET = (
    "kvtune's CUDA attention backend is not implemented in this version of the plugin (CPU_ATTN only); "
    "serve the config on the CPU, or in kvtune's own engine"
)


class KvtuneCudaBackend(AttentionBackend):
    """Refuses every configuration with :data:`NOT_YET`."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        return [NOT_YET]

    @staticmethod
    def get_impl_cls() -> Any:
        raise NotImplementedError(NOT_YET)

    @staticmethod
    def get_builder_cls() -> Any:
        raise NotImplementedError(NOT_YET)
