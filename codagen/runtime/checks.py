"""Launcher argument checks: shapes bind the symbolic sizes M, N, K consistently, dtypes agree, every tensor
sits on one device, outputs do not overlap themselves. Each failure says which argument and what was expected."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Decl:
    name: str
    dims: tuple[str, ...]  # "M", "K", "N", "N/2", "2*N", "tiles(M)", "tiles(N)"
    dtype: str  # "T", "float32", "float16", "bfloat16", "index"
    output: bool = False


def _fail(kernel: str, message: str):
    raise ValueError(f"{kernel}: {message}")


def bind(kernel: str, decls: tuple[Decl, ...], values: dict, even_n: bool = False
         ) -> tuple[dict, torch.dtype, torch.device]:
    """Check the tensors against their declarations; return the sizes {M, N, K}, the type T and the device.
    `even_n`: the epilogue splits columns into pairs. Tile-count dimensions are checked later, by
    check_tiles, once the tile shape is known."""
    sizes: dict[str, int] = {}
    t_dtype = device = None
    for d in decls:
        t = values[d.name]
        if not isinstance(t, torch.Tensor):
            _fail(kernel, f"'{d.name}' must be a torch.Tensor, got {type(t).__name__}")
        if device is None:
            device = t.device
        elif t.device != device:
            _fail(kernel, f"'{d.name}' is on {t.device} but the other tensors are on {device}")
        if t.dim() != len(d.dims):
            _fail(kernel, f"'{d.name}' must have shape [{', '.join(d.dims)}], got {tuple(t.shape)}")
        for size, dim in zip(t.shape, d.dims):
            _bind_dim(kernel, d.name, sizes, dim, size)
        if d.dtype == "T":
            if t_dtype is None:
                if t.dtype not in FLOATS.values():
                    _fail(kernel, f"'{d.name}' must be float16, bfloat16 or float32, got {t.dtype}")
                t_dtype = t.dtype
            elif t.dtype != t_dtype:
                _fail(kernel, f"'{d.name}' must have the same dtype as the other T tensors ({t_dtype}), got {t.dtype}")
        elif d.dtype == "index":
            if t.dtype not in INDEX:
                _fail(kernel, f"'{d.name}' must be int32 or int64, got {t.dtype}")
        elif t.dtype != FLOATS[d.dtype]:
            _fail(kernel, f"'{d.name}' must be {d.dtype}, got {t.dtype}")
        if d.output and t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            _fail(kernel, f"output '{d.name}' has overlapping elements (stride {t.stride()}); pass a dense tensor")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail(kernel, "tensors are on the CPU; generated kernels run on CUDA devices, or on the CPU through "
                      "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    if (even_n or any("N/2" in d.dims for d in decls)) and sizes.get("N", 0) % 2:
        _fail(kernel, f"N must be even, since columns come in pairs; got N={sizes['N']}")
    return sizes, t_dtype, device


def _bind_dim(kernel: str, name: str, sizes: dict, dim: str, size: int) -> None:
    if dim.startswith("tiles("):
        return
    if dim == "N/2":
        key, value = "N", 2 * size
    elif dim == "2*N":
        if size % 2:
            _fail(kernel, f"'{name}' has {size} columns for 2*N, which must be even")
        key, value = "N", size // 2
    else:
        key, value = dim, size
    if sizes.setdefault(key, value) != value:
        _fail(kernel, f"'{name}' has {dim} = {size}, which does not match {key} = {sizes[key]} of the earlier "
                      "arguments")


def check_tiles(kernel: str, decls: tuple[Decl, ...], values: dict, tiles_m: int, tiles_n: int) -> None:
    counts = {"tiles(M)": tiles_m, "tiles(N)": tiles_n}
    for d in decls:
        for axis, dim in enumerate(d.dims):
            if dim in counts and values[d.name].shape[axis] != counts[dim]:
                _fail(kernel, f"'{d.name}' must have {counts[dim]} columns ({dim} for this tile shape), "
                              f"got {values[d.name].shape[axis]}")
