"""Rules across a kernel's parts: names, the GEMM's operands, the type of every step, and that each value is
defined once, before use, and used; each output written exactly once. All errors are reported together.
Each primitive's own type rule lives with it (codagen/primitives) and runs through a StepCheck."""
from __future__ import annotations

import difflib

from . import dims
from .errors import ErrorSink, SpecError, ValidationFailed
from .model import (ACC, BLayout, Dim, DType, InputRole, Kernel, Kind, Literal, Location, Output, Step,
                    ValueType, Width, dims_type)
from .names import kernel_functions
from .primitives import PRIMITIVES
from .primitives.quantize import FP8_DTYPES, FP8_SHAPES
from .primitives.reduce import GROUPED_WIDTHS

_SCALAR = ValueType(Kind.SCALAR)
_ROW = ValueType(Kind.ROW)


def _fmt(dims: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(d.value for d in dims) + "]"


def check_kernel(k: Kernel) -> dict[str, ValueType]:
    """Types of every value of a loaded kernel; raises ValidationFailed listing every problem."""
    sink = ErrorSink()
    types: dict[str, ValueType | None] = {}  # None: defined by a step with an error (reported there)
    defined_at: dict[str, Location] = {}
    _check_declarations(k, sink, types, defined_at)
    used: set[str] = set()
    written: dict[str, Location] = {}
    for step in k.steps:
        _check_step(k, step, sink, types, defined_at, used, written)
    for name, loc in defined_at.items():
        if name not in used:
            if name == ACC:
                sink.add(loc, "the GEMM accumulator 'acc' is never used; read it in a step such as "
                              "'- store: {x: acc, to: ...}', or remove the gemm")
            elif k.input(name):
                sink.add(loc, f"input '{name}' is never used; remove it from the inputs or read it in a step")
            else:
                sink.add(loc, f"value '{name}' is never used; remove the step that defines it or use it")
    for o in k.outputs:
        if o.name not in written:
            how = "accumulate: {x: ..., into: %s}" % o.name if o.inplace else "store: {x: ..., to: %s}" % o.name
            sink.add(o.loc, f"output '{o.name}' is never written; add a step such as '{how}'")
    sink.raise_if_any()
    return {name: t for name, t in types.items() if t is not None}


# What a type check may say of a kernel whose spec lost parts to structural errors only because they are lost: a
# name that a dropped declaration or step would have defined, used or written
_FOLLOW_ON = ("is never used", "is never written", "is not defined", "is used before it is defined",
              "is not among the", "without a gemm")


def check_partial_kernel(k: Kernel) -> list[SpecError]:
    """The type errors of a kernel read from a spec with structural errors (the parts with errors left out), less
    those that could follow from a part left out, so that one run reports both kinds (loader.parse_kernel_partly)."""
    try:
        check_kernel(k)
    except ValidationFailed as e:
        return [err for err in e.errors if not any(words in err.message for words in _FOLLOW_ON)]
    except Exception:  # noqa: BLE001 - a model no intact spec gives; its structural errors say what to fix
        return []
    return []


def _check_declarations(k, sink, types, defined_at):
    seen: dict[str, Location] = {}
    for decl in (*k.inputs, *k.outputs):
        if decl.name in seen:
            sink.add(decl.loc, f"'{decl.name}' is declared twice (first at line {seen[decl.name].line}); "
                               "inputs and outputs share one namespace")
        elif decl.name in kernel_functions(k.name):
            sink.add(decl.loc, f"'{decl.name}' is the name of a function of the generated kernel module; choose "
                               "another name")
        seen[decl.name] = decl.loc
    g = k.gemm
    if g:
        for role, name, want in (("a", g.a, (Dim.M, Dim.K)),
                                 ("b", g.b, (Dim.N, Dim.K) if g.b_layout is BLayout.NK else (Dim.K, Dim.N))):
            inp = k.input(name)
            if inp is None:
                sink.add(g.loc, f"gemm.{role} '{name}' is not among the inputs; declare it as {_fmt(want)}")
            elif inp.dims != want:
                layout = f" with b_layout '{g.b_layout.value}'" if role == "b" else ""
                sink.add(inp.loc, f"gemm.{role} '{name}' must have shape {_fmt(want)}{layout}, got {_fmt(inp.dims)}")
            elif k.fp8_gemm and inp.dtype not in FP8_DTYPES:
                sink.add(inp.loc, f"gemm.{role} '{name}' must be FP8 like gemm.a '{g.a}' "
                                  f"({k.input(g.a).dtype.value}): both operands are FP8 (float8_e4m3fn or "
                                  f"float8_e5m2), or both the kernel's type T; got {inp.dtype.value}")
            elif not k.fp8_gemm and inp.dtype is not DType.T:
                sink.add(inp.loc, f"gemm.{role} '{name}' takes the kernel's type T; remove its dtype"
                                  + (" (an FP8 gemm.b needs an FP8 gemm.a)" if inp.dtype in FP8_DTYPES else ""))
        if k.fp8_gemm and g.b_layout is not BLayout.NK:
            sink.add(g.loc, f"gemm: FP8 operands take b_layout 'nk' (b [N, K], K contiguous, as FP8 MMAs read "
                            f"it); got '{g.b_layout.value}'")
        if k.fp8_gemm:
            for d in (*k.inputs, *k.outputs):
                if d.dtype is DType.T and d.name not in (g.a, g.b, *(g.scales.names if g.scales else ())):
                    # an operand's dtype is reported above, a K-group scale's in _check_scales
                    sink.add(d.loc, f"'{d.name}' has the kernel's type T, and a kernel with FP8 gemm operands has "
                                    "none; give it a dtype (float32, bfloat16, float16), e.g. "
                                    f"'{d.name}: {{shape: {_fmt(d.dims)}, dtype: bfloat16}}'")
        if g.a == g.b:
            sink.add(g.loc, "gemm.a and gemm.b must be different inputs")
        if g.scales:
            _check_scales(k, sink)
        types[ACC] = ValueType(Kind.TILE, Width.FULL)
        defined_at[ACC] = g.loc
    for i in k.inputs:
        if i.role is InputRole.GEMM_SCALE:  # read by the mainloop (checked above), not an epilogue value
            continue
        if any(d in (Dim.GROUPS_K, Dim.BLOCKS_N) for d in i.dims):
            sink.add(i.loc, f"input '{i.name}' has shape {_fmt(i.dims)}: groups(K) and blocks(N) are the dims of "
                            "the gemm's K-group scales, and it is not one; name it in gemm.scales (docs/fp8.md) "
                            "or give it an epilogue input's shape")
            continue
        if i.role in (InputRole.GEMM_A, InputRole.GEMM_B):
            if not g or i.name not in (g.a, g.b):
                sink.add(i.loc, f"input '{i.name}' has a K dimension but is not an operand of the gemm; only "
                                "gemm.a and gemm.b have K (epilogue inputs are [M, N], [M], [N] or [])")
            continue
        t = i.type
        if t is None:
            sink.add(i.loc, f"input '{i.name}' has shape {_fmt(i.dims)}; epilogue inputs are [M, N] (or N/2, "
                            "2*N) matrices, [M] row vectors, [N] column vectors, [M, groups(N)] group values or [] "
                            "scalars")
            continue
        if i.dtype is DType.INDEX and t != _ROW:
            sink.add(i.loc, f"input '{i.name}' has dtype index, which only row vectors [M] may have")
        if i.dtype in FP8_DTYPES:
            sink.add(i.loc, f"input '{i.name}' has dtype {i.dtype.value}; the only FP8 inputs are the gemm's "
                            "operands (docs/fp8.md), and the epilogue reads none")
        types[i.name] = t
        defined_at[i.name] = i.loc
    for o in k.outputs:
        if o.dtype is DType.INDEX:
            sink.add(o.loc, f"output '{o.name}' cannot have dtype index; outputs are floating point")
        if o.dtype in FP8_DTYPES and (o.inplace or o.dims not in FP8_SHAPES):
            sink.add(o.loc, f"output '{o.name}' has dtype {o.dtype.value}: FP8 outputs hold quantized tiles "
                            f"[M, N] or [M, N/2], written once by a store of a quantize value; got shape "
                            f"{_fmt(o.dims)}{', inplace' if o.inplace else ''}")
        if any(dims.is_tiles(d.value) for d in o.dims):
            if o.dtype is not DType.FLOAT32:
                sink.add(o.loc, f"output '{o.name}' holds partial reductions and must be float32, got "
                                f"{o.dtype.value}; remove its dtype (float32 is the default) or set dtype: float32")
            if o.inplace:
                sink.add(o.loc, f"output '{o.name}' holds partial reductions and cannot be inplace")
        elif dims_type(o.dims) is None or o.dims == ():
            sink.add(o.loc, f"output '{o.name}' has shape {_fmt(o.dims)}; outputs are [M, N] (or N/2, 2*N), [M], "
                            "[N], [M, groups(N)], or partial-reduction buffers [M, tiles(N)] / [N, tiles(M)]")
    for decl in (*k.inputs, *k.outputs):
        if Dim.GROUPS_N in decl.dims and k.column_group is None:
            sink.add(decl.loc, f"'{decl.name}' has a groups(N) dimension, but the kernel declares no column groups; "
                               "add 'column_group: <width>' (the columns of each group, e.g. a head's 128) at the "
                               "top level")
        elif Dim.GROUPS_N in decl.dims and k.whole_rows:
            sink.add(decl.loc, f"'{decl.name}' has a groups(N) dimension, but with column_group N the group is the "
                               "whole row: a value per row is a row vector; declare it [M]")
    needs_t = any(d.dtype is DType.T for d in (*k.inputs, *k.outputs))
    if not g and needs_t and not any(i.dtype is DType.T and i.type and i.type.kind is Kind.TILE for i in k.inputs):
        sink.add(k.loc, "without a gemm, the kernel's type T is that of its first [M, N] input, and it has none; "
                        "give the outputs an explicit dtype or add a matrix input")
    if not g and not any(d.dims and d.dims[0] is Dim.M and len(d.dims) == 2 for d in (*k.inputs, *k.outputs)
                         if dims_type(d.dims) and dims_type(d.dims).kind is Kind.TILE):
        sink.add(k.loc, "a kernel without a gemm needs a matrix input or output [M, N] to set its grid")


def _check_scales(k: Kernel, sink: ErrorSink) -> None:
    """gemm.scales: the K-group scales of FP8 operands, float32 inputs [M, groups(K)] (a) and [blocks(N),
    groups(K)] (b), which the mainloop applies at each K step (docs/fp8.md)."""
    g = k.gemm
    sc = g.scales
    if not k.fp8_gemm:
        sink.add(sc.loc, f"gemm.scales: K-group scales dequantize FP8 operands, and gemm.a '{g.a}' is not FP8; "
                         "declare both operands float8_e4m3fn or float8_e5m2, or remove the scales")
    if sc.a and sc.a == sc.b:
        sink.add(sc.loc, f"gemm.scales.a and gemm.scales.b must be different inputs, got '{sc.a}' for both")
        return  # its shape can fit one of the two only: that is this error
    for role, name, want in (("a", sc.a, (Dim.M, Dim.GROUPS_K)), ("b", sc.b, (Dim.BLOCKS_N, Dim.GROUPS_K))):
        if name is None:
            continue
        inp = k.input(name)
        per = ("one per row of a and group of K" if role == "a"
               else f"one per {sc.group} x {sc.group} block of b [N, K]")
        if name in (g.a, g.b):
            sink.add(sc.loc, f"gemm.scales.{role} '{name}' is a gemm operand; the scales are an input of their "
                             f"own, {_fmt(want)} float32 ({per})")
        elif inp is None:
            sink.add(sc.loc, f"gemm.scales.{role} '{name}' is not among the inputs; declare it as "
                             f"'{name}: {{shape: {_fmt(want)}, dtype: float32}}' ({per})")
        elif inp.dims != want or inp.dtype is not DType.FLOAT32:
            got = f"{_fmt(inp.dims)} {inp.dtype.value}"
            sink.add(inp.loc, f"gemm.scales.{role} '{name}' must be {_fmt(want)} float32 ({per}), got {got}")


def _broadcast(x: ValueType, y: ValueType) -> ValueType | None:
    if x == y:
        return x
    if x.kind is Kind.SCALAR:
        return y
    if y.kind is Kind.SCALAR:
        return x
    kinds = {x.kind, y.kind}
    widths = {t.width for t in (x, y) if t.width}
    if len(widths) > 1:
        return None
    width = widths.pop() if widths else None
    # groups are of N columns: a group value meets rows, groups, and tiles or columns of width N, or N/2, whose
    # groups are half as wide (a gated activation's output: each group of N's pairs gives column_group/2 columns)
    if Kind.GROUP in kinds:
        if kinds <= {Kind.GROUP, Kind.ROW}:
            return ValueType(Kind.GROUP)
        return ValueType(Kind.TILE, width) if width in GROUPED_WIDTHS else None
    if kinds == {Kind.ROW, Kind.COL} or (Kind.TILE in kinds and kinds <= {Kind.TILE, Kind.ROW, Kind.COL}):
        return ValueType(Kind.TILE, width)
    return None


class StepCheck:
    """What a primitive's type rule (codagen/primitives) sees of one step: its operands' types, the kernel, and
    where to report. Reading an operand marks it used; `target` records the output the step writes."""

    def __init__(self, k: Kernel, step: Step, sink: ErrorSink, types: dict, used: set, written: dict):
        self.kernel, self.step = k, step
        self._sink, self._types, self._used, self._written = sink, types, used, written

    def loc(self, arg: str | None) -> Location:
        return self.step.arg_locs.get(arg, self.step.loc) if arg else self.step.loc

    def error(self, arg: str | None, message: str) -> None:
        """Report at the argument `arg`, or at the step when None."""
        self._sink.add(self.loc(arg), message)

    def use(self, name: str) -> None:
        self._used.add(name)

    def typed(self, arg: str) -> ValueType | None:
        """The type of an operand; None when it cannot be read (reported) or its defining step failed."""
        k, op, ref = self.kernel, self.step.op, self.step.args.get(arg)
        if isinstance(ref, Literal):
            return _SCALAR
        if ref == ACC and ACC not in self._types:
            self.error(arg, f"{op}.{arg}: 'acc' exists only in kernels with a gemm")
            return None
        inp = k.input(ref)
        if inp and inp.role in (InputRole.GEMM_A, InputRole.GEMM_B):
            self.error(arg, f"{op}.{arg}: '{ref}' is a gemm operand and cannot be read in the epilogue")
            return None
        if ref not in self._types:
            self.error(arg, f"{op}.{arg}: {_undefined(k, self.step, ref, self._types)}")
            return None
        self._used.add(ref)
        return self._types[ref]  # None when the step that defined it had an error: reported there, not again

    def need(self, arg: str, t: ValueType | None, kinds: tuple[Kind, ...], what: str) -> bool:
        """Whether `t` is known and of one of `kinds`; reports `what` the argument must be when it is not."""
        if t is not None and t.kind not in kinds:
            self.error(arg, f"{self.step.op}.{arg} must be {what}, got {t} '{self.step.args[arg]}'")
            return False
        return t is not None

    @staticmethod
    def broadcast(x: ValueType, y: ValueType) -> ValueType | None:
        return _broadcast(x, y)

    def target(self, want: tuple[Dim, ...] | None, inplace: bool = False, partial: bool = False,
               what: str = "") -> None:
        """Record that the step writes its target and check how: `want` is the shape it writes (None when the
        written value's type is unknown, an error already reported: the shape is not checked, and the output
        counts as written); `partial`: it writes partial reductions, `what` says how, for the messages."""
        _check_target(self.kernel, self.step, self._sink, self._written, want, inplace, partial, what)


def _check_step(k, step, sink, types, defined_at, used, written):
    result = PRIMITIVES[step.op].check(StepCheck(k, step, sink, types, used, written))
    if step.out is not None:
        op, name, where = step.op, step.out, step.arg_locs.get("out", step.loc)
        if name in kernel_functions(k.name):
            sink.add(where, f"{op}.out: '{name}' is the name of a function of the generated kernel module; choose "
                            "another name")
            types[name] = None  # reported here, not again at each use
        elif name == ACC:
            sink.add(where, f"{op}.out: 'acc' is the GEMM accumulator; choose another name for this value")
        elif k.output(name):
            sink.add(where, f"{op}.out: '{name}' is an output, and values and outputs share one namespace; "
                            f"name the value differently and write it with '- store: {{x: <value>, to: {name}}}'")
        elif k.input(name):
            sink.add(where, f"{op}.out: '{name}' is already an input (line {k.input(name).loc.line}); "
                            "values are assigned once: choose a new name")
        elif name in defined_at:
            sink.add(where, f"{op}.out: '{name}' is already defined at line {defined_at[name].line}; "
                            "values are assigned once: choose a new name")
        else:
            types[name] = result  # None marks a value whose step failed, so its uses are not errors again
            defined_at[name] = where


def _undefined(k: Kernel, step, ref: str, types: dict) -> str:
    """Why `ref` cannot be read at `step`, and the likely fix."""
    if k.output(ref):
        return (f"'{ref}' is an output; outputs are written, not read: read the value that was stored "
                f"into '{ref}' instead")
    if k.input(ref) and k.input(ref).role is InputRole.GEMM_SCALE:
        return (f"'{ref}' is a K-group scale of the gemm (gemm.scales), which the mainloop applies at each K step; "
                "the epilogue does not read it (a scale per row or column of acc is an epilogue input of its own)")
    here = next(i for i, s in enumerate(k.steps) if s is step)
    later = [s for s in k.steps[here + 1:] if s.out == ref]
    if later:
        return (f"'{ref}' is used before it is defined (at line {later[0].arg_locs.get('out', later[0].loc).line}); "
                "move this step after the one that defines it")
    known = [n for n in types if n != ACC] + [i.name for i in k.inputs]
    close = difflib.get_close_matches(ref, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; declare it under inputs or define it with 'out: {ref}'"
    return f"'{ref}' is not defined: it is not an input and no earlier step defines it{hint}"


def _check_target(k: Kernel, step: Step, sink: ErrorSink, written: dict, want: tuple[Dim, ...] | None,
                  inplace: bool, partial: bool, what: str):
    arg = PRIMITIVES[step.op].target.name
    loc = step.arg_locs.get(arg, step.loc)
    out: Output | None = k.output(step.target)
    if out is None:
        close = difflib.get_close_matches(step.target, [o.name for o in k.outputs], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else "; declare it under outputs"
        sink.add(loc, f"{step.op}.{arg}: '{step.target}' is not among the outputs{hint}")
        return
    if out.name in written:
        sink.add(loc, f"{step.op}.{arg}: output '{out.name}' is already written at line {written[out.name].line}; "
                      "each output is written once")
        return
    written[out.name] = loc
    holds_partials = any(dims.is_tiles(d.value) for d in out.dims)  # an inplace one is reported on its own
    if holds_partials and not partial:
        sink.add(loc, f"{step.op}.{arg}: output '{out.name}' holds partial reductions {_fmt(out.dims)}; write it "
                      f"with '- reduce: {{op: ..., x: ..., axis: ..., to: {out.name}}}'")
        return
    if out.inplace != inplace and not holds_partials:
        if inplace:
            sink.add(loc, f"{step.op}.{arg}: output '{out.name}' must be declared with 'inplace: true'")
        else:
            sink.add(loc, f"{step.op}.{arg}: output '{out.name}' is inplace; update it with 'accumulate'")
    if want is not None and out.dims != want:
        what = f" ({what})" if what else ""
        sink.add(loc, f"{step.op}.{arg}: output '{out.name}' has shape {_fmt(out.dims)}, but this step writes "
                      f"{_fmt(want)}{what}; declare '{out.name}' as {_fmt(want)}")


def in_place_inputs(k: Kernel) -> dict[str, tuple[str, ...]]:
    """For each output, the inputs a caller may pass as it, the very same view, to update them in place: tile
    inputs of its shape and dtype (each element read by the one program that writes it: no GEMM operand, no
    vector) that every value stored to it is computed from, so that each element is read before it is
    overwritten."""
    tiles = {i.name for i in k.inputs if i.role is InputRole.TENSOR and i.type.kind is Kind.TILE}
    sources: dict[str, set[str]] = {}  # value -> the tile inputs it is computed from
    stored: dict[str, list[set[str]]] = {}  # output -> the sources of each value stored to it
    for s in k.steps:
        used: set[str] = set()
        for arg in PRIMITIVES[s.op].args:
            v = s.args.get(arg.name)
            if arg.kind in ("value", "index") and isinstance(v, str):
                used |= sources.get(v, {v} & tiles)
        if s.out:
            sources[s.out] = used
        if s.target:
            stored.setdefault(s.target, []).append(used)
    return {o.name: tuple(i.name for i in k.inputs if i.name in set.intersection(*stored[o.name])
                          and (i.dims, i.dtype) == (o.dims, o.dtype))
            for o in k.outputs if not o.inplace and o.name in stored}
