"""Whether the Triton kernels can be used: the public launchers dispatch to them for CUDA tensors.

The Triton modules (``triton_decode``, ``triton_quest``, ``triton_quant``) are imported on first CUDA use, not
here: Triton chooses between its compiler and its CPU interpreter when a kernel is defined.
"""

from __future__ import annotations

import importlib.util

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None
