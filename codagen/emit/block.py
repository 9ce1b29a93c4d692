"""A checked block -> its generated module: a torch.autograd.Function whose forward and backward call the
generated kernels and finish steps, and the nn.Module that owns the parameters."""
from __future__ import annotations

from ..blockcheck import Call, CheckedBlock
from ..blockspec import TOKENS
from .templates import render

_FINISH = {"rstd": "finish.rstd", "sum_tiles": "finish.sum_tiles", "logsumexp_tiles": "finish.logsumexp_tiles",
           "cross_entropy": "finish.cross_entropy", "matmul": "finish.matmul"}


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _arg_src(a, names: set[str], rename: dict[str, str]) -> str:
    """A value or attr by name (values renamed to their row slices in a chunked backward), else a literal."""
    if isinstance(a, str) and a in names:
        return rename.get(a, a)
    return repr(a)


def _call_lines(c: Call, names: set[str], rename: dict[str, str],
                summed_by_gemm: set[str] = frozenset()) -> list[str]:
    args = ", ".join(_arg_src(a, names, rename) for a in c.args)
    if c.outs[0] in summed_by_gemm:  # a parameter's gradient over row chunks: the GEMM sums it
        return [f"# {c.loc.file}:{c.loc.line}  {c.op}", f"{c.outs[0]}_sum.add_matmul({args})"]
    fn = f"kernels.{c.op}.{c.op}" if c.kernel else _FINISH[c.op]
    return [f"# {c.loc.file}:{c.loc.line}  {c.op}", f"{', '.join(c.outs)} = {fn}({args})"]


def render_block(cb: CheckedBlock, regenerate: str) -> str:
    b = cb.block
    names = {a.name for a in b.attrs} | set(cb.values)
    forward = [line for c in cb.forward for line in _call_lines(c, names, {})]
    saved = [name for name, _ in b.save] + [p.name for p in b.params]
    outputs = [f"{o.alias}.view_as({o.alias})" if o.alias else o.name for o in b.outputs]
    non_diff = [o.name for o in b.outputs if not o.grad and not o.alias]
    grad_params = [f"grad_{o.name}" if o.grad else f"_grad_{o.name}" for o in b.outputs]
    returns = [g or "None" for g in cb.grads] + ["None"] * len(b.attrs)
    chunked = b.backward_row_chunks is not None
    sliced, row_grads, summed_grads, rename = [], [], [], {}
    if chunked:
        # in a chunked backward, values with a token dimension are sliced by rows; the gradients with one
        # are concatenated, the others (parameters') summed
        sliced = [n for n in (*saved, *grad_params) if n in cb.values and cb.values[n].dims[:1] == (TOKENS,)]
        rename = {n: f"{n}_rows" for n in sliced}
        for g in filter(None, cb.grads):
            (row_grads if cb.values[g].dims[:1] == (TOKENS,) else summed_grads).append(g)
    # a summed gradient that a plain GEMM makes and no step reads is accumulated by that GEMM (ChunkSum)
    read = {a for c in cb.backward for a in c.args if isinstance(a, str)}
    summed_by_gemm = {c.outs[0] for c in cb.backward
                      if c.op == "matmul" and c.outs[0] in summed_grads and c.outs[0] not in read}
    backward = [line for c in cb.backward for line in _call_lines(c, names, rename, summed_by_gemm)]
    # a chunk's values are dropped before the next chunk makes its own, so that two never coexist
    chunk_values = list(dict.fromkeys(o for c in cb.backward for o in c.outs if o not in summed_by_gemm))
    first_row_value = sliced[0] if sliced else None
    return render(
        "block.py.j2",
        b=b,
        cls=class_name(b.name),
        kernels=sorted({c.op for c in (*cb.forward, *cb.backward) if c.kernel}),
        inputs=[t.name for t in b.inputs],
        params=b.params,
        param_shapes={p.name: "(" + ", ".join(d.expr(" * ", " // ") for d in p.dims) + ("," if len(p.dims) == 1 else "") + ")"
                      for p in b.params},
        attrs=b.attrs,
        attr_names=[a.name for a in b.attrs],
        forward=forward,
        saved=saved,
        outputs=outputs,
        non_diff=non_diff,
        grad_params=grad_params,
        backward=backward,
        returns=returns,
        chunk=_arg_src(b.backward_row_chunks, names, {}) if chunked else None,
        sliced=sliced,
        first_row_value=first_row_value,
        row_grads=row_grads,
        summed_grads=summed_grads,
        added_grads=[g for g in summed_grads if g not in summed_by_gemm],
        chunk_values=chunk_values if chunked else [],
        regenerate=regenerate,
        apply_args=[line for line in (
            ", ".join(t.name for t in b.inputs) + ",",
            "".join(f"self.{p.name}, " for p in b.params).rstrip(),
            "".join(f"self.{a.name}, " for a in b.attrs).rstrip(),
        ) if line],
        signature=", ".join([t.name for t in b.inputs] + [p.name for p in b.params] + [a.name for a in b.attrs]),
    )
