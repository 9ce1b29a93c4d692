"""Tile configurations: the committed tuning table of this GPU when it has the shape and was tuned for what the
kernel computes (its fingerprint) with this Triton (`codagen tune` writes generated/tuning/<gpu>/<kernel>.json);
otherwise, once per shape bucket, the fastest of a few built-in candidates, timed on the launch itself, in this
process or an earlier one (tuning_cache keeps the choices in the user's cache folder); otherwise the default.

CODAGEN_NO_TUNE=1 always gives the default: no table, no tuning at run time (reproducible baselines)."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("codagen.tune")


BACKENDS = ("tl", "gluon", "mm")
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
    # group_m and num_stages (its operand stages); the other fields are the tl kernel's. "mm": the GEMM by
    # torch.mm (cuBLAS on NVIDIA GPUs) into an fp32 product, then the tl kernel with this tile shape runs the
    # epilogue over it, reading the product in place of its mainloop: two passes, for shapes of a long K and
    # few output tiles, where cuBLAS splits K across the SMs and a kernel of one program per tile cannot (mm_pays)
    backend: str = "tl"

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
        if self.backend not in BACKENDS:
            fail(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
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
        if self.backend == "mm" and (self.tma or self.flatten or self.warp_specialize):
            fail("backend 'mm' has no mainloop to load through TMA, flatten or warp-specialize: tma, flatten and "
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
                + epilogue_label(self) + (f" {self.backend}" if self.backend != "tl" else ""))


def epilogue_label(config) -> str:
    """The label's part for how the epilogue runs, from a Config or a HopperConfig (the same fields): its
    slices, their buffers, direct stores, the slice loop and its step, the consumers."""
    return ((f" epilogue/{config.epilogue_split}" if config.epilogue_split > 1 else "")
            + (f" in {config.epilogue_stages}" if config.epilogue_stages is not None else "")
            + (" direct" if config.direct_stores else "") + (" loop" if config.slice_loop else "")
            + (f" by {config.slice_unroll}" if config.slice_unroll != 1 else "")
            + (f" c{config.consumers}" if config.consumers != 2 else ""))


def launch_hopper(package: str, kernel: str, /, **arguments) -> None:
    """Launch a kernel's Hopper module, <package>.gluon.<kernel>, for a config whose backend is "gluon". The
    module is imported at the first such launch only: it imports Triton's Gluon (and refuses all but sm_90)."""
    importlib.import_module(f"{package}.gluon.{kernel}").launch(**arguments)


def hopper_default(package: str, kernel: str) -> Config:
    """The Hopper kernel's own default configuration (gluon_hopper.default_config of its epilogue: 128x128 tiles,
    as many operand stages as fit), as a tl launcher's Config whose backend is "gluon"."""
    from . import gluon_hopper

    h = gluon_hopper.default_config(importlib.import_module(f"{package}.gluon.{kernel}").EPILOGUE)
    return Config(h.block_m, h.block_n, h.block_k, h.group_m, num_warps=4, num_stages=h.stages,
                  epilogue_split=h.epilogue_split, backend="gluon")


def hopper_or_tl(package: str, kernel: str, config: Config, tensors) -> Config:
    """A tuning table's choice of the Hopper kernel, or the tl kernel with the same tile shape where the Hopper
    kernel refuses these tensors (a dtype, or strides TMA cannot address, that the table was not tuned on)."""
    try:
        importlib.import_module(f"{package}.gluon.{kernel}").check_launch(tensors, config)
    except ValueError as e:
        log.info("codagen: %s: the tuning table chose the Hopper kernel, which refuses these arguments (%s); "
                 "running the tl kernel", kernel, e)
        return dataclasses.replace(config, backend="tl", epilogue_stages=None, direct_stores=False,
                                   slice_loop=False, slice_unroll=1, consumers=2)
    return config


def fits_group(config: Config, group: int | str | None, n: int | None = None) -> bool:
    """Whether each column slice the epilogue runs on holds whole column groups of `group` columns; for group
    "N" (the whole row), whether one slice spans the `n` columns (unknown n: any may)."""
    if group == "N":
        return n is None or n <= config.epilogue_n
    return group is None or config.epilogue_n % group == 0


def _row_width(n: int) -> int:
    """The narrowest tile width that spans n columns."""
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


