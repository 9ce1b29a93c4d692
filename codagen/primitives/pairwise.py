"""Pairwise primitives on interleaved columns (2j, 2j+1): the gated activations SwiGLU and GeGLU, their
backward, and the rotary embedding (RoPE) with its inverse. A pair value held as its even and odd halves
(a 2*N-wide value, see codagen/emit/epilogue.py) goes to the `_pairs` device function as those halves."""
from __future__ import annotations

from ..model import Kind, ValueType
from .base import OUT, X, Arg, F, Primitive, torch
from .elementwise import gelu_tanh


def pairs(x):
    """(even columns, odd columns) of a tensor of interleaved pairs."""
    return x[:, 0::2], x[:, 1::2]


def interleave(even, odd):
    return torch.stack([even, odd], dim=2).reshape(even.shape[0], -1)


# -- gated activations: (gate, up) -> act(gate) * up, half the width -----------------------------------------
def _check_gated(c) -> ValueType | None:
    op, a = c.step.op, c.step.args
    x = c.typed("x")
    if c.need("x", x, (Kind.TILE,), "a tile of interleaved (gate, up) pairs"):
        if x.width.half is None:
            c.error("x", f"{op}.x: '{a['x']}' is a {x}, already halved: {op} turns each (gate, up) pair into one "
                         f"value, so it needs a [M, N] or [M, 2*N] tile of pairs")
        else:
            return ValueType(Kind.TILE, x.width.half)
    return None


def _emit_gated(e, s):
    x = s.args["x"]
    if e.is_pair(x):
        e.assign(s, f"tile.{s.op}_pairs({', '.join(e.halves(x))})")
    else:
        e.assign(s, f"tile.{s.op}({e.ref(x)})")


def gated(name: str, act, act_name: str) -> Primitive:
    def reference(r, s):
        gate, up = pairs(r.value(s.args["x"]))
        return act(gate) * up
    return Primitive(
        name, (X, OUT), f"out_j = {act_name}(g_j) · u_j, on the interleaved pairs (g_j, u_j) = (x_2j, x_2j+1).",
        "x: a tile of width N or 2*N; out: a tile of half that width.", f"{name}: {{x: zv, out: yv}}",
        check=_check_gated, reference=reference,
        # Gluon: the accumulator's pairs are split in registers (tile.split_pairs) in a layout derived from
        # the accumulator's, whose result the Hopper backend only stores; pairs loaded from memory arrive as
        # halves in the accumulator's layout (emit/gluon.py)
        emitters={"tl": _emit_gated, "gluon": _emit_gated})


# -- their backward: (dy, saved pairs) -> interleaved (d gate, d up) -----------------------------------------
def _check_gated_bwd(c) -> ValueType | None:
    op, a = c.step.op, c.step.args
    dy, x = c.typed("dy"), c.typed("x")
    if c.need("dy", dy, (Kind.TILE,), "a tile (the gradient of the gated output)") & c.need(
            "x", x, (Kind.TILE,), "a tile of the saved (gate, up) pairs"):
        if dy.width.double != x.width:
            want = dy.width.double.value if dy.width.double else "none"
            c.error("x", f"{op}.x must be twice as wide as dy ([M, {want}]), got {x} '{a['x']}'")
        else:
            return x
    return None


def _emit_gated_bwd(e, s):
    dy, x = e.ref(s.args["dy"]), s.args["x"]
    if e.is_pair(x):
        e.assign_pair(s, f"tile.{s.op}_pairs({dy}, {', '.join(e.halves(x))})")
    else:
        e.assign(s, f"tile.{s.op}({dy}, {e.ref(x)})")


def gated_bwd(name: str, act, forward: str, formula: str) -> Primitive:
    def reference(r, s):
        dy = r.value(s.args["dy"])
        gate, up = pairs(r.value(s.args["x"]))
        gate = gate.detach().requires_grad_(True)
        with torch.enable_grad():
            (d_gate,) = torch.autograd.grad(act(gate), gate, dy * up)
        return interleave(d_gate, dy * act(gate.detach()))
    return Primitive(
        name, (Arg("dy", "value"), X, OUT),
        f"The gradient of {forward} at the saved pairs x given dy, interleaved (d gate, d up): {formula}.",
        "dy: a tile of width w (N/2 or N); x: the saved pairs, a tile of width 2w; out: a tile of width 2w.",
        f"{name}: {{dy: acc, x: z1, out: dz}}", check=_check_gated_bwd, reference=reference,
        # Gluon: saved pairs loaded from memory (2*N) arrive as halves in the accumulator's layout
        emitters={"tl": _emit_gated_bwd, "gluon": _emit_gated_bwd})


