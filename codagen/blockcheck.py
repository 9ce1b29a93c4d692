"""Rules of block specs: each kernel call matches the kernel's arguments and shapes, values exist before
they are used and are used, saved values are used by the backward, and the backward (or the forward with
gradients) defines the gradient of every differentiable input and parameter. Produces the checked block
(blockmodel.CheckedBlock): the resolved calls, and for steps in row chunks what is sliced, concatenated,
summed and dropped."""
from __future__ import annotations

from fractions import Fraction

from . import dims
from .blockmodel import (IN_PLACE, TOKENS, Accumulator, Arg, Block, BlockDim, BlockStep, Call, CheckedBlock,
                         GradForward, Partial, RowChunks, SUMS, Value)
from .errors import ErrorSink
from .finish_steps import FINISH_STEPS, FinishStep, combining
from .finish_steps.base import fmt as _fmt
from .model import BLayout, Dim, DType, InputRole, Kernel, Location
from .names import MODULE_ATTRIBUTES
from .validate import in_place_inputs

DISCARD = "_"
RESERVED = frozenset({"kernels", "finish", "runtime", "nn", "torch", "ctx", "self", "function", "rows"})
# what the generated backward makes of a value name v in row chunks: v_rows (its slice), v_chunks (the pieces
# of a gradient), v_sum (a summed gradient); value names of these forms are refused
DERIVED_SUFFIXES = ("_rows", "_chunks", "_sum")
# what a kernel's type T may be in a call besides the block's T: the 16-bit types a block declares (an FP8 block's
# bfloat16 activations); every T argument of one call has the same, which the call's T outputs then have
T_DTYPES = ("T", DType.BFLOAT16.value, DType.FLOAT16.value)


def _scope(attrs: dict, sink):
    """The values of one pass (name -> Value), where each was defined, and `define`, which reports a name that
    is reserved, an attr or already defined (values are assigned once)."""
    env: dict[str, Value] = {}
    defined_at: dict[str, Location] = {}

    def define(name: str, value: Value, loc: Location) -> None:
        if name == DISCARD:
            return
        if name in RESERVED or name in attrs or name.endswith(DERIVED_SUFFIXES):
            sink.add(loc, f"'{name}' is reserved or an attr; choose another value name")
        elif name in env:
            sink.add(loc, f"'{name}' is already defined (line {defined_at[name].line}); values are assigned once")
        else:
            env[name] = value
            defined_at[name] = loc
    return env, defined_at, define


