"""`reduce`: partial reductions of a tile, one value per (row, N-tile) or per (column, M-tile), masked and
deterministic (plain stores, no atomics). Finishing them (combining the partials) is not a kernel step.
`group_reduce`: a whole reduction over each group of `column_group` columns (a head), which a tile holds whole:
a value that the following steps read, broadcast back over its group's columns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import dims
from ..model import Dim, Kind, ValueType, Width
from .base import OUT, X, Arg, Primitive, torch


@dataclass(frozen=True)
class Reduction:
    name: str
    partial: str  # over the in-range elements of one tile, for the docs
    combine: str  # how the partials combine into the full reduction, for the docs
    fill: float  # what masked-off elements count as
    reference: Callable  # [rows, tiles, block] -> [rows, tiles]

    @property
    def constant(self) -> str:
        """partial_reduce's OP for it, a constant of codagen/runtime/tile.py."""
        return f"tile.{self.name.upper()}"


GROUPED_WIDTHS = (Width.FULL, Width.HALF)  # the tile widths a group value meets (dims.group_columns)


def group_columns(group: int, width: Width) -> int:
    """The columns of a column group in a tile of `width` (dims.group_columns)."""
    return dims.group_columns(group, width.value)


REDUCTIONS = (
    Reduction("sum", "Σ x", "sum", 0.0, lambda t: t.sum(-1)),
    Reduction("sumsq", "Σ x²", "sum", 0.0, lambda t: (t * t).sum(-1)),
    Reduction("max", "max x", "max", float("-inf"), lambda t: t.amax(-1)),
    Reduction("logsumexp", "m + ln Σ exp(x − m), m = max x", "logsumexp", float("-inf"),
              lambda t: torch.logsumexp(t, -1)),
)
_BY_NAME = {r.name: r for r in REDUCTIONS}
AXES = ("cols", "rows")
_WRITES = {"cols": "one partial per row and N-tile", "rows": "one partial per column and M-tile"}


def partial_dims(axis: str, t: ValueType) -> tuple[Dim, ...]:
    """Shape of the partial-reduction buffer of a tile value: per row and N-tile, or per column and M-tile."""
    return (Dim.M, Dim.TILES_N) if axis == "cols" else (Dim.for_width(t.width), Dim.TILES_M)


def _check(c) -> None:
    axis = c.step.args["axis"]
    x = c.typed("x")
    ok = c.need("x", x, (Kind.TILE,), "a tile")
    c.target(partial_dims(axis, x) if ok else None, partial=True, what=_WRITES[axis])


def _emit(e, s):
    x, t = s.args["x"], e.types[s.args["x"]]
    e.need_width(t.width)
    to, op = s.target, _BY_NAME[s.args["op"]].constant
    if s.args["axis"] == "cols":
        # one partial per row and N-tile (or slice of one); a slice wholly past N, which the last tile
        # split for its epilogue can have, has no slot in tiles(N) and stores nothing. Only the columns are
        # masked: a row past M stores nothing either
        mask = f"{e.col_mask(t.width)}[None, :]"
        ptr = f"{e.row_ptr(to)} + {e.pid_n} * {e.stride(to, 't')}"
        if e.is_pair(x):
            partial = f"tile.partial_reduce_pairs({', '.join(e.halves(x))}, {mask}, OP={op})"
        else:
            partial = f"tile.partial_reduce({e.ref(x)}, {mask}, OP={op}, AXIS=1)"
        e.guarded(f"{e.pid_n} * BLOCK_N < N", f"{e.lang}.store({ptr}, {partial}, mask={e.row_mask})")
        return
    # one partial per column and M-tile; only the rows are masked: a column past N stores nothing
    mask = f"{e.row_mask}[:, None]"
    for value, cols in e.columns(x, t.width):
        e.line(f"{e.lang}.store({e.ptr(to)} + {cols} * {e.stride(to, 'n')} + {e.pid_m} * {e.stride(to, 't')}, "
               f"tile.partial_reduce({value}, {mask}, OP={op}, AXIS=0), mask={e.col_mask(t.width)})")


