"""Finish steps of losses: per-row losses reduced as PyTorch's losses reduce them, the rows' weights in the
loss, and the power of two a forward with gradients makes them for."""
from __future__ import annotations

from ..blockmodel import TOKENS, Value
from .base import FinishArg, FinishStep, fmt

TARGET = FinishArg("target", "value", what="`[M]` index")
CLASSES = FinishArg("classes", "size")
IGNORE_INDEX = FinishArg("ignore_index", "int")
TOKEN_WEIGHTS = FinishArg("token_weights", "value", optional=True, what="`[M]` float32")
EMPTY_MEAN = FinishArg("empty_mean", "choice", optional=True, choices=("nan", "zero"))
REDUCTIONS = ("mean", "sum", "none")


def _rows(c, want: tuple[tuple[str, str], ...]) -> bool:
    """Whether each argument given of `want` ((name, dtype)) is an [M] value of its dtype; reported if not."""
    for name, dtype in want:
        v = c.type(name)
        if v is not None and (v.dims != (TOKENS,) or v.dtype != dtype):
            c.error(f"{c.op}.{name} must be [M] {dtype}, got {fmt(v.dims)} {v.dtype}")
            return False
    return True


def _cross_entropy(c) -> list[Value] | None:
    for name, dtype in (("lse", "float32"), ("target_logit", "float32"), ("target", "index")):
        v = c.type(name)
        if v.dims != (TOKENS,) or v.dtype != dtype:
            c.error(f"cross_entropy.{name} must be [M] {dtype}, got {fmt(v.dims)} {v.dtype}")
            return None
    return [Value((), "float32"), Value((TOKENS,), "float32")]


def _reduce_loss(c) -> list[Value] | None:
    if not _rows(c, (("target", "index"), ("token_weights", "float32"), ("x", "float32"))):
        return None
    per_row = _per_row_loss(c)
    if per_row is None:
        return None
    return [Value((TOKENS,) if per_row else (), "float32"), Value((TOKENS,), "float32")]


def _per_row_loss(c) -> bool | None:
    """Whether reduce_loss makes a loss per row ([M], reduction 'none') rather than a scalar: a static shape,
    so an attr may choose between 'mean' and 'sum' but not between either and 'none'."""
    arg = c.arg("reduction")
    if not arg.is_name:
        return arg.value == "none"
    choices = set(c.block.attr(arg.value).choices)
    if "none" in choices and choices != {"none"}:
        c.error(f"reduce_loss.reduction: attr '{arg.value}' chooses between 'none' (a loss per row, [M]) and "
                f"{', '.join(repr(x) for x in sorted(choices - {'none'}))} (a scalar): the loss's shape must not "
                "depend on an attr; give 'none' a block of its own", at="reduction")
        return None
    return choices == {"none"}


def _row_weights(c) -> list[Value] | None:
    if not _rows(c, (("target", "index"), ("token_weights", "float32"))):
        return None
    return [Value((TOKENS,), "float32")]


def _unit_scale(c) -> list[Value] | None:
    if c.type("x").dtype != "float32":
        c.error(f"unit_scale.x must be float32, got {c.type('x').dtype}")
        return None
    return [Value((), "float32")]


CROSS_ENTROPY = FinishStep(
    "cross_entropy",
    (FinishArg("lse", "value", what="`[M]` float32"), FinishArg("target_logit", "value", what="`[M]` float32"),
     TARGET, CLASSES, IGNORE_INDEX, FinishArg("reduction", "choice", choices=("mean", "sum")), EMPTY_MEAN,
     FinishArg("loss", "out"), FinishArg("weights", "out")),
    "`loss` `[]` float32 and `weights` `[M]` float32: `reduce_loss` of `lse − target_logit` in one pass",
    "cross_entropy: {lse: lse, target_logit: target_logit, target: target, classes: vocab, ignore_index: "
    "ignore_index, reduction: reduction, loss: loss, weights: row_weight}",
    check=_cross_entropy)

REDUCE_LOSS = FinishStep(
    "reduce_loss",
    (FinishArg("x", "value", what="`[M]` float32 (each row's loss)"), TARGET, CLASSES, IGNORE_INDEX,
     FinishArg("reduction", "choice", choices=REDUCTIONS), TOKEN_WEIGHTS, EMPTY_MEAN, FinishArg("loss", "out"),
     FinishArg("weights", "out")),
    "`loss`: `[]` for `mean`/`sum`, `[M]` for `none`; `weights` `[M]`: each row's weight in the loss (below)",
    "reduce_loss: {x: row_loss, target: target, classes: vocab, ignore_index: -100, reduction: mean, loss: loss, "
    "weights: row_weight}",
    check=_reduce_loss)

ROW_WEIGHTS = FinishStep(
    "row_weights",
    (TARGET, IGNORE_INDEX, FinishArg("reduction", "choice", choices=REDUCTIONS), TOKEN_WEIGHTS,
     FinishArg("out", "out")),
    "`[M]` float32: the rows' weights as `reduce_loss` returns them, from the targets alone (for a forward that "
    "makes the gradient before the loss)",
    "row_weights: {target: target, ignore_index: ignore_index, reduction: reduction, out: row_weight}",
    check=_row_weights)

UNIT_SCALE = FinishStep(
    "unit_scale", (FinishArg("x", "value", what="float32"), FinishArg("out", "out")),
    "`[]` float32: the power of two `s` that brings the largest magnitude in `x` into [0.5, 1) (1 when `x` is "
    "empty, all zero or not finite): the output gradient to make gradients for (`forward_with_grads.grad_scale`)",
    "unit_scale: {x: row_weight, out: scale}",
    check=_unit_scale)

STEPS = (CROSS_ENTROPY, REDUCE_LOSS, ROW_WEIGHTS, UNIT_SCALE)
