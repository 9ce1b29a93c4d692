"""What a kernel computes, as one hash: the key of its tuning tables.

The spec file's sha256 changes with every comment, doc or layout edit; a tuning table keyed by it would be
silently dropped by such an edit. The fingerprint hashes a canonical serialization of the checked kernel
instead: its name, GEMM operands, layout and K-group scales, inputs and outputs (dims, dtypes, roles, inplace) and the
epilogue steps (op, arguments, defined value, written output), in spec order. Docs, comments, source
locations and spelling (a literal 1 or 1.0, an argument left at its default or written out) do not enter it.
"""
from __future__ import annotations

import enum
import hashlib
import json

from .model import Kernel, Literal


def fingerprint(kernel: Kernel) -> str:
    """sha256 of canonical(kernel): equal exactly when two kernels compute the same thing."""
    text = json.dumps(canonical(kernel), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical(kernel: Kernel) -> dict:
    """The kernel's computation as plain JSON data, without docs or locations."""
    gemm = kernel.gemm
    return {
        "kernel": kernel.name,
        "gemm": None if gemm is None else {"a": gemm.a, "b": gemm.b, "b_layout": gemm.b_layout.value,
                                           **({"scales": {"a": gemm.scales.a, "b": gemm.scales.b,
                                                          "group": gemm.scales.group}} if gemm.scales else {})},
        **({"column_group": kernel.column_group} if kernel.column_group else {}),
        "inputs": [{"name": i.name, "dims": [d.value for d in i.dims], "dtype": i.dtype.value, "role": i.role.value}
                   for i in kernel.inputs],
        "outputs": [{"name": o.name, "dims": [d.value for d in o.dims], "dtype": o.dtype.value,
                     "inplace": o.inplace} for o in kernel.outputs],
        "steps": [{"op": s.op, "args": {k: _value(v) for k, v in s.args.items()}, "out": s.out, "target": s.target}
                  for s in kernel.steps],
    }


def _value(v):
    """A step argument as JSON: a value name or choice as its string, a number literal as a float."""
    if isinstance(v, Literal):
        return float(v.value)
    if isinstance(v, enum.Enum):
        return _value(v.value)
    if v is None or isinstance(v, (str, bool)):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    raise TypeError(f"a step argument of type {type(v).__name__} has no canonical form; "
                    "extend codagen/fingerprint.py")
