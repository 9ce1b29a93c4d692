"""Launcher argument checks: shapes bind the symbolic sizes M, N, K consistently, dtypes agree, every tensor
sits on one device, outputs overlap neither themselves nor each other nor any input, host scalars are numbers.
Each failure says which argument and what was expected."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import torch

from .. import dims

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}  # FP8: declared, never T
T_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the kernel's type T may be
INDEX = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Decl:
    name: str
    dims: tuple[str, ...]  # "M", "K", "N", "N/2", "2*N", "tiles(M)", "tiles(N)", "groups(N)", "groups(K)", ...
    dtype: str  # "T", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "index"
    output: bool = False
    # the inputs this output may be, as the very same view, to update that input in place: tile inputs that
    # every value stored to the output is computed from, so that each element is read before it is written
    in_place_of: tuple[str, ...] = ()


def _fail(kernel: str, message: str):
    raise ValueError(f"{kernel}: {message}")


def bind(kernel: str, decls: tuple[Decl, ...], values: dict, even_n: bool = False, group: int | None = None,
         k_group: int | None = None) -> tuple[dict, torch.dtype, torch.device]:
    """Check the tensors against their declarations; return the sizes {M, N, K}, the type T (None for a kernel
    without T tensors: one with FP8 GEMM operands) and the device.
    `even_n`: the epilogue splits columns into pairs; `group`: the kernel's column groups have this many
    columns (N must be whole groups; a groups(N) dimension of size g means N = g * group); `k_group`: the GEMM's
    K-group scales have this many columns of K per scale (K must be whole groups; groups(K) is K / k_group and
    blocks(N) is N / k_group rounded up, checked once M, N and K are bound). Tile-count dimensions are checked
    later, by check_tiles, once the tile shape is known."""
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
            _bind_dim(kernel, d.name, sizes, dim, size, group)
        if d.dtype == "T":
            if t_dtype is None:
                if t.dtype not in T_FLOATS:
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
    if (even_n or any(dims.N_HALF in d.dims for d in decls)) and sizes.get("N", 0) % 2:
        _fail(kernel, f"N must be even, since columns come in pairs; got N={sizes['N']}")
    if group:
        _whole_groups(kernel, sizes.get("N", 0), group)
    if k_group:
        _check_k_groups(kernel, decls, values, sizes, k_group)
    return sizes, t_dtype, device


def _check_k_groups(kernel: str, decls, values: dict, sizes: dict, k_group: int) -> None:
    """The K-group scales (gemm.scales, docs/fp8.md): K whole groups, and each scale tensor one per group of K
    (and per block of N)."""
    k = sizes.get("K", 0)
    if k % k_group:
        _fail(kernel, f"K must be a multiple of the K-group scales' group {k_group} (gemm.scales: one scale per "
                      f"{k_group} columns of K); got K={k}")
    for d in decls:
        if not any(dim in dims.K_GROUPED for dim in d.dims):
            continue
        want = tuple(dims.size(dim, sizes, k_group=k_group) for dim in d.dims)
        got = tuple(values[d.name].shape)
        if got != want:
            _fail(kernel, f"'{d.name}' must have shape [{', '.join(d.dims)}] = {want} for M={sizes.get('M')}, "
                          f"N={sizes.get('N')}, K={k} and K group {k_group}, got {got}")


def _whole_groups(kernel: str, n: int, group: int) -> None:
    if n % group:
        _fail(kernel, f"N must be a multiple of the column group width {group} (whole groups); got N={n}")


def _bind_dim(kernel: str, name: str, sizes: dict, dim: str, size: int, group: int | None) -> None:
    if dims.is_tiles(dim) or dim in dims.K_GROUPED:  # checked once the sizes are bound
        return
    # N is known to be whole groups first, so that a ragged N is reported as such
    if dim == dims.GROUPS_N and "N" in sizes:
        _whole_groups(kernel, sizes["N"], group)
    elif dim == dims.N_DOUBLE and size % 2:
        _fail(kernel, f"'{name}' has {size} columns for 2*N, which must be even")
    key, value = dims.base(dim), dims.base_of_size(dim, size, group)
    if sizes.setdefault(key, value) != value:
        _fail(kernel, f"'{name}' has {dim} = {size}, which does not match {key} = {sizes[key]} of the earlier "
                      "arguments")


def check_tiles(kernel: str, decls: tuple[Decl, ...], values: dict, tiles_m: int, tiles_n: int) -> None:
    counts = {dims.TILES_M: tiles_m, dims.TILES_N: tiles_n}
    for d in decls:
        for axis, dim in enumerate(d.dims):
            if dim in counts and values[d.name].shape[axis] != counts[dim]:
                _fail(kernel, f"'{d.name}' must have {counts[dim]} columns ({dim} for this tile shape), "
                              f"got {values[d.name].shape[axis]}")


def host_scalar(kernel: str, name: str, value) -> float:
    """A host scalar argument as the float the kernel takes: a Python (or NumPy) real number, not a tensor."""
    if type(value) is float:
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor):
        return float(value)
    got = "a tensor (call .item() to pass its value)" if isinstance(value, torch.Tensor) else type(value).__name__
    raise TypeError(f"{kernel}: '{name}' is a host scalar and must be a Python number, got {got}")


def check_choice(block: str, name: str, value, choices: tuple[str, ...], spec: str) -> None:
    """A block's choice attr (`name: [a, b]` in its spec) against the choices its spec declares."""
    if value not in choices:
        raise ValueError(f"{block}: {name} must be {' or '.join(map(repr, choices))} (the choices {spec} declares), "
                         f"got {value!r}")


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last; 0 for an empty tensor."""
    if not t.numel():
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


class Aliasing:
    """The overlap check of launches with one argument signature: outputs must share no memory with each other
    or with any input (GEMM operands included), except an output that is the very same view as an input it
    may update in place (Decl.in_place_of). The byte span of every argument follows from the signature;
    only the addresses are new at each call, and a set of addresses found apart is checked only once."""

    def __init__(self, kernel: str, decls, tensors):
        self.kernel, self.decls = kernel, decls
        self.extents = tuple(byte_extent(t) for t in tensors)
        # (output, other argument) pairs that could overlap: an output with each input and each later output
        self.pairs = tuple((j, i) for j, d in enumerate(decls) if d.output and self.extents[j]
                           for i, e in enumerate(decls) if e is not d and self.extents[i] and (not e.output or i > j))
        self.apart: set[tuple[int, ...]] = set()  # argument addresses checked already

    def check(self, tensors) -> None:
        ptrs = tuple([t.data_ptr() for t in tensors])
        if ptrs in self.apart:
            return
        ext = self.extents
        for j, i in self.pairs:
            if ptrs[i] < ptrs[j] + ext[j] and ptrs[j] < ptrs[i] + ext[i] and not self._allowed(tensors, i, j):
                a, b = self.decls[j], self.decls[i]
                what = "output" if b.output else "input"
                hint = (f"; to update '{b.name}' in place, pass it as '{a.name}' itself (the same view)"
                        if b.name in a.in_place_of else "")
                _fail(self.kernel, f"output '{a.name}' overlaps {what} '{b.name}' in memory: outputs may not share "
                                   f"memory with each other or with an input, or the kernel would read what it "
                                   f"has already overwritten{hint}")
        if len(self.apart) >= 64:  # bounded: addresses of a training step recur, others need not be kept
            self.apart.clear()
        self.apart.add(ptrs)

    def _allowed(self, tensors, i: int, j: int) -> bool:
        """Whether the output j and the argument i, whose byte spans intersect, may still be passed: j is the
        same view as an input it may update in place, or no element of one lies in the other."""
        a, b = tensors[j], tensors[i]
        if self.decls[i].name in self.decls[j].in_place_of and _same_view(a, b):
            return True
        return _rows_apart(_rows(a), _rows(b))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The bytes of a tensor as rows: (address of the first, rows, bytes from row to row, bytes of a row), for
    a row-major or column-major matrix, a vector or a single element; None for other layouts."""
    item = t.element_size()
    dims = [(size, stride * item) for size, stride in zip(t.shape, t.stride()) if size != 1]
    if not dims:
        return t.data_ptr(), 1, item, item
    if len(dims) == 1:
        size, step = dims[0]
        if step == item:
            return t.data_ptr(), 1, size * item, size * item
        return (t.data_ptr(), size, step, item) if step > item else None
    if len(dims) == 2:
        (rows, row_step), (cols, col_step) = sorted(dims, key=lambda d: -d[1])  # rows: the larger stride
        if col_step == item and cols * item <= row_step:
            return t.data_ptr(), rows, row_step, cols * item
    return None


def _rows_apart(a, b) -> bool:
    """Whether two sets of rows (see _rows) share no byte; False when that cannot be told cheaply."""
    if a is None or b is None:
        return False
    if a[0] > b[0]:
        a, b = b, a
    (start_a, rows_a, step_a, width_a), (start_b, rows_b, step_b, width_b) = a, b
    if rows_a == 1 or rows_b == 1:  # one contiguous span against rows: which rows reach into it
        (start, _, _, width), (first, rows, step, row_width) = (a, b) if rows_a == 1 else (b, a)
        lowest = max(0, (start - first - row_width) // step + 1)  # rows ending after the span starts
        highest = min(rows - 1, -(-(start + width - first) // step) - 1)  # rows starting before it ends
        return lowest > highest
    if step_a != step_b:
        return False
    # b's rows start `offset` bytes into a row of a, `shift` rows down: each of b's rows can touch only that
    # row of a and the next
    shift, offset = divmod(start_b - start_a, step_a)
    touches_same = offset < width_a and shift < rows_a
    touches_next = offset + width_b > step_a and shift + 1 < rows_a
    return not (touches_same or touches_next)