def _reference(r, s):
    """Per tile: along columns in groups of the tile's width (one value per row and tile), or along rows."""
    x, axis = r.value(s.args["x"]), s.args["axis"]
    if axis == "rows":
        x, block = x.T, r.block_m
    else:
        block = int(r.block_n * dims.scale(r.types[s.args["x"]].width.value))
    reduction = _BY_NAME[s.args["op"]]
    rows, cols = x.shape
    tiles = -(-cols // block)
    padded = torch.full((rows, tiles * block), reduction.fill, dtype=x.dtype, device=x.device)
    padded[:, :cols] = x
    return reduction.reference(padded.reshape(rows, tiles, block))


REDUCE = Primitive(
    "reduce", (Arg("op", "enum", choices=tuple(r.name for r in REDUCTIONS)), X, Arg("axis", "enum", choices=AXES),
               Arg("to", "target")),
    "Partial reduction of a tile, per tile, masked, deterministic (no atomics): op over the columns of each N-tile "
    "(axis cols) or the rows of each M-tile (axis rows); the logsumexp partial is max + ln Σ exp(x − max).",
    "x: a tile of width w; to: a float32 output [M, tiles(N)] for axis cols, [w, tiles(M)] for axis rows.",
    "reduce: {op: sumsq, x: x_new, axis: cols, to: ss}",
    check=_check, reference=_reference, emitters={"tl": _emit, "gluon": _emit})


def grouped_tile(c, primitive: str, declare: str, widths: tuple[Width, ...] = (Width.FULL,)) -> bool:
    """The check a step over column groups starts with (group_reduce, fp8_scale): the kernel declares column groups
    (else the error says what to `declare`), and x is a tile of one of `widths` (N; fp8_scale also N/2, whose
    groups are column_group/2 of its columns); False after reporting an error."""
    x = c.typed("x")
    names = " or ".join(w.value for w in widths)
    if c.kernel.column_group is None:
        c.error(None, f"{primitive} {declare} at the top level")
        return False
    if not c.need("x", x, (Kind.TILE,), f"a tile of width {names}"):
        return False
    if x.width not in widths:
        c.error("x", f"{primitive}.x must be a tile of width {names} (column groups are groups of N's columns), got "
                     f"{x} '{c.step.args['x']}'")
        return False
    return True


def _check_group(c) -> ValueType | None:
    if not grouped_tile(c, "group_reduce", "reduces over column groups, and the kernel declares none; add "
                                           "'column_group: <width>' (the columns of each group, e.g. a head's 128)"):
        return None
    return ValueType(Kind.ROW) if c.kernel.whole_rows else ValueType(Kind.GROUP)


def _emit_group(e, s):
    x = s.args["x"]
    e.need_width(Width.FULL, tile=True)
    op = _BY_NAME[s.args["op"]].constant
    if e.kernel.whole_rows:  # the tile spans the row: its reduction over columns is the row's
        e.assign(s, f"tile.partial_reduce({e.ref(x)}, {e.tile_mask(Width.FULL)}, OP={op}, AXIS=1)")
        return
    e.assign(s, f"tile.group_reduce({e.ref(x)}, {e.tile_mask(Width.FULL)}, GROUP={e.kernel.column_group}, "
                f"OP={op})")


def _emit_group_gluon(e, s):
    """Gluon: a group value is held over its group's columns, in the accumulator's layout (emit/gluon.py)."""
    x = s.args["x"]
    e.need_width(Width.FULL, tile=True)
    e.assign(s, f"hopper.group_reduce({e.ref(x)}, {e.tile_mask(Width.FULL)}, GROUP={e.kernel.column_group}, "
                f"OP={_BY_NAME[s.args['op']].constant})")


def _reference_group(r, s):
    x, group = r.value(s.args["x"]), r.kernel.column_group
    rows, cols = x.shape
    if r.kernel.whole_rows:
        return _BY_NAME[s.args["op"]].reference(x.reshape(rows, 1, cols))[:, 0]
    return _BY_NAME[s.args["op"]].reference(x.reshape(rows, cols // group, group))


GROUP_REDUCE = Primitive(
    "group_reduce", (Arg("op", "enum", choices=tuple(r.name for r in REDUCTIONS)), X, OUT),
    "Reduction of each group of column_group columns of a tile (a head), whole: one value per row and group, which "
    "later steps read (broadcast over the group's columns where they meet a tile). Every epilogue column slice "
    "holds whole groups: block_n / epilogue_split must be a multiple of column_group. With column_group N, the "
    "group is the whole row, which one tile then spans (N at most block_n / epilogue_split).",
    "x: a tile of width N, in a kernel that declares column_group; out: a group value [M, groups(N)], or a row "
    "vector [M] with column_group N.",
    "group_reduce: {op: sumsq, x: q, out: ss_head}",
    check=_check_group, reference=_reference_group, emitters={"tl": _emit_group, "gluon": _emit_group_gluon})

PRIMITIVES = (REDUCE, GROUP_REDUCE)