def check_block(b: Block, kernels: dict[str, Kernel]) -> CheckedBlock:
    sink = ErrorSink()
    attrs = {a.name: a for a in b.attrs}
    env, defined_at, define = _scope(attrs, sink)
    used: set[str] = set()

    for a in (*b.attrs, *b.params):
        if a.name in MODULE_ATTRIBUTES:
            sink.add(a.loc, f"'{a.name}' is an attribute of the generated nn.Module (self.{a.name}), which this "
                            "attr or parameter would replace; choose another name")
    for t in (*b.params, *b.inputs):
        for d in t.dims:
            if d.symbol not in (None, "M") and (d.symbol not in attrs or attrs[d.symbol].kind != "int"):
                sink.add(t.loc, f"'{t.name}': dimension '{d}' names no int attr; declare it under attrs")
        if t.alias is not None:
            sink.add(t.loc, f"'{t.name}': only outputs may be an alias of an input")
        define(t.name, Value(t.dims, t.dtype), t.loc)
    for p in b.params:
        if TOKENS in p.dims:
            sink.add(p.loc, f"parameter '{p.name}' cannot have the token dimension M")
        used.add(p.name)  # a parameter unused by the forward is caught by its missing gradient use
    forward = tuple(c for c in (_resolve(s, b, kernels, env, define, used, sink) for s in b.forward) if c)
    for o in b.outputs:
        if o.alias:
            src = next((i for i in b.inputs if i.name == o.alias), None)
            if src is None:
                sink.add(o.loc, f"output '{o.name}' is an alias of '{o.alias}', which is not an input")
            elif src.dims != o.dims:
                sink.add(o.loc, f"output '{o.name}' has shape {_fmt(o.dims)} but its alias '{o.alias}' has "
                                f"{_fmt(src.dims)}")
            else:
                used.add(o.alias)
            continue
        v = env.get(o.name)
        if v is None:
            sink.add(o.loc, f"output '{o.name}' is not defined by any forward step")
            continue
        used.add(o.name)
        if v.dims != o.dims or v.dtype != o.dtype:
            sink.add(o.loc, f"output '{o.name}' is declared {_fmt(o.dims)} {o.dtype} but the forward makes "
                            f"{_fmt(v.dims)} {v.dtype}")
    _check_in_place(forward, {o.name for o in b.outputs} | {name for name, _ in b.save}, sink)
    if b.grad_forward is not None:  # inputs that only the forward with gradients reads are used
        g = b.grad_forward
        used |= {v for s in (*g.before, *g.chunk, *g.after) for v in s.args.values() if isinstance(v, str)}
    for name, loc in defined_at.items():
        if name not in used and name not in dict(b.save):
            sink.add(loc, f"'{name}' is never used; remove it, save it, or map a kernel output to '_'")

    # backward: parameters, saved values and the gradients of differentiable outputs
    forward_env = dict(env)
    env.clear()
    defined_at.clear()
    used_back: set[str] = set()
    for p in b.params:
        if p.name in forward_env:  # else refused in the forward, reported there
            define(p.name, forward_env[p.name], p.loc)
    saved_locs = {}
    for name, loc in b.save:
        if name in saved_locs:
            sink.add(loc, f"'{name}' is saved twice")
        elif name not in forward_env:
            sink.add(loc, f"save: '{name}' is not a forward value")
        elif name not in env:
            saved_locs[name] = loc
            define(name, forward_env[name], loc)
    differentiable_outputs = [o for o in b.outputs if o.grad]
    for o in differentiable_outputs:
        define(f"grad_{o.name}", Value(o.dims, o.dtype), o.loc)
    backward = tuple(c for c in (_resolve(s, b, kernels, env, define, used_back, sink) for s in b.backward) if c)
    grads = []
    wanted = [t for t in (*b.inputs, *b.params) if t.grad] if b.backward or differentiable_outputs else []
    if differentiable_outputs and not b.backward and b.grad_forward is None:
        sink.add(b.loc, "the block has differentiable outputs but no backward; add one (or forward_with_grads) "
                        "or mark them 'grad: false'")
    for t in (*b.inputs, *b.params):
        if t not in wanted:
            grads.append("")
            continue
        g = f"grad_{t.name}"
        v = env.get(g)
        if v is None:
            if b.backward:
                sink.add(t.loc, f"the backward never defines '{g}', the gradient of '{t.name}'; define it or "
                                "declare the input with 'grad: false'")
        elif v.dims != t.dims:
            sink.add(defined_at[g], f"'{g}' has shape {_fmt(v.dims)} but '{t.name}' has {_fmt(t.dims)}")
        used_back.add(g)
        grads.append(g)
    _check_in_place(backward, {g for g in grads if g}, sink)
    for name, loc in saved_locs.items():
        if name not in used_back:
            sink.add(loc, f"saved value '{name}' is never used by the backward; do not save it")
    for name, loc in defined_at.items():
        if name not in used_back and name not in saved_locs and name not in {p.name for p in b.params} \
                and not name.startswith("grad_"):
            sink.add(loc, f"'{name}' is never used; remove it or map a kernel output to '_'")
    values = {**forward_env, **env}
    saved = tuple(name for name, _ in b.save) + tuple(p.name for p in b.params)
    chunks = grad_forward = None
    if b.backward_row_chunks is not None:
        chunks = _chunked_backward(b, backward, values, saved, grads, attrs, sink)
    if b.grad_forward is not None:
        grad_forward, grads, grad_values = _grad_forward(b, kernels, attrs, sink)
        values.update(grad_values)
        saved = tuple(g for g in grads if g) + ((grad_forward.grad_scale,) if grad_forward and
                                                 grad_forward.grad_scale else ())
    _check_accumulate(forward, None, sink)
    _check_accumulate(backward, chunks, sink)
    if grad_forward is not None:
        _check_accumulate(grad_forward.before + grad_forward.after, None, sink)
        _check_accumulate(grad_forward.chunk, grad_forward.chunks, sink)
    sink.raise_if_any()
    return CheckedBlock(b, forward, backward, values, saved, tuple(grads), chunks, grad_forward)


