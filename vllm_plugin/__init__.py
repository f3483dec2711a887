"""kvtune's hybrid cache inside vLLM: a ``vllm.general_plugins`` entry point (see docs/VLLM_PLUGIN.md).

``pip install -e .`` registers :func:`register`; vLLM calls it in each of its processes. It checks the vLLM
version (one line naming both when it is not :data:`~kvtune.vllm_plugin.settings.VLLM_SERIES`), overrides
vLLM's ``CPU_ATTN`` backend with :class:`kvtune.vllm_plugin.backend.KvtuneCPUBackend`, which stays vLLM's own
CPU attention unless ``--additional-config`` holds a ``kvtune`` block, and adds the CUDA backend ``KVTUNE``
(:class:`kvtune.vllm_plugin.cuda.KvtuneCudaBackend`, taken only with ``--attention-backend KVTUNE``).
Importing this package does not import vLLM.
"""

from __future__ import annotations

from kvtune.vllm_plugin.settings import VLLM_SERIES, PluginSettings, VersionError, check_vllm_version

__all__ = ["VLLM_SERIES", "PluginSettings", "VersionError", "check_vllm_version", "register"]

BACKEND_PATH = "kvtune.vllm_plugin.backend.KvtuneCPUBackend"
CUDA_NAME, CUDA_PATH = "KVTUNE", "kvtune.vllm_plugin.cuda.KvtuneCudaBackend"


def register() -> None:
    """The entry point: refuse another vLLM minor version, then override ``CPU_ATTN`` and add the CUDA
    backend ``KVTUNE`` (see :mod:`kvtune.vllm_plugin.cuda`). Idempotent."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(vllm.__version__)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    if CUDA_NAME not in AttentionBackendEnum.__members__:
        register_backend(CUDA_NAME, CUDA_PATH)
