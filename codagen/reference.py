"""A PyTorch interpreter of the kernel model: whole tensors instead of tiles, float64 by default. It is the
oracle of the tests and of tuning. Partial reductions need the tile shape, since they are per tile."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .model import ACC, BLayout, Dim, InputRole, Kernel, Kind, Literal, Step, ValueType, Width
from .validate import check_kernel

_WIDTH = {Width.HALF: 0.5, Width.FULL: 1, Width.DOUBLE: 2}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


UNARY = {
    "silu": F.silu, "sigmoid": torch.sigmoid, "gelu_tanh": _gelu_tanh, "tanh": torch.tanh,
    "relu": torch.relu, "exp": torch.exp, "log": torch.log, "square": torch.square, "rsqrt": torch.rsqrt,
    "neg": torch.neg, "abs": torch.abs,
}
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
          "minimum": torch.minimum}


def _pairs(x):
    return x[:, 0::2], x[:, 1::2]


def _interleave(even, odd):
    return torch.stack([even, odd], dim=2).reshape(even.shape[0], -1)


def _gated_bwd(act, dy, x):
    gate, up = _pairs(x)
    gate = gate.detach().requires_grad_(True)
    with torch.enable_grad():
        (d_gate,) = torch.autograd.grad(act(gate), gate, dy * up)
    return _interleave(d_gate, dy * act(gate.detach()))


def _rope(x, positions, freqs, inverse):
    angle = positions[:, None] * freqs[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = -sin
    even, odd = _pairs(x)
    return _interleave(even * cos - odd * sin, even * sin + odd * cos)


def _partial(op: str, x: torch.Tensor, axis: str, block: int) -> torch.Tensor:
    """Per-tile reduction: along columns in groups of `block` (one value per row and tile), or along rows."""
    if axis == "rows":
        return _partial(op, x.T, "cols", block)
    rows, cols = x.shape
    tiles = -(-cols // block)
    fill = float("-inf") if op in ("max", "logsumexp") else 0.0
    padded = torch.full((rows, tiles * block), fill, dtype=x.dtype, device=x.device)
    padded[:, :cols] = x
    t = padded.reshape(rows, tiles, block)
    if op == "sum":
        return t.sum(-1)
    if op == "sumsq":
        return (t * t).sum(-1)
    if op == "max":
        return t.amax(-1)
    return torch.logsumexp(t, -1)


def run(kernel: Kernel, args: dict, block_m: int, block_n: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Outputs of the kernel on `args` (inputs, and the current values of inplace outputs), in `dtype`,
    before the cast to each output's dtype. `block_m`/`block_n` set the tiles of partial reductions (block_n:
    the columns that the epilogue runs on at a time, Config.epilogue_n)."""
    types = check_kernel(kernel)
    env: dict[str, torch.Tensor | float] = {}
    for i in kernel.inputs:
        v = args[i.name]
        env[i.name] = v if i.role is InputRole.HOST_SCALAR else v.to(dtype)
    if kernel.gemm:
        a, b = env[kernel.gemm.a], env[kernel.gemm.b]
        env[ACC] = a @ (b.T if kernel.gemm.b_layout is BLayout.NK else b)
    outs: dict[str, torch.Tensor] = {}
    for step in kernel.steps:
        _step(kernel, step, env, types, outs, args, block_m, block_n, dtype)
    return outs


def _step(kernel, step: Step, env, types: dict[str, ValueType], outs, args, block_m, block_n, dtype):
    a = step.args

    def val(name, into: ValueType | None = None):
        if isinstance(name, Literal):
            return name.value
        v = env[name]
        t = types[name]
        if into is not None and into.kind is Kind.TILE and isinstance(v, torch.Tensor):
            if t.kind is Kind.ROW:
                return v[:, None]
            if t.kind is Kind.COL:
                return v[None, :]
        return v

    op = step.op
    if op in UNARY:
        x = val(a["x"])
        result = UNARY[op](x) if isinstance(x, torch.Tensor) else UNARY[op](torch.tensor(x, dtype=dtype))
    elif op == "cast":
        rounded = args[kernel.t_input].dtype if a["dtype"] == "T" else _DTYPES[a["dtype"]]
        result = val(a["x"]).to(rounded).to(dtype)
    elif op in BINARY or op == "scale":
        out_t = types[step.out]
        # a row vector meets a column vector as [:, None] and [None, :]: their outer product
        x, y = val(a["x"], out_t), val(a["y" if op in BINARY else "by"], out_t)
        fn = BINARY.get(op, torch.mul)
        x = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        y = y if isinstance(y, torch.Tensor) else torch.tensor(y, dtype=dtype)
        result = fn(x, y)
    elif op == "swiglu":
        g, u = _pairs(val(a["x"]))
        result = F.silu(g) * u
    elif op == "geglu":
        g, u = _pairs(val(a["x"]))
        result = _gelu_tanh(g) * u
    elif op == "swiglu_bwd":
        result = _gated_bwd(F.silu, val(a["dy"]), val(a["x"]))
    elif op == "geglu_bwd":
        result = _gated_bwd(_gelu_tanh, val(a["dy"]), val(a["x"]))
    elif op in ("rope", "rope_bwd"):
        result = _rope(val(a["x"]), val(a["positions"]).to(dtype), val(a["freqs"]), op == "rope_bwd")
    elif op == "reduce":
        x = val(a["x"])
        w = _WIDTH[types[a["x"]].width]
        block = int(block_n * w) if a["axis"] == "cols" else block_m
        outs[step.target] = _partial(a["op"], x, a["axis"], block)
        return
    elif op == "select":
        x = val(a["x"])
        index = args[a["index"]].long()
        inside = (index >= 0) & (index < x.shape[1])
        picked = x.gather(1, index.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
        outs[step.target] = torch.where(inside, picked, torch.zeros_like(picked))
        return
    elif op == "one_hot":
        index = args[a["index"]].long()
        n = env[ACC].shape[1] if ACC in env else _full_width(kernel, args)
        result = (index[:, None] == torch.arange(n, device=index.device)[None, :]).to(dtype)
    elif op == "store":
        outs[step.target] = val(a["x"])
        return
    elif op == "accumulate":
        outs[step.target] = args[step.target].to(dtype) + val(a["x"])
        return
    else:  # pragma: no cover - the validator admits only the ops above
        raise AssertionError(op)
    env[step.out] = result


def _full_width(kernel: Kernel, args: dict) -> int:
    """N, from a tile input, in a kernel without a gemm."""
    for i in kernel.inputs:
        t = i.type
        if t is not None and t.kind is Kind.TILE:
            return int(args[i.name].shape[1] / _WIDTH[t.width])
    raise ValueError(f"{kernel.name}: no tile input fixes N")


def output_dims(kernel: Kernel, sizes: dict[str, int], block_m: int, block_n: int) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of the outputs for given sizes and tile shape."""
    n = sizes["N"]
    concrete = {Dim.M: sizes["M"], Dim.K: sizes.get("K", 0), Dim.N: n, Dim.N_HALF: n // 2, Dim.N_DOUBLE: 2 * n,
                Dim.TILES_M: -(-sizes["M"] // block_m), Dim.TILES_N: -(-n // block_n)}
    return {o.name: tuple(concrete[d] for d in o.dims) for o in kernel.outputs}
