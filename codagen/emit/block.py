"""A checked block -> its generated module: a torch.autograd.Function whose forward and backward call the
generated kernels and finish steps, and the nn.Module that owns the parameters. blockcheck.py decided what
runs and how the backward is chunked; this module only prints it, a statement a line (the line breaker,
layout.py, fits the rendered module to its width)."""
from __future__ import annotations

from ..blockmodel import Accumulator, Arg, Call, CheckedBlock, RowChunks
from .templates import render


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _enclosed(head: str, items: list[str], tail: str) -> list[str]:
    """The statement `head` + items + `tail`."""
    return [head + ", ".join(items) + tail]


def _tuple(prefix: str, items: list[str], suffix: str, parens: bool = False) -> list[str]:
    """A statement with a tuple (`a, b = ...`, `x = (a,)`)."""
    text = ", ".join(items) + ("," if len(items) == 1 else "")
    return [prefix + (f"({text})" if parens else text) + suffix]


def _statement(keyword: str, items: list[str]) -> list[str]:
    """`return` or `del` of the items."""
    return [f"{keyword} {', '.join(items)}"]


def _docstring(paragraphs: list[str], indent: int) -> str:
    """A docstring at `indent`: one line for one paragraph, else the paragraphs and the closing quotes alone."""
    if len(paragraphs) == 1:
        return f'"""{paragraphs[0]}"""'
    return '"""' + f"\n\n{' ' * indent}".join(paragraphs) + f"\n{' ' * indent}" + '"""'


def _grad_factor(gf) -> str:
    """What the backward multiplies the gradients made in the forward by: the output's gradient, over the output
    gradient they were made for when the spec gives one (grad_scale)."""
    return "_factor" if gf.grad_scale else f"grad_{gf.output}"


def _value(a: Arg, rows: set[str] = frozenset()) -> str:
    """A name in scope (a value renamed to its row slice in a chunked backward), else a literal, or the function
    that matmul.accumulate names."""
    if isinstance(a.value, Accumulator):
        k = a.value
        inputs = ", ".join(f"{name}={'t' if role == 'total' else role}" for name, role in k.inputs)
        return f"lambda a, b, t: kernels.{k.kernel}.{k.kernel}({inputs}, {k.output}=t)"
    if not a.is_name:
        return repr(a.value)
    return f"{a.value}_rows" if a.value in rows else str(a.value)


def _calls(calls, chunks: RowChunks | None = None) -> list[str]:
    """Steps, inside a loop over `chunks` when given."""
    rows, by_gemm = (set(chunks.sliced), chunks.summed_by_gemm) if chunks else (set(), ())
    return [line for c in calls for line in _call(c, rows, by_gemm)]


def _call(c: Call, rows: set[str] = frozenset(), summed_by_gemm: tuple[str, ...] = ()) -> list[str]:
    """One step, its arguments by keyword."""
    args = [f"{a.param}={_value(a, rows)}" for a in c.args]
    args += [f"{out}={over}" for out, over in c.in_place]  # the output's memory: that value's
    if c.outs[0] in summed_by_gemm:  # a parameter's gradient over row chunks: the GEMM sums it
        return _enclosed(f"{c.outs[0]}_sum.add_matmul(", args, ")")
    fn = f"kernels.{c.op}.{c.op}" if c.kernel else f"finish.{c.op}"
    return _enclosed(f"{', '.join(c.outs)} = {fn}(", args, ")")


