"""Elementwise finish steps on row vectors ([M]), partial buffers ([rows, tiles]) and scalars, in fp32, and
`gather`. Partials stay partials of their reduction where combining them commutes with the step: partials
combined by summing (sum, sumsq), added to or subtracted from partials of the same reduction, or multiplied or
divided by a scalar (Σ_t s·p_t = s·Σ_t p_t). Anything else made from partials (a number added to each, a
product of two, a square, any step on max or logsumexp partials) is a plain value, which no finish step
combines: its sum over the tiles would depend on the tile shape."""
from __future__ import annotations

from ..blockmodel import Partial, Value
from ..primitives.reduce import REDUCTIONS
from .base import FinishArg, FinishStep, fmt

_COMBINE = {r.name: r.combine for r in REDUCTIONS}
X, Y, OUT = FinishArg("x", "operand"), FinishArg("y", "operand"), FinishArg("out", "out")
_SHAPE = ("of the values' shape (values of one shape, or one value and scalars: `[]` values, numbers, attrs); "
          "float32")


def _elementwise(c) -> list | None:
    """An elementwise finish step computes in fp32 on values of one shape, or on one value and scalars (a []
    value, a number or an attr): its result has that shape, in float32."""
    operands = [(n, c.type(n)) for n in ("x", "y") if c.type(n) is not None]
    if not operands:
        c.error(f"{c.op}: both operands are numbers; write the result as one number")
        return None
    for name, v in operands:
        if v.dtype == "index":
            c.error(f"{c.op}.{name} is an index value; elementwise finish steps compute on floats")
            return None
    shapes = {v.dims for _, v in operands if v.dims != ()}
    if len(shapes) > 1:
        (_, x), (_, y) = operands
        c.error(f"{c.op}: x is {fmt(x.dims)} and y is {fmt(y.dims)}; elementwise finish steps take values of one "
                "shape, or one value and a scalar")
        return None
    dims = shapes.pop() if shapes else ()
    return [_partial(c, operands, dims) or Value(dims, "float32")]


def _partial(c, operands, dims) -> Partial | None:
    """The result as partials of the operands' reduction, where it still is (the module's docstring)."""
    partials = [v for _, v in operands if isinstance(v, Partial)]
    if not partials or len({p.op for p in partials}) != 1 or _COMBINE[partials[0].op] != "sum":
        return None
    scalar = lambda n: c.type(n) is None or c.type(n).dims == ()  # noqa: E731  (a number, an attr or a [] value)
    if c.op in ("add", "sub"):
        linear = len(partials) == 2
    elif c.op == "mul":
        linear = len(partials) == 1 and (scalar("x") or scalar("y"))
    elif c.op == "div":
        linear = isinstance(c.type("x"), Partial) and scalar("y")
    else:  # square
        linear = False
    if not linear:
        return None
    return Partial(partials[0].op, dims, f"{partials[0].source}, through {c.op} at line {c.step.loc.line}")


def _binary(name: str, symbol: str, example: str) -> FinishStep:
    return FinishStep(name, (X, Y, OUT), f"`x {symbol} y` in fp32, {_SHAPE}", example, check=_elementwise)


def _gather(c) -> list[Value] | None:
    x, index = c.type("x"), c.type("index")
    if len(x.dims) != 2 or x.dtype == "index" or index.dtype != "index" or index.dims != x.dims[:1]:
        c.error(f"gather takes x [rows, columns] of floats and index [rows] index, got x {fmt(x.dims)} {x.dtype} and "
                f"index {fmt(index.dims)} {index.dtype}")
        return None
    return [Value(x.dims[:1], "float32")]


STEPS = (
    _binary("add", "+", "add: {x: scaled, y: 1.0, out: shifted}"),
    _binary("sub", "−", "sub: {x: lse, y: target_logit, out: row_loss}"),
    _binary("mul", "·", "mul: {x: z_mean, y: smoothing, out: smooth}"),
    _binary("div", "/", "div: {x: zsum, y: vocab, out: z_mean}"),
    FinishStep("square", (FinishArg("x", "value"), OUT), "`x²` in fp32, of x's shape; float32",
               "square: {x: lse, out: lse_sq}", check=_elementwise),
    FinishStep("gather", (FinishArg("x", "value", what="`[rows, cols]`"),
                          FinishArg("index", "value", what="`[rows]` index"), OUT),
               "`[rows]` float32: `x[r, index[r]]`, 0 where the index is outside `[0, cols)` (an ignored target)",
               "gather: {x: logits, index: target, out: target_logit}", check=_gather),
)
