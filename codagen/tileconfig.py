"""Tile configurations of a kernel launch, one type per backend, and what a configuration must hold for a kernel:
standard library only, so that `codagen build --check` checks tuning tables' entries without importing torch.

`TlConfig` (also named `Config`) is the tl kernel's (generated/kernels/<name>.py), `HopperConfig` the Hopper
backend's (generated/kernels/gluon/<name>.py); each validates its own fields when it is made. `CONFIGS` names each
type by its backend (the `backend` of a table's entry), and `config_of` makes one from a table's fields.
codagen.runtime.configs re-exports these; codagen.runtime.autotune chooses a launch's configuration."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Protocol

MAINLOOPS = ("triton", "cublas")
MIN_BLOCK, MAX_BLOCK = 16, 512  # tile sizes: tl.dot needs 16 or more, and larger tiles do not fit on chip


class TileConfig(Protocol):
    """What every backend's config type answers (TlConfig, HopperConfig: a frozen dataclass each, checking its own
    fields when it is made), which the registries, tables and the tuner ask of a config of any backend."""

    backend: ClassVar[str]  # the backend whose kernel it runs, as CONFIGS names its type
    block_m: int
    block_n: int
    epilogue_split: int

    @property
    def epilogue_n(self) -> int:
        """Columns the epilogue runs on at a time: what tiles(N) counts."""

    def label(self) -> str:
        """Its short form in logs (`codagen tune --only` matches it)."""

    def as_dict(self) -> dict:
        """Its fields, as a table's entry holds them (from_fields reads them back)."""

    @classmethod
    def from_fields(cls, given: dict) -> TileConfig:
        """The config of a table entry's fields, with what tables written before this type hold."""

    def as_tl(self) -> TlConfig:
        """The tl kernel's config of the same tile, where a launch falls back to it."""

    def operand_bytes(self, element_size: int = 2) -> int:
        """Its resource model: the shared memory of a program it needs at the least (fits_shared)."""

    def pays(self, m: int, n: int, k: int) -> bool:
        """Whether it is worth timing at an [m, n] x k problem."""


def _fail(kind: str, message: str):
    raise ValueError(f"{kind}: {message}")


def _check_tile(config, kind: str, ints: tuple[str, ...], bools: tuple[str, ...], stages: str) -> None:
    """The checks every backend's config shares: field types, the tile sizes, the epilogue split, group_m and
    the operand stages (the field named `stages`)."""
    for name in ints:
        if type(getattr(config, name)) is not int:
            _fail(kind, f"{name} must be an int, got {getattr(config, name)!r}")
    for name in bools:
        if type(getattr(config, name)) is not bool:
            _fail(kind, f"{name} must be True or False, got {getattr(config, name)!r}")
    if config.epilogue_split not in (1, 2, 4, 8) or config.block_n % (2 * config.epilogue_split):
        _fail(kind, f"epilogue_split must be 1, 2, 4 or 8, and block_n a multiple of twice it (whole pairs in each "
                    f"slice), got {config.epilogue_split} with block_n {config.block_n}")
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(config, name)
        if not (MIN_BLOCK <= size <= MAX_BLOCK and size & (size - 1) == 0):
            _fail(kind, f"{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK} (tl.arange and tl.dot "
                        f"sizes), got {size}")
    if config.group_m < 1 or getattr(config, stages) < 1:
        _fail(kind, f"group_m and {stages} must be at least 1, got {config.group_m} and {getattr(config, stages)}")