def _chunked_backward(b: Block, backward: tuple[Call, ...], values: dict, saved: tuple[str, ...],
                      grads: list[str], attrs: dict, sink) -> RowChunks | None:
    """The backward over row chunks: values with the token dimension are sliced by rows, gradients with it
    concatenated, the others summed; a chunk's values are dropped before the next chunk makes its own."""
    rows = b.backward_row_chunks
    if not b.backward:
        sink.add(b.loc, "backward_row_chunks is given but the block has no backward; remove it")
        return None
    if isinstance(rows, str) and (rows not in attrs or attrs[rows].kind != "int"):
        sink.add(b.loc, f"backward_row_chunks '{rows}' names no int attr")
        return None
    upstream = [f"grad_{o.name}" for o in b.outputs if o.grad]
    sliced = tuple(n for n in (*saved, *upstream) if n in values and values[n].dims[:1] == (TOKENS,))
    if not sliced:
        sink.add(b.loc, "backward_row_chunks needs a saved value or an output gradient with the token dimension "
                        "M to cut into chunks; remove backward_row_chunks or save such a value")
        return None
    made = [g for g in grads if g in values]  # a missing gradient is reported already
    concatenated = tuple(g for g in made if values[g].dims[:1] == (TOKENS,))
    summed = tuple(g for g in made if g not in concatenated)
    return _row_chunks(rows, backward, sliced, concatenated, summed, Arg("sums", "float32", False))


def _row_chunks(rows, calls: tuple[Call, ...], sliced, concatenated, summed, sums: Arg) -> RowChunks:
    # a summed gradient that a plain GEMM makes and no step reads is accumulated by that GEMM (ChunkSum)
    read = {a.value for c in calls for a in c.args if a.is_name}
    summed_by_gemm = tuple(c.outs[0] for c in calls
                           if c.op == "matmul" and c.outs[0] in summed and c.outs[0] not in read)
    dropped = tuple(dict.fromkeys(o for c in calls for o in c.outs if o not in summed_by_gemm and o != DISCARD))
    return RowChunks(Arg("rows", rows, isinstance(rows, str)), tuple(sliced), tuple(concatenated), tuple(summed),
                     summed_by_gemm, dropped, sums)


def _check_accumulate(calls: tuple[Call, ...], chunks: RowChunks | None, sink) -> None:
    """matmul.accumulate applies where the GEMM sums a gradient over row chunks in the operands' type."""
    for c in calls:
        if not any(a.param == "accumulate" for a in c.args):
            continue
        if chunks is None or c.outs[0] not in chunks.summed_by_gemm:
            sink.add(c.loc, f"matmul.accumulate: only a parameter's gradient that its GEMM sums over row chunks (made "
                            f"on each chunk and read by no step) is accumulated, and '{c.outs[0]}' is not one; remove "
                            "accumulate")
        elif not chunks.sums.is_name and chunks.sums.value == "float32":
            sink.add(c.loc, "matmul.accumulate: the gradients are summed in float32 here, and the kernel adds to a "
                            "total of its inputs' type; sum them in 'same' (or an attr choosing), or remove "
                            "accumulate")