# -- rotary embedding ----------------------------------------------------------------------------------------
def _check_rotary(c) -> ValueType | None:
    op, a = c.step.op, c.step.args
    x, pos, freqs = c.typed("x"), c.typed("positions"), c.typed("freqs")
    ok = c.need("x", x, (Kind.TILE,), "a tile of interleaved pairs")
    ok &= c.need("positions", pos, (Kind.ROW,), "a row vector [M] of positions")
    ok &= c.need("freqs", freqs, (Kind.COL,), "a column vector of per-pair frequencies")
    if ok:
        if x.width.half is None or freqs.width != x.width.half:
            want = x.width.half.value if x.width.half else "?"
            c.error("freqs", f"{op}.freqs must have one frequency per pair, [{want}] for a {x}, got {freqs} "
                             f"'{a['freqs']}'; declare it as [{want}]")
        else:
            return x
    return None


def _emit_rotary(e, s):
    x = s.args["x"]
    xs = e.halves(x) if e.is_pair(x) else (e.ref(x),)
    pos, freqs = e.ref(s.args["positions"]), e.ref(s.args["freqs"])
    args = ", ".join((*xs, pos, freqs, f"INVERSE={s.op == 'rope_bwd'}"))
    if e.is_pair(x):
        e.assign_pair(s, f"tile.rope_pairs({args})")
    else:
        e.assign(s, f"tile.rope({args})")


def _emit_rotary_by_columns(e, s):
    """Gluon: the frequencies loaded once per column (cols // 2), in the accumulator's column layout. Pairs
    loaded from memory are halves in that layout already, with one frequency per column of the accumulator."""
    if e.is_pair(s.args["x"]):
        _emit_rotary(e, s)
        return
    pos, freqs = e.ref(s.args["positions"]), e.column_frequencies(s.args["freqs"])
    e.assign(s, f"tile.rope_by_columns({e.ref(s.args['x'])}, {pos}, {freqs}, INVERSE={s.op == 'rope_bwd'})")


def rotary(name: str, doc: str, inverse: bool) -> Primitive:
    def reference(r, s):
        angle = r.value(s.args["positions"]).to(r.dtype)[:, None] * r.value(s.args["freqs"])[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        if inverse:
            sin = -sin
        even, odd = pairs(r.value(s.args["x"]))
        return interleave(even * cos - odd * sin, even * sin + odd * cos)
    return Primitive(
        name, (X, Arg("positions", "value"), Arg("freqs", "value"), OUT), doc,
        "x: a tile of width N or 2*N; positions: a row vector (an index input or a value); freqs: a column "
        "vector of half x's width; out: like x.",
        f"{name}: {{x: z, positions: positions, freqs: freqs, out: rotated}}",
        check=_check_rotary, reference=reference, emitters={"tl": _emit_rotary, "gluon": _emit_rotary_by_columns})


PRIMITIVES = (
    gated("swiglu", lambda g: F.silu(g), "silu"),
    gated("geglu", gelu_tanh, "gelu_tanh"),
    gated_bwd("swiglu_bwd", lambda g: F.silu(g), "swiglu",
              "out_2j = dy_j · u_j · σ(g_j) (1 + g_j (1 − σ(g_j))), out_2j+1 = dy_j · silu(g_j)"),
    gated_bwd("geglu_bwd", gelu_tanh, "geglu",
              "out_2j = dy_j · u_j · gelu_tanh'(g_j), out_2j+1 = dy_j · gelu_tanh(g_j)"),
    rotary("rope", "Rotate each interleaved pair (g_j, u_j) of x by θ = positions_m · freqs_j: "
                   "out_2j = g_j cos θ − u_j sin θ, out_2j+1 = g_j sin θ + u_j cos θ.", inverse=False),
    rotary("rope_bwd", "The inverse rotation of rope (its gradient): rope with −θ.", inverse=True),
)
