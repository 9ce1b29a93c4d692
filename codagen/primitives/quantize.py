"""FP8 quantization of a tile, per column group (DeepSeek-V3's 1 x 128 tile-wise scaling with column_group: 128):
`fp8_scale` is each group's scale, amax / FP8_MAX, and `quantize` the tile divided by it and rounded to the FP8
grid. The next GEMM reads the stored FP8 values and scales; x ≈ quantized · scale. docs/fp8.md states the exact
semantics (rounding, saturation, a zero amax) that the float64 reference and the emitters share."""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Dim, DType, Kind, ValueType
from .base import OUT, X, Arg, Primitive, torch
from .reduce import GROUPED_WIDTHS, group_columns, grouped_tile


@dataclass(frozen=True)
class Fp8Format:
    dtype: str  # the output dtype and torch's name of the type
    triton: str  # Triton's name of the type
    max: float  # the largest finite value: the saturation bound
    mantissa: int  # mantissa bits
    min_exponent: int  # the exponent of the smallest normal value

    @property
    def args(self) -> str:
        """tile.round_fp8's constants of the format."""
        return f"MAX={self.max}, MANTISSA={self.mantissa}, MIN_EXPONENT={self.min_exponent}"


FORMATS = (
    Fp8Format("float8_e4m3fn", "float8e4nv", 448.0, 3, -6),  # activations and weights
    Fp8Format("float8_e5m2", "float8e5", 57344.0, 2, -14),  # gradients: range over precision
)
BY_DTYPE = {f.dtype: f for f in FORMATS}
FP8_DTYPES = frozenset(DType(f.dtype) for f in FORMATS)
# what FP8 outputs hold: a quantized tile of width N, or N/2 (a gated activation's output, SwiGLU's y)
FP8_SHAPES = ((Dim.M, Dim.N), (Dim.M, Dim.N_HALF))
DTYPE = Arg("dtype", "enum", choices=tuple(BY_DTYPE))


def _check_scale(c) -> ValueType | None:
    if not grouped_tile(c, "fp8_scale", "scales each column group, and the kernel declares none; add 'column_group: "
                                        "128' (DeepSeek-V3's 1 x 128 groups; any power of two the epilogue slice "
                                        "holds whole)", GROUPED_WIDTHS):
        return None
    if c.kernel.whole_rows:  # column_group N
        c.error(None, "fp8_scale with column_group N (one scale per whole row) is not implemented; use groups of "
                      "a power of two columns, e.g. 'column_group: 128'")
        return None
    return ValueType(Kind.GROUP)


def _emit_scale(e, s):
    x, fmt = s.args["x"], BY_DTYPE[s.args["dtype"]]
    width = e.types[x].width
    e.need_width(width, tile=True)
    group = group_columns(e.kernel.column_group, width)
    amax = f"tile.group_reduce({e.lang}.abs({e.ref(x)}), {e.tile_mask(width)}, GROUP={group}, OP=tile.MAX)"
    e.assign(s, f"tile.fp8_scale({amax}, MAX={fmt.max})")