def _grad_forward(b: Block, kernels: dict[str, Kernel], attrs: dict, sink) -> tuple[GradForward | None, list, dict]:
    """forward_with_grads: the forward to run when a gradient is wanted, which makes the gradients of the one
    differentiable output, a scalar, for an output gradient of 1; the backward only scales them, which is exact
    since every gradient is linear in the output's gradient. `before` and `after` run on all rows, `chunk` on
    each chunk of rows: values with the token dimension from before the loop are sliced, what the loop makes
    with it for `after` (or as a gradient) is concatenated, parameters' gradients are summed."""
    g = b.grad_forward
    if b.backward or b.save or b.backward_row_chunks is not None:
        sink.add(g.loc, "forward_with_grads makes the gradients in the forward: the block has no backward, save or "
                        "backward_row_chunks besides")
    differentiable = [o for o in b.outputs if o.grad and not o.alias]
    if len(differentiable) != 1 or differentiable[0].dims != ():
        sink.add(g.loc, "forward_with_grads needs exactly one differentiable output, a scalar (a loss), whose "
                        f"gradient scales the gradients made in the forward; got {len(differentiable)}")
        return None, [], {}
    if isinstance(g.rows, str) and (g.rows not in attrs or attrs[g.rows].kind != "int"):
        sink.add(g.loc, f"forward_with_grads.row_chunks '{g.rows}' names no int attr")
    sums = _sums(g.sums, attrs, g.loc, sink)
    env, defined_at, define = _scope(attrs, sink)
    used: set[str] = set()
    for t in (*b.inputs, *b.params):
        env[t.name] = Value(t.dims, t.dtype)
    resolve = lambda steps: tuple(c for c in (_resolve(s, b, kernels, env, define, used, sink)  # noqa: E731
                                              for s in steps) if c)
    before = resolve(g.before)
    if g.grad_scale is not None:
        v = env.get(g.grad_scale)
        if g.grad_scale not in defined_at or v is None:
            sink.add(g.loc, f"forward_with_grads.grad_scale: '{g.grad_scale}' is not made by forward_with_grads.before")
        elif v.dims != () or v.dtype != "float32":
            sink.add(defined_at[g.grad_scale], f"forward_with_grads.grad_scale '{g.grad_scale}' must be a [] float32 "
                                               f"value (the output gradient the gradients are made for), got "
                                               f"{_fmt(v.dims)} {v.dtype}")
        used.add(g.grad_scale)
    outer = dict(env)
    chunk = resolve(g.chunk)
    made = [n for n in env if n not in outer]
    read_after: set[str] = set()
    after = tuple(c for c in (_resolve(s, b, kernels, env, define, read_after, sink) for s in g.after) if c)
    used |= read_after
    wanted = [t for t in (*b.inputs, *b.params) if t.grad]
    grads = []
    for t in (*b.inputs, *b.params):
        name = f"grad_{t.name}"
        if t not in wanted:
            grads.append("")
        elif name not in env:
            sink.add(t.loc, f"forward_with_grads never defines '{name}', the gradient of '{t.name}'; define it or "
                            "declare the input with 'grad: false'")
            grads.append("")
        elif env[name].dims != t.dims:
            sink.add(defined_at[name], f"'{name}' has shape {_fmt(env[name].dims)} but '{t.name}' has {_fmt(t.dims)}")
            grads.append("")
        else:
            used.add(name)
            grads.append(name)
    _check_in_place(before + chunk + after, {o.name for o in b.outputs} | {n for n in grads if n}, sink)
    out = differentiable[0].name
    for o in b.outputs:
        if o.alias:
            continue
        v = env.get(o.name)
        if v is None:
            sink.add(o.loc, f"output '{o.name}' is not defined by forward_with_grads")
        elif v.dims != o.dims or v.dtype != o.dtype:
            sink.add(o.loc, f"output '{o.name}' is declared {_fmt(o.dims)} {o.dtype} but forward_with_grads makes "
                            f"{_fmt(v.dims)} {v.dtype}")
        used.add(o.name)
    for name, loc in defined_at.items():
        if name not in used:
            sink.add(loc, f"'{name}' is never used; remove it or map a kernel output to '_'")
    rows_of = lambda n: env[n].dims[:1] == (TOKENS,)  # noqa: E731
    later = read_after | {n for n in grads if n} | {o.name for o in b.outputs}
    summed = [n for n in made if n in grads and not rows_of(n)]
    for n in made:
        if n in read_after and not rows_of(n) and n not in summed:
            sink.add(defined_at[n], f"'{n}' is made on each chunk of rows without the token dimension M, so it "
                                    "cannot be used after the chunks; only gradients of parameters are summed")
    read_in_chunk = {a.value for c in chunk for a in c.args if a.is_name}
    sliced = [n for n in outer if n in read_in_chunk and rows_of(n)]
    concatenated = [n for n in made if n in later and rows_of(n)]
    if not sliced:
        sink.add(g.loc, "forward_with_grads.chunk reads no value with the token dimension M to cut into chunks")
    chunks = _row_chunks(g.rows, chunk, sliced, concatenated, summed, sums)
    return GradForward(before, chunk, after, chunks, out, g.grad_scale), grads, env


def _sums(ref, attrs: dict, loc, sink) -> Arg:
    """forward_with_grads.sums: what parameters' gradients are summed over chunks in."""
    if ref is None or ref in SUMS:
        return Arg("sums", ref or "float32", False)
    a = attrs.get(ref)
    if a is None or a.kind != "choice" or not set(a.choices) <= set(SUMS):
        sink.add(loc, f"forward_with_grads.sums must be 'float32', 'same' or an attr choosing between them, "
                      f"got '{ref}'")
    return Arg("sums", ref, True)


