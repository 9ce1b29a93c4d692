"""A checked kernel -> the source of its generated module: the @triton.jit kernel, the launcher and the
torch.library op. The template holds the fixed parts; this file computes what varies, in spec order."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

from .. import dims
from ..fingerprint import fingerprint
from ..model import BLayout, Dim, DType, Input, InputRole, Kernel, Kind, Output, ValueType, Width
from ..validate import in_place_inputs
from .epilogue import emit_epilogue, fit
from .templates import render

AXIS = {Dim.M: "m", Dim.K: "k", Dim.N: "n", Dim.N_HALF: "n", Dim.N_DOUBLE: "n", Dim.TILES_M: "t",
        Dim.TILES_N: "t", Dim.GROUPS_N: "n"}
TORCH_DTYPES = {DType.FLOAT32: "torch.float32", DType.FLOAT16: "torch.float16", DType.BFLOAT16: "torch.bfloat16"}
WIDTH = 120  # the longest line of a generated kernel module, its header aside


@dataclass(frozen=True)
class Tensor:
    """A tensor argument of the kernel, as the template needs it."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    strides: tuple[str, ...]  # kernel parameter names, one per dim
    output: bool
    inplace: bool
    in_place_of: tuple[str, ...]  # the inputs this output may be passed as, to update them in place
    alloc_shape: str  # Python source of the shape, for allocated outputs
    alloc_dtype: str

    @property
    def decl_src(self) -> str:
        """The runtime.Decl of this argument, as the launcher checks it."""
        return (f'runtime.Decl("{self.name}", {_strings(self.dims)}, "{self.dtype}"'
                + (", output=True" if self.output else "")
                + (f", in_place_of={_strings(self.in_place_of)}" if self.in_place_of else "") + ")")

    @property
    def stride_args(self) -> str:
        return ", ".join(f"{self.name}.stride({i})" for i in range(len(self.dims)))


def _strings(items: tuple[str, ...]) -> str:
    """A tuple of strings as Python source."""
    return "(" + ", ".join(f'"{i}"' for i in items) + ("," if len(items) == 1 else "") + ")"


def _size_expr(d: Dim, group: int | None) -> str:
    return dims.python(d.value, group)


def _tensor(decl: Input | Output, output: bool, group: int | None, in_place_of: tuple[str, ...] = ()) -> Tensor:
    shape = ", ".join(_size_expr(d, group) for d in decl.dims)
    dtype = "_t_dtype" if decl.dtype is DType.T else TORCH_DTYPES.get(decl.dtype, "")
    return Tensor(
        name=decl.name,
        dims=tuple(d.value for d in decl.dims),
        dtype=decl.dtype.value,
        strides=tuple(f"_stride_{decl.name}_{AXIS[d]}" for d in decl.dims),
        output=output,
        inplace=output and decl.inplace,
        in_place_of=in_place_of,
        alloc_shape=f"({shape},)" if len(decl.dims) == 1 else f"({shape})",
        alloc_dtype=dtype,
    )


def tensor_args(k: Kernel) -> list[Tensor]:
    """The kernel's tensor arguments in launch order: inputs (host scalars aside), then outputs."""
    in_place = in_place_inputs(k)
    return ([_tensor(i, False, k.column_group) for i in k.inputs if i.role is not InputRole.HOST_SCALAR]
            + [_tensor(o, True, k.column_group, in_place.get(o.name, ())) for o in k.outputs])


