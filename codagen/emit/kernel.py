"""A checked kernel -> the source of its generated module: the @triton.jit kernel, the launcher and the
torch.library op. The template holds the fixed parts; this file computes what varies, in spec order."""
from __future__ import annotations

from dataclasses import dataclass

from ..fingerprint import fingerprint
from ..model import Dim, DType, Input, InputRole, Kernel, Output, ValueType, Width
from .epilogue import emit_epilogue
from .templates import render

AXIS = {Dim.M: "m", Dim.K: "k", Dim.N: "n", Dim.N_HALF: "n", Dim.N_DOUBLE: "n", Dim.TILES_M: "t",
        Dim.TILES_N: "t"}
TORCH_DTYPES = {DType.FLOAT32: "torch.float32", DType.FLOAT16: "torch.float16", DType.BFLOAT16: "torch.bfloat16"}


@dataclass(frozen=True)
class Tensor:
    """A tensor argument of the kernel, as the template needs it."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    strides: tuple[str, ...]  # kernel parameter names, one per dim
    output: bool
    inplace: bool
    alloc_shape: str  # Python source of the shape, for allocated outputs
    alloc_dtype: str

    @property
    def dims_src(self) -> str:
        return "(" + ", ".join(f'"{d}"' for d in self.dims) + ("," if len(self.dims) == 1 else "") + ")"

    @property
    def stride_args(self) -> str:
        return ", ".join(f"{self.name}.stride({i})" for i in range(len(self.dims)))


def _size_expr(d: Dim) -> str:
    return {Dim.M: "M", Dim.K: "K", Dim.N: "N", Dim.N_HALF: "N // 2", Dim.N_DOUBLE: "2 * N",
            Dim.TILES_M: "triton.cdiv(M, config.block_m)", Dim.TILES_N: "triton.cdiv(N, config.epilogue_n)"}[d]


def _tensor(decl: Input | Output, output: bool) -> Tensor:
    shape = ", ".join(_size_expr(d) for d in decl.dims)
    dtype = "t_dtype" if decl.dtype is DType.T else TORCH_DTYPES.get(decl.dtype, "")
    return Tensor(
        name=decl.name,
        dims=tuple(d.value for d in decl.dims),
        dtype=decl.dtype.value,
        strides=tuple(f"stride_{decl.name}_{AXIS[d]}" for d in decl.dims),
        output=output,
        inplace=output and decl.inplace,
        alloc_shape=f"({shape},)" if len(decl.dims) == 1 else f"({shape})",
        alloc_dtype=dtype,
    )


def render_kernel(k: Kernel, types: dict[str, ValueType], regenerate: str) -> str:
    tensors = [_tensor(i, False) for i in k.inputs if i.role is not InputRole.HOST_SCALAR]
    tensors += [_tensor(o, True) for o in k.outputs]
    scalars = [i.name for i in k.inputs if i.role is InputRole.HOST_SCALAR]
    a = k.input(k.gemm.a) if k.gemm else None
    b = k.input(k.gemm.b) if k.gemm else None
    op_args = [i.name for i in k.inputs] + [o.name for o in k.outputs if o.inplace]
    returned = [o.name for o in k.outputs if not o.inplace]
    if len(returned) == 1:
        returns = "torch.Tensor"
    elif returned:
        returns = "tuple[" + ", ".join(["torch.Tensor"] * len(returned)) + "]"
    else:
        returns = "None"
    names = [t.name for t in tensors]
    epilogue_tensors = [t for t in tensors if not k.gemm or t.name not in (k.gemm.a, k.gemm.b)]
    epilogue_pointers = [f"{t.name}_ptr" for t in epilogue_tensors]
    if k.gemm and any(s.op == "cast" and s.args["dtype"] == "T" for s in k.steps):
        epilogue_pointers.insert(0, f"{k.gemm.a}_ptr")  # only its element type: what `cast` to T rounds to
    return render(
        "kernel.py.j2",
        pointer_params=wrap([f"{n}_ptr" for n in names], 4),
        pointer_args=wrap(names, 12),
        epilogue_tensors=epilogue_tensors,
        epilogue_pointer_params=wrap(epilogue_pointers, 4),
        epilogue_pointer_args=wrap(epilogue_pointers, 16),
        launch_params=", ".join(op_args + (["*"] + [t.name for t in tensors if t.output and not t.inplace]
                                           if returned else []) + ["config=None"]),
        tensor_names=names,
        tensor_names_quoted=", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else ""),
        a_index=names.index(k.gemm.a) if k.gemm else None,
        b_index=names.index(k.gemm.b) if k.gemm else None,
        values_inputs="{" + ", ".join(f'"{t.name}": {t.name}' for t in tensors if not t.output) + "}",
        mutated_src="(" + "".join(f'"{n}", ' for n in (o.name for o in k.outputs if o.inplace)).rstrip(" ") + ")",
        returned_kwargs=", ".join(f"{n}={n}" for n in returned),
        k=k,
        gemm=k.gemm,
        a=a,
        b=b,
        tensors=tensors,
        inputs=[t for t in tensors if not t.output],
        outputs=[t for t in tensors if t.output],
        allocated=[t for t in tensors if t.output and not t.inplace],
        scalars=scalars,
        op_args=op_args,
        op_params=[f"{n}: float" if n in scalars else f"{n}: torch.Tensor" for n in op_args],
        returned=returned,
        returns=returns,
        epilogue=emit_epilogue(k, types),
        has_k=k.gemm is not None,
        even_n=any(t.width is Width.HALF for t in types.values()),
        regenerate=regenerate,
        fingerprint=fingerprint(k),
        tune_at_launch=tunes_at_launch(k),
    )


def tunes_at_launch(k: Kernel) -> bool:
    """Whether the launcher may time candidate configs on the caller's own arguments (an untuned shape, once
    per process): each trial launch must overwrite every output (an inplace accumulation would be applied
    once per trial) and be repeatable from the tensors alone (host scalars are not among them)."""
    return not any(o.inplace for o in k.outputs) and not any(i.role is InputRole.HOST_SCALAR for i in k.inputs)


def wrap(items: list[str], indent: int, width: int = 116) -> list[str]:
    """Comma-separated items over as few lines as fit in `width` columns, each line ending in a comma."""
    lines, line = [], ""
    for item in items:
        piece = f"{item},"
        if line and indent + len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = piece
        else:
            line = f"{line} {piece}" if line else piece
    if line:
        lines.append(line)
    return lines