def _resolve(step: BlockStep, b: Block, kernels: dict[str, Kernel], env, define, used, sink) -> Call | None:
    if step.op in FINISH_STEPS:
        return _finish(step, b, kernels, env, define, used, sink, shadowed=step.op in kernels)
    kernel = kernels.get(step.op)
    if kernel is None:
        known = ", ".join(sorted(kernels)) or "none"
        sink.add(step.loc, f"unknown kernel or finish step '{step.op}'; kernels: {known}; finish steps: "
                           f"{', '.join(FINISH_STEPS)}")
        return None
    if any(o.inplace for o in kernel.outputs):
        sink.add(step.loc, f"kernel '{kernel.name}' updates an output in place; blocks call only kernels that "
                           "allocate their outputs")
        return None
    expected = [i.name for i in kernel.inputs] + [o.name for o in kernel.outputs]
    loc_of = lambda k: step.arg_locs.get(k, step.loc)  # noqa: E731
    for key in step.args:
        if key not in expected:
            sink.add(step.arg_locs.get(key, step.loc), f"kernel '{kernel.name}' has no argument '{key}'; "
                                                       f"expected: {', '.join(expected)}")
    missing = [k for k in expected if k not in step.args]
    if missing:
        sink.add(step.loc, f"kernel '{kernel.name}' call is missing {', '.join(missing)}")
        return None
    sizes: dict[str, BlockDim] = {}
    ok = True
    args = []
    t_dtype = None  # what T is in this call: the dtype of its first T argument
    counts = []  # blocks(N) arguments, checked once N is bound
    for i in kernel.inputs:
        ref = step.args[i.name]
        if i.role is InputRole.HOST_SCALAR:
            ok &= _number(ref, b, loc_of(i.name), f"{kernel.name}.{i.name}", sink, ("float", "int"))
            args.append(Arg(i.name, ref, isinstance(ref, str)))
            continue
        v = env.get(ref) if isinstance(ref, str) else None
        if v is None:
            sink.add(loc_of(i.name), f"{kernel.name}.{i.name}: '{ref}' is not defined before this step")
            ok = False
            continue
        used.add(ref)
        args.append(Arg(i.name, ref, True))
        if i.dtype is DType.T and t_dtype is None and v.dtype in T_DTYPES:
            t_dtype = v.dtype
        want = t_dtype if i.dtype is DType.T else i.dtype.value
        if want != v.dtype:
            sink.add(loc_of(i.name), f"{kernel.name}.{i.name} takes dtype {want or 'T'}"
                                     + (" (T, the dtype of the call's other T arguments)" if want != "T" and
                                        i.dtype is DType.T else "") + f", but '{ref}' is {v.dtype}")
            ok = False
        if len(v.dims) != len(i.dims):
            sink.add(loc_of(i.name), f"{kernel.name}.{i.name} is [{', '.join(d.value for d in i.dims)}], "
                                     f"but '{ref}' is {_fmt(v.dims)}")
            ok = False
            continue
        for kd, bd in zip(i.dims, v.dims):
            what = f"{kernel.name}.{i.name}"
            if kd is Dim.BLOCKS_N:
                counts.append((bd, loc_of(i.name), what, ref))
            else:
                ok &= _bind(kd, bd, sizes, loc_of(i.name), what, ref, sink, kernel.column_group, kernel.k_group)
    for bd, loc, what, ref in counts:
        ok &= _count(bd, sizes, loc, what, ref, sink, kernel.k_group)
    if not ok:
        return None
    outs = []
    for o in kernel.outputs:
        name = step.args[o.name]
        if not isinstance(name, str):
            sink.add(loc_of(o.name), f"{kernel.name}.{o.name} is an output: give it a new value name")
            return None
        out_dims = tuple(_tiles(d, sizes) or _unbind(d, sizes, kernel.column_group) for d in o.dims)
        reduction = next((s.args["op"] for s in kernel.steps if s.op == "reduce" and s.target == o.name), None)
        if reduction is not None:  # partials: typed with their reduction, which only some finish steps combine
            define(name, Partial(reduction, out_dims, f"kernel '{kernel.name}', output '{o.name}'"), loc_of(o.name))
        else:
            define(name, Value(out_dims, (t_dtype or "T") if o.dtype is DType.T else o.dtype.value), loc_of(o.name))
        outs.append(name)
    return Call(kernel.name, True, tuple(args), tuple(outs), step.loc, _in_place(step, kernel, sink))


