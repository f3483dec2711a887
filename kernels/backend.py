"""Whether the Triton kernels are used: the public launchers dispatch to them for CUDA tensors.

The Triton modules (``triton_decode``, ``triton_quest``, ``triton_quant``, ...) are imported on first CUDA
use, not here: Triton chooses between its compiler and its CPU interpreter when a kernel is defined.

``KVTUNE_KERNELS=torch`` in the environment makes every launcher take its PyTorch reference, also on CUDA (to
compare, or to step around a kernel problem); the default, ``triton``, uses the kernels wherever they can run.
The variable is read once per process, at the first launch (:func:`kernel_choice`).

Planning ahead (:func:`plan_ahead`): a process that compiles kernels for a GPU it does not have
(:mod:`kvtune.engine.warm`) runs the engine on CPU tensors and must take every decision a CUDA process
would: the Triton launchers, the Gluon kernels, the architecture's limits and multiprocessor count. With an
:class:`Ahead` set, :func:`use_triton` and :func:`on_gpu` answer as for a CUDA tensor of that GPU, and
``kernels.arch`` plans a CPU device with its limits. Such a process only compiles: its launches never run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Ahead:
    """The GPU a planning process compiles for: its limits (a ``kernels.arch.Arch``) and multiprocessors."""

    arch: Any
    sms: int


_ahead: list[Ahead | None] = [None]


def plan_ahead(ahead: Ahead | None) -> None:
    """Plan every launch of this process for ``ahead``'s GPU (None: for the tensors' own devices again)."""
    _ahead[0] = ahead


def ahead() -> Ahead | None:
    """The GPU this process plans for, if it plans ahead (:func:`plan_ahead`)."""
    return _ahead[0]


def on_gpu(t: torch.Tensor | torch.device) -> bool:
    """A CUDA tensor or device, or any while planning ahead."""
    device = t if isinstance(t, torch.device) else t.device
    return device.type == "cuda" or _ahead[0] is not None


def use_triton(t: torch.Tensor | torch.device) -> bool:
    """Take the Triton kernel for this tensor (or device): CUDA (or planning ahead), Triton installed, and not
    ``KVTUNE_KERNELS=torch``."""
    choice = kernel_choice()  # checked on every machine, so that a typo fails on a CPU too
    return on_gpu(t) and HAS_TRITON and choice == "triton"
