"""`matmul`: a plain GEMM through torch.matmul (cuBLAS), for weight gradients and data gradients with no
epilogue."""
from __future__ import annotations

from ..blockmodel import Value
from .base import FinishArg, FinishStep, fmt


def _matmul(c) -> list[Value] | None:
    a, b = c.type("a"), c.type("b")
    if len(a.dims) != 2 or len(b.dims) != 2:
        c.error(f"matmul operands must be matrices, got {fmt(a.dims)} and {fmt(b.dims)}")
        return None
    transpose = c.arg("transpose").value if c.arg("transpose") else "none"
    ad = a.dims[::-1] if transpose == "a" else a.dims
    bd = b.dims[::-1] if transpose == "b" else b.dims
    if ad[1] != bd[0]:
        c.error(f"matmul: {fmt(ad)} @ {fmt(bd)} do not chain ({ad[1]} != {bd[0]})")
        return None
    if (a.dtype, b.dtype) != ("T", "T") and c.arg("accumulate") is not None:
        c.error(f"matmul.accumulate: a is {a.dtype} and b {b.dtype}; the kernel takes both in the block's type T")
        return None
    return [Value((ad[0], bd[1]), a.dtype if a.dtype == b.dtype else "float32")]


MATMUL = FinishStep(
    "matmul",
    (FinishArg("a", "value"), FinishArg("b", "value"),
     FinishArg("transpose", "keyword", optional=True, choices=("none", "a", "b")),
     FinishArg("accumulate", "kernel", optional=True), FinishArg("out", "out")),
    "`a @ b` with the operand named by `transpose` transposed, through `torch.matmul` (cuBLAS): weight gradients, "
    "data gradients with no epilogue; the result has the operands' dtype when they share one, else float32. "
    "`accumulate` names a kernel spec that adds its GEMM to a total (below, row chunks)",
    "matmul: {a: grad_res, b: a, transpose: a, out: grad_w}",
    check=_matmul)

STEPS = (MATMUL,)
