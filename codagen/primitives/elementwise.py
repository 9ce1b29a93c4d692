"""Elementwise primitives: unary functions, binary operators with broadcasting, `scale` and `cast`. Every value
is fp32 in registers; a value of interleaved pairs is computed on as its two halves."""
from __future__ import annotations

from ..model import Kind, Literal, ValueType
from .base import OUT, X, Arg, F, FLOAT_DTYPES, Primitive, expression, same_type, torch

UNARY_TYPING = "x: any value; out has its kind and width."
# tl.maximum and tl.minimum drop a NaN by default; torch's propagate it, at no extra cost (max.NaN.f32)
NAN = ", propagate_nan={lang}.PropagateNan.ALL"


def gelu_tanh(x):
    """½ x (1 + tanh(√(2/π) (x + 0.044715 x³))): torch's own function, whose gradient is PyTorch's at infinities
    too (autograd through the formula written out gives NaN where PyTorch gives ±inf)."""
    return F.gelu(x, approximate="tanh")


def unary(name: str, tl: str, fn, doc: str, example: str) -> Primitive:
    """A unary primitive: `tl` is its Triton expression of `{x}`, `fn` its PyTorch function."""
    emit = expression(tl)
    return Primitive(name, (X, OUT), doc, UNARY_TYPING, example, check=same_type,
                     reference=lambda r, s: fn(r.tensor(s.args["x"])), emitters={"tl": emit, "gluon": emit})


UNARY = (
    unary("silu", "tile.silu({x})", lambda x: F.silu(x), "out = x · σ(x)", "silu: {x: acc, out: act}"),
    unary("sigmoid", "{lang}.sigmoid({x})", lambda x: torch.sigmoid(x), "out = σ(x) = 1 / (1 + e^(−x))",
          "sigmoid: {x: acc, out: gate}"),
    unary("gelu_tanh", "tile.gelu_tanh({x})", gelu_tanh, "out = ½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))",
          "gelu_tanh: {x: acc, out: act}"),
    unary("gelu", "0.5 * {x} * (1.0 + {lang}.erf({x} * 0.7071067811865476))", lambda x: F.gelu(x),
          "out = ½ x (1 + erf(x / √2)), the exact GELU (torch.nn.functional.gelu's default)",
          "gelu: {x: acc, out: act}"),
    unary("tanh", "tile.tanh({x})", lambda x: torch.tanh(x), "out = tanh(x), computed as 2σ(2x) − 1",
          "tanh: {x: acc, out: th}"),
    unary("relu", "{lang}.maximum({x}, 0.0" + NAN + ")", lambda x: torch.relu(x), "out = max(x, 0)",
          "relu: {x: acc, out: act}"),
    unary("exp", "tile.exp_flushed({x})", lambda x: torch.exp(x),
          "out = eˣ; on NVIDIA GPUs a result below 2⁻¹²⁶ (x < −87.3) is 0 rather than subnormal",
          "exp: {x: shifted, out: p}"),
    unary("log", "{lang}.log({x})", lambda x: torch.log(x), "out = ln x", "log: {x: p, out: logp}"),
    unary("square", "{x} * {x}", lambda x: torch.square(x), "out = x²", "square: {x: acc, out: sq}"),
    unary("rsqrt", "{lang}.rsqrt({x})", lambda x: torch.rsqrt(x), "out = 1 / √x", "rsqrt: {x: ms_eps, out: r}"),
    unary("neg", "-{x}", lambda x: torch.neg(x), "out = −x", "neg: {x: acc, out: minus}"),
    unary("abs", "{lang}.abs({x})", lambda x: torch.abs(x), "out = |x|", "abs: {x: acc, out: mag}"),
)


# -- binary -------------------------------------------------------------------------------------------------
BINARY_ARGS = (Arg("x", "value", number=True), Arg("y", "value", number=True), OUT)
BINARY_TYPING = "x, y: values or numbers, not both numbers; out has their broadcast type (row with column: a tile)."


