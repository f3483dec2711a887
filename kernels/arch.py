"""What a kernel launch may use on one GPU architecture: the limits the launchers plan with.

The kernels run on the architectures of the card catalog (``search_spaces/cards.py``): sm_80 (A100), sm_86
(A10G), sm_89 (L4, L40S, RTX 4090) and sm_90 (H100, H200). The launch options that depend on the card are
taken from an :class:`Arch`, never assumed to be Hopper's:

* programmatic dependent launch (``griddepcontrol``) and tensor copies (TMA) exist from sm_90 only
  (:attr:`Arch.pdl`, :attr:`Arch.tma`);
* a Gluon build's shared-memory ring must fit ``shared_per_program``, and the programs resident per
  multiprocessor follow from ``shared_per_sm``, ``regs_per_sm`` and ``max_programs_per_sm``;
* the largest block size whose decode kernels fit a program's shared memory (``max_block_size``): the
  Triton split kernel stages a whole block of codes (a 256-token 8-bit block with per-block bits, or an
  unquantized one, needs ~140 KB), more than the 99 KB an sm_86 / sm_89 program may have.

Figures are NVIDIA's (CUDA programming guide, "compute capabilities"). ``tests/test_triton_compile.py``
compiles every kernel for each architecture here, with the options :func:`arch_of` leads the launchers to.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kvtune.kernels.backend import ahead

KB = 1024


@dataclass(frozen=True)
class Arch:
    """The limits of one compute capability that the launchers plan with (bytes, registers, programs)."""

    capability: tuple[int, int]
    shared_per_sm: int
    shared_per_program: int  # the most one program (thread block) may opt in to
    max_programs_per_sm: int  # resident thread blocks per multiprocessor
    max_block_size: int  # the largest KV block (tokens) whose decode kernels fit ``shared_per_program``
    regs_per_sm: int = 64 * KB

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def target(self) -> int:
        """The compiler's architecture number (90 for sm_90)."""
        return 10 * self.capability[0] + self.capability[1]

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (``griddepcontrol``): Hopper and later."""
        return self.capability >= (9, 0)

    @property
    def tma(self) -> bool:
        """Tensor memory access (bulk tensor copies against an mbarrier): Hopper and later."""
        return self.capability >= (9, 0)

    @property
    def fp8(self) -> bool:
        """Float8 e4m3 loads and conversions (Triton's ``float8e4nv``): Ada (sm_89) and later."""
        return self.capability >= (8, 9)


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch((8, 0), 164 * KB, 163 * KB, 32, 256),
        Arch((8, 6), 100 * KB, 99 * KB, 16, 128),
        Arch((8, 9), 100 * KB, 99 * KB, 24, 128),
        Arch((9, 0), 228 * KB, 227 * KB, 32, 256),
    )
}
HOPPER = ARCHS["sm_90"]


def arch_for(capability: tuple[int, int]) -> Arch:
    """The catalog's :class:`Arch` of a compute capability; ValueError naming the known ones."""
    for arch in ARCHS.values():
        if arch.capability == tuple(capability):
            return arch
    known = [a.capability for a in ARCHS.values()]
    raise ValueError(
        f"compute capability {tuple(capability)} is not one the kernels plan for; known: {known}"
    )


def arch_of(device: torch.device) -> Arch:
    """The limits of ``device``: its capability's entry, with the shared memory and registers the driver
    reports. A CPU device (the Triton interpreter, launches recorded for a compile) plans as sm_90, or as the
    GPU a planning process compiles for (``kernels.backend.plan_ahead``); a newer capability than the
    catalog's plans as the newest entry with the driver's figures."""
    if device.type != "cuda":
        planned = ahead()
        return HOPPER if planned is None else planned.arch
    return _cuda_arch(device)


@functools.lru_cache(maxsize=16)
def _cuda_arch(device: torch.device) -> Arch:
    cap = torch.cuda.get_device_capability(device)
    known = [a for a in ARCHS.values() if a.capability <= cap]
    if not known:
        raise ValueError(f"{device}: compute capability {cap} is older than sm_80, which the kernels need")
    base = (
        arch_for(cap) if any(a.capability == cap for a in known) else max(known, key=lambda a: a.capability)
    )
    props = torch.cuda.get_device_properties(device)
    return dataclasses.replace(
        base,
        capability=cap,
        shared_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", base.shared_per_sm)),
        shared_per_program=int(getattr(props, "shared_memory_per_block_optin", base.shared_per_program)),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", base.regs_per_sm)),
    )


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a CPU, the interpreter's or a recorded launch, plans with 4; planning
    ahead, with the planned GPU's)."""
    if device.type != "cuda":
        planned = ahead()
        return 4 if planned is None else planned.sms
    return _cuda_sms(device)


@functools.lru_cache(maxsize=16)
def _cuda_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
