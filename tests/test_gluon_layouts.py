"""The Gluon cold kernel's hand-placed layouts, checked as the linear maps they are (no GPU, no compiler):
bijections, whole 32-byte sectors per global warp-instruction, and shared-memory accesses that meet every
bank once per phase (``kernels/gluon_decode.py``)."""

from __future__ import annotations

from functools import reduce

import pytest

from kvtune.kernels import gluon_decode as gd

# (channels per operand, tokens per block): INT8 d128 / d64, INT4 d128 / d64, and the block sizes
SHAPES = [(128, 64), (64, 64), (32, 64), (128, 16), (64, 32), (32, 16)]


def _coord(bases: list[list[int]], index: int) -> tuple[int, ...]:
    """The coordinate of ``index`` under a linear map with these bases (XOR of its set bits' bases)."""
    picked = [b for i, b in enumerate(bases) if index >> i & 1]
    return tuple(reduce(lambda a, b: [x ^ y for x, y in zip(a, b, strict=True)], picked, [0] * len(bases[0])))


def _offsets(shared) -> dict[tuple[int, ...], int]:
    """Byte offset of every coordinate of a one-byte-element shared linear layout (asserting a bijection)."""
    bases = shared.offset_bases
    where = {_coord(bases, off): off for off in range(1 << len(bases))}
    assert len(where) == 1 << len(bases), "the shared layout maps two offsets to one coordinate"
    return where


def _vector(dist) -> int:
    """Bytes a lane reads as one vector (at most 16)."""
    return 1 << gd.vector_registers(dist)


def _lane_starts(dist, reg: int) -> list[tuple[int, int]]:
    """The [token, channel] each of the 32 lanes holds at register index ``reg`` (a vector's first byte)."""
    at = _coord(dist.reg_bases, reg)
    lanes = [_coord(dist.lane_bases, lane) for lane in range(32)]
    return [tuple(a ^ b for a, b in zip(at, lane, strict=True)) for lane in lanes]


