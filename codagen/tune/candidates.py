"""The tile configurations `codagen tune` tries: for Hopper GPUs (H100/H200), bf16 operands and FP8 ones."""
from __future__ import annotations

import dataclasses

from ..emit.gluon import default_split, tma_inputs, tma_outputs
from ..errors import SpecError, ValidationFailed
from ..model import Kernel
from ..runtime import configs
from ..tileconfig import Config, HopperConfig, TileConfig


def _c(bm, bn, bk, warps, stages, persistent, tma) -> Config:
    return Config(bm, bn, bk, 8, warps, stages, persistent=persistent, tma=tma)


def _h(bm, bn, bk, group_m, stages, **fields) -> HopperConfig:
    return HopperConfig(bm, bn, bk, stages=stages, group_m=group_m, **fields)


# For Hopper (H100/H200: 228 KB of shared memory per SM, wgmma on 64-row warpgroups) and bf16 operands.
# Centred on what the H200 measured for the plain GEMM: a persistent grid with TMA operands and 128x256x64
# tiles matched cuBLAS's mainloop, but epilogues add registers and shared memory, so smaller N-tiles and
# fewer stages stay in. 128x256 tiles use 8 warps (two warpgroups); 64-wide tiles use 4. Shared memory per stage is
# (BM + BN) * BK * 2 bytes: 48 KB for 128x256x64, so 4 stages is the most that fits next to an epilogue.
# Pointer loads (tma=False) and one-program-per-tile grids stay in for layouts and shapes where TMA or
# persistence lose. Candidates that do not fit are discarded by the check, not chosen.
GEMM_CANDIDATES = (
    #   BM   BN   BK  warps stages persistent tma
    _c(128, 256, 64, 8, 3, True, True),  # the fastest plain mainloop measured
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), flatten=True),  # won most GEMM shapes on the H200
    _c(128, 128, 64, 8, 4, True, True),  # runtime.configs.GPU_DEFAULT
    dataclasses.replace(_c(128, 128, 64, 8, 4, True, True), flatten=True),
    # warp-specialized: the loads in producer warps, the epilogue overlapping them (won 10 of the 36 matmul
    # shapes on the H200)
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True),
    dataclasses.replace(_c(128, 128, 64, 8, 4, True, True), warp_specialize=True),
    _c(128, 128, 64, 8, 4, False, True),  # one program per tile: the epilogue of one overlaps the next's loads
    _c(128, 64, 64, 4, 4, False, True),  # narrow tiles: heavy epilogues, few registers to spare
    _c(64, 128, 64, 4, 4, False, True),
    _c(64, 64, 64, 4, 4, False, True),  # wide inputs in the epilogue (2*N columns) need the smallest tiles
    # ... or the epilogue on a half or a quarter of the tile at a time, fewer registers live at once: on the
    # H200 (2026-12-02) these won 26 of the 36 shapes of the fused GEMM kernels, all of swiglu_dgrad's and
    # lm_head_logsumexp's
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), epilogue_split=2),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True, epilogue_split=2),
    dataclasses.replace(_c(128, 128, 64, 8, 4, False, True), epilogue_split=2),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), epilogue_split=4),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True, epilogue_split=4),
    dataclasses.replace(_c(128, 128, 64, 8, 4, False, True), epilogue_split=4),
    # eighths of a 128x128 tile: compiled for sm_90 with triton 3.6 (benchmarks/results/sm90-spills.md), the
    # SwiGLU and RMSNorm backward epilogues (swiglu_dgrad, norm_dgrad_residual) hold 172 and 139 registers per
    # thread on eighths, 241 and 171 on quarters, and spill 1768 and 72 bytes on the whole tile
    dataclasses.replace(_c(128, 128, 64, 8, 4, False, True), epilogue_split=8),
    dataclasses.replace(_c(128, 128, 64, 8, 4, True, True), epilogue_split=8),
    # two programs per SM: with 3 stages (96 KB of shared memory) and the epilogue on eighths, the forward
    # epilogues hold at most 128 registers per thread (out_proj_residual_norm 110, gate_up_swiglu 123,
    # qkv_norm_rope 124, lm_head_logsumexp 128; compiled for sm_90 with triton 3.6), so two programs fit an SM
    # and one's epilogue runs beside the other's mainloop
    dataclasses.replace(_c(128, 128, 64, 8, 3, False, True), epilogue_split=8),
    # two programs per SM for the backward epilogues: 64x128 tiles in 4 warps, 4 stages (96 KB), hold 245
    # registers per thread on quarters (swiglu_dgrad) and 229 on halves (norm_dgrad_residual) without
    # spilling, at most 256 for two programs of 128 threads
    dataclasses.replace(_c(64, 128, 64, 4, 4, False, True), epilogue_split=2),
    dataclasses.replace(_c(64, 128, 64, 4, 4, False, True), epilogue_split=4),
)
# Pruned on the H200 (2026-12-02, graph-timed sweep of 8 configs over the Llama kernels, see
# benchmarks/results/h200-kernels.md): pointer loads, 4 warps on 128x128 and 256-row tiles never won.
# No GEMM, no K loop: the tile shape, the warps and the grid matter; the rest is the default's. A persistent
# grid keeps one tile's loads in flight per SM: lm_head_ce_dz, which reads and writes a chunk of logits once,
# moved 2 TB/s so (0.51 ms for 1 GB at 2048x128256 on the H200, against 4.3 TB/s for a copy); a grid of one
# program per tile lets several programs per SM keep their loads in flight at once. How many fit an SM is set by
# the registers (compiled for sm_90 with triton 3.6): at 64 elements a thread, lm_head_ce_dz holds 128 and
# swiglu_bwd_rowdot 253, so 1 to 4 programs of 4 warps fit; at 32, 72 and 128; at 16 (32x128 tiles, 8 warps), 62
# and 75. Tiles that small only pay with one program per tile: a persistent grid keeps one per SM.
ELEMENTWISE_CANDIDATES = tuple(
    dataclasses.replace(configs.GPU_DEFAULT, block_m=bm, block_n=bn, num_warps=w, persistent=persistent)
    for bm, bn, w, grids in ((128, 128, 8, (True, False)), (64, 128, 4, (True, False)), (32, 256, 4, (True, False)),
                             (32, 128, 4, (False,)), (64, 128, 8, (False,)), (32, 128, 8, (False,)))
    for persistent in grids
)


