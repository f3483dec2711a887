"""Which kernel computes a hybrid decode attention launch, and the options the Triton kernels run with.

:func:`decode_kernel` is the only place that decides between the PyTorch reference
(:mod:`kvtune.kernels.decode_ref`), the Triton split kernel and the Gluon cold kernel
(:mod:`kvtune.kernels.triton_decode`, :mod:`kvtune.kernels.gluon_decode`); the dispatcher
(:mod:`kvtune.kernels.decode_attention`) and the Triton launcher both ask it. Plain Python: it imports the
Gluon module (and with it Triton) only inside :func:`decode_kernel`, where Triton may run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvtune.kernels.backend import use_triton
from kvtune.kernels.layout import ColdPool
from kvtune.kernels.triton_common import tileable_head_dim

DecodeKernel = Literal["reference", "split", "gluon", "gluon_mixed"]
GluonBuilds = Literal["two", "paired", "by_id"]


@dataclass(frozen=True)
class DecodeKernelOptions:
    """How :func:`~kvtune.kernels.triton_decode.hybrid_decode_attention_triton` runs a launch (per-pool
    defaults: :func:`options_for`).

    Live knobs, in which the shipped defaults differ (``benchmarks/decode_attention.py --sweep`` varies them):

    cvt: code -> fp16 conversion, 0 plain cast, 1 magic number in pure ``tl``, 2 PTX ``prmt`` (GPU only).
    mixed: 8-bit pools honour ``block_bits`` per block (False only if no block was ever demoted).
    k_transposed: load key codes as ``[D/2, T]`` tiles (no register transpose before the matrix unit).
    programs_per_sm: the split kernel's split count aims at this many programs per multiprocessor.
    num_warps: warps per program of the split kernel.
    maxnreg: register cap per thread of the split kernel (more programs per multiprocessor), None for the
        compiler's choice.
    v_pairs: value codes are read as 16-bit pairs of neighbouring channels (``[T, D/2]`` uint16), split
        into the even and the odd channels and multiplied as two ``[T, D/2]`` tiles; the output accumulates
        as even and odd channels instead of low and high halves. 16-bit elements take the matrix unit's
        transposing shared-memory load, where byte codes are gathered one by one for ``P . V`` (whose
        contraction runs over tokens). Pure 8-bit pools only (others take the byte path).
    gluon: pure 8-bit and 4-bit pools on CUDA take the Gluon kernel for the cold blocks
        (``gluon_decode``: one warp per program, every register placed by hand), and the merge kernel
        attends the hot zone before it merges (:func:`decode_kernel`).
    gluon_mixed: 8-bit pools read with per-block bits (``mixed``) on CUDA take the Gluon kernel too: a
        partition kernel splits each table row by block bits (``bits_partition_ref``), the 8-bit build reads
        the 8-bit blocks and the 4-bit build the demoted ones (``gluon_stages``, at most 2: the 4-bit ring's
        fastest), each into its own partials, and the merge combines both with the hot zone. On by
        default for 8-bit pools: on an H200 (graph replays, 16 x 32K, L1 1/8 + top 2,048) the sparse INT8
        step took 0.094 ms against 0.178 ms on the split kernel, the same 0.175 ms at 4 x 128K
        (``benchmarks/decode_attention.py --mixed``).
    gluon_stages: the Gluon kernel copies blocks j + 1 .. j + s - 1 into a ring of s blocks in shared memory
        (``cp.async``) while a program computes block j; 0 loads each block into registers when the program
        starts it.
    gluon_busy_blocks: the fewest listed blocks a Gluon program takes: a row that lists n blocks keeps
        ``ceil(n / gluon_busy_blocks)`` of the planned splits busy (all of them at most, one at least) and
        shares its blocks evenly among them; the other programs write no partial and the merge reads none
        for them. The split count is planned from the table's width, which a sparse row fills only in part
        (L1 + k of M + k entries), and the splits are sized from the row's count on the device, so no
        host synchronisation is needed (graph capture). 1: every split that can take a block does, as
        before. ``gluon_busy_blocks4``: the same for ``gluon_mixed``'s 4-bit build (0: as the 8-bit one's).
    gluon_overlap: (``gluon_mixed`` in two launches, ``gluon_builds`` "two", with ``gluon_pdl``, sm_90) the
        4-bit build is launched as a programmatic dependent of the 8-bit build, so its programs start in the
        multiprocessors' free room while the 8-bit build runs instead of after it; it waits for the 8-bit
        build only after its own stores, so its end still implies both builds' and the merge's wait covers
        them. Off by default: on an H100 it saved
        nothing (sparse INT8, graphs, two rounds: 102.7-106.6 µs without, 106.4 with at 16 x 32K; 113.2-113.9
        both ways at 4 x 128K; ``lab/scripts/sparse_kernels.py --overlap both``): the 8-bit build's
        programs hold every slot the multiprocessors have, so the dependent's programs start only to wait.
    gluon_builds: how ``gluon_mixed`` launches its two builds: ``"two"``, one launch each, the 4-bit
        build after the 8-bit one; ``"paired"``, one launch whose program reads its split of the 8-bit
        build, then the same split of the 4-bit build; ``"by_id"``, one launch with both builds' splits,
        each program taking one by its id (``gluon_decode._cold_pair_kernel``). In one launch the builds
        share one ramp and one tail, and their rings the same shared memory. ``"by_id"`` by default for
        8-bit pools: on an H100 (sparse INT8, graph replays, four rounds over two machines' calls) the
        step took 94.2-94.7 µs against 96.3-100.9 at 16 x 32K and 92.7-94.4 against 100.1-103.6 at 4 x
        128K; ``"paired"`` 97.6-98.2 and 97.5-97.9 (``lab/scripts/sparse_kernels.py --ways``).
    gluon_stages4: ``gluon_mixed``'s 4-bit ring depth (0: ``gluon_stages``, at most 2).
    gluon_tma: (``gluon`` and ``gluon_mixed``, a ring, sm_90) the ring is filled by tensor copies (TMA):
        one lane issues a block's six copies (codes, scales, mins) against its stage's mbarrier, instead of
        every lane issuing its 16-byte ``cp.async`` pieces, so the copies cost the computing warp a few
        instructions a block instead of ~40 of its ~1,050, and the lanes hold no copy addresses (INT4: 195
        registers against 255, 10 programs a multiprocessor against 8; sm_90 SASS). Pools whose fields are
        not whole contiguous rows (``gluon_decode.tma_ready``) and cards below sm_90 keep ``cp.async``.
        Off until timed on an H100 / H200 (``lab/scripts/tma_ring.py``, ``lab/scripts/sparse_kernels.py``).
    gluon_after_select: (``gluon_mixed``, sm_90) the cold builds launch as a programmatic dependent of the
        launch before them, which in a sparse step is the selection's merge (it lets its dependents start as
        it starts: ``triton_sparse_split``): each program loads and scales its queries and sets up its ring,
        then waits for that launch to end before it reads the table split by bits. The builds' launch and
        set-up then overlap the merge instead of following it. The launch before is waited for whatever it
        is, so the outputs do not change. Off until timed (``lab/scripts/sparse_kernels.py``, ``+after``).

    Named constants, the same in every shipped default (tests and sweeps set the other values):

    num_stages: software-pipelining stages of the split kernel.
    min_blocks_per_split: either kernel plans at most ``ceil(blocks / min_blocks_per_split)`` splits.
    gluon_programs_per_sm: the Gluon kernel's split count aims at this many programs per multiprocessor until
        the build's occupancy is known (its first launch); then the wave model plans it (:func:`wave_splits`).
    gluon_pdl: the merge is launched as a programmatic dependent of the Gluon kernel, so it attends the hot
        zone while the cold blocks are read and waits only before merging.
    gluon_key_rows: key codes are copied into the ring by consecutive lanes along whole rows (whole 128-byte
        lines per quarter-warp) into a swizzled stage; False: each lane copies the pieces it loads.
    gluon_table_ahead: (with a ring) the block-table entries travel in the ring too, s blocks ahead, so no
        iteration waits on a load of its next block id (False: that id is loaded one iteration ahead, a
        round trip to memory per block).
    """

    # live knobs
    cvt: int = 2
    mixed: bool = True
    k_transposed: bool = False
    programs_per_sm: int = 4
    num_warps: int = 4
    maxnreg: int | None = None
    v_pairs: bool = False
    gluon: bool = False
    gluon_mixed: bool = False
    gluon_stages: int = 2
    gluon_busy_blocks: int = 1
    gluon_busy_blocks4: int = 0
    gluon_overlap: bool = False
    gluon_builds: GluonBuilds = "two"
    gluon_stages4: int = 0
    gluon_tma: bool = False
    gluon_after_select: bool = False
    # named constants
    num_stages: int = 2
    min_blocks_per_split: int = 4
    gluon_programs_per_sm: int = 32
    gluon_pdl: bool = True
    gluon_key_rows: bool = True
    gluon_table_ahead: bool = True


# Chosen on the H200 per pool bits (docs/RESULTS.md, "Decode attention kernels").
# An 8-bit pool is read with per-block bits (a demoted block may sit in it); ``PURE_INT8`` is for 8-bit pools
# where no block is ever demoted, which the Gluon kernel can take.
_DEFAULTS = {
    # gluon_mixed: the Gluon builds over the table split by bits; gluon_stages 3, the 8-bit ring's depth (as
    # in ``PURE_INT8``); both builds in one launch, each program one build's split (gluon_builds); busy
    # splits of at least 32 blocks (8-bit build) and 8 (4-bit build): a sparse row lists a fraction of its
    # table, from which 33 splits are planned at 4 x 128K. With both builds in one launch, on an H100 SXM
    # (attention alone, graphs, two calls; lab/scripts/merge_tile.py --busy) 32:8 took 79.6 / 77.6 µs at 16 x
    # 32K / 4 x 128K against 81.7 / 83.2 at 24:4 (the default chosen on an H200 when the builds launched
    # apart), 32:4 2.2-3.1 µs and a 4-bit busy count of 8 0-4.6 µs shorter than 24:4 in both calls; 64:4
    # (one 8-bit split a row at 16 x 32K) 30 µs longer. The split kernel's options stay for what the Gluon
    # kernel does not take
    8: DecodeKernelOptions(
        cvt=2,
        mixed=True,
        programs_per_sm=8,
        maxnreg=128,
        gluon_mixed=True,
        gluon_stages=3,
        gluon_busy_blocks=32,
        gluon_busy_blocks4=8,
        gluon_builds="by_id",
    ),
    # INT4: 2 stages and a 128-register cap fit 4 programs per multiprocessor (3 stages or no cap: 3).
    4: DecodeKernelOptions(
        cvt=2, k_transposed=True, num_stages=2, programs_per_sm=16, maxnreg=128, gluon=True
    ),
    # unquantized: the split kernel aims at 3 programs per SM (4 splits at 16 x 32K, 13 at 4 x 128K; 64 x 8K
    # keeps one): on an H200 (graphs, two runs) 0.502-0.506 ms against 0.518-0.519 with 2 at 16 x 32K, 0.549
    # against 0.619-0.621 at 4 x 128K; 4 per SM was slower at both (the sparse step, sparse_options.py)
    0: DecodeKernelOptions(cvt=0, num_warps=8, programs_per_sm=3),
}
# v_pairs: the value tile takes the matrix unit's transposing load instead of a byte gather. gluon: one warp
# per block, no shared-memory round trips between warps. gluon_stages 3: the 8-bit ring is fastest at 3
# stages, the 4-bit one at 2 (each measured on an H200).
PURE_INT8 = DecodeKernelOptions(
    cvt=2, mixed=False, programs_per_sm=16, maxnreg=128, v_pairs=True, gluon=True, gluon_stages=3
)


def default_options(bits: int) -> DecodeKernelOptions:
    """The kernel options used for a pool of ``bits`` (0, 4 or 8) that may hold demoted blocks."""
    return _DEFAULTS[bits]


def options_for(pool: ColdPool, options: DecodeKernelOptions | None = None) -> DecodeKernelOptions:
    """``options``, else the defaults for this pool: :data:`PURE_INT8` for an 8-bit pool that never demotes
    a block, else :func:`default_options` of its bits."""
    if options is not None:
        return options
    if pool.bits == 8 and not pool.may_demote:
        return PURE_INT8
    return default_options(pool.bits)


def decode_kernel(
    q: torch.Tensor,
    pool: ColdPool,
    block_table: torch.Tensor,
    options: DecodeKernelOptions | None = None,
    *,
    triton: bool | None = None,
) -> DecodeKernel:
    """Which kernel computes one hybrid decode attention launch; the only place that decides it.

    * ``"reference"``: :func:`~kvtune.kernels.decode_ref.hybrid_decode_attention_ref` (PyTorch), where the
      Triton kernels may not run on ``q`` (``triton``; None: :func:`~kvtune.kernels.backend.use_triton`,
      i.e. a CUDA tensor, Triton installed and not ``KVTUNE_KERNELS=torch``) or its head dim does not tile
      (:func:`~kvtune.kernels.triton_common.tileable_head_dim`).
    * ``"gluon"``: the Gluon cold kernel (``gluon_decode``) over the cold blocks, then the Triton merge
      kernel, which attends the hot zone before it merges. Taken where the options (``options``; None: the
      pool's defaults, :func:`options_for`) ask for it (``gluon``) and ``gluon_decode.supported``
      holds: a CUDA fp16/bf16 model, a 4-bit pool or an 8-bit one read without per-block bits, head dim 64
      or 128, blocks of 16, 32 or 64 tokens, at most 8 query heads per KV head, every pool field 16-byte
      aligned with strides of multiples of 16 elements (``gluon_decode.aligned``).
    * ``"gluon_mixed"``: an 8-bit pool read with per-block bits, where the options ask for it
      (``gluon_mixed``) and ``gluon_decode.supported_mixed`` holds (as above, for 8-bit codes): the table
      split by bits, the Gluon 8-bit and 4-bit builds over their parts, then the merge.
    * ``"split"``: otherwise, the Triton split kernel (cold blocks and hot zone), then the merge kernel.

    ``triton_decode.hybrid_decode_attention_triton`` asks with ``triton=True``: called directly (tests,
    benchmarks) it runs the Triton kernels on the device ``q`` is on, the interpreter's on a CPU.
    """
    if not (use_triton(q) if triton is None else triton) or not tileable_head_dim(q.shape[2]):
        return "reference"
    from kvtune.kernels import gluon_decode

    opts = options_for(pool, options)
    mixed = pool.bits == 8 and opts.mixed
    # the two Gluon paths exclude each other (pure pools / mixed ones): the alignment is read at most once
    if (
        opts.gluon
        and gluon_decode.supported(
            q, pool.bits, mixed, pool.k.shape[2], tuple(pool.k.stride()), block_table.shape[1]
        )
        and gluon_decode.aligned(pool)
    ):
        return "gluon"
    if (
        opts.gluon_mixed
        and mixed
        and gluon_decode.supported_mixed(q, pool.k.shape[2], tuple(pool.k.stride()), block_table.shape[1])
        and gluon_decode.aligned(pool)
    ):
        return "gluon_mixed"
    return "split"
