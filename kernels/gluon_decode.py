"""The cold blocks of hybrid decode attention in Gluon: one warp per (split, sequence, KV head), every
register placed by hand (Hopper and Ampere, ``mma.sync``; GPU only).

Why a second kernel beside ``triton_decode._split_kernel``: that kernel spreads each 64-token block over four
warps, so every warp repeats the per-block work (folding the key scales into q, the softmax of a 16-row tile
of which four rows are real) and the tiles go through shared memory between the warps and to reach the
matrix unit's operand layouts. Its quantized loops issue ~3,000 warp-instructions per block and are bound by
that (measured on an H200: docs/RESULTS.md, "Decode attention kernels"). Here one warp owns a whole block
and nothing leaves its registers:

* **Keys** are the B operand of ``S = Q' K^T`` ([channels, tokens]). The contraction runs over channels, so
  their order is free as long as q uses the same one: logical channel bits are mapped onto memory bits so
  that each lane's channels of a token are contiguous bytes. A lane loads 16-byte vectors, and one ``prmt``
  turns two codes into an fp16 pair already in the operand's register (``0x64cc`` is ``1024 + c``).
* **Values** are the A operand of ``O^T = V^T P'^T`` ([channels, tokens], the group's query heads on the
  8-wide N): the output's channel order is free until the final store, which maps it back. A lane loads
  16 contiguous channels of a token; one ``prmt`` interleaves two tokens' bytes and two more make the fp16
  pairs (tokens t, t + 1) that the operand holds.
* **The offsets** (``1024 + c`` instead of ``c``, the key mins) never touch a code: ``q . kmin - 1024 (q
  * kscale) . 1`` is one more tiny product per block on the matrix unit (``corr``); for the values each
  block's ``1024 * sum(p * vscale)`` comes off the accumulators right after the block's product (an
  offset left to the end grows with the blocks a program reads, and with it the matrix unit's
  accumulation error: 1.7e-2 relative at 64 blocks for INT4 on an H200, where the Triton split kernel
  stays at 2.7e-4; ``lab/scripts/split_error.py``); ``sum(p * vmin)`` is a per-row sum. The scores'
  softmax works on the 8 rows of the 16-row tile that can hold heads.
* The running maximum rescales the accumulators only when it grows (the branch is uniform: one warp).

INT4 bytes hold channel ``c`` (low nibble) and ``c + D/2`` (high nibble): each half is its own operand of
``D/2`` channels from the same bytes; high nibbles are taken as ``1024 + 16 n`` (no shift), their ``1/16``
folds into q (keys) or the final store (values).

Blocks j + 1 .. j + s - 1 are in flight while block j is computed: ``cp.async`` copies them into a ring of
``s`` stages in shared memory, consecutive lanes along whole rows (stage layouts in which both the copies
and the loads back in the operands' layouts meet every bank once); the block ids travel in the same commit
groups, ``s`` blocks ahead, so no iteration waits on the load of its next id. With ``gluon_tma`` (sm_90)
tensor copies fill the ring instead: one lane issues a block's six copies against its stage's mbarrier
(the stages then take the copies' swizzle, ``descriptors``), and the lanes hold no copy addresses.

An 8-bit pool whose blocks may be demoted to 4 bits (``gluon_mixed``) lists both widths in one table row:
the row is split by bits first (by the sparse selection's kernels where they built the table, else by the
launcher's ``triton_bits_partition``), then the launcher runs the 8-bit build and the 4-bit build (``ROW =
D``: a demoted block's codes fill the first ``D/2`` bytes of its 8-bit rows) over their halves, each into
its own partial slots (``part0``, ``part_stride``): by default both in one launch (``_cold_pair_kernel``),
whose programs take one build's split each by their id, so the builds share one ramp and one tail, and
their rings, live one after the other, the same shared memory.

The hot zone (model precision) and the merge stay with the Triton kernels: the launcher runs this kernel
over the cold blocks, then ``_merge_kernel``, which attends the hot zone and then merges; launched as a
programmatic dependent, it attends the hot zone while this kernel runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvtune.kernels.arch import Arch
from kvtune.kernels.backend import on_gpu
from kvtune.kernels.launch import launch

if TYPE_CHECKING:
    from kvtune.kernels.layout import ColdPool

_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
MMA = gl.constexpr(_MMA)
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
ROWS_N = 8  # query rows per program on the matrix unit's N (the GQA group, G <= 8)
NP = gl.constexpr(ROWS_N)


def _linear(reg: list[list[int]], lane: list[list[int]], shape: list[int]) -> gl.DistributedLinearLayout:
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[], block_bases=[],
                                      shape=shape)  # fmt: skip


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _key_lane_bit(n: int) -> int:
    """The memory bit of the key operand's first lane bit (channels ``2**n``): 4 where a lane holds more
    than 16 channels of a token, so that one warp-instruction reads 16-byte pieces that fill whole 32-byte
    sectors; else the top two bits."""
    return min(4, n - 2)


def key_register_bits(c: int) -> list[int]:
    """The memory bits of the key channels a lane holds in registers, in increasing order."""
    n = _log2(c)
    low = _key_lane_bit(n)
    return [b for b in range(n) if b not in (low, low + 1)]


def key_bits(c: int) -> list[int]:
    """Memory bit of each logical channel bit of the key operand (channels ``c``): logical bits 0, 3, 4, ..
    (a lane's registers) go to memory bits 0, 1, 2, 3, then the bits above the lanes' two; logical bits 1
    and 2 (lanes) to memory bits 4 and 5 (the top two bits where ``c`` < 64)."""
    low = _key_lane_bit(_log2(c))
    return [0, low, low + 1, *key_register_bits(c)[1:]]


def value_bits(c: int) -> list[int]:
    """Memory bit of each logical channel bit of the value operand: bits 3, 4, .. (registers) go to memory
    bits 0, 1, ..; bits 0, 1, 2 (lanes) to the top."""
    n = _log2(c)
    return [n - 3, n - 2, n - 1] + [j - 3 for j in range(3, n)]


def relabel_order(sigma: list[int], lead: int, trail: int) -> list[int]:
    """The ``permute`` order taking a tensor reshaped to ``[lead dims.., 2 x n memory bits (high first),
    trail dims..]`` to ``[lead.., 2 x n logical bits (high first), trail..]``, logical bit ``j`` being
    memory bit ``sigma[j]``."""
    n = len(sigma)
    return (list(range(lead)) + [lead + n - 1 - sigma[n - 1 - p] for p in range(n)]
            + list(range(lead + n, lead + n + trail)))  # fmt: skip


def transposed_order(sigma: list[int]) -> list[int]:
    """The ``permute`` order taking codes reshaped to ``[T, 2 x n memory bits (high first)]`` to ``[2 x n
    logical bits (high first), T]``."""
    n = len(sigma)
    return [1 + n - 1 - sigma[n - 1 - p] for p in range(n)] + [0]


@dataclass(frozen=True)
class Layouts:
    """The hand-placed layouts of one build (channels per operand ``c``, tokens per block ``t``)."""

    k_mem: gl.DistributedLinearLayout  # key codes [t, c] as loaded
    q_mem: gl.DistributedLinearLayout  # q rows [16, c], channels in memory order
    kmin_mem: gl.DistributedLinearLayout  # key mins [c, 8] (broadcast over N)
    v_mem: gl.DistributedLinearLayout  # value codes [t, c] as loaded
    v_pair: gl.DistributedLinearLayout  # value codes [t, c], tokens t, t + 1 side by side
    v_pair4: gl.DistributedLinearLayout  # the same registers, channels c, c + 1 side by side (4-bit codes)
    rows: gl.DistributedLinearLayout  # scores [8, t] of the query rows
    k_smem: gl.SharedLinearLayout  # key codes [t, c] of a stage: rows in order, 16-byte pieces swizzled
    k_lanes: gl.SharedLinearLayout  # the same, each lane's bytes of k_mem contiguous (copied as loaded)
    v_smem: gl.SharedLinearLayout  # value codes [t, c] of a stage: rows in order, 16-byte pieces swizzled
    copy: gl.BlockedLayout  # codes [t, c] as copied: consecutive lanes, consecutive 16 bytes


def vector_registers(dist: gl.DistributedLinearLayout) -> int:
    """log2 of the bytes a lane reads as one vector: its leading registers that are consecutive channels of
    one-byte codes (at most 4: 16 bytes)."""
    regs = dist.reg_bases
    n = 0
    while n < min(4, len(regs)) and regs[n] == [0, 1 << n]:
        n += 1
    return n


def staged(dist: gl.DistributedLinearLayout) -> gl.SharedLinearLayout:
    """The shared layout of one stage [*dist.shape] in which a lane's leading contiguous registers (up to 16
    bytes) are contiguous and a warp's 32 vectors are one run of consecutive bytes: the async copies and
    the loads back in ``dist`` are whole 16-byte vectors without bank conflicts."""
    vec = vector_registers(dist)
    return gl.SharedLinearLayout(dist.reg_bases[:vec] + dist.lane_bases + dist.reg_bases[vec:])


def swizzled_rows(c: int, t: int, swaps: tuple[tuple[int, int], ...]) -> gl.SharedLinearLayout:
    """Rows of ``c`` bytes in order, with each (row bit, byte-offset bit) of ``swaps`` XORed: the row bit
    moves the 16-byte pieces of a row to other banks."""
    where = {}
    for r in range(t):
        for col in range(c):
            off = r * c + col
            for row_bit, off_bit in swaps:
                off ^= ((r >> row_bit) & 1) << off_bit
            where[off] = [r, col]
    return gl.SharedLinearLayout([where[1 << k] for k in range(_log2(t * c))])


def value_stage(c: int, t: int) -> gl.SharedLinearLayout:
    """Value rows with row bits 1 and 2 XORed into byte-offset bits 5 and 6: both the coalesced copy
    (``copy``: a quarter-warp writes one 128-byte run) and the loads in ``v_mem`` (a quarter-warp reads
    16-byte pieces of rows 0, 2, 4, 6) meet every bank once."""
    return swizzled_rows(c, t, ((1, 5), (2, 6)))


def key_stage(c: int, t: int) -> gl.SharedLinearLayout:
    """Key rows for the coalesced copy (``copy``): a quarter-warp of ``k_mem``'s loads reads two rows' halves
    (pieces 0..3 or 4..7 of 128-byte rows), so row bit 0 is XORed into byte-offset bit 6 and the two halves
    meet different banks; rows of 64 bytes or fewer are read whole and stay in order."""
    return swizzled_rows(c, t, ((0, 6),) if c > 64 else ())


@functools.cache
def layouts(c: int, t: int) -> Layouts:
    n, nt = _log2(c), _log2(t)
    low, regs_k = _key_lane_bit(n), key_register_bits(c)
    lanes_k = [[0, 1 << low], [0, 2 << low]]
    tok_regs = [[1 << i, 0] for i in range(3, nt)]
    v_lanes = [[2, 0], [4, 0], [0, 1 << (n - 3)], [0, 1 << (n - 2)], [0, 1 << (n - 1)]]
    lay = dict(
        k_mem=_linear([[0, 1 << b] for b in regs_k] + tok_regs, [*lanes_k, [1, 0], [2, 0], [4, 0]], [t, c]),
        q_mem=_linear([[0, 1], [8, 0]] + [[0, 1 << b] for b in regs_k[1:]],
                      [*lanes_k, [1, 0], [2, 0], [4, 0]], [16, c]),
        kmin_mem=_linear([[1 << b, 0] for b in regs_k],
                         [[1 << low, 0], [2 << low, 0], [0, 1], [0, 2], [0, 4]], [c, ROWS_N]),
        v_mem=_linear([[0, 1 << b] for b in range(n - 3)] + [[1, 0]] + tok_regs, v_lanes, [t, c]),
        v_pair=_linear([[1, 0], [0, 1]] + tok_regs + [[0, 1 << b] for b in range(1, n - 3)], v_lanes, [t, c]),
        v_pair4=_linear([[0, 1], [1, 0]] + tok_regs + [[0, 1 << b] for b in range(1, n - 3)], v_lanes,
                        [t, c]),
        rows=_linear([[0, 1]] + [[0, 1 << i] for i in range(3, nt)], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                     [ROWS_N, t]),
    )  # fmt: skip
    lanes_row = min(c // 16, 32)
    return Layouts(
        **lay,
        k_smem=key_stage(c, t),
        k_lanes=staged(lay["k_mem"]),
        v_smem=value_stage(c, t),
        copy=gl.BlockedLayout([1, 16], [32 // lanes_row, lanes_row], [1, 1], [1, 0]),
    )


# ---- the code -> fp16 conversions (PTX, four bytes per register) ----


@gluon.jit
def _bytes_f16(x):
    """uint8 codes -> fp16 ``1024 + code``: one ``prmt`` per output register (bytes 0, 1 | 2, 3)."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, 0x64646464, 0x4140;\nprmt.b32 $1, $2, 0x64646464, 0x4342;",
        "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _nibbles_f16(x):
    """uint8 bytes -> (low nibble ``1024 + n``, high nibble ``1024 + 16 n``) as fp16, in byte order: a
    ``prmt`` spreads bytes 0, 1 (2, 3) into the two halves of a register, a ``lop3`` per output masks a
    nibble under the exponent of 1024 (six instructions per four bytes)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 y0, y1;
        prmt.b32 y0, $4, 0, 0x4140;
        prmt.b32 y1, $4, 0, 0x4342;
        lop3.b32 $0, y0, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, y1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, y0, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, y1, 0x00F000F0, 0x64006400, 0xEA;
        }
        """,
        "=r,=r,=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _nibbles_f16_02(x):
    """As ``_nibbles_f16`` in five instructions per four bytes: a ``lop3`` per output register masks the
    nibbles of bytes 0 and 2 (of 1 and 3 after one shift), so the four codes of a register come out as
    bytes 0, 2, 1, 3 (in tensor order). The values take it on the channel-first pair layout, where that
    order is the token pairs the operand wants (``_unswap_pairs`` renames the coordinates)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 y;
        shr.b32 y, $4, 8;
        lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, y, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, $4, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, y, 0x00F000F0, 0x64006400, 0xEA;
        }
        """,
        "=r,=r,=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _unswap_pairs(x, T: gl.constexpr, C: gl.constexpr):
    """Value nibbles [T, C] from ``_nibbles_f16_02`` on the channel-first pair layout, whose register bytes
    (t, c), (t, c + 1), (t + 1, c), (t + 1, c + 1) come out as (t, c), (t + 1, c), (t, c + 1), (t + 1, c + 1):
    token bit 0 and channel bit 0 trade places, which leaves them in the token-first pair layout."""
    x = gl.permute(gl.reshape(x, [T // 2, 2, C // 2, 2]), [0, 3, 2, 1])
    return gl.reshape(x, [T, C])


# ---- relabelling: memory channel order <-> the operand's logical order (register renaming only) ----


@gluon.jit
def _key_operand(x, C: gl.constexpr, T: gl.constexpr, BITS: gl.constexpr, ORDER: gl.constexpr):
    """fp16 key codes [T, C] (memory order) -> the B operand [C, T] of ``Q' K^T`` (BITS: [T, 2, 2, ..])."""
    x = gl.reshape(x, BITS)
    x = gl.permute(x, ORDER.value)
    return gl.convert_layout(gl.reshape(x, [C, T]), B_OP, assert_trivial=True)


@gluon.jit
def _value_operand(x, C: gl.constexpr, T: gl.constexpr, BITS: gl.constexpr, ORDER: gl.constexpr):
    """fp16 value codes [T, C] (memory order, pair layout) -> the A operand [C, T] of ``V^T P'^T``."""
    x = gl.reshape(x, BITS)
    x = gl.permute(x, ORDER.value)
    return gl.convert_layout(gl.reshape(x, [C, T]), A_OP, assert_trivial=True)


@gluon.jit
def _q_operand(x, C: gl.constexpr, BITS: gl.constexpr, ORDER: gl.constexpr):
    """fp16 q rows [16, C] (memory order) -> the A operand [16, C] of ``Q' K^T`` (BITS: [16, 2, 2, ..])."""
    x = gl.reshape(x, BITS)
    x = gl.permute(x, ORDER.value)
    return gl.convert_layout(gl.reshape(x, [16, C]), A_OP, assert_trivial=True)


@gluon.jit
def _kmin_operand(x, C: gl.constexpr, BITS: gl.constexpr, ORDER: gl.constexpr):
    """fp16 key mins [C, 8] (memory order, the same in every column) -> a B operand [C, 8]."""
    x = gl.reshape(x, BITS)
    x = gl.permute(x, ORDER.value)
    return gl.convert_layout(gl.reshape(x, [C, NP]), B_OP, assert_trivial=True)


@gluon.jit
def _rows_of_8(s, T: gl.constexpr):
    """Rows 0..7 of a [16, T] accumulator (the rows 8..15 of the matrix unit's tile hold no head)."""
    s = gl.permute(gl.reshape(s, [2, NP, T]), [1, 2, 0])
    lo, _ = gl.split(s)
    return lo


@gluon.jit
def _corr_rows(corr, ROWS: gl.constexpr):
    """The per-row value of a [16, 8] product whose columns are all equal, in ROWS' row layout."""
    return gl.convert_layout(gl.max(_rows_of_8(corr, NP), 1), gl.SliceLayout(1, ROWS))


@gluon.jit
def _memory_channel(m, BITS: gl.constexpr):
    """The memory channel of logical channels ``m`` (logical bit j is memory bit ``BITS[j]``)."""
    out = gl.zeros_like(m)
    for j in gl.static_range(len(BITS)):
        out = out | (((m >> j) & 1) << BITS[j])
    return out


@gluon.jit
def _launch_dependents(x):
    """``griddepcontrol.launch_dependents``: the next launch on the stream, if programmatic, may start."""
    return gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _wait_primary(x):
    """``griddepcontrol.wait``: wait until the launch this one depends on (programmatically) has ended and its
    memory is visible."""
    return gl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _block_id(table_ptr, row, j, j1):
    """Entry ``j`` of the block-table row at ``row`` as int64 (0 past the split's end ``j1``)."""
    return gl.load(table_ptr + row + j, mask=j < j1, other=0).to(gl.int64)


@gluon.jit
def _copy_id(ids, table_ptr, row, j0, k, j1, zero1):
    """Start the async copy of the split's block id ``j0 + k`` (0 past its end ``j1``) into slot ``k % 16`` of
    the id ring ``ids`` [16, 1]."""
    async_copy.async_copy_global_to_shared(ids.index(k % 16), table_ptr + row + j0 + k + zero1,
                                           mask=j0 + k + zero1 < j1)  # fmt: skip


@gluon.jit
def _copy_keys(kbuf, ksb, kmb, st, bid, h, ck_ptr, ksc_ptr, kmin_ptr, s_cn, s_ch, s_kn, s_kh, k_copy, cd):
    """Start the async copies of block ``bid``'s key codes, scales and mins (all D channels) into stage
    ``st``; the caller commits the group."""
    kq = bid * s_kn + h * s_kh
    async_copy.async_copy_global_to_shared(kbuf.index(st), ck_ptr + bid * s_cn + h * s_ch + k_copy)
    async_copy.async_copy_global_to_shared(ksb.index(st), ksc_ptr + kq + cd)
    async_copy.async_copy_global_to_shared(kmb.index(st), kmin_ptr + kq + cd)


@gluon.jit
def _copy_values(vbuf, vsb, vmb, st, bid, h, cv_ptr, vsc_ptr, vmin_ptr, s_cn, s_ch, s_vn, s_vh, v_copy, ct):
    """Start the async copies of block ``bid``'s value codes, scales and mins into stage ``st``."""
    vq = bid * s_vn + h * s_vh
    async_copy.async_copy_global_to_shared(vbuf.index(st), cv_ptr + bid * s_cn + h * s_ch + v_copy)
    async_copy.async_copy_global_to_shared(vsb.index(st), vsc_ptr + vq + ct)
    async_copy.async_copy_global_to_shared(vmb.index(st), vmin_ptr + vq + ct)


@gluon.jit
def _tma_copy(kd, vd, ksd, kmd, vsd, vmd, bars, kbuf, vbuf, ksb, kmb, vsb, vmb, st, bid, h,
              H: gl.constexpr, T: gl.constexpr, NBYTES: gl.constexpr):  # fmt: skip
    """Start the tensor (TMA) copies of block ``bid``'s key and value codes, key scales and mins, value
    scales and mins (KV head ``h``) into stage ``st``: six copies issued by one lane, their ``NBYTES``
    counted on the stage's mbarrier (``TMA`` of :func:`_cold_part`)."""
    bar = bars.index(st)
    mbarrier.expect(bar, NBYTES)
    r = (bid * H + h).to(gl.int32)
    tma.async_copy_global_to_shared(kd, [r * T, 0], bar, kbuf.index(st))
    tma.async_copy_global_to_shared(vd, [r * T, 0], bar, vbuf.index(st))
    tma.async_copy_global_to_shared(ksd, [r, 0], bar, ksb.index(st))
    tma.async_copy_global_to_shared(kmd, [r, 0], bar, kmb.index(st))
    tma.async_copy_global_to_shared(vsd, [r, 0], bar, vsb.index(st))
    tma.async_copy_global_to_shared(vmd, [r, 0], bar, vmb.index(st))


@gluon.jit
def _scores(kc, ks, km, ks_hi, km_h, q_lo, q_hi, neg, kmz,
            C: gl.constexpr, T: gl.constexpr, KIND: gl.constexpr, ROWS: gl.constexpr, K_ORDER: gl.constexpr,
            Q_ORDER: gl.constexpr, KM_ORDER: gl.constexpr, TC_BITS: gl.constexpr, Q_BITS: gl.constexpr,
            KM_BITS: gl.constexpr):  # fmt: skip
    """One block's scores [8, T] of the query rows (``S = Q' K^T``, without the per-row ``corr``) and
    ``corr = q . kmin - 1024 (q * kscale) . 1`` per row, from its key codes ``kc``, scales and mins (and the
    high nibbles' ``ks_hi``, ``km_h`` where KIND is 4)."""
    qs = _q_operand(q_lo * ks[None, :], C, Q_BITS, Q_ORDER)
    qa = _q_operand(q_lo, C, Q_BITS, Q_ORDER)
    kmb = _kmin_operand(gl.broadcast(km[:, None], kmz)[0], C, KM_BITS, KM_ORDER)
    corr = mma_v2(qa, kmb, gl.zeros([16, NP], gl.float32, layout=MMA))
    corr = mma_v2(qs, neg, corr)
    if KIND == 8:
        kb = _key_operand(_bytes_f16(kc), C, T, TC_BITS, K_ORDER)
        s = mma_v2(qs, kb, gl.zeros([16, T], gl.float32, layout=MMA))
    else:
        klo, khi = _nibbles_f16(kc)
        qs_h = _q_operand(q_hi * (ks_hi * 0.0625)[None, :], C, Q_BITS, Q_ORDER)  # high nibbles: 1024 + 16 n
        qa_h = _q_operand(q_hi, C, Q_BITS, Q_ORDER)
        corr = mma_v2(qa_h, _kmin_operand(gl.broadcast(km_h[:, None], kmz)[0], C, KM_BITS, KM_ORDER), corr)
        corr = mma_v2(qs_h, neg, corr)
        s = mma_v2(qs, _key_operand(klo, C, T, TC_BITS, K_ORDER), gl.zeros([16, T], gl.float32, layout=MMA))
        s = mma_v2(qs_h, _key_operand(khi, C, T, TC_BITS, K_ORDER), s)
    return gl.convert_layout(_rows_of_8(s, T), ROWS, assert_trivial=True), _corr_rows(corr, ROWS)


@gluon.jit
def _staged_scores(kbuf, ksb, kmsb, st, q_lo, q_hi, neg, kmz,
                   C: gl.constexpr, D: gl.constexpr, T: gl.constexpr, KIND: gl.constexpr, LK: gl.constexpr,
                   LQ: gl.constexpr, LKM: gl.constexpr, ROWS: gl.constexpr, K_ORDER: gl.constexpr,
                   Q_ORDER: gl.constexpr, KM_ORDER: gl.constexpr, TC_BITS: gl.constexpr, Q_BITS: gl.constexpr,
                   KM_BITS: gl.constexpr):  # fmt: skip
    """``_scores`` of the block in stage ``st`` of the ring."""
    ks, km = ksb.index(st), kmsb.index(st)
    return _scores(kbuf.index(st).load(LK), ks.slice(0, C).load(gl.SliceLayout(0, LQ)),
                   km.slice(0, C).load(gl.SliceLayout(1, LKM)),
                   ks.slice(D - C, C).load(gl.SliceLayout(0, LQ)),
                   km.slice(D - C, C).load(gl.SliceLayout(1, LKM)), q_lo, q_hi, neg, kmz,
                   C, T, KIND, ROWS, K_ORDER, Q_ORDER, KM_ORDER, TC_BITS, Q_BITS, KM_BITS)  # fmt: skip


@gluon.jit
def _attend(s8, c8, vc, vs, vmn, m_i, l_i, vm_i, acc, acc_h, ones, lse_ptr, rows,
            G: gl.constexpr, C: gl.constexpr, T: gl.constexpr, KIND: gl.constexpr, LV: gl.constexpr,
            LP: gl.constexpr, LP4: gl.constexpr, TC_BITS: gl.constexpr, V_ORDER: gl.constexpr,
            STAGED: gl.constexpr):  # fmt: skip
    """Fold one block into the running state: the online softmax of its scores, its lse (stored at
    ``lse_ptr``), and ``P' V`` from its value codes ``vc`` (module docstring; STAGED: ``vc`` is the stage
    in shared memory, loaded only once the softmax is done). The codes enter the matrix unit as ``1024 +
    c``; the block's ``1024 sum(p * vscale)`` (a product with a ones tile: the same fp16 products) comes off
    the accumulators right after the block's own product, so they only ever carry the output's magnitude plus
    one block's offset. Left to the end, the offset grew with every block and the matrix unit's accumulation
    error with it (``lab/scripts/split_error.py``). Returns the new state."""
    m_new = gl.maximum(m_i, gl.max(s8, 1) + c8)
    if gl.max(m_new - m_i, 0) > 0.0:  # the running maximum grew: rescale (uniform branch, one warp)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha
        vm_i = vm_i * alpha
        a_n = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
        acc = acc * a_n[None, :]
        if KIND == 4:
            acc_h = acc_h * a_n[None, :]
        m_i = m_new
    p = gl.exp2(s8 - (m_i - c8)[:, None])
    l_blk = gl.sum(p, 1)
    l_i = l_i + l_blk
    vm_i = vm_i + gl.sum(p * vmn[None, :], 1)
    gl.store(lse_ptr + rows, m_i + gl.log2(l_blk), mask=rows < G)
    pb = gl.convert_layout(gl.permute((p * vs[None, :]).to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
    # the block's sum(p * vscale) in every row, from the same fp16 products
    off = 1024.0 * gl.max(mma_v2(ones, pb, gl.zeros([16, NP], gl.float32, layout=MMA)), 0)[None, :]
    if STAGED:
        vc = vc.load(LV)
    if KIND == 8:
        acc = mma_v2(_value_operand(_bytes_f16(gl.convert_layout(vc, LP)), C, T, TC_BITS, V_ORDER), pb, acc)
    else:
        vlo, vhi = _nibbles_f16_02(gl.convert_layout(vc, LP4))
        acc = mma_v2(_value_operand(_unswap_pairs(vlo, T, C), C, T, TC_BITS, V_ORDER), pb, acc)
        acc_h = mma_v2(_value_operand(_unswap_pairs(vhi, T, C), C, T, TC_BITS, V_ORDER), pb, acc_h) - off
    return m_i, l_i, vm_i, acc - off, acc_h


@gluon.jit
def _cold_part(
    pid_s, bh, q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table_ptr, num_cold_ptr,
    part_acc_ptr, part_ml_ptr, blk_lse_ptr,
    qk_scale, busy_blocks, num_splits, M, part_stride, part0,
    s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh,
    H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, T: gl.constexpr, KIND: gl.constexpr,
    LK: gl.constexpr, LQ: gl.constexpr, LKM: gl.constexpr, LV: gl.constexpr, LP: gl.constexpr,
    LP4: gl.constexpr,
    ROWS: gl.constexpr, K_ORDER: gl.constexpr, Q_ORDER: gl.constexpr, KM_ORDER: gl.constexpr,
    V_ORDER: gl.constexpr, V_BITS: gl.constexpr, TC_BITS: gl.constexpr, Q_BITS: gl.constexpr,
    KM_BITS: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr, COPY: gl.constexpr, STAGES: gl.constexpr,
    KROWS: gl.constexpr, TABLE_AHEAD: gl.constexpr, ROW: gl.constexpr,
    kd=None, vd=None, ksd=None, kmd=None, vsd=None, vmd=None, TMA: gl.constexpr = False,
    AFTER: gl.constexpr = False,
):  # fmt: skip
    """Partial attention of split ``pid_s`` of row ``bh`` (sequence * KV head) over its cold blocks (module
    docstring): the partial (m, l, acc) in the layout of ``_split_kernel``'s partials (slot ``part0 +
    split`` of the row's ``part_stride``), and each block's lse. ``ROW``: bytes from one code row to the
    next (``C``; ``D`` for the 4-bit blocks of an 8-bit pool, whose codes fill the first half of each
    row). ``TMA`` (with a ring, sm_90): the ring is filled by tensor copies over the descriptors ``kd`` ..
    ``vmd`` (:func:`descriptors`), one lane issuing a block's six against its stage's mbarrier, instead of
    every lane's ``cp.async``; the block ids are loaded one iteration ahead (``TABLE_AHEAD`` is not read).
    ``AFTER``: launched as a programmatic dependent of the launch before (``gluon_after_select``), the
    program loads and scales its queries, then waits for that launch to end before it reads the table and
    the counts (the reads take their row from the wait's result, so none is moved above it)."""
    b = bh // H
    h = bh % H
    C: gl.constexpr = D if KIND == 8 else D // 2  # channels per operand (and bytes per code row)
    # q rows of the group (rows >= G are zero), scaled to the base-2 softmax, channels in memory order
    g16 = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
    cq = gl.arange(0, C, layout=gl.SliceLayout(0, LQ))
    qmask = (g16 < G)[:, None]
    q_off = b.to(gl.int64) * s_qb + (h * G + g16)[:, None] * s_qh + cq[None, :]
    q_lo = gl.where(qmask, (gl.load(q_ptr + q_off, mask=qmask, other=0.0).to(gl.float32) * qk_scale), 0.0)
    q_lo = q_lo.to(gl.float16)
    q_hi = q_lo
    if KIND == 4:
        q_hi = gl.where(qmask, gl.load(q_ptr + q_off + C, mask=qmask, other=0.0).to(gl.float32) * qk_scale,
                        0.0).to(gl.float16)  # fmt: skip
    neg = gl.full([C, NP], -1024.0, gl.float16, layout=B_OP)
    # running state: per query row (ROWS' rows) and the output [C, 8] (channels in the value order)
    rows = gl.arange(0, NP, layout=gl.SliceLayout(1, ROWS))
    tok = gl.arange(0, T, layout=gl.SliceLayout(0, ROWS))
    m_i = gl.full([NP], -1.0e30, gl.float32, layout=gl.SliceLayout(1, ROWS))
    l_i = gl.zeros([NP], gl.float32, layout=gl.SliceLayout(1, ROWS))
    vm_i = gl.zeros([NP], gl.float32, layout=gl.SliceLayout(1, ROWS))
    acc = gl.zeros([C, NP], gl.float32, layout=MMA)
    acc_h = acc  # the high nibbles' channels (KIND 4)
    ones = gl.full([16, T], 1.0, gl.float16, layout=A_OP)
    tk = gl.arange(0, T, layout=gl.SliceLayout(1, LK))
    ck = gl.arange(0, C, layout=gl.SliceLayout(0, LK))
    k_off = tk[:, None] * ROW + ck[None, :]
    tv = gl.arange(0, T, layout=gl.SliceLayout(1, LV))
    cv = gl.arange(0, C, layout=gl.SliceLayout(0, LV))
    v_off = tv[:, None] * ROW + cv[None, :]
    ckm = gl.arange(0, C, layout=gl.SliceLayout(1, LKM))
    kmz = gl.zeros([C, NP], gl.float16, layout=LKM)

    # the row's own count split evenly over its busy splits, one per ``busy_blocks`` listed blocks (see
    # triton_decode._split_kernel and _busy_splits); the splits after them take no block and write nothing
    if AFTER:  # the table and the counts are the launch before's outputs
        bh = _wait_primary(bh)
    nc = gl.load(num_cold_ptr + bh)
    busy = gl.maximum(gl.minimum((nc + busy_blocks - 1) // busy_blocks, num_splits), 1)
    per = (nc + busy - 1) // busy
    j0 = pid_s * per
    j1 = gl.minimum(j0 + per, nc)
    row = bh.to(gl.int64) * M
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    if STAGES > 0:
        # A ring of STAGES blocks in shared memory: blocks j + 1 .. j + STAGES - 1 are in flight while block j
        # is computed (one commit group per block, empty past the split's end). TABLE_AHEAD: each group also
        # copies the block-table entry STAGES blocks further on into a ring of 16 ids, so that an iteration
        # reads its next block id from shared memory instead of waiting on a load from the iteration before.
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        if TMA:
            # the stages in the descriptors' layouts (codes swizzled as the copies write them, one-row scale
            # tiles unswizzled); the scales read back through a plain [STAGES, n] view of the same bytes
            kbuf = gl.allocate_shared_memory(ck_ptr.dtype.element_ty, [STAGES, T, C], kd.layout)
            vbuf = gl.allocate_shared_memory(cv_ptr.dtype.element_ty, [STAGES, T, C], vd.layout)
            ks3 = gl.allocate_shared_memory(ksc_ptr.dtype.element_ty, [STAGES, 1, D], ksd.layout)
            km3 = gl.allocate_shared_memory(kmin_ptr.dtype.element_ty, [STAGES, 1, D], kmd.layout)
            vs3 = gl.allocate_shared_memory(vsc_ptr.dtype.element_ty, [STAGES, 1, T], vsd.layout)
            vm3 = gl.allocate_shared_memory(vmin_ptr.dtype.element_ty, [STAGES, 1, T], vmd.layout)
            ksb = ks3._reinterpret(ksc_ptr.dtype.element_ty, [STAGES, D], plain)
            kmsb = km3._reinterpret(kmin_ptr.dtype.element_ty, [STAGES, D], plain)
            vsb = vs3._reinterpret(vsc_ptr.dtype.element_ty, [STAGES, T], plain)
            vmb = vm3._reinterpret(vmin_ptr.dtype.element_ty, [STAGES, T], plain)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            gl.thread_barrier()  # every lane sees the barriers initialised
            SB: gl.constexpr = ksc_ptr.dtype.element_ty.primitive_bitwidth // 8  # bytes a scale or min
            NBYTES: gl.constexpr = 2 * T * C + 2 * (D + T) * SB  # a block's six copies
            for i in gl.static_range(STAGES - 1):
                if j0 + i < j1:
                    bid0 = gl.load(table_ptr + row + j0 + i).to(gl.int64)
                    _tma_copy(kd, vd, ksd, kmd, vsd, vmd, bars, kbuf, vbuf, ks3, km3, vs3, vm3, i, bid0, h,
                              H, T, NBYTES)  # fmt: skip
        else:
            kbuf = gl.allocate_shared_memory(ck_ptr.dtype.element_ty, [STAGES, T, C], SK)
            vbuf = gl.allocate_shared_memory(cv_ptr.dtype.element_ty, [STAGES, T, C], SV)
            ksb = gl.allocate_shared_memory(ksc_ptr.dtype.element_ty, [STAGES, D], plain)
            kmsb = gl.allocate_shared_memory(kmin_ptr.dtype.element_ty, [STAGES, D], plain)
            vsb = gl.allocate_shared_memory(vsc_ptr.dtype.element_ty, [STAGES, T], plain)
            vmb = gl.allocate_shared_memory(vmin_ptr.dtype.element_ty, [STAGES, T], plain)
            ids = gl.allocate_shared_memory(table_ptr.dtype.element_ty, [16, 1], plain)
            zero1 = gl.arange(0, 1, layout=one)
            tc = gl.arange(0, T, layout=gl.SliceLayout(1, COPY))
            cc = gl.arange(0, C, layout=gl.SliceLayout(0, COPY))
            v_copy = tc[:, None] * ROW + cc[None, :]  # consecutive lanes along whole rows
            k_copy = v_copy if KROWS else k_off
            cd = gl.arange(0, D, layout=gl.BlockedLayout([max(D // 32, 2)], [32], [1], [0]))
            ct = gl.arange(0, T, layout=gl.BlockedLayout([2], [32], [1], [0]))
            for i in gl.static_range(STAGES - 1):
                if j0 + i < j1:
                    bid0 = gl.load(table_ptr + row + j0 + i).to(gl.int64)
                    _copy_keys(kbuf, ksb, kmsb, i, bid0, h, ck_ptr, ksc_ptr, kmin_ptr, s_cn, s_ch, s_kn, s_kh,
                               k_copy, cd)  # fmt: skip
                    _copy_values(vbuf, vsb, vmb, i, bid0, h, cv_ptr, vsc_ptr, vmin_ptr, s_cn, s_ch, s_vn,
                                 s_vh, v_copy, ct)  # fmt: skip
                if TABLE_AHEAD:  # the id of block j0 + STAGES + i
                    _copy_id(ids, table_ptr, row, j0, STAGES + i, j1, zero1)
                async_copy.commit_group()
    # the id of the first block the loop copies (direct loads: loads); after it, each next id is read an
    # iteration ahead, or taken from the id ring (TABLE_AHEAD)
    nxt = _block_id(table_ptr, row, j0 + max(STAGES - 1, 0), j1)
    for j in range(j0, j1):
        if STAGES > 0:
            st = (j - j0) % STAGES
            gl.thread_barrier()  # every lane is done with the stage the next copy overwrites (block j - 1's)
            if TMA:
                if j + STAGES - 1 < j1:
                    _tma_copy(kd, vd, ksd, kmd, vsd, vmd, bars, kbuf, vbuf, ks3, km3, vs3, vm3,
                              (st + STAGES - 1) % STAGES, nxt, h, H, T, NBYTES)  # fmt: skip
                nxt = _block_id(table_ptr, row, j + STAGES, j1)
                mbarrier.wait(bars.index(st), ((j - j0) // STAGES) & 1)  # block j has landed, every byte
            else:
                if TABLE_AHEAD and j > j0:  # block j + STAGES - 1's id, copied STAGES iterations ago
                    nxt = gl.max(ids.index((j - j0 + STAGES - 1) % 16).load(one), 0).to(gl.int64)
                if j + STAGES - 1 < j1:
                    sn = (st + STAGES - 1) % STAGES
                    _copy_keys(kbuf, ksb, kmsb, sn, nxt, h, ck_ptr, ksc_ptr, kmin_ptr,
                               s_cn, s_ch, s_kn, s_kh, k_copy, cd)  # fmt: skip
                    _copy_values(vbuf, vsb, vmb, sn, nxt, h, cv_ptr, vsc_ptr, vmin_ptr,
                                 s_cn, s_ch, s_vn, s_vh, v_copy, ct)  # fmt: skip
                if TABLE_AHEAD:
                    _copy_id(ids, table_ptr, row, j0, j - j0 + 2 * STAGES - 1, j1, zero1)
                else:
                    nxt = _block_id(table_ptr, row, j + STAGES, j1)
                async_copy.commit_group()
                async_copy.wait_group(STAGES - 1)  # block j's copies (this lane's) have landed
                gl.thread_barrier()  # ... and every other lane's
            s8, c8 = _staged_scores(kbuf, ksb, kmsb, st, q_lo, q_hi, neg, kmz, C, D, T, KIND, LK, LQ, LKM,
                                    ROWS, K_ORDER, Q_ORDER, KM_ORDER, TC_BITS, Q_BITS, KM_BITS)  # fmt: skip
            vs = vsb.index(st).load(gl.SliceLayout(0, ROWS)).to(gl.float32)
            vmn = vmb.index(st).load(gl.SliceLayout(0, ROWS)).to(gl.float32)
            m_i, l_i, vm_i, acc, acc_h = _attend(
                s8, c8, vbuf.index(st), vs, vmn, m_i, l_i, vm_i, acc, acc_h, ones,
                blk_lse_ptr + (row + j) * G, rows, G, C, T, KIND, LV, LP, LP4, TC_BITS, V_ORDER, True,
            )  # fmt: skip
        else:
            bid = nxt
            nxt = _block_id(table_ptr, row, j + 1, j1)
            base = bid * s_cn + h * s_ch
            kq = bid * s_kn + h * s_kh
            vq = bid * s_vn + h * s_vh
            s8, c8 = _scores(gl.load(ck_ptr + base + k_off), gl.load(ksc_ptr + kq + cq),
                             gl.load(kmin_ptr + kq + ckm), gl.load(ksc_ptr + kq + D - C + cq),
                             gl.load(kmin_ptr + kq + D - C + ckm), q_lo, q_hi, neg, kmz, C, T, KIND, ROWS,
                             K_ORDER, Q_ORDER, KM_ORDER, TC_BITS, Q_BITS, KM_BITS)  # fmt: skip
            vs = gl.load(vsc_ptr + vq + tok).to(gl.float32)
            vmn = gl.load(vmin_ptr + vq + tok).to(gl.float32)
            m_i, l_i, vm_i, acc, acc_h = _attend(
                s8, c8, gl.load(cv_ptr + base + v_off), vs, vmn, m_i, l_i, vm_i, acc, acc_h, ones,
                blk_lse_ptr + (row + j) * G, rows, G, C, T, KIND, LV, LP, LP4, TC_BITS, V_ORDER, False,
            )  # fmt: skip
    if STAGES > 0 and TMA:  # every copy issued was waited for; the memory may serve another build's ring
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
    # partials: acc + sum(p * vmin), channels back in memory order
    part = (bh * part_stride + part0 + pid_s).to(gl.int64)
    vmo = gl.convert_layout(vm_i, gl.SliceLayout(0, MMA))
    mo = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
    no = gl.arange(0, NP, layout=gl.SliceLayout(0, MMA))
    memc = _memory_channel(mo, V_BITS)
    o_off = part * G * D + no[None, :] * D + memc[:, None]
    o_mask = (no < G)[None, :] & (pid_s < busy)
    gl.store(part_acc_ptr + o_off, acc + vmo[None, :], mask=o_mask)
    if KIND == 4:
        gl.store(part_acc_ptr + o_off + C, acc_h * 0.0625 + vmo[None, :], mask=o_mask)
    gl.store(part_ml_ptr + part * 2 * G + rows, m_i, mask=(rows < G) & (pid_s < busy))
    gl.store(part_ml_ptr + part * 2 * G + G + rows, l_i, mask=(rows < G) & (pid_s < busy))


# Sizes that follow the batch and the sequence lengths are not specialized (a value of 1 or a multiple of 16
# would otherwise compile the kernel again in the middle of a replay).
@gluon.jit(do_not_specialize=["busy_blocks", "num_splits", "M", "part_stride", "part0"])
def _cold_kernel(
    q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table_ptr, num_cold_ptr,
    part_acc_ptr, part_ml_ptr, blk_lse_ptr,
    qk_scale, busy_blocks, num_splits, M, part_stride, part0,
    s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh,
    H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, T: gl.constexpr, KIND: gl.constexpr,
    LK: gl.constexpr, LQ: gl.constexpr, LKM: gl.constexpr, LV: gl.constexpr, LP: gl.constexpr,
    LP4: gl.constexpr,
    ROWS: gl.constexpr, K_ORDER: gl.constexpr, Q_ORDER: gl.constexpr, KM_ORDER: gl.constexpr,
    V_ORDER: gl.constexpr, V_BITS: gl.constexpr, TC_BITS: gl.constexpr, Q_BITS: gl.constexpr,
    KM_BITS: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr, COPY: gl.constexpr, STAGES: gl.constexpr,
    KROWS: gl.constexpr, TABLE_AHEAD: gl.constexpr, PDL: gl.constexpr, ROW: gl.constexpr,
    SPLIT_MAJOR: gl.constexpr = False, FOLLOW: gl.constexpr = False,
    kd=None, vd=None, ksd=None, kmd=None, vsd=None, vmd=None, TMA: gl.constexpr = False,
    AFTER: gl.constexpr = False,
):  # fmt: skip
    """One build over its grid of (split, sequence * KV head) programs (:func:`_cold_part`). ``FOLLOW``:
    this launch is a programmatic dependent of the build before it, whose outputs it does not read: it
    waits for that build only after its own stores (``gluon_overlap``). ``TMA``: the ring filled by tensor
    copies over the descriptors ``kd`` .. ``vmd``."""
    pid_s = gl.program_id(1 if SPLIT_MAJOR else 0)  # SPLIT_MAJOR: grid (B * H, splits)
    bh = gl.program_id(0 if SPLIT_MAJOR else 1)
    if PDL:  # the merge launch that follows (a programmatic dependent) may start now: it waits to merge
        _launch_dependents(pid_s)
    _cold_part(pid_s, bh, q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table_ptr,
               num_cold_ptr, part_acc_ptr, part_ml_ptr, blk_lse_ptr, qk_scale, busy_blocks, num_splits, M,
               part_stride, part0, s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh, H, G, D, T, KIND,
               LK, LQ, LKM, LV, LP, LP4, ROWS, K_ORDER, Q_ORDER, KM_ORDER, V_ORDER, V_BITS, TC_BITS, Q_BITS,
               KM_BITS, SK, SV, COPY, STAGES, KROWS, TABLE_AHEAD, ROW, kd, vd, ksd, kmd, vsd, vmd,
               TMA, AFTER)  # fmt: skip
    if FOLLOW:  # end no earlier than the build before: the merge, waiting on this launch, then has both
        _wait_primary(pid_s)


@gluon.jit(do_not_specialize=["busy_blocks", "busy_blocks4", "num_splits", "num_splits4", "M", "part_stride"])
def _cold_pair_kernel(
    q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table_ptr, num_cold_ptr, blk_lse_ptr,
    table4_ptr, num_cold4_ptr, blk_lse4_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, busy_blocks, busy_blocks4, num_splits, num_splits4, M, part_stride,
    s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh,
    H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, T: gl.constexpr,
    LK: gl.constexpr, LQ: gl.constexpr, LKM: gl.constexpr, LV: gl.constexpr, LP: gl.constexpr,
    LP4: gl.constexpr,
    ROWS: gl.constexpr, K_ORDER: gl.constexpr, Q_ORDER: gl.constexpr, KM_ORDER: gl.constexpr,
    V_ORDER: gl.constexpr, V_BITS: gl.constexpr, TC_BITS: gl.constexpr, Q_BITS: gl.constexpr,
    KM_BITS: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr, COPY: gl.constexpr, STAGES: gl.constexpr,
    LK4: gl.constexpr, LQ4: gl.constexpr, LKM4: gl.constexpr, LV4: gl.constexpr, LP_4: gl.constexpr,
    LP4_4: gl.constexpr,
    ROWS4: gl.constexpr, K_ORDER4: gl.constexpr, Q_ORDER4: gl.constexpr, KM_ORDER4: gl.constexpr,
    V_ORDER4: gl.constexpr, V_BITS4: gl.constexpr, TC_BITS4: gl.constexpr, Q_BITS4: gl.constexpr,
    KM_BITS4: gl.constexpr, SK4: gl.constexpr, SV4: gl.constexpr, COPY4: gl.constexpr, STAGES4: gl.constexpr,
    KROWS: gl.constexpr, TABLE_AHEAD: gl.constexpr, PDL: gl.constexpr, BY_ID: gl.constexpr,
    SPLIT_MAJOR: gl.constexpr = False,
    kd=None, vd=None, kd4=None, vd4=None, ksd=None, kmd=None, vsd=None, vmd=None, TMA: gl.constexpr = False,
    AFTER: gl.constexpr = False,
):  # fmt: skip
    """Both builds of ``gluon_mixed`` in one launch (``gluon_builds``), over an 8-bit pool whose demoted
    blocks hold 4-bit codes in the first half of their rows: the 8-bit build over ``table_ptr`` (partial
    slots ``0 .. num_splits - 1``), the 4-bit one over ``table4_ptr`` (the ``num_splits4`` slots after
    them). ``BY_ID``: the grid holds ``num_splits + num_splits4`` splits a row and each program takes one
    build's split by its id; else ``max(num_splits, num_splits4)`` and each program reads its split of
    both builds, the 8-bit one first. The builds' rings are live one after the other: the compiler gives
    them the same shared memory. ``TMA``: both rings filled by tensor copies, the 8-bit build's codes over
    ``kd`` / ``vd``, the 4-bit build's over ``kd4`` / ``vd4`` (the first half of each row), the scales and
    mins over the descriptors they share."""
    pid_s = gl.program_id(1 if SPLIT_MAJOR else 0)  # SPLIT_MAJOR: grid (B * H, splits)
    bh = gl.program_id(0 if SPLIT_MAJOR else 1)
    if PDL:  # the merge launch that follows (a programmatic dependent) may start now: it waits to merge
        _launch_dependents(pid_s)
    if not BY_ID or pid_s < num_splits:
        _cold_part(pid_s, bh, q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table_ptr,
                   num_cold_ptr, part_acc_ptr, part_ml_ptr, blk_lse_ptr, qk_scale, busy_blocks, num_splits, M,
                   part_stride, 0, s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh, H, G, D, T, 8,
                   LK, LQ, LKM, LV, LP, LP4, ROWS, K_ORDER, Q_ORDER, KM_ORDER, V_ORDER, V_BITS, TC_BITS,
                   Q_BITS, KM_BITS, SK, SV, COPY, STAGES, KROWS, TABLE_AHEAD, D, kd, vd, ksd, kmd, vsd, vmd,
                   TMA, AFTER)  # fmt: skip
    if not BY_ID or pid_s >= num_splits:
        pid4 = pid_s - num_splits if BY_ID else pid_s
        _cold_part(pid4, bh, q_ptr, ck_ptr, cv_ptr, kmin_ptr, ksc_ptr, vmin_ptr, vsc_ptr, table4_ptr,
                   num_cold4_ptr, part_acc_ptr, part_ml_ptr, blk_lse4_ptr, qk_scale, busy_blocks4,
                   num_splits4, M, part_stride, num_splits, s_qb, s_qh, s_cn, s_ch, s_kn, s_kh, s_vn, s_vh,
                   H, G, D, T, 4,
                   LK4, LQ4, LKM4, LV4, LP_4, LP4_4, ROWS4, K_ORDER4, Q_ORDER4, KM_ORDER4, V_ORDER4, V_BITS4,
                   TC_BITS4, Q_BITS4, KM_BITS4, SK4, SV4, COPY4, STAGES4, KROWS, TABLE_AHEAD, D, kd4, vd4,
                   ksd, kmd, vsd, vmd, TMA, AFTER and BY_ID)  # fmt: skip


# ---- host side ----


@functools.cache
def build_constants(
    channels: int, tokens: int, stages: int = 2, key_rows: bool = True, table_ahead: bool = True
) -> dict[str, object]:
    """The compile-time layouts and relabelling orders of one build (channels per operand, tokens per
    block, blocks in the shared-memory ring or 0: direct loads; ``key_rows``: the key codes are copied by
    consecutive lanes along whole rows, else each lane copies the pieces it loads; ``table_ahead``: the ring
    also carries the block ids, ``STAGES`` blocks ahead), as ``_cold_kernel``'s constexpr arguments."""
    lay = layouts(channels, tokens)
    kb, vb = key_bits(channels), value_bits(channels)
    n = _log2(channels)
    return dict(
        LK=lay.k_mem, LQ=lay.q_mem, LKM=lay.kmin_mem, LV=lay.v_mem, LP=lay.v_pair, LP4=lay.v_pair4,
        ROWS=lay.rows,
        K_ORDER=tuple(transposed_order(kb)), Q_ORDER=tuple(relabel_order(kb, 1, 0)),
        KM_ORDER=tuple(relabel_order(kb, 0, 1)), V_ORDER=tuple(transposed_order(vb)), V_BITS=tuple(vb),
        TC_BITS=(tokens,) + (2,) * n, Q_BITS=(16,) + (2,) * n, KM_BITS=(2,) * n + (ROWS_N,),
        SK=lay.k_smem if key_rows else lay.k_lanes, SV=lay.v_smem, COPY=lay.copy, STAGES=stages,
        KROWS=key_rows, TABLE_AHEAD=table_ahead,
    )  # fmt: skip


# A ring is kept only as deep as lets this many programs share a multiprocessor: the H200's fastest 8-bit
# build (3 stages) has 4 resident (`benchmarks/pool_read.py --rings` on an H200). Where a card holds fewer
# (sm_86 / sm_89: 100 KB), a shallower ring, or none, keeps the program count; not yet timed there.
RING_RESIDENT = 4


def ring_bytes(d: int, t: int, kind: int, stages: int, scale_bytes: int = 2, tma: bool = False) -> int:
    """Shared memory of one program's ring: per stage a block's key and value codes ([T, C] each), the key
    scales and mins ([D] each) and the value scales and mins ([T] each); the 16-entry id ring (int32), or
    with ``tma`` (tensor copies) a stage's mbarrier (8 bytes) instead."""
    if stages == 0:
        return 0
    c = d if kind == 8 else d // 2
    return stages * (2 * t * c + 2 * d * scale_bytes + 2 * t * scale_bytes) + (8 * stages if tma else 16 * 4)


def ring_stages(arch: Arch, d: int, t: int, kind: int, stages: int) -> int:
    """The ring depth a launch uses on ``arch``: the deepest of ``stages`` .. 2 with which
    :data:`RING_RESIDENT` programs fit a multiprocessor's shared memory (+ the 1 KB per program the driver
    reserves), else 0 (each block loaded into registers). A ring of 1 (no block ahead) is kept as asked."""
    for s in range(stages, min(stages, 2) - 1, -1):
        per = ring_bytes(d, t, kind, s) + 1024
        if per <= arch.shared_per_program and arch.shared_per_sm // per >= RING_RESIDENT:
            return s
    return 0


def supported(q: torch.Tensor, pool_bits: int, mixed: bool, block_size: int, code_stride: tuple[int, ...],
              num_kv_heads: int) -> bool:  # fmt: skip
    """Whether this kernel takes a launch: CUDA, fp16/bf16 models, 8-bit pools read without per-block bits
    (``mixed`` False: nothing demoted) or 4-bit pools, head_dim 64 or 128, blocks of 16, 32 or 64 tokens, at
    most 8 query heads per KV head, code rows contiguous."""
    d = q.shape[2]
    return (
        on_gpu(q)
        and q.dtype in (torch.float16, torch.bfloat16)
        and (pool_bits == 4 or (pool_bits == 8 and not mixed))
        and d in (64, 128)
        and block_size in (16, 32, 64)
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads <= ROWS_N
        and code_stride[-1] == 1
        and code_stride[-2] == d * pool_bits // 8
    )


def aligned(pool: ColdPool) -> bool:
    """Whether the kernel's async copies can be 4 bytes or wider over ``pool``: every field 16-byte aligned,
    its block and head strides multiples of 16 elements (Triton proves alignment only from arguments
    divisible by 16). A pool laid out otherwise (a page view with odd strides) takes the split kernel."""
    fields = (pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale)
    for t in fields:
        st = t.stride()
        if t.data_ptr() % 16 or st[0] % 16 or st[1] % 16:
            return False
    return True


def tma_ready(pool: ColdPool) -> bool:
    """Whether tensor copies (``TMA``) can fill the ring from ``pool``: each field laid out as whole rows
    (codes ``[N H T, row]``, scales ``[N H, D]`` / ``[N H, T]``, every row right after the one before) from
    a 16-byte aligned start, as a 2-D descriptor reads it; a pool laid out otherwise keeps ``cp.async``."""
    return all(
        t.is_contiguous() and t.data_ptr() % 16 == 0
        for t in (pool.k, pool.v, pool.k_min, pool.k_scale, pool.v_min, pool.v_scale)
    )


def _code_descriptors(pool: ColdPool, kind: int, row: int | None = None) -> tuple[TensorDescriptor, ...]:
    """Key and value codes as rows ``[N H T, row]`` read ``[T, C]`` at a time (``C`` = the build's bytes per
    token, ``kind`` 8: ``D``, 4: ``D / 2``; ``row``: the pool's own width by default), swizzled by ``C`` bytes
    (32, 64 or 128) as the copies write them."""
    n, h, t, width = pool.k.shape
    d = pool.k_scale.shape[2]
    c = d if kind == 8 else d // 2
    row = width if row is None else row
    swizzle = c if c in (32, 64, 128) else 0
    codes = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8, rank=2)
    return (
        TensorDescriptor(pool.k, [n * h * t, row], [row, 1], [t, c], codes),
        TensorDescriptor(pool.v, [n * h * t, row], [row, 1], [t, c], codes),
    )


def _scale_descriptors(pool: ColdPool) -> tuple[TensorDescriptor, ...]:
    """Key scales and mins ``[N H, D]``, value scales and mins ``[N H, T]``, a row at a time, unswizzled."""
    n, h, t, _ = pool.k.shape
    d = pool.k_scale.shape[2]
    halves = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return (
        TensorDescriptor(pool.k_scale, [n * h, d], [d, 1], [1, d], halves),
        TensorDescriptor(pool.k_min, [n * h, d], [d, 1], [1, d], halves),
        TensorDescriptor(pool.v_scale, [n * h, t], [t, 1], [1, t], halves),
        TensorDescriptor(pool.v_min, [n * h, t], [t, 1], [1, t], halves),
    )


def descriptors(pool: ColdPool, kind: int, row: int | None = None) -> tuple[TensorDescriptor, ...]:
    """The six 2-D tensor descriptors the ``TMA`` ring copies from (:func:`tma_ready` pools): key and value
    codes as rows ``[N H T, row]`` read ``[T, C]`` at a time (``C`` = the build's bytes per token, ``kind``
    8: ``D``, 4: ``D / 2``; ``row``: the pool's own width by default), swizzled by ``C`` bytes (32, 64 or
    128) as the copies write them; key scales and mins ``[N H, D]`` and value scales and mins ``[N H, T]`` a
    row at a time, unswizzled."""
    return (*_code_descriptors(pool, kind, row), *_scale_descriptors(pool))


def pair_descriptors(pool: ColdPool) -> tuple[TensorDescriptor, ...]:
    """The eight descriptors of :func:`launch_pair`'s ``tma`` over an 8-bit pool with demoted blocks: the
    8-bit build's key and value codes, the 4-bit build's (``[T, D / 2]`` of the ``D``-byte rows), then the
    key scales and mins, value scales and mins both builds read (:func:`descriptors`)."""
    return (*_code_descriptors(pool, 8), *_code_descriptors(pool, 4), *_scale_descriptors(pool))


def supported_mixed(
    q: torch.Tensor, block_size: int, code_stride: tuple[int, ...], num_kv_heads: int
) -> bool:
    """Whether the mixed path (an 8-bit pool read with per-block bits: its table split by bits, the 8-bit
    and the 4-bit builds over their parts) takes a launch: the conditions of :func:`supported` for an 8-bit
    pool read as pure; its demoted blocks are read as 4-bit codes in the first half of 8-bit rows."""
    return supported(q, 8, False, block_size, code_stride, num_kv_heads)


# The launch order of the programs: split-major (every row's split 0, then every row's split 1, ...), so that
# the busy splits of rows that keep only some of theirs busy (``gluon_busy_blocks``) launch first and spread
# over every multiprocessor. Row-major (a row's splits consecutive), a row of ``s`` splits puts split ``i`` of
# every row on the same multiprocessors wherever ``s`` divides their count (the first wave is dealt out one
# program per multiprocessor in launch order): at 4 x 128K on an H200, 33 splits of 132 multiprocessors, a
# sparse row busy in 16 of its splits ran on 64 of them.
SPLIT_MAJOR = True


def launch_cold(grid: tuple[int, int], args: tuple[object, ...], *, H: int, G: int, D: int, T: int, kind: int,
                stages: int = 2, pdl: bool = False, key_rows: bool = True, table_ahead: bool = True,
                row: int | None = None, follow: bool = False,
                tma: tuple[TensorDescriptor, ...] | None = None, after: bool = False) -> object:  # fmt: skip
    """Launch ``_cold_kernel`` over ``grid`` = (splits, B * H), in :data:`SPLIT_MAJOR` order, with its runtime
    ``args`` (in order); ``pdl``: the next launch on the stream, a programmatic dependent, may start at once;
    ``row``: bytes between code rows (None: the pool's own width, ``D * kind / 8``; ``D`` for 4-bit codes in
    an 8-bit pool); ``follow``: launched as a programmatic dependent of the launch before it (launched with
    ``pdl``), which it does not read, and waits for it at its end (``FOLLOW``); ``tma``: the ring (``stages``
    above 0) filled by tensor copies over these :func:`descriptors` (``TMA``; sm_90); ``after``: launched as
    a programmatic dependent of the launch before it, whose outputs it reads after waiting (``AFTER``)."""
    channels = D if kind == 8 else D // 2
    tma = tma if stages > 0 else None
    constants = build_constants(channels, T, stages, key_rows, table_ahead and tma is None)
    order = (grid[1], grid[0]) if SPLIT_MAJOR else grid
    extra: dict[str, object] = {"FOLLOW": True, "launch_pdl": True} if follow else {}
    if tma is not None:
        extra.update(zip(("kd", "vd", "ksd", "kmd", "vsd", "vmd"), tma, strict=True), TMA=True)
    if after:
        extra.update(AFTER=True, launch_pdl=True)
    return launch(_cold_kernel, order, *args, H=H, G=G, D=D, T=T, KIND=kind, PDL=pdl, ROW=row or channels,
                  SPLIT_MAJOR=SPLIT_MAJOR, num_warps=1, **constants, **extra)  # fmt: skip


def launch_pair(splits: tuple[int, int], rows: int, args: tuple[object, ...], *, H: int, G: int, D: int,
                T: int, stages: tuple[int, int], by_id: bool, pdl: bool = False, key_rows: bool = True,
                table_ahead: bool = True, tma: tuple[TensorDescriptor, ...] | None = None,
                after: bool = False) -> object:  # fmt: skip
    """Launch ``_cold_pair_kernel``: both builds of an 8-bit pool with demoted blocks in one launch, with
    ``splits`` (8-bit, 4-bit) a row over ``rows`` = B * H rows, ring depths ``stages`` (8-bit, 4-bit) and
    its runtime ``args`` (in order); ``by_id``: each program takes one build's split (``BY_ID``), else
    its split of both; ``pdl``, ``after`` as :func:`launch_cold`; ``tma``: the rings filled by tensor copies
    over :func:`pair_descriptors` (a build without a ring loads its blocks as before)."""
    extra: dict[str, object] = {}
    if tma is not None:
        extra = dict(zip(("kd", "vd", "kd4", "vd4", "ksd", "kmd", "vsd", "vmd"), tma, strict=True), TMA=True)
        table_ahead = False
    if after:
        extra.update(AFTER=True, launch_pdl=True)
    eight = build_constants(D, T, stages[0], key_rows, table_ahead)
    four = build_constants(D // 2, T, stages[1], key_rows, table_ahead)
    renamed = {"LP": "LP_4", "LP4": "LP4_4"}
    both = {
        **eight,
        **{renamed.get(k, k + "4"): v for k, v in four.items() if k not in ("KROWS", "TABLE_AHEAD")},
    }
    n = splits[0] + splits[1] if by_id else max(splits)
    order = (rows, n) if SPLIT_MAJOR else (n, rows)
    return launch(_cold_pair_kernel, order, *args, H=H, G=G, D=D, T=T, PDL=pdl, BY_ID=by_id,
                  SPLIT_MAJOR=SPLIT_MAJOR, num_warps=1, **both, **extra)  # fmt: skip