def _in_place(step: BlockStep, kernel: Kernel, sink) -> tuple[tuple[str, str], ...]:
    """The call's `in_place` pairs (output, value): each value is passed as an input the kernel lets that output
    overwrite (validate.in_place_inputs: every element is read before the program that reads it writes it)."""
    allowed = in_place_inputs(kernel)
    loc = step.arg_locs.get(IN_PLACE, step.loc)
    pairs = []
    for out, over in step.in_place.items():
        if out not in {o.name for o in kernel.outputs}:
            sink.add(loc, f"{kernel.name}.{IN_PLACE}: '{out}' is not an output of kernel '{kernel.name}'")
            continue
        may = allowed.get(out, ())
        if not any(step.args.get(i) == over for i in may):
            inputs = " or ".join(f"'{i}'" for i in may)
            sink.add(loc, f"{kernel.name}.{IN_PLACE}.{out}: '{over}' is not what this call passes as "
                          + (f"{inputs}, the input {out} may be written over" if may else
                             f"an input that {out} may be written over (the kernel lets it overwrite none)"))
            continue
        pairs.append((out, over))
    return tuple(pairs)


def _check_in_place(calls: tuple[Call, ...], read_later: set[str], sink) -> None:
    """A value that a call writes an output over must be made by an earlier call of the same steps (not a
    block input, a parameter or a row slice of one), and be read by no later call nor after these steps
    (saved, output, concatenated): from that call on, its memory holds the output."""
    made: set[str] = set()
    for i, c in enumerate(calls):
        for out, over in c.in_place:
            what = f"{c.op}.{IN_PLACE}.{out}"
            if over not in made:
                sink.add(c.loc, f"{what}: '{over}' is not made by an earlier step of these steps; only a value "
                                "the block makes (not an input, a parameter or a row slice) may be written over")
            reader = next((d for d in calls[i + 1:] if any(a.is_name and a.value == over for a in d.args)), None)
            if reader is not None:
                sink.add(c.loc, f"{what}: '{over}' is read again at line {reader.loc.line}, after this call "
                                "writes over it")
            elif over in read_later:
                sink.add(c.loc, f"{what}: '{over}' is used after these steps (saved, an output or a result), but "
                                "this call writes over it")
        made.update(c.outs)


def _tiles(d: Dim, sizes: dict) -> BlockDim | None:
    """A count of tiles along M or N, named after the size it divides ([M, tiles(vocab)])."""
    if not dims.is_tiles(d.value):
        return None
    size = sizes.get(dims.base(d.value))
    return BlockDim(Fraction(1), d.value if size is None else f"tiles({size})")


def _bind(kd: Dim, bd: BlockDim, sizes: dict, loc, what: str, ref: str, sink, group: int | None,
          k_group: int | None) -> bool:
    if bd.rounded_up:
        sink.add(loc, f"{what}: '{ref}' has the dimension {bd}, a count of blocks rounded up, where the kernel has "
                      f"{kd.value}; only its blocks(N) is one")
        return False
    key, value = dims.base(kd.value), bd.scaled(1 / dims.scale(kd.value, group, k_group))
    if key not in sizes:
        sizes[key] = value
        return True
    if sizes[key] != value:
        sink.add(loc, f"{what}: '{ref}' makes {kd.value} = {bd}, but the earlier arguments make {key} = {sizes[key]}")
        return False
    return True


def _count(bd: BlockDim, sizes: dict, loc, what: str, ref: str, sink, k_group: int) -> bool:
    """A blocks(N) argument (dims.BLOCKS_N: N over the K group, rounded up) against the N the call binds."""
    n = sizes.get(dims.N)
    if n is None:
        sink.add(loc, f"{what}: '{ref}' counts blocks of N, and no argument of the call gives N")
        return False
    want = BlockDim(n.coef / dims.rounded_up_by(dims.BLOCKS_N, k_group), n.symbol, rounded_up=True)
    if bd != want:
        sink.add(loc, f"{what}: '{ref}' has {bd} blocks of N, but the call's N = {n} has {want} (blocks({n}) of "
                      f"the K group {k_group}); declare it [blocks(...), ...] with the block's group {k_group}")
        return False
    return True


def _unbind(d: Dim, sizes: dict, group: int | None) -> BlockDim:
    return sizes[dims.base(d.value)].scaled(dims.scale(d.value, group))