def widened(config: Config, group: int | str | None, n: int | None = None) -> Config:
    """A default config made wide enough for column groups: block_n the smallest multiple of the group width
    per epilogue slice that is at least its own; for group "N", the narrowest that spans the row (unchanged
    when none does: the launch then says so)."""
    if fits_group(config, group, n):
        return config
    if group == "N":
        block_n = _row_width(n) * config.epilogue_split
        return dataclasses.replace(config, block_n=block_n) if block_n <= MAX_BLOCK else config
    block_n = max(config.block_n, group * config.epilogue_split)
    if block_n > MAX_BLOCK:  # slices of whole groups would be too wide a tile: the epilogue on the whole tile
        return dataclasses.replace(config, block_n=max(config.block_n, group), epilogue_split=1)
    return dataclasses.replace(config, block_n=block_n)


def check_group(kernel: str, config: Config, group: int | str, n: int) -> None:
    """Refuse a config whose epilogue slices would cut a column group in two (or, for group "N", the row)."""
    if fits_group(config, group, n):
        return
    split = f" / epilogue_split {config.epilogue_split}" if config.epilogue_split > 1 else ""
    at_a_time = (f"{kernel}: the config's epilogue runs on {config.epilogue_n} columns at a time (block_n "
                 f"{config.block_n}{split})")
    if group != "N":
        raise ValueError(f"{at_a_time}, which is not a multiple of the spec's column_group {group}; use a block_n "
                         f"of {group * config.epilogue_split} or more")
    if _row_width(n) > MAX_BLOCK:
        raise ValueError(f"{kernel}: N = {n} is wider than the widest tile ({MAX_BLOCK} columns), and the spec's "
                         "column_group N needs one tile over the whole row")
    raise ValueError(f"{at_a_time}, fewer than N = {n}, and the spec's column_group N needs one tile over the "
                     f"whole row; use a block_n of {_row_width(n) * config.epilogue_split} or more")


def check_tl_only(kernel: str, config: Config, gemm: bool = True) -> None:
    """Refuse, for a kernel that the Hopper backend does not lower, a config that asks for its kernel; and for a
    kernel without a GEMM, one that asks for torch.mm's."""
    if config.backend == "gluon":
        raise ValueError(f"{kernel}: Config(backend='gluon'), but the Hopper backend does not lower this kernel "
                         "(generated/kernels/gluon/__init__.py says why); use backend='tl'")
    if config.backend == "mm" and not gemm:
        raise ValueError(f"{kernel}: Config(backend='mm') makes a GEMM's product with torch.mm, but this kernel has "
                         "no GEMM; use backend='tl'")


def mm_pays(m: int, n: int, k: int) -> bool:
    """Whether backend "mm" is worth timing at an [m, n] x k GEMM: K at least 8 times M and N, as the LM head's
    input gradient over a chunk of rows (1280 x 2048 x 128256), where the fp32 product's extra write and read are
    a few percent of the GEMM's time and memory, and cuBLAS's split-K fills SMs that one program per output tile
    leaves idle (norm_dgrad at 1280 x 2048: 80 tiles of 128x256 for the H200's 132 SMs)."""
    return k >= 8 * max(m, n)


def mm_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for backend "mm": bf16 and fp16 operands through cuBLAS with an fp32 output (no rounding
    of the product to their dtype before the epilogue, as in the fused kernel); elsewhere in fp32."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def hopper_runs(device: torch.device) -> bool:
    """Whether the Hopper kernels can run here: an sm_90 GPU, not the interpreter, and a Triton with Gluon."""
    from . import INTERPRETED

    return (not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and importlib.util.find_spec("triton.experimental.gluon") is not None)


# Under the interpreter each program is a numpy step: larger tiles mean fewer steps.
INTERPRETER_DEFAULT = Config(64, 64, 32, 8, 4, 1)
GPU_DEFAULT = Config(128, 128, 64, 8, 8, 3, persistent=True, tma=True)

