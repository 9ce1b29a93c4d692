"""The epilogue primitives: each op's arguments, as data. The loader parses steps with this table, the
validator types them with it, and the emitter and the reference each keep one function per op."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arg:
    name: str
    # value: a value name (or a number where `number` is set); index: an index input's name;
    # enum: one of `choices`; out: the value this step defines; target: the output it writes
    kind: str
    number: bool = False
    choices: tuple[str, ...] = ()
    default: str | None = None


UNARY = ("silu", "sigmoid", "gelu_tanh", "tanh", "relu", "exp", "log", "square", "rsqrt", "neg", "abs")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
GATED = ("swiglu", "geglu")  # pairwise (gate, up) -> act(gate) * up: halves the width
GATED_BWD = ("swiglu_bwd", "geglu_bwd")  # (dy, saved pairs) -> interleaved (d gate, d up)
ROTARY = ("rope", "rope_bwd")  # rotate each pair by position * frequency (backward: the inverse)
REDUCE_OPS = ("sum", "sumsq", "max", "logsumexp")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
CAST_DTYPES = ("T", *FLOAT_DTYPES)  # T: the kernel's type, whichever it is at the launch

_X = Arg("x", "value")
_OUT = Arg("out", "out")

SIGNATURES: dict[str, tuple[Arg, ...]] = {
    **{op: (_X, _OUT) for op in UNARY},
    **{op: (Arg("x", "value", number=True), Arg("y", "value", number=True), _OUT) for op in BINARY},
    "scale": (_X, Arg("by", "value", number=True), _OUT),
    "cast": (_X, Arg("dtype", "enum", choices=CAST_DTYPES), _OUT),
    **{op: (_X, _OUT) for op in GATED},
    **{op: (Arg("dy", "value"), Arg("x", "value"), _OUT) for op in GATED_BWD},
    **{op: (_X, Arg("positions", "value"), Arg("freqs", "value"), _OUT) for op in ROTARY},
    "reduce": (Arg("op", "enum", choices=REDUCE_OPS), _X, Arg("axis", "enum", choices=("cols", "rows")),
               Arg("to", "target")),
    "select": (_X, Arg("index", "index"), Arg("to", "target")),
    "one_hot": (Arg("index", "index"), _OUT),
    "store": (_X, Arg("to", "target")),
    "accumulate": (_X, Arg("into", "target")),
}

OUT_ARG = "out"
TARGET_ARGS = ("to", "into")
