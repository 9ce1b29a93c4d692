"""Tile configurations of a kernel launch (Config), and what a configuration must hold for a kernel: standard
library only, so that `codagen build --check` checks tuning tables' entries without importing torch.
codagen.runtime.configs re-exports these; codagen.runtime.autotune chooses a launch's configuration."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

BACKENDS = ("tl", "gluon")
MAINLOOPS = ("triton", "cublas")
MIN_BLOCK, MAX_BLOCK = 16, 512  # tile sizes: tl.dot needs 16 or more, and larger tiles do not fit on chip


@dataclass(frozen=True)
class Config:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # a grid of one program per SM, each walking over tiles
    tma: bool = False  # GEMM operands through TMA tensor descriptors (Hopper), where their layout allows
    # flatten the persistent loop over tiles with the K loop, so that Triton's pipeliner can overlap a tile's
    # epilogue with the next tile's loads (tl.range(flatten=True), as in Triton's persistent-matmul tutorial)
    flatten: bool = False
    # warp-specialize the persistent loop over tiles (tl.range(warp_specialize=True)): producer warps issue
    # the TMA loads while the others run the MMAs and the epilogue, so that an epilogue overlaps the next
    # tile's loads by construction; Triton supports it on Hopper for descriptor loads, without flatten, so a
    # launch whose operands cannot go through TMA runs without it
    warp_specialize: bool = False
    # run the epilogue on each of this many column slices of the tile in turn (1, 2, 4 or 8), so that it holds
    # fewer registers at a time: a heavy epilogue on a 128x256 tile spills otherwise. Partial reductions over
    # columns are per slice, so tiles(N) counts slices (see epilogue_n).
    epilogue_split: int = 1
    # the Hopper kernel only: how many of a consumer's epilogue slices have shared-memory buffers at once
    # (1, 2, 4 or 8, dividing epilogue_split; None: every slice of the tile). With fewer, a tile's inputs
    # stream through them slice by slice, which leaves room for more operand stages
    epilogue_stages: int | None = None
    # the Hopper kernel only: tile outputs stored from registers to global memory instead of through shared
    # memory by TMA, so that stores wait for nothing and free the buffers they would take
    direct_stores: bool = False
    # the Hopper kernel only: its epilogue slices in a loop rather than unrolled, so that a long epilogue's
    # code is there once (two unrolled copies, one per consumer, miss the instruction cache); the loop selects
    # each slice of the accumulator at run time and keeps all of it live (epilogue_split 2 or more)
    slice_loop: bool = False
    # with slice_loop: the slices each of the loop's steps runs, unrolled (1, 2 or 4, less than epilogue_split
    # and dividing it), so that the step selects each slice among epilogue_split / slice_unroll of the
    # accumulator's, not among all of them, with that many copies of the epilogue's code
    slice_unroll: int = 1
    # the Hopper kernel only: its consumer warpgroups, 2, or 3 with fewer registers each (block_m 64), so that
    # an epilogue longer than the mainloop (short K) is still covered by the other consumers' MMAs
    consumers: int = 2
    # the kernel that runs: "tl" (generated/kernels/<name>.py) or "gluon", the Hopper backend's kernel
    # (generated/kernels/gluon/<name>.py: sm_90 only, for kernels it lowers), with this config's tile shape,
    # group_m and num_stages (its operand stages); the other fields are the tl kernel's
    backend: str = "tl"
    # the tl kernel's GEMM: "triton", its own mainloop; "cublas", the product by torch.mm (cuBLAS on NVIDIA GPUs)
    # in fp32, which the tl kernel with this tile shape reads in place of its mainloop before its epilogue: two
    # passes, for shapes of a long K and few output tiles, where cuBLAS splits K across the SMs and a kernel of
    # one program per tile cannot (runtime.backends.cublas_pays)
    mainloop: str = "triton"

    def __post_init__(self):
        """Refuse, when it is made, a config no kernel can launch with (Triton would fail deep inside)."""
        def fail(message: str):
            raise ValueError(f"Config: {message}")

        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "epilogue_split",
                     "slice_unroll", "consumers"):
            if type(getattr(self, name)) is not int:
                fail(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("persistent", "tma", "flatten", "warp_specialize", "direct_stores", "slice_loop"):
            if type(getattr(self, name)) is not bool:
                fail(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.epilogue_split not in (1, 2, 4, 8) or self.block_n % (2 * self.epilogue_split):
            fail(f"epilogue_split must be 1, 2, 4 or 8, and block_n a multiple of twice it (whole pairs in each "
                 f"slice), got {self.epilogue_split} with block_n {self.block_n}")
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if not (MIN_BLOCK <= size <= MAX_BLOCK and size & (size - 1) == 0):
                fail(f"{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK} (tl.arange and tl.dot "
                     f"sizes), got {size}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            fail(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")
        if self.group_m < 1 or self.num_stages < 1:
            fail(f"group_m and num_stages must be at least 1, got {self.group_m} and {self.num_stages}")
        if self.flatten and not self.persistent:
            fail("flatten pipelines a persistent program's loop over tiles: it needs persistent=True")
        if self.backend == "mm":  # the flat tables of before the mainloop field: tablefile reads them as it
            fail("backend 'mm' is the tl kernel over cuBLAS's product now: Config(backend='tl', mainloop='cublas')")
        if self.backend not in BACKENDS:
            fail(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mainloop not in MAINLOOPS:
            fail(f"mainloop must be one of {', '.join(MAINLOOPS)}, got {self.mainloop!r}")
        if self.epilogue_stages is not None and (
                type(self.epilogue_stages) is not int or self.epilogue_stages not in (1, 2, 4, 8)
                or self.epilogue_split % self.epilogue_stages or self.backend != "gluon"):
            fail(f"epilogue_stages is the Hopper (gluon) kernel's: None, or 1, 2, 4 or 8 dividing epilogue_split "
                 f"({self.epilogue_split}), got {self.epilogue_stages!r} with backend {self.backend!r}")
        if self.direct_stores and self.backend != "gluon":
            fail("direct_stores is the Hopper (gluon) kernel's (the tl kernels always store from registers)")
        if self.consumers != 2 and (self.consumers != 3 or self.backend != "gluon" or self.block_m != 64):
            fail(f"consumers is the Hopper (gluon) kernel's: 2, or 3 with block_m 64 (three consumers hold 64-row "
                 f"tiles in their registers), got {self.consumers} with backend {self.backend!r} and block_m "
                 f"{self.block_m}")
        if self.slice_loop and (self.backend != "gluon" or self.epilogue_split == 1):
            fail(f"slice_loop is the Hopper (gluon) kernel's, for an epilogue_split of 2 or more, got backend "
                 f"{self.backend!r} and epilogue_split {self.epilogue_split}")
        if self.slice_unroll != 1 and (not self.slice_loop or self.slice_unroll not in (2, 4)
                                       or self.epilogue_split % self.slice_unroll
                                       or self.slice_unroll == self.epilogue_split):
            fail(f"slice_unroll is slice_loop's: 2 or 4 slices per step of the loop, dividing epilogue_split "
                 f"({self.epilogue_split}) and less than it, got {self.slice_unroll} with slice_loop "
                 f"{self.slice_loop}")
        if self.mainloop == "cublas" and (self.backend != "tl" or self.tma or self.flatten or self.warp_specialize):
            fail(f"mainloop 'cublas' is the tl kernel's (backend 'tl', got {self.backend!r}), which then has no "
                 "mainloop of its own to load through TMA, flatten or warp-specialize: tma, flatten and "
                 "warp_specialize must be False")
        if self.warp_specialize and not (self.persistent and self.tma and not self.flatten):
            fail("warp_specialize needs persistent=True and tma=True (Triton specializes the loop over tiles "
                 "with descriptor loads), and flatten=False")

    @property
    def epilogue_n(self) -> int:
        """Columns of what the epilogue runs on at a time: the width that tiles(N) counts in."""
        return self.block_n // self.epilogue_split

    def meta(self) -> dict:
        """Keyword arguments of a kernel launch."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "FLATTEN": self.flatten, "EPILOGUE_SPLIT": self.epilogue_split,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """Short form for logs, e.g. '128x256x64 g8 w8 s3 persistent tma'."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} s{self.num_stages}"
                + (" persistent" if self.persistent else "") + (" tma" if self.tma else "")
                + (" flatten" if self.flatten else "") + (" ws" if self.warp_specialize else "")
                + epilogue_label(self) + (f" {self.backend}" if self.backend != "tl" else "")
                + (f" {self.mainloop}" if self.mainloop != "triton" else ""))