def _check_binary(c) -> ValueType | None:
    op, a = c.step.op, c.step.args
    x, y = c.typed("x"), c.typed("y")
    result = None
    if x and y:
        result = c.broadcast(x, y)
        if result is None:
            c.error(None, f"{op}: cannot combine {x} '{a['x']}' with {y} '{a['y']}'; widths differ")
    if isinstance(a["x"], Literal) and isinstance(a["y"], Literal):
        c.error(None, f"{op}: both operands are numbers; write the result as one number")
        result = None
    return result


def binary(name: str, tl: str, fn, doc: str, example: str) -> Primitive:
    """A binary primitive: `tl` is its Triton expression of `{x}` and `{y}`, `fn` its PyTorch function."""
    def reference(r, s):
        into = r.types[s.out]  # a row vector meets a column vector as [:, None] and [None, :]
        return fn(r.tensor(s.args["x"], into), r.tensor(s.args["y"], into))
    emit = expression(tl)
    return Primitive(name, BINARY_ARGS, doc, BINARY_TYPING, example, check=_check_binary, reference=reference,
                     emitters={"tl": emit, "gluon": emit})


BINARY = (
    binary("add", "{x} + {y}", lambda x, y: torch.add(x, y), "out = x + y", "add: {x: acc, y: bias, out: biased}"),
    binary("sub", "{x} - {y}", lambda x, y: torch.sub(x, y), "out = x − y",
           "sub: {x: acc, y: shift, out: centered}"),
    binary("mul", "{x} * {y}", lambda x, y: torch.mul(x, y), "out = x · y",
           "mul: {x: mean, y: w_colsum, out: shift}"),
    binary("div", "{x} / {y}", lambda x, y: torch.div(x, y), "out = x / y", "div: {x: acc, y: 4, out: quarter}"),
    binary("maximum", "{lang}.maximum({x}, {y}" + NAN + ")", lambda x, y: torch.maximum(x, y), "out = max(x, y)",
           "maximum: {x: acc, y: -1.0, out: lo}"),
    binary("minimum", "{lang}.minimum({x}, {y}" + NAN + ")", lambda x, y: torch.minimum(x, y), "out = min(x, y)",
           "minimum: {x: 1.0, y: lo, out: clamped}"),
)


# -- where --------------------------------------------------------------------------------------------------
def _check_where(c) -> ValueType | None:
    a = c.step.args
    cond, x, y = c.typed("cond"), c.typed("x"), c.typed("y")
    if isinstance(a["cond"], Literal):
        c.error("cond", "where.cond: a number selects the same operand everywhere; write that operand instead")
        return None
    if isinstance(a["x"], Literal) and isinstance(a["y"], Literal) and a["x"].value == a["y"].value:
        c.error(None, "where: x and y are the same number; write that number instead")
        return None
    if not (cond and x and y):
        return None
    result = c.broadcast(x, y)
    result = c.broadcast(result, cond) if result else None
    if result is None:
        c.error(None, f"where: cannot combine {cond} '{a['cond']}', {x} '{a['x']}' and {y} '{a['y']}'; widths differ")
    return result


def _where_reference(r, s):
    into = r.types[s.out]
    cond, x, y = (r.tensor(s.args[n], into) for n in ("cond", "x", "y"))
    return torch.where(cond != 0, x, y).to(r.dtype)


_emit_where = expression("{lang}.where({cond} != 0, {x}, {y})")

WHERE = Primitive(
    "where", (Arg("cond", "value"), Arg("x", "value", number=True), Arg("y", "value", number=True), OUT),
    "out = x where cond ≠ 0, else y (torch.where): a selection, not a product with a 0/1 mask, so that a NaN or "
    "infinity in the operand not selected does not reach out (0 · NaN is NaN); a NaN cond selects x.",
    "cond: a value; x, y: values or numbers; out has the broadcast type of the three (row with column: a tile).",
    "where: {cond: v_pass, x: zv, y: normed_qk, out: normed}",
    check=_check_where, reference=_where_reference, emitters={"tl": _emit_where, "gluon": _emit_where},
)