def render_block(cb: CheckedBlock, regenerate: str) -> str:
    b, chunks, gf = cb.block, cb.chunks, cb.grad_forward
    kernels = sorted({name for _, calls, _ in cb.passes() for c in calls for name in c.kernels})
    passes = "The forward and backward run" if cb.backward or gf else "The forward runs"
    grad_params = [f"grad_{o.name}" if o.grad else f"_grad_{o.name}" for o in b.outputs]
    inputs = [t.name for t in b.inputs]
    non_diff = [o.name for o in b.outputs if not o.grad and not o.alias]
    init_params = ["self", *(a.name if a.default is None else f"{a.name}={_default(a)}" for a in b.attrs),
                   "*", "device=None", "dtype=None"]
    return render(
        "block.py.j2",
        b=b,
        cls=class_name(b.name),
        module_doc=_docstring([f"{b.name}: {b.doc}", f"{passes} generated GEMM-epilogue kernels "
                               f"({', '.join(kernels)}) and finish steps (codagen.runtime.finish); plain GEMMs "
                               "go to cuBLAS through torch.matmul."], 0),
        class_doc=_docstring([b.doc], 4),
        forward_def=_enclosed("def forward(", ["ctx", *inputs, *(p.name for p in b.params),
                                               *(a.name for a in b.attrs)], "):"),
        forward=_calls(cb.forward),
        # each choice attr against its spec's choices, where a call enters: the Function's forward, and, in a block
        # that makes its gradients in the forward, the function's forward alone, which does not go through it
        choice_checks=[f"runtime.check_choice(NAME, {a.name!r}, {a.name}, {a.choices!r}, SPEC)" for a in b.attrs
                       if a.kind == "choice"],
        save=_enclosed("ctx.save_for_backward(", list(cb.saved), ")") if cb.saved else [],
        attrs=_tuple("ctx.attrs = ", [a.name for a in b.attrs], "", parens=True) if b.attrs else [],
        unpack_attrs=_tuple("", [a.name for a in b.attrs], " = ctx.attrs") if b.attrs else [],
        non_diff=_enclosed("ctx.mark_non_differentiable(", non_diff, ")") if non_diff else [],
        outputs=_statement("return", [f"{o.alias}.view_as({o.alias})" if o.alias else o.name for o in b.outputs]),
        backward_def=_enclosed("def backward(", ["ctx", *grad_params], "):"),
        unpack_saved=_tuple("", list(cb.saved), " = ctx.saved_tensors") if cb.saved else [],
        chunks=chunks,
        rows=_value(chunks.rows) if chunks else None,
        sums=_value(chunks.sums) if chunks else None,
        backward=_calls(cb.backward, chunks),
        drop=_statement("del", list(chunks.dropped)) if chunks else [],
        # a forward-only block whose outputs are all non-differentiable: autograd never calls its backward, which
        # returns no gradients rather than raising, so that torch.compile traces the block into its graph
        no_grads=_statement("return", ["None"] * (len(inputs) + len(b.params) + len(b.attrs)))
        if len(non_diff) == len(b.outputs) else [],
        returns=_statement("return", [(f"finish.scale_(x={g}, factor={_grad_factor(gf)})" if gf else g) if g else "None"
                                      for g in cb.grads] + ["None"] * len(b.attrs)),
        gf=gf,
        gf_doc=_docstring([f"{b.name} when a gradient is wanted: the forward also makes the gradients. {b.name}() "
                           "(below) runs it then, and the forward alone otherwise."], 4) if gf else "",
        gf_before=_calls(gf.before) if gf else [],
        gf_chunk=_calls(gf.chunk, gf.chunks) if gf else [],
        gf_after=_calls(gf.after) if gf else [],
        gf_drop=_statement("del", list(gf.chunks.dropped)) if gf else [],
        gf_rows=_value(gf.chunks.rows) if gf else None,
        gf_sums=_value(gf.chunks.sums) if gf else None,
        function=_enclosed(f"def {b.name}(", [*inputs, *(p.name for p in b.params),
                                              *(a.name if a.default is None else f"{a.name}={_default(a)}"
                                                for a in b.attrs)], "):"),
        function_doc=_docstring([f"{b.name}'s forward: {class_name(b.name)}Function, which also makes the "
                                 "gradients, when one is wanted; else the forward alone."], 4),
        wants_grad=_tuple("if torch.is_grad_enabled() and any(t.requires_grad for t in ",
                          [t.name for t in (*b.inputs, *b.params) if t.grad], "):", parens=True),
        apply_all=_enclosed(f"return {class_name(b.name)}Function.apply(", [*inputs, *(p.name for p in b.params),
                                                                           *(a.name for a in b.attrs)], ")"),
        init_def=_enclosed("def __init__(", init_params, "):"),
        param_shapes={p.name: _shape(p.dims) for p in b.params},
        # a parameter of a declared dtype has it whatever the module's dtype (an FP8 block's bfloat16 weights)
        param_dtypes={p.name: "dtype" if p.dtype == "T" else f"torch.{p.dtype}" for p in b.params},
        module_forward_def=_enclosed("def forward(", ["self", *inputs], "):"),
        apply_args=[", ".join(names) + "," for names in (inputs, [f"self.{p.name}" for p in b.params],
                                                         [f"self.{a.name}" for a in b.attrs]) if names],
        regenerate=regenerate,
    )


def _shape(dims) -> str:
    """A parameter's shape as a Python tuple of attr expressions."""
    return "(" + ", ".join(d.expr(" * ", " // ") for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _default(a) -> str:
    return f'"{a.default}"' if a.kind == "choice" else repr(a.default)