def render_kernel(k: Kernel, types: dict[str, ValueType], regenerate: str, hopper: bool = False) -> str:
    """The tl kernel's module; `hopper`: the Hopper backend lowers the kernel too, and the launcher runs that
    kernel when its config says so (backend "gluon")."""
    tensors = tensor_args(k)
    scalars = [i.name for i in k.inputs if i.role is InputRole.HOST_SCALAR]
    a = k.input(k.gemm.a) if k.gemm else None
    b = k.input(k.gemm.b) if k.gemm else None
    names = [t.name for t in tensors]
    epilogue_tensors = [t for t in tensors if not k.gemm or t.name not in (k.gemm.a, k.gemm.b)]
    epilogue_pointers = [f"_{t.name}_ptr" for t in epilogue_tensors]
    if k.gemm and any(s.op == "cast" and s.args["dtype"] == "T" for s in k.steps):
        epilogue_pointers.insert(0, f"_{k.gemm.a}_ptr")  # only its element type: what `cast` to T rounds to
    return render(
        "kernel.py.j2",
        pointer_params=wrap([f"_{n}_ptr" for n in names], 4),
        pointer_args=wrap(names, 12),
        epilogue_tensors=epilogue_tensors,
        epilogue_pointer_params=wrap(epilogue_pointers, 4),
        epilogue_pointer_args=wrap(epilogue_pointers, 16),
        k=k,
        gemm=k.gemm,
        a=a,
        b=b,
        tensors=tensors,
        inputs=[t for t in tensors if not t.output],
        allocated=[t for t in tensors if t.output and not t.inplace],
        scalars=scalars,
        host=_host_code(k, tensors, scalars),
        **({"a_ptrs": _sum("_a_ptrs", [f"_{a.name}_ptr", f"(_rows % M)[:, None] * _stride_{a.name}_m",
                                        f"_offs_k[None, :] * _stride_{a.name}_k"], 12),
            "b_ptrs": _sum("_b_ptrs", [f"_{b.name}_ptr", f"_offs_k[:, None] * _stride_{b.name}_k",
                                        f"(_cols % N)[None, :] * _stride_{b.name}_n"], 12)} if k.gemm else {}),
        hopper=hopper,
        epilogue=emit_epilogue(k, types),
        has_k=k.gemm is not None,
        even_n=any(t.width is Width.HALF for t in types.values()),
        regenerate=regenerate,
        fingerprint=fingerprint(k),
        tune_at_launch=tunes_at_launch(k),
        group_arg=f", group={k.column_group!r}" if k.column_group else "",  # "N": the whole row
        default_split=gpu_default_split(k),
        bind_group=f", group={k.column_group}" if isinstance(k.column_group, int) else "",
        column_group=repr(k.column_group),
    )