# -- scale --------------------------------------------------------------------------------------------------
def _check_scale(c):
    a = c.step.args
    x, by = c.typed("x"), c.typed("by")
    if c.need("x", x, (Kind.TILE,), "a tile") & c.need("by", by, (Kind.ROW, Kind.COL, Kind.GROUP, Kind.SCALAR),
                                                        "a row vector, column vector, group value or scalar"):
        result = c.broadcast(x, by)
        if result is None:
            c.error("by", f"scale.by: {by} '{a['by']}' does not match {x} '{a['x']}'")
        return result
    return None


_emit_scale = expression("{x} * {by}")
SCALE = Primitive(
    "scale", (X, Arg("by", "value", number=True), OUT),
    "out = x · by, by[:, None] for a row, by[None, :] for a column, each group's value over its columns for a "
    "group value: mul restricted to a tile times a vector or scalar, which catches a mistyped operand early.",
    "x: a tile; by: a row vector ([M]), a column vector of the tile's width, a group value ([M, groups(N)], with "
    "a tile of width N, or N/2: groups of column_group/2 columns), a scalar or a number; out: a tile of x's width.",
    "scale: {x: acc, by: rstd, out: z}",
    check=_check_scale,
    reference=lambda r, s: torch.mul(r.tensor(s.args["x"], r.types[s.out]), r.tensor(s.args["by"], r.types[s.out])),
    emitters={"tl": _emit_scale, "gluon": _emit_scale})


# -- cast ---------------------------------------------------------------------------------------------------
def _check_cast(c):
    if c.step.args["dtype"] == "T" and c.kernel.t_input is None:
        c.error("dtype", "cast.dtype T is the type of the kernel's matrix inputs, and it has none; name a dtype "
                         "(float32, float16, bfloat16)")
    return c.typed("x")


def _emit_cast(e, s):
    # round to the narrower type and back: models where an unfused program would store that type. A tile by
    # pairs of elements (tile.round_to), and once with a store of it to an output of that type
    if e.cast(s):
        return
    dtype = s.args["dtype"]
    to = e.t_dtype() if dtype == "T" else f"{e.lang}.{dtype}"
    kind = e.types[s.args["x"]].kind
    if kind is Kind.TILE:
        e.elementwise(s, f"tile.round_to({{x}}, {to})", {"x": s.args["x"]})
    elif kind is Kind.SCALAR:  # a host scalar is a Python float under the interpreter
        e.elementwise(s, f"{e.lang}.cast({e.lang}.cast({{x}}, {to}), {e.lang}.float32)", {"x": s.args["x"]})
    else:
        e.elementwise(s, f"{{x}}.to({to}).to({e.lang}.float32)", {"x": s.args["x"]})


def _cast_reference(r, s):
    dtype = s.args["dtype"]
    rounded = r.args[r.kernel.t_input].dtype if dtype == "T" else getattr(torch, dtype)
    return r.tensor(s.args["x"]).to(rounded).to(r.dtype)


CAST = Primitive(
    "cast", (X, Arg("dtype", "enum", choices=("T", *FLOAT_DTYPES)), OUT),
    "out = x rounded to dtype and converted back to fp32: a value that an unfused program would have stored "
    "in that dtype and reloaded.",
    "x: any value; out has its kind and width. dtype T: the kernel's type at the launch.",
    "cast: {x: acc, dtype: bfloat16, out: acc_bf16}",
    check=_check_cast, reference=_cast_reference, emitters={"tl": _emit_cast, "gluon": _emit_cast})

PRIMITIVES = (*UNARY, *BINARY, WHERE, SCALE, CAST)
