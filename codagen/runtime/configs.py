"""Tile configurations: each backend's config type (codagen.tileconfig: TlConfig, also named Config, and
HopperConfig), the tl kernel's defaults a launch falls back to, the few
candidates run-time tuning tries, and a config fitted to a kernel's column groups. Which config a launch runs:
codagen.runtime.autotune.pick_config; the committed tables it reads: tables; the kernels a config's backend names:
backends."""
from __future__ import annotations

import dataclasses
import functools

from ..tileconfig import (BACKENDS, CONFIGS, CONSUMER_REGS, MAX_BLOCK, MIN_BLOCK, PRODUCER_REGS,  # noqa: F401
                          REGISTERS, Config, HopperConfig, TileConfig, TlConfig, epilogue_label, fits_group)
# (re-exported)


def _row_width(n: int) -> int:
    """The narrowest tile width that spans n columns."""
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


def widened(config: TileConfig, group: int | str | None, n: int | None = None) -> TileConfig:
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


def check_group(kernel: str, config: TileConfig, group: int | str, n: int) -> None:
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


def fits_k_group(config: TileConfig, k_group: int | None) -> bool:
    """Whether each K step of the config (block_k columns of K) lies within one group of the GEMM's K-group
    scales (gemm.scales, k_group columns each; None: none): block_k divides k_group."""
    return not k_group or k_group % config.block_k == 0


def with_k_group(config: TileConfig, k_group: int | None) -> TileConfig:
    """A default config whose K steps lie within the K groups: block_k at most k_group (both powers of two)."""
    return config if fits_k_group(config, k_group) else dataclasses.replace(config, block_k=k_group)


def gpu_k_group_default(config: Config, k_group: int | None) -> Config:
    """The GPU's default tl config for a GEMM with K-group scales (k_group columns of K per scale; None: none):
    one group of up to 128 a K step (FP8 operands, a byte an element: a stage of bf16's BK 64 in bytes, one
    scaling per group), and at most 64 fp32 values of a tile per thread. The mainloop holds two tiles, the
    accumulator and each step's product, which it scales before adding: compiled for sm_90, 128 x 256 on 8 warps
    spilled 488 bytes a thread in the gate/up projection (whose column groups of 256 make every tile 256 wide),
    64 x 256 nothing."""
    if not k_group:
        return config
    config = dataclasses.replace(config, block_k=min(k_group, 128))
    while config.block_m > 64 and config.block_m * config.block_n > 64 * 32 * config.num_warps:
        config = dataclasses.replace(config, block_m=config.block_m // 2)
    return config


def k_group_problem(config: TileConfig, k_group: int) -> str | None:
    """Why a config cannot run a GEMM with K-group scales of k_group columns, or None."""
    if fits_k_group(config, k_group):
        return None
    return (f"block_k {config.block_k} does not divide the K group {k_group} of the gemm's scales (gemm.scales: "
            f"each K step applies one scale per row and block, so it must lie within one group); use a block_k "
            f"of {k_group} or less")


def check_k_group(kernel: str, config: TileConfig, k_group: int) -> None:
    """Refuse a config whose K steps would cross a group of the GEMM's K-group scales."""
    problem = k_group_problem(config, k_group)
    if problem:
        raise ValueError(f"{kernel}: the config's {problem}")


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
def gpu_default(group: int | str | None = None, n: int | None = None, split: int = 1) -> Config:
    """GPU_DEFAULT with a kernel's default epilogue split (its generated module's DEFAULT_SPLIT), widened to its
    column groups."""
    return widened(dataclasses.replace(GPU_DEFAULT, epilogue_split=split), group, n)


def runtime_candidates(has_gemm: bool, tile_dependent: bool, group: int | str | None = None,
                       n: int | None = None, split: int = 1, default: Config | None = None) -> list[Config]:
    """`default`: the launch's default config (gpu_default's unless given: a K-group GEMM's, gpu_k_group_default),
    whose tile a tile-dependent kernel's candidates keep."""
    pool = RUNTIME_GEMM_CANDIDATES if has_gemm else RUNTIME_ELEMENTWISE_CANDIDATES
    default = default or gpu_default(group, n, split)
    if split != 1:
        pool = [dataclasses.replace(c, epilogue_split=split) for c in pool]
    if tile_dependent:
        pool = [dataclasses.replace(c, block_m=default.block_m, block_n=default.block_n,
                                    epilogue_split=default.epilogue_split) for c in pool]
    pool = [c for c in pool if fits_group(c, group, n)] or [default]
    return list(dict.fromkeys(pool))  # in order, without duplicates