def _number(ref, b: Block, loc, what: str, sink, kinds: tuple[str, ...], positive: bool = False) -> bool:
    """Whether `ref` is a number (an integer unless kinds has "float"; with `positive`, above 0: a count or a divisor
    of 0 or -1 would fail or mislead at run time) or an attr of one of `kinds`; reported at `loc` if not."""
    if isinstance(ref, (int, float)):
        if not ("float" in kinds or isinstance(ref, int)):
            sink.add(loc, f"{what} must be an integer")
            return False
        if positive and not ref > 0:
            sink.add(loc, f"{what} must be positive, got {ref}")
            return False
        return True
    a = b.attr(ref)
    if a is None or a.kind not in kinds:
        sink.add(loc, f"{what}: '{ref}' must be a number or an attr of kind {' or '.join(kinds)}")
        return False
    return True


class FinishCheck:
    """What a finish step's type rule (FinishStep.check) sees: the step, its block, the types of its value
    arguments and its resolved arguments; errors are reported at the step, or at an argument's value."""

    def __init__(self, step: BlockStep, b: Block, types: dict, args: list[Arg], sink):
        self.op, self.step, self.block = step.op, step, b
        self._types, self._args, self._sink = types, {a.param: a for a in args}, sink

    def type(self, arg: str) -> Value | Partial | None:
        """The type of a value argument; None for a number, an attr or an argument left out."""
        return self._types.get(arg)

    def arg(self, arg: str) -> Arg | None:
        return self._args.get(arg)

    def error(self, message: str, at: str | None = None) -> None:
        self._sink.add(self.step.arg_locs.get(at, self.step.loc) if at else self.step.loc, message)


def _finish(step: BlockStep, b: Block, kernels: dict[str, Kernel], env, define, used, sink,
            shadowed: bool = False) -> Call | None:
    """A finish step (codagen/finish_steps); `shadowed`: a kernel spec has its name too, which a block step cannot
    call. Each argument is checked against its kind, then the step's own type rule gives what it defines."""
    fs = FINISH_STEPS[step.op]
    names = [a.name for a in fs.args]
    loc_of = lambda k: step.arg_locs.get(k, step.loc)  # noqa: E731
    hint = (f" (a block step named '{step.op}' is the finish step, not the kernel of that name: rename the kernel "
            "to call it)") if shadowed else ""
    for key in step.args:
        if key not in names:
            sink.add(loc_of(key), f"{step.op} has no argument '{key}'; expected: {', '.join(names)}{hint}")
    if step.in_place:
        sink.add(loc_of(IN_PLACE), f"{step.op}.{IN_PLACE}: only kernel calls write outputs over a value")
    ok, args, outs, vals = True, [], [], {}
    for fa in fs.args:
        name, kind = fa.name, fa.kind
        ref = step.args.get(name)
        if ref is None:
            if fa.optional:
                continue
            sink.add(step.loc, f"{step.op} is missing '{name}'")
            ok = False
            continue
        if kind == "operand" and not isinstance(ref, str):
            args.append(Arg(name, ref, False))
            vals[name] = None
        elif kind == "operand" and b.attr(ref) is not None:
            ok &= _number(ref, b, loc_of(name), f"{step.op}.{name}", sink, ("float", "int"))
            args.append(Arg(name, ref, True))
            vals[name] = None
        elif kind in ("value", "partials", "operand"):
            v = env.get(ref) if isinstance(ref, str) else None
            if v is None:
                sink.add(loc_of(name), f"{step.op}.{name}: '{ref}' is not defined before this step")
                ok = False
                continue
            used.add(ref)
            vals[name] = v
            args.append(Arg(name, ref, True))
            if kind == "partials":
                ok &= _partials(fs, name, ref, v, loc_of(name), sink)
        elif kind in ("size", "int"):
            ok &= _number(ref, b, loc_of(name), f"{step.op}.{name}", sink, ("int",), positive=kind != "int")
            args.append(Arg(name, ref, isinstance(ref, str)))
        elif kind == "number":
            ok &= _number(ref, b, loc_of(name), f"{step.op}.{name}", sink, ("float", "int"))
            args.append(Arg(name, ref, isinstance(ref, str)))
        elif kind == "choice":
            a = b.attr(ref) if isinstance(ref, str) else None
            if ref not in fa.choices and not (a and a.kind == "choice" and set(a.choices) <= set(fa.choices)):
                sink.add(loc_of(name), f"{step.op}.{name} must be {', '.join(map(repr, fa.choices))} or an attr "
                                       "choosing between them")
                ok = False
            args.append(Arg(name, ref, a is not None))
        elif kind == "kernel":
            accumulator = _accumulator(kernels.get(ref) if isinstance(ref, str) else None, ref,
                                       loc_of(name), f"{step.op}.{name}", sink)
            ok &= accumulator is not None
            args.append(Arg(name, accumulator, False))
        elif kind == "keyword":
            if ref not in fa.choices:
                words = ", ".join(map(repr, fa.choices[:-1])) + f" or {fa.choices[-1]!r}"
                sink.add(loc_of(name), f"{step.op}.{name} must be {words}, got '{ref}'")
                ok = False
            args.append(Arg(name, ref, False))
        else:  # out
            if not isinstance(ref, str):
                sink.add(loc_of(name), f"{step.op}.{name} must be a new value name")
                ok = False
            outs.append((ref, name))
    if not ok:
        return None
    result = fs.check(FinishCheck(step, b, vals, args, sink))
    if result is None:
        return None
    for (ref, name), value in zip(outs, result):
        define(ref, value, loc_of(name))
    return Call(step.op, False, tuple(args), tuple(ref for ref, _ in outs), step.loc)