def fp8_scale(amax, fmt: Fp8Format):
    """amax / FP8_MAX, correctly rounded to fp32 (a float64 quotient of fp32 numbers rounds to fp32 exactly);
    1 where it is 0 (a zero group, or one whose quotient underflows fp32)."""
    scale = (amax.to(torch.float32).double() / fmt.max).to(torch.float32)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _reference_scale(r, s):
    x, fmt = r.value(s.args["x"]).to(torch.float32), BY_DTYPE[s.args["dtype"]]
    rows, cols = x.shape
    group = group_columns(r.kernel.column_group, r.types[s.args["x"]].width)
    return fp8_scale(x.abs().reshape(rows, cols // group, group).amax(-1), fmt).to(r.dtype)


def _check_quantize(c) -> ValueType | None:
    x, scale = c.typed("x"), c.typed("scale")
    if not (c.need("x", x, (Kind.TILE,), "a tile")
            & c.need("scale", scale, (Kind.GROUP,), "the scale of its group, a group value (fp8_scale's)")):
        return None
    result = c.broadcast(x, scale)
    if result is None:
        c.error("scale", f"quantize.scale: {scale} '{c.step.args['scale']}' does not match {x} '{c.step.args['x']}'")
    return result


def _emit_quantize(e, s):
    fmt = BY_DTYPE[s.args["dtype"]]
    e.elementwise(s, f"tile.round_fp8({e.lang}.div_rn({{x}}, {{scale}}), {fmt.args})",
                  {"x": s.args["x"], "scale": s.args["scale"]})


def check_store(c) -> None:
    """A store to an FP8 output writes a quantize value of that dtype: anything else would be rounded by a
    cast that differs between the interpreter and the GPU, and unscaled. A scale is stored in float32: rounded
    to a narrower type, it would not be the scale the values were divided by."""
    out = c.kernel.output(c.step.target)
    name = c.step.args["x"]
    source = next((s for s in c.kernel.steps if s.out == name), None)
    if out is not None and source is not None and source.op == "fp8_scale" and out.dtype is not DType.FLOAT32:
        c.error("to", f"store.to: '{name}' is an FP8 scale, which must be stored in float32 (the values were "
                      f"divided by it in fp32), and output '{out.name}' has dtype {out.dtype.value}; declare it "
                      f"'{out.name}: {{shape: [...], dtype: float32}}'")
    if out is None or out.dtype not in FP8_DTYPES or out.dims not in FP8_SHAPES:  # else reported at the output
        return
    if source is None or source.op != "quantize" or source.args["dtype"] != out.dtype.value:
        c.error("x", f"store.x: output '{out.name}' has dtype {out.dtype.value}, and '{name}' is not a quantize "
                     f"value of that dtype; store '- quantize: {{x: {name}, scale: ..., dtype: {out.dtype.value}, "
                     "out: ...}' instead (docs/fp8.md)")


def store_value(e, s) -> str | None:
    """The value a store to an FP8 output writes: the quantize value converted by tile.to_fp8, which gives a
    NaN torch's code on the interpreter and the GPU alike (their own conversions do not); None for other
    outputs."""
    fmt = BY_DTYPE.get(e.kernel.output(s.target).dtype.value)
    return None if fmt is None else f"tile.to_fp8({{x}}, {e.lang}.{fmt.triton})"


def round_fp8(q, fmt: Fp8Format):
    """q (fp32) saturated to ±FP8_MAX and rounded to the nearest FP8 value, ties to even; NaN stays NaN."""
    return q.clamp(-fmt.max, fmt.max).to(getattr(torch, fmt.dtype))


def _reference_quantize(r, s):
    into = r.types[s.out]
    x, scale = (r.tensor(s.args[n], into).to(torch.float32) for n in ("x", "scale"))
    quotient = (x.double() / scale.double()).to(torch.float32)  # fp32's correctly rounded x / scale
    return round_fp8(quotient, BY_DTYPE[s.args["dtype"]]).to(r.dtype)


PRIMITIVES = (
    Primitive(
        "fp8_scale", (X, DTYPE, OUT),
        "The FP8 scale of each group of column_group columns of a tile: amax / FP8_MAX (448 for float8_e4m3fn, "
        "57344 for float8_e5m2), amax = max |x| over the group, rounded to fp32; 1 where that is 0 (docs/fp8.md).",
        "x: a tile of width N, or N/2 (SwiGLU's output: each group is column_group/2 of its columns), in a kernel "
        "that declares a column_group of a power of two columns; out: a group value [M, groups(N)].",
        "fp8_scale: {x: h, dtype: float8_e4m3fn, out: h_scale}",
        check=_check_scale, reference=_reference_scale, emitters={"tl": _emit_scale}),
    Primitive(
        "quantize", (X, Arg("scale", "value"), DTYPE, OUT),
        "out = x / scale (fp32, correctly rounded), saturated to ±FP8_MAX and rounded to the nearest value of "
        "dtype, ties to even: FP8 values held in fp32, which a store to an output of that dtype writes exactly.",
        "x: a tile of width N or N/2; scale: its group's scale, a group value (fp8_scale's); out: a tile like x.",
        "quantize: {x: h, scale: h_scale, dtype: float8_e4m3fn, out: h_q}",
        check=_check_quantize, reference=_reference_quantize, emitters={"tl": _emit_quantize}),
)