# What an untuned shape tries at run time: few, since each costs a compile on the first call. GPU_DEFAULT
# comes first, so that ties keep it. A kernel whose outputs depend on the tile shape keeps GPU_DEFAULT's
# block_m x block_n and epilogue split (its op allocated the partial-reduction buffers for them before the
# launch), which leaves block_k, warps, stages and the grid to choose.
RUNTIME_GEMM_CANDIDATES = (
    GPU_DEFAULT,
    Config(128, 256, 64, 8, 8, 3, persistent=True, tma=True),  # the fastest plain mainloop measured
    Config(128, 128, 64, 8, 4, 4, persistent=True, tma=True),
    Config(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
    Config(128, 128, 64, 8, 8, 4, persistent=False, tma=True),  # fastest for heavy epilogues on the H200
)
RUNTIME_ELEMENTWISE_CANDIDATES = (  # no GEMM: only the tile shape and the warps matter
    GPU_DEFAULT,
    dataclasses.replace(GPU_DEFAULT, block_m=64, block_n=128, num_warps=4),
    dataclasses.replace(GPU_DEFAULT, block_m=64, block_n=256, num_warps=8),
    dataclasses.replace(GPU_DEFAULT, num_warps=4),
)


@functools.lru_cache(maxsize=None)
def gpu_key(device: torch.device) -> str:
    """Folder name of a GPU's tuning tables: its marketing name in lowercase, e.g. 'nvidia-h200'."""
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(m: int, n: int, k: int) -> str:
    """A tuning table's key: the tuned shape itself, 'MxNxK' (K is 0 for kernels without a GEMM). Tables hold
    the few token counts and row chunks that were tuned, each its own entry (1280- and 2048-row chunks of the
    LM head alike); a launch at another M takes the nearest (nearest_tuned)."""
    return f"{int(m)}x{int(n)}x{int(k)}"


def shape_bucket(m: int, n: int, k: int) -> str:
    """Run-time tuning tunes once per bucket: M rounded up to a power of two (token counts vary from batch to
    batch), the exact N and K (model widths do not)."""
    return f"{1 << max(int(m) - 1, 0).bit_length()}x{int(n)}x{int(k)}"


def nearest_tuned(table: dict, key: str, other_widths: bool = False, fits=lambda config: True) -> Config | None:
    """For a shape that was not tuned: the entry of the same N and K whose M is nearest (by ratio; between two
    as near, the larger), or with `other_widths`, the entry nearest in M, N and K together; only entries
    for which fits(config) holds. Tables hold a few token counts per model width, and a configuration tuned
    at 8k tokens serves 4k far better than the untuned default (which spills in the kernels with heavy
    epilogues, and which kernels with tile-shaped partial sums cannot leave at run time)."""
    want = [math.log2(max(int(d), 1)) for d in key.split("x")]
    near = []
    for tuned, config in table.items():
        have = [math.log2(max(int(d), 1)) for d in tuned.split("x")]
        if (other_widths or have[1:] == want[1:]) and fits(config):
            near.append((sum(abs(h - w) for h, w in zip(have, want)), -have[0], tuned))
    return table[min(near)[2]] if near else None


def table_path(tuning_dir: Path, gpu: str, kernel: str) -> Path:
    return Path(tuning_dir) / gpu / f"{kernel}.json"


@functools.lru_cache(maxsize=None)
def _table(path: str, fingerprint: str, triton_version: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if data.get("fingerprint") != fingerprint or data.get("triton") != triton_version:
        return {}  # tuned for another computation or another Triton: use the defaults
    return {key: Config(**value["config"]) for key, value in data["shapes"].items()}


@functools.lru_cache(maxsize=None)
def _saved(path: str, fingerprint: str, triton_version: str) -> dict:
    """What earlier processes' run-time tuning chose (bucket -> Config), read once per process."""
    from . import tuning_cache  # it imports Config from here

    return tuning_cache.read(Path(path), fingerprint, triton_version)


_tuned: dict[tuple, Config] = {}  # (kernel, fingerprint, gpu, bucket) -> what run-time tuning chose
_picked: dict[tuple, Config] = {}  # pick_config's arguments -> its final answer for them
_tuning = threading.Lock()


def clear_caches() -> None:
    """Forget the tables and tuning cache files read and the configurations tuned in this process (after
    `codagen tune` wrote tables, and in tests); the files themselves stay."""
    _table.cache_clear()
    _saved.cache_clear()
    _from_table.cache_clear()
    _tuned.clear()
    _picked.clear()


def _on_gpu(device: torch.device) -> bool:
    """Whether tables and tuning apply: a real CUDA device, not the interpreter."""
    from . import INTERPRETED

    return not INTERPRETED and device.type == "cuda"


def _may_tune() -> bool:
    """Trial launches would be recorded into a CUDA graph being captured, and torch.compile must not see
    them (nor time anything while it traces): then the default is used, and not remembered."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def measure(run: Callable[[Config], None], config: Config) -> float:
    """Milliseconds per launch of `run(config)` on the current stream: one launch to compile and warm up,
    one to size the loop, then about 10 ms of launches. Replaced by a fake timer in tests."""
    run(config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(config)
    end.record()
    end.synchronize()
    reps = max(1, min(20, int(10.0 / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(reps):
        run(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def runtime_candidates(has_gemm: bool, tile_dependent: bool, group: int | str | None = None,
                       n: int | None = None, split: int = 1) -> list[Config]:
    pool = RUNTIME_GEMM_CANDIDATES if has_gemm else RUNTIME_ELEMENTWISE_CANDIDATES
    default = gpu_default(group, n, split)
    if split != 1:
        pool = [dataclasses.replace(c, epilogue_split=split) for c in pool]
    if tile_dependent:
        pool = [dataclasses.replace(c, block_m=default.block_m, block_n=default.block_n,
                                    epilogue_split=default.epilogue_split) for c in pool]
    pool = [c for c in pool if fits_group(c, group, n)] or [default]
    return list(dict.fromkeys(pool))  # in order, without duplicates


def _tune(kernel: str, bucket: str, candidates: list[Config], run: Callable[[Config], None]) -> Config | None:
    """The fastest candidate, timed by `measure` on the caller's own arguments; a candidate that fails
    (does not compile, needs more shared memory than there is) is skipped. None if all fail."""
    timings = []
    for config in candidates:
        try:
            timings.append((measure(run, config), config))
        except Exception as e:  # noqa: BLE001 - any failure rules the candidate out; the launch reports its own
            log.info("codagen: %s %s: candidate %s failed: %s", kernel, bucket, config.label(), e)
    if not timings:
        return None
    ms, best = min(timings, key=lambda t: t[0])  # min keeps the first of equal times: the default's
    log.info("codagen: %s %s is not in the tuning table; tuned in this process: %s (%.3f ms); "
             "`codagen tune` commits a table, CODAGEN_NO_TUNE=1 skips this", kernel, bucket, best.label(), ms)
    return best


def _aliased(decls, values: dict) -> bool:
    """Whether an output shares memory with an input (a launch that updates x in place through x_out=x):
    then a second launch would read its own results."""
    inputs = {t.untyped_storage().data_ptr() for d in decls if not d.output
              for t in [values.get(d.name)] if isinstance(t, torch.Tensor)}
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs
               for d in decls if d.output for t in [values.get(d.name)])


@functools.lru_cache(maxsize=None)
def gpu_default(group: int | str | None = None, n: int | None = None, split: int = 1) -> Config:
    """GPU_DEFAULT with a kernel's default epilogue split (its generated module's DEFAULT_SPLIT), widened to its
    column groups."""
    return widened(dataclasses.replace(GPU_DEFAULT, epilogue_split=split), group, n)


def pick_config(kernel: str, fingerprint: str, tuning_dir: Path, m, n, k, device: torch.device, group=None, *,
                run: Callable[[Config], None] | None = None, decls=None, values: dict | None = None,
                split: int = 1, package: str | None = None) -> Config:
    """The configuration of a launch of `kernel` on an [m, n] (x k) problem. `fingerprint` (the generated
    module's FINGERPRINT) says what the kernel computes: a table tuned for another computation is not used.

    A token count the table lacks takes the table's entry at the nearest one of the same N and K
    (nearest_tuned); widths it lacks, for a kernel whose outputs depend on the tile shape (or without
    `decls`), the nearest entry of other widths. `run(config)` launches the kernel on the caller's arguments
    with `config`; given, another shape is tuned on those arguments once per process, unless an earlier process
    tuned its bucket (tuning_cache keeps the choice). Pass it only when every output is overwritten by a launch
    (no `inplace` outputs: an accumulation would be applied once per trial).
    `decls` (the module's DECLS) says whether outputs depend on the tile shape (without it, tuning keeps the
    default tile shape) and, with `values` (name -> tensor), whether an output aliases an input (then there is
    no tuning). `group`: the kernel's column_group, which every epilogue slice must hold whole (defaults are
    widened to it); "N": one slice must span the n columns. `split`: the epilogue split of the kernel's default
    and of its run-time candidates on a GPU (codagen.emit.kernel.gpu_default_split: 4 where the whole tile's
    epilogue would spill). `package`: the generated package of a kernel the Hopper backend lowers; on an sm_90
    GPU, run-time tuning tries its Hopper kernel's default too (hopper_default)."""
    if not _on_gpu(device):
        return widened(INTERPRETER_DEFAULT, group, n)
    if os.environ.get("CODAGEN_NO_TUNE") == "1":
        return gpu_default(group, n, split)
    # a launch's arguments decide its configuration once the table or tuning has it: the look-ups below cost
    # hundreds of microseconds of host time, on every launch of a training step
    launch = (kernel, fingerprint, tuning_dir, int(m), int(n), int(k), device, group, split, decls is None)
    picked = _picked.get(launch)
    if picked is not None:
        return picked
    import triton

    gpu = gpu_key(device)
    tile_dependent = decls is None or _tile_dependent(decls)
    hit = _from_table(kernel, fingerprint, tuning_dir, gpu, int(m), int(n), int(k), group, tile_dependent,
                      triton.__version__)
    if hit is not None:
        _picked[launch] = hit
        return hit
    default = gpu_default(group, n, split)
    from . import tuning_cache  # it imports Config from here

    bucket = shape_bucket(m, n, k)
    key = (kernel, fingerprint, gpu, bucket)
    pool = functools.partial(_candidates, kernel, m, n, k, device, default, tile_dependent, group, split, package)
    saved = tuning_cache.cache_file(gpu, kernel)
    hit = _tuned.get(key)
    if hit is None and saved is not None:
        earlier = _saved(str(saved), fingerprint, triton.__version__).get(bucket)
        # one outside this launch's candidates was chosen by another codagen version, and may not suit its launch
        if earlier is not None and earlier in pool():
            hit = _tuned[key] = earlier
    if hit is not None:
        _picked[launch] = hit
        return hit
    if run is None or not _may_tune():
        return default  # for now: tuning may choose another later
    if values is not None and _aliased(decls or (), values):
        return default  # trial launches would read what the previous ones wrote
    with _tuning:
        if key not in _tuned:
            best = _tune(kernel, bucket, pool(), run)
            _tuned[key] = best or default  # all failed: the default, whose launch raises the error for the caller
            if best is not None and saved is not None:
                tuning_cache.write(saved, kernel, gpu, fingerprint, triton.__version__, bucket, best)
    _picked[launch] = _tuned[key]
    return _tuned[key]


@functools.lru_cache(maxsize=None)
def _tile_dependent(decls) -> bool:
    return any(d.startswith("tiles(") for decl in decls for d in decl.dims)


@functools.lru_cache(maxsize=None)
def _from_table(kernel: str, fingerprint: str, tuning_dir: Path, gpu: str, m: int, n: int, k: int, group,
                tile_dependent: bool, triton_version: str) -> Config | None:
    """The committed table's configuration for this launch (pick_config), or None: looked up once per launch shape,
    also where the answer is none (a shape run-time tuning has not chosen for yet asks again at every launch)."""
    table = _table(str(table_path(tuning_dir, gpu, kernel)), fingerprint, triton_version)
    shape = shape_key(m, n, k)
    fits = lambda config: fits_group(config, group, n)  # noqa: E731
    hit = table.get(shape) or nearest_tuned(table, shape, fits=fits)
    if hit is None and tile_dependent:  # run-time tuning could not change the tile: a tuned one of other widths
        hit = nearest_tuned(table, shape, other_widths=True, fits=fits)
    return hit


def _candidates(kernel: str, m: int, n: int, k: int, device: torch.device, default: Config, tile_dependent: bool,
                group, split: int, package: str | None) -> list[Config]:
    """What run-time tuning times at this launch (see pick_config for the arguments)."""
    pool = runtime_candidates(bool(k), tile_dependent, group, n, split)
    if k and mm_pays(m, n, k):  # the default's tile, its epilogue after torch.mm's product
        pool.append(dataclasses.replace(default, backend="mm", persistent=False, tma=False, flatten=False,
                                        warp_specialize=False))
    if package is not None and hopper_runs(device):
        pool += hopper_candidates(package, kernel, default, tile_dependent, group, n)
    return pool


def hopper_candidates(package: str, kernel: str, default: Config, tile_dependent: bool, group, n) -> list[Config]:
    """The Hopper kernel's default as a run-time candidate (none where its slices would split column groups);
    for a kernel whose outputs depend on the tile shape, with the default's tile and epilogue split, as the tl
    candidates (runtime_candidates)."""
    try:
        config = hopper_default(package, kernel)
    except Exception as e:  # noqa: BLE001 - as a candidate that fails to compile: the tl candidates remain
        log.info("codagen: %s: the Hopper kernel is not a run-time candidate: %s", kernel, e)
        return []
    if tile_dependent:
        config = dataclasses.replace(config, block_m=default.block_m, block_n=default.block_n,
                                     epilogue_split=default.epilogue_split)
    return [config] if fits_group(config, group, n) else []
