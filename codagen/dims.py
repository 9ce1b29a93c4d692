"""The meaning of a dim expression, written once for the generator and the runtime.

A tensor dimension of a kernel spec is one of

    M, K, N          the GEMM's sizes (a kernel without a GEMM has M and N)
    N/2, 2*N         half and twice N: a gated activation's output, and interleaved pairs (2j, 2j+1)
    tiles(M)         one per tile of rows (block_m), tiles(N) one per tile of columns: partial reductions
    groups(N)        one per column group (column_group columns) of N: a per-head value
    groups(K)        one per group of K (gemm.scales.group columns of K): K-group scales of FP8 operands
    blocks(N)        one per block of N (gemm.scales.group rows of b), rounded up: a weight's block scales

(`model.Dim`'s values; a tile value's width is one of N/2, N, 2*N). Each but the counts is its *base*
size (M, K or N) times a scale; a tile count is its base divided by a tile's extent, rounded up, and blocks(N)
is N divided by the K group (docs/fp8.md), rounded up. The launchers'
shape checks (runtime/checks.py), the block checker, the emitters, the float64 reference and the tuner all read
a dim through these functions. Standard library only: `codagen build --check` does not import torch, and the
runtime does not import the generator.
"""
from __future__ import annotations

from fractions import Fraction

M, K, N = "M", "K", "N"
N_HALF, N_DOUBLE = "N/2", "2*N"
TILES_M, TILES_N = "tiles(M)", "tiles(N)"
GROUPS_N = "groups(N)"
GROUPS_K, BLOCKS_N = "groups(K)", "blocks(N)"  # the K-group scales of FP8 GEMM operands (gemm.scales)

DIMS = (M, K, N_HALF, N, N_DOUBLE, TILES_M, TILES_N, GROUPS_N, GROUPS_K, BLOCKS_N)  # model.Dim's order
K_GROUPED = (GROUPS_K, BLOCKS_N)  # sized by the gemm's scales group, not the column group
WIDTHS = (N_HALF, N, N_DOUBLE)  # the column spaces of a tile value
TILES = (TILES_M, TILES_N)

_BASE = {M: M, K: K, N: N, N_HALF: N, N_DOUBLE: N, TILES_M: M, TILES_N: N, GROUPS_N: N,
         GROUPS_K: K, BLOCKS_N: N}
_SCALE = {N_HALF: Fraction(1, 2), N_DOUBLE: Fraction(2)}
# a launcher's sizes as Python: N // 2, not N / 2 (N/2 is whole, N being even)
_PYTHON = {M: "M", K: "K", N: "N", N_HALF: "N // 2", N_DOUBLE: "2 * N", TILES_M: "triton.cdiv(M, config.block_m)",
           TILES_N: "triton.cdiv(N, config.epilogue_n)"}


def _known(dim: str) -> str:
    if dim not in _BASE:
        raise ValueError(f"unknown dim {dim!r}: one of {', '.join(DIMS)}")
    return dim


def base(dim: str) -> str:
    """The GEMM size a dim is written in: "M", "K" or "N" (tiles(M) -> M, N/2, 2*N, tiles(N), groups(N) -> N)."""
    return _BASE[_known(dim)]


def is_tiles(dim: str) -> bool:
    """Whether a dim counts tiles (tiles(M), tiles(N)): its size follows from the tile shape, not the sizes."""
    return _known(dim) in TILES


def scale(dim: str, group: int | None = None, k_group: int | None = None) -> Fraction:
    """A dim's size per unit of its base: 1/2 for N/2, 2 for 2*N, 1/group for groups(N) (group None: 1), 1/k_group
    for groups(K) (k_group None: 1), 1 for M, K and N. Not for tile counts (is_tiles), which depend on the tile
    shape, nor for blocks(N), which is rounded up."""
    if is_tiles(dim):
        raise ValueError(f"{dim} is a count of tiles: its size depends on the tile shape, not a scale of {base(dim)}")
    if dim == BLOCKS_N:
        raise ValueError(f"{dim} is a count of blocks, rounded up: not a scale of {base(dim)}")
    if dim == GROUPS_N:
        return Fraction(1, group or 1)
    if dim == GROUPS_K:
        return Fraction(1, k_group or 1)
    return _SCALE.get(dim, Fraction(1))


def size(dim: str, sizes: dict, tile: tuple[int, int] | None = None, group: int | None = None,
         k_group: int | None = None) -> int:
    """A dim's size for the GEMM sizes {M, N, K}: a scale of its base rounded down (N // 2, 2 * N, N // group,
    K // k_group), or for a count, its base over the tile's extent (tile = (block_m, block_n)) or over k_group
    (blocks(N)) rounded up."""
    b = sizes[base(dim)]
    if is_tiles(dim):
        extent = tile[0] if dim == TILES_M else tile[1]
        return -(-b // extent)
    if dim == BLOCKS_N:
        return -(-b // rounded_up_by(dim, k_group))
    s = scale(dim, group, k_group)
    return b * s.numerator // s.denominator


def rounded_up_by(dim: str, k_group: int | None = None) -> int:
    """What a count that is not of tiles divides its base by, rounding up: k_group for blocks(N) (size())."""
    if _known(dim) != BLOCKS_N:
        raise ValueError(f"{dim} is not a count of blocks")
    return k_group or 1


def group_columns(group: int, width: str) -> int:
    """The columns of one column group (group of N's columns) in a value of width `width`: group for N, group / 2
    for N/2 (a gated activation's output: a group of N's pairs gives half as many columns)."""
    if width not in (N, N_HALF):
        raise ValueError(f"column groups are of values of width N or N/2, not {width}")
    s = scale(width) * group
    return s.numerator // s.denominator


def base_size(dim: str, size: int | Fraction, group: int | None = None) -> Fraction:
    """The size of a dim's base that a dimension of `size` implies (2 * size for N/2, size / 2 for 2*N, size * group
    for groups(N)): scale's inverse. A Fraction; whole where the size fits the dim."""
    return Fraction(size) / scale(dim, group)


def base_of_size(dim: str, size, group: int | None = None):
    """base_size for a whole size in integer arithmetic only (2 * size, size // 2, size * group): what a launcher
    binds, where the size may be symbolic (torch.compile's SymInt, which a Fraction does not take)."""
    s = scale(dim, group)
    return size * s.denominator // s.numerator


def python(dim: str, group: int | None = None) -> str:
    """A dim's size as the Python expression a generated launcher computes it with, from M, N, K, and `config`
    (its tile configuration) for tile counts: "N // 2", "triton.cdiv(N, config.epilogue_n)", "N // 16"."""
    if _known(dim) == GROUPS_N:
        return f"N // {group}"
    if dim == GROUPS_K:
        return "K // K_GROUP"
    if dim == BLOCKS_N:
        return "triton.cdiv(N, K_GROUP)"
    return _PYTHON[dim]
