"""The registry of finish steps: the host-side steps of a block spec that combine what kernels wrote (the
partials of their `reduce`, row vectors) and the plain GEMMs; everything about a step in one place, one
module per family.

    partials.py     rstd, sum_tiles, logsumexp_tiles: the partials of a kernel's `reduce`, combined per row
    elementwise.py  add, sub, mul, div, square (fp32, on values of one shape or a value and scalars), gather
    loss.py         cross_entropy, reduce_loss, row_weights, unit_scale
    gemm.py         matmul

Each step is a `FinishStep` (base.py) holding

    name, args  its signature: the block step's keys, in the order the generated block passes them (by
                keyword) and the docs list them, each a `FinishArg` with a kind (base.KINDS: partials, value,
                operand, size, int, number, choice, keyword, kernel, out), whether it may be left out, its
                choices, and what it must be (for the docs).
    combines    the reductions (codagen/primitives/reduce.py: sum, sumsq, max, logsumexp) whose partials its
                `partials` argument takes. A kernel's `reduce: {op: ...}` output is a `blockmodel.Partial(op,
                dims)` in the block; partials of another reduction are refused at the value's file:line:col.
    doc, example
                what it makes, and one block step: the finish-step table of docs/spec-reference.md (generated:
                `python -m codagen.primitives.docs`).
    check(c)    its type rule, run once every argument has the kind it declares. `c` is a
                `codagen.blockcheck.FinishCheck`: c.op, c.step, c.block, c.type(arg) (the type of a value
                argument: blockmodel.Value or Partial; None for a number, an attr or an argument left out),
                c.arg(arg) (the resolved blockmodel.Arg, None if left out), c.error(message, at=arg or None).
                Returns the types of the values its `out` arguments define, in their order (None: an error,
                reported).
    runtime     the function the generated block calls, `finish.<name>(...)` of codagen/runtime/finish.py,
                every argument but the outs by keyword (matmul's `accumulate` goes to runtime.ChunkSum instead).

Adding a finish step: docs/contributing.md."""
from __future__ import annotations

from . import elementwise, gemm, loss, partials
from .base import KINDS, FinishArg, FinishStep

FAMILIES = (partials, elementwise, loss, gemm)
FINISH_STEPS: dict[str, FinishStep] = {s.name: s for family in FAMILIES for s in family.STEPS}


def combining(op: str) -> list[str]:
    """The finish steps that combine the partials of the reduction `op`."""
    return [s.name for s in FINISH_STEPS.values() if op in s.combines]


__all__ = ["FAMILIES", "FINISH_STEPS", "KINDS", "FinishArg", "FinishStep", "combining"]