@dataclass(frozen=True)
class TlConfig:
    """The tl kernel's configuration: its tile, grid and mainloop."""

    backend: ClassVar[str] = "tl"  # the kernel that runs: generated/kernels/<name>.py

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
    # the GEMM: "triton", the kernel's own mainloop; "cublas", the product by torch.mm (cuBLAS on NVIDIA GPUs)
    # in fp32, which the kernel with this tile shape reads in place of its mainloop before its epilogue: two
    # passes, for shapes of a long K and few output tiles, where cuBLAS splits K across the SMs and a kernel of
    # one program per tile cannot (cublas_pays)
    mainloop: str = "triton"

    def __post_init__(self):
        """Refuse, when it is made, a config the tl kernel cannot launch with (Triton would fail deep inside)."""
        kind = "Config"
        _check_tile(self, kind, ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
                                 "epilogue_split"),
                    ("persistent", "tma", "flatten", "warp_specialize"), "num_stages")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            _fail(kind, f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")
        if self.flatten and not self.persistent:
            _fail(kind, "flatten pipelines a persistent program's loop over tiles: it needs persistent=True")
        if self.mainloop not in MAINLOOPS:
            _fail(kind, f"mainloop must be one of {', '.join(MAINLOOPS)}, got {self.mainloop!r}")
        if self.mainloop == "cublas" and (self.tma or self.flatten or self.warp_specialize):
            _fail(kind, "mainloop 'cublas' is the tl kernel's over cuBLAS's product, which then has no mainloop of its "
                        "own to load through TMA, flatten or warp-specialize: tma, flatten and warp_specialize must "
                        "be False")
        if self.warp_specialize and not (self.persistent and self.tma and not self.flatten):
            _fail(kind, "warp_specialize needs persistent=True and tma=True (Triton specializes the loop over tiles "
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
                + epilogue_label(self) + (f" {self.mainloop}" if self.mainloop != "triton" else ""))

    def as_tl(self) -> TlConfig:
        """The tl kernel's config of the same tile: itself."""
        return self

    @classmethod
    def from_fields(cls, given: dict) -> TlConfig:
        """The config of a table entry's fields. Tables written while one Config held every backend's fields hold
        the Hopper kernel's too: dropped where they are at the values that Config took for the tl kernel."""
        given = dict(given)
        for name, default in _OLD_HOPPER_FIELDS.items():
            if name in given and (given[name] != default or type(given[name]) is not type(default)):
                raise ValueError(f"{name} is the Hopper (gluon) kernel's, which the tl kernel does not read: "
                                 f"{default!r} or none, got {given[name]!r} with backend 'tl'")
            given.pop(name, None)
        return _made(cls, given)

    def operand_bytes(self, element_size: int = 2) -> int:
        """Shared memory the config needs at the least on a GEMM: one stage of its operand tiles (the kernel
        lowers its stages to what fits, down to one: runtime.fitting_stages); none with mainloop "cublas"."""
        return 0 if self.mainloop == "cublas" else stage_bytes(self, element_size)

    def pays(self, m: int, n: int, k: int) -> bool:
        """Whether the config is worth timing at an [m, n] x k problem: mainloop "cublas" only where cublas_pays."""
        return self.mainloop != "cublas" or cublas_pays(m, n, k)


Config = TlConfig  # the tl kernel's, the configuration most launches take: codagen.runtime.Config


# Registers per thread of a warpgroup that the register file holds (64K for 128 threads), the Hopper kernel's
# producer warp's setmaxnreg (its warpgroup's), and each consumer's setmaxnreg by how many there are: two hold
# 128x128 accumulators; three (3 * 160 + 24 <= 512) hold 64-row tiles' epilogues
REGISTERS = 512
PRODUCER_REGS = 24
CONSUMER_REGS = {2: 232, 3: 160}


@dataclass(frozen=True)
class HopperConfig:
    """The Hopper (Gluon) kernel's configuration (codagen/runtime/gluon_hopper.py, docs/hopper.md). One consumer's
    tile is BLOCK_M x BLOCK_N with its fp32 accumulator in one warpgroup's registers (BLOCK_M * BLOCK_N / 128 per
    thread: 128 at 128x128), so tiles are half the width the tl kernels use. Shared memory holds `stages` operand
    stages and the epilogue's buffers, within the 227 KiB a program has on an H200; 128x128 tiles need 4 stages or
    more to keep the tensor cores fed (measured). The epilogue runs on `epilogue_split` column slices of the tile in
    turn (its inputs and outputs cross by TMA in slices too), so that fewer values are live at a time.
    `epilogue_stages` of those slices have buffers of their own (None: all of them): the first that many slices'
    inputs load while the mainloop runs, and each later slice's once an earlier slice's stores are done with its
    buffers, so that a tile's inputs stream through a ring of small buffers and more operand stages fit beside them.
    `direct_stores`: tile outputs go from registers to global memory (masked stores, as the tl kernels make them)
    instead of through the epilogue's buffers by TMA, so that no store waits for an earlier one to have left a
    buffer, a slice's buffers take the next slice's inputs as soon as they are read, and buffers for the stores
    alone are not needed (more operand stages fit). `slice_loop`: the consumer runs its slices in a loop, not
    unrolled, so that a long epilogue's code is there once per consumer and fits the instruction cache; the loop
    selects each slice of the accumulator at run time and keeps all of it live throughout; `slice_unroll` slices
    per step of the loop, unrolled, so that each is selected among epilogue_split / slice_unroll. `consumers`: 2,
    or 3 with fewer registers each (64-row tiles), so that a consumer's epilogue may take up to twice a mainloop
    and still be covered by the others' MMAs; `consumer_regs`: each one's setmaxnreg (None: CONSUMER_REGS of
    that many)."""

    backend: ClassVar[str] = "gluon"  # the kernel that runs: generated/kernels/gluon/<name>.py (sm_90 only)

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    consumer_regs: int | None = None  # setmaxnreg of the worker consumers; the default one gets the rest
    epilogue_split: int = 1
    epilogue_stages: int | None = None
    direct_stores: bool = False
    slice_loop: bool = False
    slice_unroll: int = 1
    consumers: int = 2

    def __post_init__(self):
        """Refuse, when it is made, a config the Hopper kernel cannot launch with whatever the kernel (each
        launch checks the rest against its kernel's epilogue: gluon_hopper.check)."""
        kind = "HopperConfig"
        if self.consumer_regs is None:  # (for consumers that are not 2 or 3, whose message follows, two's)
            object.__setattr__(self, "consumer_regs", CONSUMER_REGS[3 if self.consumers == 3 else 2])
        _check_tile(self, kind, ("block_m", "block_n", "block_k", "stages", "group_m", "consumer_regs",
                                 "epilogue_split", "slice_unroll", "consumers"),
                    ("direct_stores", "slice_loop"), "stages")
        if self.epilogue_stages is not None and (
                type(self.epilogue_stages) is not int or self.epilogue_stages not in (1, 2, 4, 8)
                or self.epilogue_split % self.epilogue_stages):
            _fail(kind, f"epilogue_stages must be None, or 1, 2, 4 or 8 dividing epilogue_split "
                        f"({self.epilogue_split}), got {self.epilogue_stages!r}")
        if self.consumers not in (2, 3) or (self.consumers == 3 and self.block_m != 64):
            _fail(kind, f"consumers must be 2, or 3 with block_m 64 (three consumers hold 64-row tiles in their "
                        f"registers), got {self.consumers} with block_m {self.block_m}")
        if self.consumers * self.consumer_regs + PRODUCER_REGS > REGISTERS:
            _fail(kind, f"consumers must be 2 or 3, each with consumer_regs registers, within the {REGISTERS} per "
                        f"thread of a warpgroup that the register file holds beside the producer's {PRODUCER_REGS}; "
                        f"got {self.consumers} consumers of {self.consumer_regs}")
        if self.slice_loop and self.epilogue_split == 1:
            _fail(kind, f"slice_loop is for an epilogue_split of 2 or more, got epilogue_split {self.epilogue_split}")
        if self.slice_unroll != 1 and (not self.slice_loop or self.slice_unroll not in (2, 4)
                                       or self.epilogue_split % self.slice_unroll
                                       or self.slice_unroll == self.epilogue_split):
            _fail(kind, f"slice_unroll is slice_loop's: 2 or 4 slices per step of the loop, dividing epilogue_split "
                        f"({self.epilogue_split}) and less than it, got {self.slice_unroll} with slice_loop "
                        f"{self.slice_loop}")

    @property
    def epilogue_n(self) -> int:
        """Columns that one partial reduction covers (tiles(N) counts these), as TlConfig.epilogue_n."""
        return self.block_n // self.epilogue_split

    @property
    def slices_in_flight(self) -> int:
        """The epilogue slices with buffers of their own, per consumer."""
        return self.epilogue_stages or self.epilogue_split

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "STAGES": self.stages,
                "GROUP_M": self.group_m, "CONSUMER_REGS": self.consumer_regs, "EPILOGUE_SPLIT": self.epilogue_split,
                "EPILOGUE_STAGES": self.slices_in_flight, "SLICE_LOOP": self.slice_loop,
                "SLICE_UNROLL": self.slice_unroll, "DIRECT_STORES": self.direct_stores, "CONSUMERS": self.consumers}

    def as_dict(self) -> dict:
        return asdict(self)

    def smem_bytes(self, element_size: int, epilogue) -> int:
        """Shared memory of a program: the ring, the consumers' epilogue buffers and scratch (`epilogue`: the
        kernel's gluon_hopper.Epilogue), and barriers."""
        stage = (self.block_m + self.block_n) * self.block_k * element_size
        held = epilogue.inputs if self.direct_stores else epilogue.buffers
        buffers = (self.consumers * held * self.block_m * epilogue.columns * self.epilogue_n * self.slices_in_flight
                   * element_size)
        scratch = epilogue.scratch * self.block_m * self.epilogue_n // (128 * 128)
        return self.stages * stage + buffers + scratch + 512

    def label(self) -> str:
        """Short form for logs, e.g. '128x128x64 s5 g8 r232 epilogue/4 direct gluon'."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} s{self.stages} g{self.group_m} r{self.consumer_regs}"
                + epilogue_label(self) + " gluon")

    def as_tl(self) -> TlConfig:
        """The tl kernel's config of the same tile, group_m, operand stages and epilogue slices, in 4 warps (a
        warpgroup, as each consumer): what a launch runs where the Hopper kernel refuses its tensors."""
        return TlConfig(self.block_m, self.block_n, self.block_k, self.group_m, num_warps=4, num_stages=self.stages,
                        epilogue_split=self.epilogue_split)

    def operand_bytes(self, element_size: int = 2) -> int:
        """Shared memory the config needs at the least on a GEMM, whatever its kernel's epilogue: one stage of its
        operand tiles (gluon_hopper.check counts all of it at each launch)."""
        return stage_bytes(self, element_size)

    def pays(self, m: int, n: int, k: int) -> bool:
        """Whether the config is worth timing at an [m, n] x k problem: at every one the Hopper kernel takes."""
        return True

    @classmethod
    def from_fields(cls, given: dict) -> HopperConfig:
        """The config of a table entry's fields. Tables written while one Config held every backend's fields name
        the operand stages num_stages and hold the tl kernel's fields too: dropped where that Config took them
        (valid, and mainloop "triton")."""
        given = dict(given)
        if "num_stages" in given:
            if "stages" in given:
                raise ValueError("the Hopper kernel's operand stages are named twice, stages and num_stages")
            given["stages"] = given.pop("num_stages")
        old = {name: given.pop(name) for name in _OLD_TL_FIELDS if name in given}
        config = _made(cls, given)
        if old.get("mainloop", "triton") != "triton":
            raise ValueError(f"mainloop {old['mainloop']!r} is the tl kernel's (backend 'tl', got 'gluon')")
        if old:  # checked as the one Config checked them
            TlConfig(config.block_m, config.block_n, config.block_k, config.group_m,
                     epilogue_split=config.epilogue_split, **old)
        return config


# Each backend's config type, by the backend's name (a table entry's "backend"): the generator's and the runtime's
# backends (codagen/emit/backends.py, codagen/runtime/backends.py) are named as these
CONFIGS: dict[str, type] = {"tl": TlConfig, "gluon": HopperConfig}
BACKENDS = tuple(CONFIGS)

# Fields of the one Config of before each backend had its own (tables written then hold them all) that another
# backend's config owns, with the values it gave a config of the backend that does not read them
_OLD_HOPPER_FIELDS = {"epilogue_stages": None, "direct_stores": False, "slice_loop": False, "slice_unroll": 1,
                      "consumers": 2}
_OLD_TL_FIELDS = ("num_warps", "persistent", "tma", "flatten", "warp_specialize", "mainloop")


def config_of(backend, given: dict) -> TileConfig:
    """The config of backend `backend` made of a table's fields `given`, by its config type (`from_fields`, which
    also reads what tables written before it hold). ValueError, saying why, for a backend without a config type,
    and as the type's own checks say."""
    if backend == "mm":  # the flat tables of before the mainloop field: tablefile reads them as it
        raise ValueError("backend 'mm' is the tl kernel over cuBLAS's product now: Config(mainloop='cublas')")
    kind = CONFIGS.get(backend) if isinstance(backend, str) else None
    if kind is None:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return kind.from_fields(given)


