"""Finish steps that combine the partials of a kernel's `reduce` (one value per row and tile) into one value
per row: each declares the reductions whose partials it combines."""
from __future__ import annotations

from ..blockmodel import Value
from .base import FinishArg, FinishStep

X = FinishArg("x", "partials", what="`[rows, tiles]` float32")
OUT = FinishArg("out", "out")


def _per_row(c) -> list[Value]:
    """[rows, tiles(...)] partials make one float32 value per row."""
    return [Value(c.type("x").dims[:1], "float32")]


RSTD = FinishStep(
    "rstd", (X, FinishArg("size", "size"), FinishArg("eps", "number"), OUT),
    "`[rows]` float32: RMSNorm's `1/√(Σ x / size + eps)` from per-tile sums of squares",
    "rstd: {x: ss, size: dim, eps: eps, out: rstd}",
    check=_per_row, combines=("sumsq",))

SUM_TILES = FinishStep(
    "sum_tiles", (X, FinishArg("divide_by", "size", optional=True), OUT),
    "`[rows]` float32: the sum over the tiles, divided by `divide_by` when given",
    "sum_tiles: {x: zsum_part, divide_by: vocab, out: z_mean}",
    check=_per_row, combines=("sum", "sumsq"))

LOGSUMEXP_TILES = FinishStep(
    "logsumexp_tiles", (X, FinishArg("inf_max", "choice", optional=True, choices=("keep", "nan")), OUT),
    "`[rows]` float32: the log-sum-exp of each row from per-tile log-sum-exps (with a running max, as online "
    "softmax). A row whose largest value is infinite gives `torch.logsumexp`'s ±inf with `keep` (the default), "
    "NaN with `nan`: the normalizer `log_softmax` and `F.cross_entropy` subtract, `max + log Σ exp(x − max)`, "
    "where inf − inf is NaN (a +inf logit makes PyTorch's loss of the row and the gradient of each of its logits "
    "NaN); cross-entropy blocks use `nan`",
    "logsumexp_tiles: {x: lse_part, inf_max: nan, out: lse}",
    check=_per_row, combines=("logsumexp",))

STEPS = (RSTD, SUM_TILES, LOGSUMEXP_TILES)