# The Hopper backend's kernel (generated/kernels/gluon/: persistent, a TMA producer warp and two ping-pong
# consumer warpgroups, 128x128 tiles per consumer), timed beside the tl candidates for the kernels it lowers
# and only on sm_90: its tile shape, group_m and operand stages (num_stages). 5 stages fit beside one epilogue
# buffer per consumer, 4 beside two or three; a candidate that does not fit is refused at its launch and
# discarded. GROUP_M 16 won some of the out-projection shapes on the H200 (benchmarks/results/h200-gluon.md).
# The epilogue on column slices holds fewer registers at a time: on 4 slices the RMSNorm backward's epilogues
# (norm_dgrad*) stop spilling, compiled for sm_90 with triton 3.6 (from 540-820 bytes of stack per thread to
# none); BK 32 makes room for two epilogue buffers and a reduction's scratch. Kernels whose
# tiles of pairs (2*N columns) cross by TMA have buffers twice as wide: 3 stages of BK 64 fit beside them, or
# 5 of BK 32; their epilogue runs on 8 slices (a whole tile's pairs spill).
GLUON_CANDIDATES = (
    _h(128, 128, 64, 8, 5),
    _h(128, 128, 64, 8, 4),
    _h(128, 128, 64, 16, 5),
    _h(128, 128, 64, 8, 5, epilogue_split=4),
    _h(128, 128, 32, 8, 5, epilogue_split=4),
    _h(128, 128, 64, 8, 3, epilogue_split=8),
    _h(128, 128, 32, 8, 5, epilogue_split=8),
    # 64-row tiles per consumer: half the epilogue buffers, so tiles of pairs fit 5 stages (188 KB) where
    # 128-row ones fit 3; on quarters swiglu_dgrad and norm_dgrad_residual do not spill
    _h(64, 128, 64, 8, 5, epilogue_split=4),
    # tile inputs streamed through 2 or 4 slices' buffers instead of the whole tile's (epilogue_stages): at
    # 128x128 tiles, 6 or 5 stages of BK 64 fit beside tiles of pairs (swiglu_dgrad, 229,720-229,752 bytes,
    # compiled for sm_90), and 4-6 beside the RMSNorm backward's two inputs (197,272 bytes at 5 stages); on the
    # H200 they won 7 of the 12 shapes of swiglu_dgrad and norm_dgrad_residual (2026-12-03)
    _h(128, 128, 64, 8, 6, epilogue_split=8, epilogue_stages=2),
    _h(128, 128, 64, 8, 5, epilogue_split=8, epilogue_stages=4),
    _h(128, 128, 64, 8, 5, epilogue_split=4, epilogue_stages=2),
    # tile outputs stored from registers (direct_stores): no store waits for an earlier one to leave a buffer,
    # a slice's buffers load the next inputs once read, and kernels without tile inputs need no buffers (6
    # stages fit, 197 KB); compiled for sm_90, none spills (benchmarks/results/h200-gluon-compile.md)
    _h(128, 128, 64, 8, 6, direct_stores=True),
    _h(128, 128, 64, 8, 6, epilogue_split=4, direct_stores=True),
    _h(128, 128, 64, 8, 5, epilogue_split=4, direct_stores=True),
    _h(128, 128, 64, 8, 6, epilogue_split=8, epilogue_stages=2, direct_stores=True),
    _h(128, 128, 64, 8, 5, epilogue_split=8, epilogue_stages=4, direct_stores=True),
    _h(128, 128, 64, 8, 5, epilogue_split=4, epilogue_stages=2, direct_stores=True),
    _h(128, 128, 64, 8, 6, epilogue_split=4, epilogue_stages=2, direct_stores=True),
    # 64-row tiles, which won swiglu_dgrad at 1B, with direct stores: 6 stages beside a whole tile of pairs
    # (213,384 bytes; norm_dgrad_residual 214,200), no stack
    _h(64, 128, 64, 8, 6, epilogue_split=4, direct_stores=True),
    # the slices in a loop (slice_loop): one copy of the epilogue's code per consumer, not one per slice.
    # swiglu_dgrad on 8 unrolled slices is 186 KB of code, and ncu found its warps waiting for instructions
    # 38% of the time; in a loop it is 46 KB and 10-33% faster (H200, 2026-12-04). The loop keeps the whole
    # accumulator live: on quarters of tiles of pairs it spills (272 bytes of stack), on eighths not (compiled
    # for sm_90 after the epilogue changes of 2026-12-04 night; 736 and 24 bytes before)
    _h(128, 128, 64, 8, 6, epilogue_split=8, epilogue_stages=2, slice_loop=True),
    # ... with 4 epilogue stages: each slice's inputs load 3 slices ahead, not 1. ncu on swiglu_dgrad with 2
    # stages (and each reload a slice later than here, a variant that lost) found its consumers waiting for their
    # slices' inputs about as long as for their operands; with 4, swiglu_dgrad ran 6% faster at 1B and 20% at 8B,
    # 32k tokens (H100, 2026-12-08)
    _h(128, 128, 64, 8, 5, epilogue_split=8, epilogue_stages=4, slice_loop=True),
    _h(128, 128, 64, 8, 5, epilogue_split=4, slice_loop=True),
    _h(128, 128, 64, 8, 5, epilogue_split=4, direct_stores=True, slice_loop=True),
    # the loop by steps of 2 or 4 slices (slice_unroll): picking each slice out of the accumulator takes
    # fewer selects (swiglu_dgrad on 8 slices: 7.25 FSEL per element in a loop of single slices, 3.25 by 2,
    # 1.25 by 4; compiled for sm_90, 50 and 75 KB of code, no stack), and its time followed its instruction count
    # when the PTX sigmoid shortened it (H200, 2026-12-04)
    _h(128, 128, 64, 8, 6, epilogue_split=8, epilogue_stages=2, slice_loop=True, slice_unroll=2),
    _h(128, 128, 64, 8, 6, epilogue_split=8, epilogue_stages=2, slice_loop=True, slice_unroll=4),
    _h(128, 128, 64, 8, 5, epilogue_split=4, slice_loop=True, slice_unroll=2),
    # three consumers of 64-row tiles (160 registers each): a consumer's epilogue may take up to twice a
    # mainloop and still be covered by the others' MMAs, where with two it must fit in one (swiglu_dgrad at
    # 1B: 1.5 mainloops, ncu). Compiled for sm_90: no stack for swiglu_dgrad (loop, 8 slices, 2 epilogue stages,
    # 8 stages of 24 KB); its slices in a loop, since three unrolled copies of a long epilogue outgrow the
    # instruction cache (147 KB of code at 4 slices)
    _h(64, 128, 64, 8, 8, epilogue_split=8, epilogue_stages=2, slice_loop=True, consumers=3),
    _h(64, 128, 64, 8, 7, epilogue_split=4, slice_loop=True, consumers=3),
    _h(64, 128, 64, 8, 8, epilogue_split=4, direct_stores=True, slice_loop=True, consumers=3),
)