def _made(kind: type, given: dict):
    """kind(**given), where `given` names only fields of kind (ValueError naming the others)."""
    unknown = sorted(set(given) - {f.name for f in fields(kind)}, key=str)
    if unknown:  # named here, as ascii() shows a name read from a file: the type's own TypeError shows it unquoted
        raise ValueError(f"the configuration has no field {', '.join(ascii(u) for u in unknown)}")
    return kind(**given)


def epilogue_label(config) -> str:
    """The label's part for how the epilogue runs, from a config of any backend (the fields it has): its slices,
    their buffers, direct stores, the slice loop and its step, the consumers."""
    stages = getattr(config, "epilogue_stages", None)
    unroll, consumers = getattr(config, "slice_unroll", 1), getattr(config, "consumers", 2)
    return ((f" epilogue/{config.epilogue_split}" if config.epilogue_split > 1 else "")
            + (f" in {stages}" if stages is not None else "")
            + (" direct" if getattr(config, "direct_stores", False) else "")
            + (" loop" if getattr(config, "slice_loop", False) else "")
            + (f" by {unroll}" if unroll != 1 else "")
            + (f" c{consumers}" if consumers != 2 else ""))


def fits_group(config: TileConfig, group: int | str | None, n: int | None = None) -> bool:
    """Whether each column slice the epilogue runs on holds whole column groups of `group` columns; for group
    "N" (the whole row), whether one slice spans the `n` columns (unknown n: any may)."""
    if group == "N":
        return n is None or n <= config.epilogue_n
    return group is None or config.epilogue_n % group == 0


def cublas_pays(m: int, n: int, k: int) -> bool:
    """Whether mainloop "cublas" is worth timing at an [m, n] x k GEMM: K at least 8 times M and N, as the LM head's
    input gradient over a chunk of rows (1280 x 2048 x 128256), where the fp32 product's extra write and read are
    a few percent of the GEMM's time and memory, and cuBLAS's split-K fills SMs that one program per output tile
    leaves idle (norm_dgrad at 1280 x 2048: 80 tiles of 128x256 for the H200's 132 SMs)."""
    return k >= 8 * max(m, n)


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


def stage_bytes(config: TileConfig, element_size: int = 2) -> int:
    """Shared memory of one stage of a GEMM's operand tiles (tables are tuned on 16-bit operands)."""
    return (config.block_m + config.block_n) * config.block_k * element_size


def fits_shared(config: TileConfig, gemm: bool = True, gpu: str | None = None) -> bool:
    """Whether what the config needs of a program's shared memory at the least (its backend's model:
    operand_bytes) fits on `gpu` (shared_bytes; any GPU codagen tunes for when None); without a GEMM, it needs none."""
    return not gemm or config.operand_bytes() <= shared_bytes(gpu)
