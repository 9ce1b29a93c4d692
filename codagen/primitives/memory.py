"""Primitives that write a value to an output: `store` (cast to the output's dtype) and `accumulate` (a
read-modify-write in fp32 of an inplace output). A row vector is written by the first N-tile of each row, a
column vector by the first M-tile of each column, so that every element is written once."""
from __future__ import annotations

from ..model import Kind, type_dims
from .base import X, Arg, Primitive
from .quantize import check_store, store_value

WRITABLE = (Kind.TILE, Kind.ROW, Kind.COL, Kind.GROUP)


def _check(inplace: bool):
    def check(c) -> None:
        x = c.typed("x")
        ok = c.need("x", x, WRITABLE, "a tile, row vector, column vector or group value")
        c.target(type_dims(x) if ok else None, inplace=inplace)
        check_store(c)
    return check


def _emit_store(e, s):
    value = store_value(e, s) or f"{{x}}.to({e.ptr(s.target)}.dtype.element_ty)"
    e.write(s, f"{e.lang}.store({{ptr}}, {value}, mask={{mask}})",
            rounded=f"{e.lang}.store({{ptr}}, {{x}}, mask={{mask}})")


def _emit_store_tma(e, s):
    # Hopper: a tile leaves through shared memory by TMA (or from registers, with direct stores); row and
    # column vectors as in tl
    if e.types[s.args["x"]].kind is Kind.TILE:
        e.store_tile(s)
    else:
        _emit_store(e, s)


def _emit_accumulate(e, s):
    e.write(s, "tile.accumulate({ptr}, {x}, {mask})")


PRIMITIVES = (
    Primitive(
        "store", (X, Arg("to", "target")),
        "Write x to an output, cast to the output's dtype, masked at the ragged edges.",
        "x: a tile, row, column or group value; to: a non-inplace output of the same shape.",
        "store: {x: x_new, to: x_out}",
        check=_check(inplace=False), reference=lambda r, s: r.value(s.args["x"]),
        emitters={"tl": _emit_store, "gluon": _emit_store_tma}),
    Primitive(
        "accumulate", (X, Arg("into", "target")),
        "into += x: a read-modify-write that adds in fp32 and stores the sum cast to the output's dtype.",
        "x: a tile, row, column or group value; into: an output declared with 'inplace: true' of the same shape.",
        "accumulate: {x: dxn, into: dx2}",
        check=_check(inplace=True), reference=lambda r, s: r.args[s.target].to(r.dtype) + r.value(s.args["x"]),
        emitters={"tl": _emit_accumulate}),
)
