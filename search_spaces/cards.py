"""Facts about the cards kvtune tunes for, and how a card is recognised (docs/DESIGN.md §3).

Each card has a canonical id (``h100-sxm``, ``a100-80g``, ``cpu``, ...) and a family (``h100``), so
``--gpu h100`` resolves to the variant that is present, and NVML names plus total memory map to an id.
Figures are the vendors' datasheet values; memory is what NVML reports as total (MiB × 2^20).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtune.kernels.arch import arch_for

MIB = 2**20
GPU_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
CPU_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128)
# a present device as NVML names it: (name, total memory in bytes)
Present = tuple[str, int]


@dataclass(frozen=True)
class Card:
    """One card model.

    ``memory_bytes`` is 0 for ``cpu`` in the catalog (host RAM is read at resolution time);
    ``hbm_bandwidth_gbs`` is 0 for ``cpu`` (not a fixed fact: measured per run).
    """

    id: str
    family: str
    label: str
    memory_bytes: int
    hbm_bandwidth_gbs: float
    l2_bytes: int
    sms: int
    int8_tensor_cores: bool
    fp8_tensor_cores: bool
    compute_capability: tuple[int, int] | None
    nvml_patterns: tuple[str, ...]
    block_sizes: tuple[int, ...] = GPU_BLOCK_SIZES

    @property
    def is_gpu(self) -> bool:
        return self.id != "cpu"

    def matches_name(self, nvml_name: str) -> bool:
        return any(re.search(p, nvml_name.lower()) for p in self.nvml_patterns)


def _gpu(id: str, family: str, label: str, mib: int, gbs: float, l2_mib: int, sms: int, fp8: bool,
         cc: tuple[int, int], *patterns: str) -> Card:  # fmt: skip
    return Card(
        id, family, label, mib * MIB, gbs, l2_mib * MIB, sms, True, fp8, cc, patterns, gpu_block_sizes(cc)
    )


def gpu_block_sizes(capability: tuple[int, int]) -> tuple[int, ...]:
    """The block sizes a card of this compute capability offers: those whose decode kernels fit one
    program's shared memory there (:attr:`kvtune.kernels.arch.Arch.max_block_size`; sm_86 / sm_89: up to
    128 tokens)."""
    largest = arch_for(capability).max_block_size
    return tuple(b for b in GPU_BLOCK_SIZES if b <= largest)


CARDS: dict[str, Card] = {
    card.id: card
    for card in (
        _gpu("h100-sxm", "h100", "H100 SXM5 80GB", 81559, 3350, 50, 132, True, (9, 0), r"h100.*(sxm|hbm3)"),
        _gpu("h100-pcie", "h100", "H100 PCIe 80GB", 81559, 2000, 50, 114, True, (9, 0), r"h100.*pcie"),
        _gpu("h200", "h200", "H200 141GB", 143771, 4800, 50, 132, True, (9, 0), r"h200"),
        _gpu("a100-40g", "a100", "A100 40GB", 40960, 1555, 40, 108, False, (8, 0), r"a100"),
        _gpu("a100-80g", "a100", "A100 80GB", 81920, 2039, 40, 108, False, (8, 0), r"a100"),
        _gpu("l40s", "l40s", "L40S 48GB", 46068, 864, 96, 142, True, (8, 9), r"\bl40s\b"),
        _gpu("l4", "l4", "L4 24GB", 23034, 300, 48, 58, True, (8, 9), r"\bl4\b"),
        _gpu("a10g", "a10g", "A10G 24GB", 23028, 600, 6, 80, False, (8, 6), r"\ba10g\b"),
        _gpu("rtx-4090", "rtx-4090", "GeForce RTX 4090 24GB", 24564, 1008, 72, 128, True, (8, 9), r"4090"),
        Card("cpu", "cpu", "host CPU", 0, 0.0, 0, 0, False, False, None, (), CPU_BLOCK_SIZES),
    )
}
ALIASES: dict[str, str] = {"4090": "rtx-4090", "rtx4090": "rtx-4090", "h100-sxm5": "h100-sxm"}
MEMORY_TOLERANCE = 0.15  # NVML totals sit a few % under the marketing figure


def host_memory_bytes() -> int:
    """Physical RAM of this machine (the ``cpu`` card's memory)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _with_host_memory(card: Card) -> Card:
    return card if card.is_gpu else dataclasses.replace(card, memory_bytes=host_memory_bytes())


def card_ids() -> list[str]:
    return list(CARDS)


def families() -> dict[str, list[str]]:
    """Family name -> the card ids in it (``h100`` -> ``[h100-sxm, h100-pcie]``)."""
    out: dict[str, list[str]] = {}
    for card in CARDS.values():
        out.setdefault(card.family, []).append(card.id)
    return out


def match_card(nvml_name: str, memory_bytes: int) -> Card:
    """The catalog card NVML calls ``nvml_name`` with ``memory_bytes`` total memory.

    Among cards whose name pattern matches, the one whose memory is within 15 % of ``memory_bytes``
    (closest first). Raises ``ValueError`` when none is.
    """
    named = [c for c in CARDS.values() if c.matches_name(nvml_name)]
    fitting = [c for c in named if abs(c.memory_bytes - memory_bytes) <= MEMORY_TOLERANCE * c.memory_bytes]
    if not fitting:
        seen = f"{nvml_name!r} with {memory_bytes / 2**30:.1f} GiB"
        raise ValueError(f"GPU {seen} matches no card of the catalog; known cards: {card_ids()}")
    return min(fitting, key=lambda c: abs(c.memory_bytes - memory_bytes))


def _normalise(arg: str) -> str:
    key = arg.strip().lower().replace("_", "-").replace(" ", "-")
    return ALIASES.get(key, key)


def _present_ids(present: Sequence[Present]) -> set[str]:
    ids = set()
    for name, memory in present:
        try:
            ids.add(match_card(name, memory).id)
        except ValueError:
            continue  # a card outside the catalog cannot be what the user asked for
    return ids


def resolve_gpu(arg: str, present: Sequence[Present] | None = None, flag: str = "--gpu") -> Card:
    """The card ``--gpu arg`` names: a card id, an alias, or a family resolved among ``present`` GPUs.

    ``present`` lists the devices seen (NVML name, total bytes); ``None`` means unknown. A family with
    several variants (``h100``) resolves to the one variant present, else raises ``ValueError`` listing
    the choices. ``cpu`` gets this machine's RAM as its memory.
    """
    key = _normalise(arg)
    if key in CARDS:
        return _with_host_memory(CARDS[key])
    variants = families().get(key)
    if variants is None:
        choices = sorted({*CARDS, *families(), *ALIASES})
        raise ValueError(f"{flag} {arg!r}: unknown GPU; choose one of {choices}")
    if len(variants) == 1:
        return CARDS[variants[0]]
    here = [v for v in variants if v in _present_ids(present or ())]
    if len(here) == 1:
        return CARDS[here[0]]
    where = "several are present" if here else "none of them is detected here"
    raise ValueError(f"{flag} {arg!r} is ambiguous ({where}); choose one of {here or variants}")