# Mainloop "cublas": torch.mm's product (cuBLAS), then the tl kernel's epilogue over it, timed where
# backends.cublas_pays
# (a long K, few output tiles: the LM head's input gradient over a chunk of rows). The tile shape and warps are
# those of the epilogue's pass alone, as for the kernels without a GEMM (ELEMENTWISE_CANDIDATES).
CUBLAS_CANDIDATES = tuple(
    Config(bm, bn, 64, 8, w, 1, epilogue_split=split, mainloop="cublas")
    for bm, bn, w, split in ((128, 128, 8, 1), (128, 128, 8, 2), (64, 128, 4, 1), (32, 128, 4, 1))
)


# Column groups as wide as the tile (Qwen3's 128-column heads) keep the epilogue on whole tiles, where
# QK-norm with RoPE spills 1400-1500 bytes per thread at 128x128; 64-row tiles hold half as much (216 bytes).
GLUON_GROUP_CANDIDATES = (_h(64, 128, 64, 8, 6),)


# A K-group mainloop holds two fp32 tiles (the accumulator and each K step's product, scaled before it is added):
# 64-row tiles on 8 warps keep 256-wide ones (a gate/up projection's column groups of 256) without spilling,
# compiled for sm_90 (128 x 256: 488 bytes of stack a thread, 64 x 256: none)
FP8_K_GROUP_CANDIDATES = (
    Config(64, 256, 64, 8, 8, 4, tma=True),
    Config(64, 256, 64, 8, 8, 3, persistent=True, tma=True),
)


