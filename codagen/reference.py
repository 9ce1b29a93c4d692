"""A PyTorch interpreter of the kernel model: whole tensors instead of tiles, float64 by default. It is the
oracle of the tests and of tuning. Partial reductions need the tile shape, since they are per tile. Each
primitive's meaning lives with it (codagen/primitives); this module binds the operands and runs the steps."""
from __future__ import annotations

import torch

from . import dims
from .model import ACC, BLayout, Dim, InputRole, Kernel, Kind, Literal, Step, ValueType
from .primitives import PRIMITIVES


class Evaluation:
    """One run of a checked kernel: the values so far (`env`) and the outputs written (`outs`)."""

    def __init__(self, kernel: Kernel, types: dict[str, ValueType], args: dict, block_m: int, block_n: int,
                 dtype: torch.dtype, env: dict):
        self.kernel, self.types, self.args, self.dtype = kernel, types, args, dtype
        self.block_m, self.block_n = block_m, block_n
        self.env = env
        self.outs: dict[str, torch.Tensor] = {}

    def value(self, ref, into: ValueType | None = None):
        """An operand: a tensor, or a float for numbers and host scalars; broadcast into a tile type `into`
        (a row vector as [:, None], a column vector as [None, :], a group value repeated over its group's
        columns), or a row vector into a group value."""
        if isinstance(ref, Literal):
            return ref.value
        v, t = self.env[ref], self.types[ref]
        if into is not None and into.kind is Kind.TILE and isinstance(v, torch.Tensor):
            if t.kind is Kind.ROW:
                return v[:, None]
            if t.kind is Kind.COL:
                return v[None, :]
            if t.kind is Kind.GROUP:  # each group's value over its columns (half as many in an N/2-wide tile)
                return v.repeat_interleave(dims.group_columns(self.kernel.column_group, into.width.value), dim=1)
        if into is not None and into.kind is Kind.GROUP and t.kind is Kind.ROW and isinstance(v, torch.Tensor):
            return v[:, None]
        return v

    def tensor(self, ref, into: ValueType | None = None) -> torch.Tensor:
        """An operand as a tensor: numbers and host scalars become 0-d tensors of the run's dtype."""
        v = self.value(ref, into)
        return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=self.dtype)

    @property
    def n(self) -> int:
        """N: the accumulator's columns, or, without a gemm, those of a tile input."""
        if ACC in self.env:
            return self.env[ACC].shape[1]
        for i in self.kernel.inputs:
            t = i.type
            if t is not None and t.kind is Kind.TILE:
                return int(dims.base_size(t.width.value, self.args[i.name].shape[1]))
        raise ValueError(f"{self.kernel.name}: no tile input fixes N")

    def step(self, step: Step) -> None:
        result = PRIMITIVES[step.op].reference(self, step)
        if step.out is not None:
            self.env[step.out] = result
        else:
            self.outs[step.target] = result


def run(kernel: Kernel, types: dict[str, ValueType], args: dict, block_m: int, block_n: int,
        dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Outputs of the checked kernel (`types`: its value types, from validate.check_kernel) on `args` (inputs,
    and the current values of inplace outputs), in `dtype`, before the cast to each output's dtype.
    `block_m`/`block_n` set the tiles of partial reductions (block_n: the columns that the epilogue runs on at
    a time, Config.epilogue_n)."""
    env: dict[str, torch.Tensor | float] = {}
    for i in kernel.inputs:
        v = args[i.name]
        env[i.name] = v if i.role is InputRole.HOST_SCALAR else v.to(dtype)
    if kernel.gemm:
        a, b = env[kernel.gemm.a], env[kernel.gemm.b]
        scales = kernel.gemm.scales
        if scales:  # K-group scales: the operands dequantized, each value times its group's or block's scale
            g = scales.group
            if scales.a:
                a = a * env[scales.a].repeat_interleave(g, dim=1)[:, :a.shape[1]]
            if scales.b:
                s_b = env[scales.b].repeat_interleave(g, dim=0).repeat_interleave(g, dim=1)
                b = b * s_b[:b.shape[0], :b.shape[1]]
        env[ACC] = a @ (b.T if kernel.gemm.b_layout is BLayout.NK else b)
    evaluation = Evaluation(kernel, types, args, block_m, block_n, dtype, env)
    for step in kernel.steps:
        evaluation.step(step)
    return evaluation.outs


def output_dims(kernel: Kernel, sizes: dict[str, int], block_m: int, block_n: int) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of the outputs for given sizes and tile shape."""
    sizes = {"K": 0, **sizes}
    group = kernel.column_group if isinstance(kernel.column_group, int) else None

    def concrete(d: Dim) -> int:
        if d is Dim.GROUPS_N and group is None:
            return 0
        return dims.size(d.value, sizes, (block_m, block_n), group, kernel.k_group)

    return {o.name: tuple(concrete(d) for d in o.dims) for o in kernel.outputs}