def _partials(fs: FinishStep, name: str, ref: str, v: Value | Partial, loc, sink) -> bool:
    """Whether `v`, passed as `ref` for the argument `name` of a finish step, has the shape of partials
    ([rows, tiles(...)] float32), so that the step's type rule can type what it makes; and, reported at `loc`,
    whether it holds the partials of a reduction the step combines."""
    what = f"{fs.name}.{name}"
    combines = " or ".join(fs.combines)
    if isinstance(v, Partial):
        if v.op in fs.combines:
            return True
        others = combining(v.op)
        hint = (f"{v.op} partials are combined by {' or '.join(others)}" if others else
                f"no finish step combines {v.op} partials")
        sink.add(loc, f"{what}: '{ref}' holds the partials of reduce op {v.op} ({v.source}), and {fs.name} "
                      f"combines those of {combines}; {hint}")
        return True
    if len(v.dims) == 2 and v.dtype == "float32" and _is_tiles(v.dims[1]):
        sink.add(loc, f"{what}: '{ref}' is no partials of a reduction, though it is {_fmt(v.dims)} float32: a finish "
                      "step made it from partials, and only partials of sum or sumsq scaled by a scalar, or added to "
                      f"partials of the same reduction, stay partials; {fs.name} combines those of {combines}")
        return True
    sink.add(loc, f"{what} must be a float32 partial-reduction buffer [rows, tiles(...)] made by a kernel's "
                  f"reduce, got {_fmt(v.dims)} {v.dtype}")
    return False


def _accumulator(k: Kernel | None, ref, loc, what: str, sink) -> Accumulator | None:
    """The kernel that matmul.accumulate names, if it is a GEMM added to a total: inputs the GEMM's a and b and
    one [M, N] tile `total`, one [M, N] output, and the epilogue `add: {x: acc, y: total}` then a store of the sum
    to that output; else None, reported."""
    if k is None:
        sink.add(loc, f"{what}: '{ref}' is no kernel spec among those given")
        return None
    role = {k.gemm.a: "a", k.gemm.b: "b" if k.gemm.b_layout is BLayout.KN else "b.T"} if k.gemm else {}
    totals = [i.name for i in k.inputs if i.name not in role and i.dims == (Dim.M, Dim.N) and i.dtype is DType.T]
    outputs = [o for o in k.outputs if o.dims == (Dim.M, Dim.N) and o.dtype is DType.T and not o.inplace]
    add, store = (k.steps + (None, None))[:2]
    if (k.gemm is None or len(k.inputs) != 3 or len(totals) != 1 or len(k.outputs) != 1 or len(outputs) != 1
            or len(k.steps) != 2 or add.op != "add" or sorted(add.args.values()) != sorted(["acc", totals[0]])
            or store.op != "store" or store.args.get("x") != add.out or store.target != outputs[0].name):
        sink.add(loc, f"{what}: kernel '{k.name}' ({k.source}) must add its GEMM to a total: inputs a and b of the "
                      "GEMM and one [M, N] tile 'total' in the inputs' type T, one [M, N] output of type T, and the "
                      "epilogue `add: {x: acc, y: total}` then `store` of that sum to the output")
        return None
    return Accumulator(k.name, tuple((i.name, role.get(i.name, "total")) for i in k.inputs), outputs[0].name)


def _is_tiles(d: BlockDim) -> bool:
    return isinstance(d.symbol, str) and d.symbol.startswith("tiles(")
