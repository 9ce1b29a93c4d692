"""The registry of epilogue primitives: everything about a primitive in one place, one module per family.

    elementwise.py  unary functions, binary operators, scale, cast
    pairwise.py     swiglu, geglu and their backward, rope and rope_bwd (interleaved pairs)
    reduce.py       reduce (per-tile partial reductions), group_reduce (whole column groups, read back)
    indexing.py     select, one_hot (a column index per row)
    quantize.py     fp8_scale, quantize (FP8 values and their scales per column group)
    memory.py       store, accumulate

Each primitive is a `Primitive` (base.py) holding

    name, args  its signature: the step's keys, in order, each an `Arg` with a kind (value, index, enum, out,
                target). The loader parses steps with it; the JSON Schema's step section is generated from it.
    doc, typing, example
                one sentence of what it computes, one of what its arguments must be, and an example step: the
                schema's hover text and the primitive table of docs/spec-reference.md (both generated:
                `python -m codagen.primitives.docs`).
    check(c)    its type rule. `c` is a `codagen.validate.StepCheck`: c.kernel, c.step, c.typed(arg) (the type
                of an operand, reporting undefined names), c.need(arg, type, kinds, what), c.broadcast(x, y),
                c.error(arg or None, message), c.use(input name), c.target(dims, inplace=, partial=, what=)
                (checks the output it writes). Returns the type of the value it defines (None: no value, or
                an error already reported).
    reference(r, s)
                its meaning on whole tensors, in float64 by default. `r` is a `codagen.reference.Evaluation`:
                r.value(ref, into=None) (an operand, broadcast into a tile type), r.tensor(...) (the same, numbers
                as 0-d tensors), r.args, r.types, r.kernel, r.dtype, r.block_m, r.block_n, r.n. Returns the
                value it defines, or the tensor it writes to its target.
    emitters    backend name -> emitter(e, s), which appends the step's source lines. "tl" is Triton's
                language; `e` is that backend's epilogue emitter (`codagen.emit.epilogue.EpilogueEmitter`), which
                holds the shared machinery: e.lang (the language module's name in generated code), e.kernel,
                e.types, e.ref(v, into), e.halves(v, into), e.is_pair(v), e.load(input), e.need_width(w, tile=),
                e.col_mask(w), e.tile_mask(w), e.size(w), e.columns(v, w), e.assign(s, expr),
                e.assign_pair(s, expr), e.elementwise(s, template, operands), e.write(s, template),
                e.guarded(condition, line), e.line(text), e.t_dtype() (T in generated code), e.need_groups()
                (the indices and mask of column groups: cols_group, col_mask_group, group_mask). Device helpers
                are called as `tile.<function>`. "gluon" is the Hopper backend (codagen/emit/gluon.py), whose
                emitter adds e.store_tile(s) (a tile stored through shared memory by TMA, or from registers).

Another backend is an emitter class with the same methods (its own loads, masks and language module) and an
entry in `emitters` for each primitive it lowers; where the text is the same up to the language module, the
same emitter serves both (`base.expression` templates write `{lang}` for it). `unsupported_steps(kernel,
backend)` lists the steps a backend cannot lower yet, so that a build can name them (file:line) and fall back.
Adding a primitive: docs/contributing.md."""
from __future__ import annotations

from ..model import Kernel, Literal, Step
from . import elementwise, indexing, memory, pairwise, quantize, reduce
from .base import Arg, Primitive

FAMILIES = (elementwise, pairwise, reduce, indexing, quantize, memory)
PRIMITIVES: dict[str, Primitive] = {p.name: p for family in FAMILIES for p in family.PRIMITIVES}


def step_text(step: Step) -> str:
    """The step as a spec writes it, in flow style: `reduce: {op: sumsq, x: x_new, axis: cols, to: ss}`."""
    def value(arg: Arg) -> str:
        v = step.out if arg.kind == "out" else step.target if arg.kind == "target" else step.args[arg.name]
        return repr(v.value) if isinstance(v, Literal) else v
    return f"{step.op}: {{" + ", ".join(f"{a.name}: {value(a)}" for a in PRIMITIVES[step.op].args) + "}"


def unsupported_steps(kernel: Kernel, backend: str) -> list[Step]:
    """The steps of `kernel` whose primitive has no emitter for `backend`, in program order."""
    return [s for s in kernel.steps if backend not in PRIMITIVES[s.op].emitters]


__all__ = ["Arg", "FAMILIES", "PRIMITIVES", "Primitive", "step_text", "unsupported_steps"]