def _phase_ways(addresses: list[int], vec: int) -> int:
    """A warp access of ``vec`` bytes per lane runs in phases of 128 bytes' worth of lanes: the most lanes of
    one phase whose vectors sit in the same bank group (1: every bank met once)."""
    per_phase = 128 // vec
    worst = 1
    for p in range(0, 32, per_phase):
        slots = [(a % 128) // vec for a in addresses[p : p + per_phase]]
        worst = max(worst, max(slots.count(x) for x in slots))
    return worst


def _conflict_free(addresses: list[int], vec: int) -> bool:
    """Within each phase the lanes' vectors sit in distinct bank groups."""
    return _phase_ways(addresses, vec) == 1


def _vector_regs(dist) -> range:
    """Register indices that start a vector (the other registers of a vector follow it)."""
    vec = _vector(dist)
    return range(0, 1 << len(dist.reg_bases), vec)


def _assert_loads_conflict_free(dist, where: dict[tuple[int, ...], int]) -> None:
    """Every vector load in ``dist`` from a stage laid out as ``where`` meets each bank once per phase."""
    vec = _vector(dist)
    for reg in _vector_regs(dist):
        starts = [where[xy] for xy in _lane_starts(dist, reg)]
        assert _conflict_free(starts, vec), f"load of register {reg}: {starts}"


def _assert_copies_conflict_free(lay: gd.Layouts, where: dict[tuple[int, ...], int], t: int) -> None:
    """The coalesced copy (consecutive lanes take consecutive 16-byte pieces of a row, a blocked layout)
    into a stage laid out as ``where`` meets each bank once per phase."""
    lanes_row = lay.copy.threads_per_warp[1]
    assert lay.copy.size_per_thread == [1, 16] and lanes_row * lay.copy.threads_per_warp[0] == 32
    for row0 in range(0, t, 32 // lanes_row):
        starts = [where[(row0 + lane // lanes_row, 16 * (lane % lanes_row))] for lane in range(32)]
        assert _conflict_free(starts, 16), f"copy of rows {row0}..: {starts}"


@pytest.mark.parametrize("c, t", SHAPES)
@pytest.mark.parametrize("codes", ["keys", "values"])
def test_stage_copies_and_loads_meet_every_bank_once(c: int, t: int, codes: str) -> None:
    lay = gd.layouts(c, t)
    stage, load = (lay.k_smem, lay.k_mem) if codes == "keys" else (lay.v_smem, lay.v_mem)
    where = _offsets(stage)
    assert sorted(where) == sorted((r, col) for r in range(t) for col in range(c))
    _assert_copies_conflict_free(lay, where, t)
    _assert_loads_conflict_free(load, where)  # the loads back in the operand's load layout


@pytest.mark.parametrize("c, t", SHAPES)
def test_lane_ordered_key_stage_loads_meet_every_bank_once(c: int, t: int) -> None:
    """The stage of keys copied as they are loaded (``gluon_key_rows`` off)."""
    lay = gd.layouts(c, t)
    _assert_loads_conflict_free(lay.k_mem, _offsets(lay.k_lanes))


@pytest.mark.parametrize("c, t", SHAPES)
def test_key_reads_fill_whole_sectors(c: int, t: int) -> None:
    """Every warp-instruction of the key codes (global memory, rows of ``c`` bytes) reads whole 32-byte
    sectors: the lanes' vectors tile the sectors they touch."""
    lay = gd.layouts(c, t)
    vec = _vector(lay.k_mem)
    for reg in _vector_regs(lay.k_mem):
        starts = [r * c + col for r, col in _lane_starts(lay.k_mem, reg)]
        touched = {a // 32 for a in starts}
        assert len(touched) * 32 == 32 * vec, f"register {reg}: {len(touched)} sectors for {32 * vec} bytes"


@pytest.mark.parametrize("c", [128, 64, 32])
def test_key_bits_is_a_permutation_with_lanes_on_bits_1_and_2(c: int) -> None:
    bits = gd.key_bits(c)
    assert sorted(bits) == list(range(c.bit_length() - 1))
    low = min(4, c.bit_length() - 3)
    assert bits[1:3] == [low, low + 1] and bits[0] == 0


def _tma_stage(c: int, t: int, swizzle: int) -> dict[tuple[int, int], int]:
    """Byte offset of every [token, byte] of a ``[t, c]`` stage written by a tensor copy with a swizzle of
    ``swizzle`` bytes (0, 32, 64, 128): address bits 4.. XOR bits 7.. (one bit per doubling of 16 bytes)."""
    n = {0: 0, 32: 1, 64: 2, 128: 3}[swizzle]
    return {(r, col): (r * c + col) ^ ((((r * c + col) >> 7) & ((1 << n) - 1)) << 4)
            for r in range(t) for col in range(c)}  # fmt: skip


def _ways(dist, where: dict[tuple[int, ...], int]) -> int:
    """The most lanes of one phase whose vectors share a bank group, over every vector load in ``dist``."""
    vec = _vector(dist)
    return max(_phase_ways([where[xy] for xy in _lane_starts(dist, reg)], vec) for reg in _vector_regs(dist))


@pytest.mark.parametrize("c, t", SHAPES)
def test_tma_stages_take_the_least_conflicting_swizzle(c: int, t: int) -> None:
    """``gluon_tma``: a tensor copy can only write the hardware's swizzles, not the stages above. The
    descriptors (``gluon_decode.descriptors``) swizzle by the row's width, ``c`` bytes, which of the
    swizzles a ``[t, c]`` box allows gives the fewest bank conflicts on the loads back: keys meet every
    bank once for rows of 64 bytes or fewer and twice for 128 (two tokens' halves share a phase), values
    once for rows of 128 bytes and twice below (tokens 0, 2, 4, 6 in one phase; no swizzle would be four
    ways). The loads stay correct either way; the conflicts cost shared-memory wavefronts, not bytes."""
    import torch

    from kvtune.kernels.layout import ColdLayout

    lay = gd.layouts(c, t)
    d = c if c == 128 else 2 * c  # the 8-bit build of d128 or the 4-bit builds of d128 / d64
    pool = ColdLayout(t, 2, d, 8 if c == d else 4, torch.bfloat16).allocate(4, "cpu")
    chosen = gd.descriptors(pool, 8 if c == d else 4)[0].layout.swizzle_byte_width
    assert chosen == c
    cost = {s: (_ways(lay.k_mem, _tma_stage(c, t, s)), _ways(lay.v_mem, _tma_stage(c, t, s)))
            for s in (0, 32, 64, 128) if s <= c}  # fmt: skip
    assert cost[chosen] == ((2 if c == 128 else 1), (1 if c == 128 else 2))
    assert all(max(cost[chosen]) <= max(v) and sum(cost[chosen]) <= sum(v) for v in cost.values())