def tl_candidates(kernel: Kernel) -> tuple[Config, ...]:
    """The tl kernel's candidates: for a kernel with a GEMM, its own mainloop's, then the cuBLAS mainloop's (timed
    only at the shapes where they pay: TlConfig.pays); for one without, the elementwise ones. FP8 operands, a byte
    an element, fill a stage of BK 128 as bf16's fill one of BK 64 (the same shared memory, rows of 128 bytes): those
    first, then BK 64 (fewer bytes a stage, more stages); with K-group scales of 128 columns, BK 128 scales each
    step's product once per group rather than twice, and FP8_K_GROUP_CANDIDATES join. torch.mm takes no FP8: no
    cuBLAS mainloop."""
    if not kernel.gemm:
        return ELEMENTWISE_CANDIDATES
    if kernel.fp8_gemm:
        pool = GEMM_CANDIDATES + (FP8_K_GROUP_CANDIDATES if kernel.gemm.scales else ())
        return tuple(dataclasses.replace(c, block_k=2 * c.block_k) for c in pool) + pool
    return GEMM_CANDIDATES + CUBLAS_CANDIDATES


def gluon_candidates(kernel: Kernel) -> tuple[HopperConfig, ...]:
    """The Gluon candidates for a kernel the Hopper backend lowers: on whole tiles, on 4 slices, on the slices
    its Hopper kernel runs by default (codagen.emit.gluon.default_split: 8 for tiles of pairs), and on 8 where
    tile inputs stream through the slices' buffers (the RMSNorm backward: 6 stages fit beside 2 of 8 slices'
    inputs, 213,656-230,040 bytes compiled for sm_90, 16 bytes of stack at most), with direct stores where it
    stores tiles by TMA; for a kernel with column groups, 64-row tiles too. None without a GEMM (the backend
    schedules GEMM mainloops only)."""
    if not kernel.gemm:
        return ()
    splits = (1, 4, default_split(kernel), *((8,) if tma_inputs(kernel) else ()))
    stores_tiles = bool(tma_outputs(kernel))
    return tuple(c for c in GLUON_CANDIDATES if c.epilogue_split in splits and (stores_tiles or not c.direct_stores)
                 ) + (GLUON_GROUP_CANDIDATES if kernel.column_group else ())


# The candidates of each backend, by its name (runtime.backends.BACKENDS), for a kernel it lowers: configs of its
# config type (codagen.tileconfig.CONFIGS), which say where they pay (pays) and what they need of a GPU
BACKEND_CANDIDATES = {"tl": tl_candidates, "gluon": gluon_candidates}


def candidates(kernel: Kernel, backends: tuple[str, ...] = ()) -> tuple[TileConfig, ...]:
    """The configs `codagen tune` tries: the tl kernel's, then those of `backends`, the other backends that lower
    the kernel and that this GPU runs (harness.other_backends), each backend's from BACKEND_CANDIDATES. For a
    kernel with column groups, only those whose epilogue slices hold whole groups; none is an error located at
    the spec's column_group."""
    pool = sum((BACKEND_CANDIDATES[b](kernel) for b in ("tl", *backends)), ())
    fitting = tuple(c for c in pool if configs.fits_group(c, kernel.column_group))
    if not fitting:
        widest = max(c.epilogue_n for c in pool)
        raise ValidationFailed([SpecError(
            kernel.column_group_loc or kernel.loc,
            f"column_group {kernel.column_group}: no tuning candidate of {kernel.name} has epilogue slices that "
            f"hold whole groups (the widest is {widest} columns); use a column_group of at most {widest}")])
    return fitting
