"""Primitives that take a column index per row, from an index input ({shape: [M], dtype: index}): `select`
(the target logit of cross-entropy) and `one_hot` (its gradient's indicator). An index outside the tile's
width (an ignore_index such as -100) selects nothing."""
from __future__ import annotations

from ..model import Dim, DType, Kind, ValueType, Width
from .base import OUT, X, Arg, Primitive, torch

INDEX = Arg("index", "index")


def _check_select(c) -> None:
    a = c.step.args
    x = c.typed("x")
    idx = c.kernel.input(a["index"])
    if idx is None:
        c.error("index", f"select.index: '{a['index']}' is not an input; declare it under inputs as "
                         f"'{a['index']}: {{shape: [M], dtype: index}}'")
    elif idx.dtype is not DType.INDEX:
        c.error("index", f"select.index: input '{idx.name}' has dtype {idx.dtype.value}, but select needs integer "
                         f"column indices; declare it as '{idx.name}: {{shape: [M], dtype: index}}'")
        c.use(idx.name)
    else:
        c.use(idx.name)
    ok = c.need("x", x, (Kind.TILE,), "a tile")
    c.target((Dim.M,) if ok else None)


def _emit_select(e, s):
    x, w = s.args["x"], e.types[s.args["x"]].width
    e.need_width(w)
    index, to = s.args["index"], s.target
    parts = e.columns(x, w)
    e.load(index)
    for i, (value, cols) in enumerate(parts):
        # the first tile of a row stores its ignored indices' zeros, once
        first = f"{e.pid_n} == 0" if i == 0 else "False"
        e.line(f"tile.store_selected({e.row_ptr(to)}, {value}, {cols}, {index}, {e.size(w)}, "
               f"{e.row_mask}, {first}, STEP={len(parts)})")


def _select_reference(r, s):
    x = r.value(s.args["x"])
    index = r.args[s.args["index"]].long()
    inside = (index >= 0) & (index < x.shape[1])
    picked = x.gather(1, index.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return torch.where(inside, picked, torch.zeros_like(picked))


def _check_one_hot(c) -> ValueType | None:
    name = c.step.args["index"]
    idx = c.kernel.input(name)
    if idx is None or idx.dtype is not DType.INDEX:
        c.error("index", f"one_hot.index must be an input of dtype index and shape [M], got '{name}'")
        return None
    c.use(idx.name)
    return ValueType(Kind.TILE, Width.FULL)


def _emit_one_hot(e, s):
    index = s.args["index"]
    e.load(index)
    e.assign(s, f"tile.one_hot({e.cols}, {e.pid_n} * BLOCK_N, {index}, N)")


def _one_hot_reference(r, s):
    index = r.args[s.args["index"]].long()
    return (index[:, None] == torch.arange(r.n, device=index.device)[None, :]).to(r.dtype)


PRIMITIVES = (
    Primitive(
        "select", (X, INDEX, Arg("to", "target")),
        "to[m] = x[m, index[m]] when 0 ≤ index[m] < the tile's width, else 0; written once per row.",
        "x: a tile; index: an input {shape: [M], dtype: index}; to: an output [M].",
        "select: {x: logits, index: target, to: target_logit}",
        check=_check_select, reference=_select_reference,
        emitters={"tl": _emit_select, "gluon": _emit_select}),
    Primitive(
        "one_hot", (INDEX, OUT),
        "out[m, j] = 1.0 if j = index[m] else 0.0, for j in [0, N): all zeros in rows whose index is outside.",
        "index: an input {shape: [M], dtype: index}; out: a tile of width N.",
        "one_hot: {index: target, out: is_target}",
        check=_check_one_hot, reference=_one_hot_reference,
        emitters={"tl": _emit_one_hot, "gluon": _emit_one_hot}),
)