def epilogue_label(config) -> str:
    """The label's part for how the epilogue runs, from a Config or a HopperConfig (the same fields): its
    slices, their buffers, direct stores, the slice loop and its step, the consumers."""
    return ((f" epilogue/{config.epilogue_split}" if config.epilogue_split > 1 else "")
            + (f" in {config.epilogue_stages}" if config.epilogue_stages is not None else "")
            + (" direct" if config.direct_stores else "") + (" loop" if config.slice_loop else "")
            + (f" by {config.slice_unroll}" if config.slice_unroll != 1 else "")
            + (f" c{config.consumers}" if config.consumers != 2 else ""))


def fits_group(config: Config, group: int | str | None, n: int | None = None) -> bool:
    """Whether each column slice the epilogue runs on holds whole column groups of `group` columns; for group
    "N" (the whole row), whether one slice spans the `n` columns (unknown n: any may)."""
    if group == "N":
        return n is None or n <= config.epilogue_n
    return group is None or config.epilogue_n % group == 0


# The most shared memory one program may use (CUDA's shared memory per block, opt-in), by GPU: the first row
# whose pattern matches words of a tuning table's GPU name (runtime.tables.gpu_key: the CUDA device name in
# lowercase, '-' between words, e.g. 'nvidia-h100-80gb-hbm3', 'nvidia-a100-sxm4-80gb', 'nvidia-geforce-rtx-4090').
# The tl kernels run at least one operand stage (runtime.fitting_stages lowers the stages to what fits, down to
# that one), so a tile whose one stage takes more fits no such GPU: every launch of it would fail there.
SHARED_BYTES_BY_GPU: tuple[tuple[str, int], ...] = (
    (r"gh200|h100|h200|h800|h20", 232448),  # sm_90, Hopper: 227 KiB
    (r"gb200|b100|b200|b300", 232448),  # sm_100, Blackwell data-center: 227 KiB
    (r"a100|a800|a30", 166912),  # sm_80: 163 KiB
    (r"a10g?|a16|a40|rtx-a[0-9]+|rtx-30[0-9]{2}(-ti)?", 101376),  # sm_86: 99 KiB
    (r"l4|l20|l40s?|rtx-40[0-9]{2}(-ti)?|rtx-[0-9]+-ada(-generation)?", 101376),  # sm_89, Ada: 99 KiB
    (r"rtx-50[0-9]{2}(-ti)?|rtx-pro-[0-9]+", 101376),  # sm_120, Blackwell workstation: 99 KiB
    (r"v100", 98304),  # sm_70: 96 KiB
    (r"t4|rtx-20[0-9]{2}(-ti)?", 65536),  # sm_75, Turing: 64 KiB
)
# A GPU none of the rows names (a new one, or a table of no GPU): the most of the GPUs codagen tunes for
MAX_SHARED_BYTES = 232448


def shared_bytes(gpu: str | None) -> int:
    """The most shared memory one program may use on `gpu` (a tuning table's GPU name), by SHARED_BYTES_BY_GPU;
    MAX_SHARED_BYTES for a name no row matches, or none."""
    for pattern, limit in SHARED_BYTES_BY_GPU:
        if isinstance(gpu, str) and re.search(rf"(?:^|-)(?:{pattern})(?:-|$)", gpu.lower()):
            return limit
    return MAX_SHARED_BYTES


def stage_bytes(config: Config, element_size: int = 2) -> int:
    """Shared memory of one stage of a GEMM's operand tiles (tables are tuned on 16-bit operands)."""
    return (config.block_m + config.block_n) * config.block_k * element_size


def fits_shared(config: Config, gemm: bool = True, gpu: str | None = None) -> bool:
    """Whether the config's operand tiles fit a program's shared memory on `gpu` (shared_bytes; any GPU codagen
    tunes for when None); without a GEMM, or with mainloop "cublas" (torch.mm makes the product), there are none."""
    return not gemm or config.mainloop == "cublas" or stage_bytes(config) <= shared_bytes(gpu)
