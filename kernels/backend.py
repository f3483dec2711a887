"""Whether the Triton kernels are used: the public launchers dispatch to them for CUDA tensors.

The Triton modules (``triton_decode``, ``triton_quest``, ``triton_quant``, ...) are imported on first CUDA
use, not here: Triton chooses between its compiler and its CPU interpreter when a kernel is defined.

``KVTUNE_KERNELS=torch`` in the environment makes every launcher take its PyTorch reference, also on CUDA (to
compare, or to step around a kernel problem); the default, ``triton``, uses the kernels wherever they can run.
The variable is read once per process, at the first launch (:func:`kernel_choice`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None
KERNEL_CHOICES = ("triton", "torch")


@functools.cache
def kernel_choice() -> str:
    """``KVTUNE_KERNELS`` (default ``triton``); ValueError naming the variable for anything else.

    Read once: the first call's answer is cached (every launch asks). A bad value is not cached, so every
    call raises. ``kernel_choice.cache_clear()`` makes the next call read the environment again (a test or a
    script that changes the variable in a running process must call it).
    """
    choice = os.environ.get("KVTUNE_KERNELS", "triton")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"KVTUNE_KERNELS={choice!r}: expected one of {list(KERNEL_CHOICES)}")
    return choice


def use_triton(t: torch.Tensor) -> bool:
    """Take the Triton kernel for this tensor: CUDA, Triton installed, and not ``KVTUNE_KERNELS=torch``."""
    choice = kernel_choice()  # checked on every machine, so that a typo fails on a CPU too
    return t.is_cuda and HAS_TRITON and choice == "triton"