def _host_code(k: Kernel, tensors: list[Tensor], scalars: list[str]) -> dict[str, str]:
    """The statements of the launcher and the op whose length depends on the spec's names, each within WIDTH
    columns at its place in the template."""
    names = [t.name for t in tensors]
    op_args = [i.name for i in k.inputs] + [o.name for o in k.outputs if o.inplace]
    args = ", ".join(op_args)
    returned = [o.name for o in k.outputs if not o.inplace]
    allocated = [t for t in tensors if t.output and not t.inplace]
    kernel_k = "K" if k.gemm else "0"
    gemm = f", gemm=({names.index(k.gemm.a)}, {names.index(k.gemm.b)})" if k.gemm else ""
    launch_params = op_args + (["*", *returned] if returned else []) + ["config=None"]
    mutated = _strings(tuple(o.name for o in k.outputs if o.inplace))
    # outputs a caller may give, such as the input they may be written over: keyword-only, None allocates
    given = [t.name for t in tensors if t.output and not t.inplace and t.in_place_of]
    given_params = ["*", *(f"{g}=None" for g in given)] if given else []
    given_args = [f"{g}={g}" for g in given]
    code = {
        "module_doc": _doc(f"{k.name}: {k.doc}", 0),
        "module_about": "\n".join(textwrap.wrap(_about(k), WIDTH)),
        "launch_def": _fitted(f"def launch({', '.join(launch_params)}) -> None:", 0),
        "tensors": _fitted(f"_tensors = ({', '.join(names)}{',' if len(names) == 1 else ''})", 4),
        **({"a_desc": _fitted(_descriptor(k.gemm.a, "block_m", "block_k"), 4),
            "b_desc": _fitted(_descriptor(k.gemm.b, *(("block_n", "block_k") if k.gemm.b_layout is BLayout.NK
                                                      else ("block_k", "block_n"))), 4)} if k.gemm else {}),
        "plan_return": _fitted(f"return runtime.LaunchPlan.make(config, device, t_dtype, M, N, {kernel_k}, "
                               f"tensors, runtime.Aliasing(NAME, DECLS, tensors){gemm})", 4),
        "hopper_launch": _fitted("runtime.backends.launch_hopper(__package__, NAME, "
                                 + "".join(f"{n}={n}, " for n in [*(i.name for i in k.inputs), *returned])
                                 + "config=_plan.config)", 8),
        "allocate_def": _fitted(f"def _allocate({', '.join(op_args + given_params)}):", 0),
        "allocate_doc": _doc("Empty outputs of the right shapes (partial-reduction buffers depend on the tile shape)"
                             + (", but for those given." if given else "."), 4, close=True),
        "allocate_values": _fitted("_values = dict(" + ", ".join(f"{t.name}={t.name}" for t in tensors
                                                             if not t.output) + ")", 4),
        "empties": ("\n" + " " * 8).join(
            _fitted((f"{t.name} if {t.name} is not None else " if t.name in given else "")
                    + f"torch.empty({t.alloc_shape}, dtype={t.alloc_dtype}, device=_device),", 8) for t in allocated),
        "run_def": _fitted(f"def _run({', '.join(op_args + given_params)}):", 0),
        "run_launch": _fitted(f"launch({', '.join(op_args + [f'{n}={n}' for n in returned])})", 4),
        "run_return": _fitted(f"return _run({args})", 4),
        "op_decorator": _fitted(f"@runtime.kernel_op(NAME, FINGERPRINT, SPEC, __name__, mutates_args={mutated}, "
                                "fake=_fake)", 0),
        "op_def": _def(f"{k.name}_op", [f"{n}: float" if n in scalars else f"{n}: torch.Tensor" for n in op_args],
                       _returns(len(returned))),
        "op_doc": _doc(k.doc, 4, close=True),
        "fake_def": _fitted(f"def _fake({args}):", 0),
        "public_def": _def(k.name, op_args + given_params, _returns(len(returned)) if returned else None),
        "public_doc": _doc(k.doc, 4),
        "public_about": ("\n" + " " * 4).join(textwrap.wrap(
            f"Under torch.compile, or where autograd would record the call, this is the op "
            f"`torch.ops.codagen.{k.name}`, which has no backward; other eager calls skip the dispatcher, which "
            "costs about 0.2 ms a call, and run the kernel directly."
            + "".join(f" `{t.name}`: where to write that output (None: a new tensor): "
                      f"{' or '.join(f'`{i}`' for i in t.in_place_of)} itself, to write over it in place, or a "
                      "tensor of its shape that shares no memory with the other arguments; under torch.compile or "
                      "autograd, a new tensor all the same." for t in tensors if t.name in given),
            WIDTH - 4, break_on_hyphens=False)),
        "public_run_return": _fitted(f"return _run({', '.join(op_args + given_args)})", 4),
        "public_op_return": _fitted(f"return {k.name}_op({args})", 8),
        "public_through_op": _fitted("if torch.compiler.is_compiling() or runtime.wants_grad("
                                     f"{', '.join(n for n in op_args if n not in scalars)}):", 4),
    }
    if returned:
        targets = f"({returned[0]},)" if len(returned) == 1 else ", ".join(returned)
        code["run_allocate"] = _fitted(f"{targets} = _allocate({', '.join(op_args + given_args)})", 4)
        plain = f"return {', '.join(returned)}"
        code["run_result"] = plain if 4 + len(plain) <= WIDTH else _fitted(f"return ({', '.join(returned)})", 4)
        code["fake_return"] = _fitted(f"return _allocate({args}){'[0]' if len(returned) == 1 else ''}", 4)
    return code


def _sum(target: str, terms: list[str], indent: int) -> str:
    """`target = ` the sum of the terms, within WIDTH columns at `indent`: in parentheses, a term a line, when
    it does not fit on one."""
    one = f"{target} = {' + '.join(terms)}"
    if indent + len(one) <= WIDTH:
        return one
    inner = "\n" + " " * (indent + len(target) + 4) + "+ "
    return f"{target} = ({terms[0]}" + "".join(inner + t for t in terms[1:]) + ")"


def _about(k: Kernel) -> str:
    """What the kernel computes, for the module docstring."""
    if not k.gemm:
        return "An elementwise kernel over [M, N] tiles: the epilogue of the spec, with no GEMM."
    b = "[N, K]^T" if k.gemm.b_layout is BLayout.NK else "[K, N]"
    return (f"acc[M, N] = {k.gemm.a}[M, K] @ {k.gemm.b}{b} in fp32, then the epilogue of the spec, on each tile "
            "while it is in registers.")


def _descriptor(name: str, rows: str, cols: str) -> str:
    """The TMA descriptor of a GEMM operand, with its block shape from the launch's config."""
    return f"_{name}_desc = runtime.descriptor({name}, _plan.config.{rows}, _plan.config.{cols}) if _tma else None"


def _fitted(statement: str, indent: int) -> str:
    """`statement` at `indent`, broken at the commas of its calls into lines of at most WIDTH columns, as the
    template prints it after its own indentation (the first line carries none)."""
    return "\n".join(fit(" " * indent + statement, WIDTH))[indent:]


def _returns(n: int, col: int = 5) -> str:
    """The annotation of n returned tensors (None for none), continued under its first item when a tuple is
    too long for the line it starts on at `col` (after ') -> ')."""
    if n <= 1:
        return "torch.Tensor" if n else "None"
    inner = col + len("tuple[")
    return "tuple[" + ("\n" + " " * inner).join(wrap(["torch.Tensor"] * n, inner, WIDTH - 2))[:-1] + "]"


def _def(name: str, params: list[str], returns: str | None) -> str:
    """`def name(params) -> returns:` on one line when it fits, else the parameters on lines of their own."""
    arrow = f" -> {returns}" if returns else ""
    one = f"def {name}({', '.join(params)}){arrow}:"
    if len(one) <= WIDTH and "\n" not in one:
        return one
    return f"def {name}(\n" + "".join(f"    {line}\n" for line in wrap(params, 4, WIDTH)) + f"){arrow}:"


def _doc(text: str, indent: int, close: bool = False) -> str:
    """A docstring's first paragraph at `indent`, wrapped within WIDTH columns; with `close`, the whole
    docstring: on one line when it fits, else with the closing quotes on a line of their own."""
    if close and indent + len(text) + 6 <= WIDTH:
        return f'"""{text}"""'
    lines = textwrap.wrap('"""' + text, WIDTH - indent, break_long_words=False, break_on_hyphens=False)
    return ("\n" + " " * indent).join(lines + ['"""'] if close else lines)


def gpu_default_split(k: Kernel) -> int:
    """The epilogue split of the kernel's configuration on a GPU without a tuning table for it (the runtime's
    GPU_DEFAULT, 128x128 tiles over 8 warps): 4 where the epilogue loads a tile of pairs (2*N wide), which on
    the whole tile spills 1.8-2.0 KB per thread and on quarters none (swiglu_dgrad, swiglu_bias_dgrad,
    geglu_dgrad compiled for sm_90, benchmarks/results/sm90-spills.md); else the whole tile."""
    pairs = any(i.type is not None and i.type.kind is Kind.TILE and i.type.width is Width.DOUBLE for i in k.inputs)
    return 4 if k.gemm is not None and pairs else 1


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
