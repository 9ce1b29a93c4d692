"""Rules of block specs: each kernel call matches the kernel's arguments and shapes, values exist before
they are used and are used, saved values are used by the backward, and the backward defines the gradient of
every differentiable input and parameter. Produces the checked block (blockmodel.CheckedBlock): the resolved
calls, and for a backward in row chunks what is sliced, concatenated, summed and dropped."""
from __future__ import annotations

from fractions import Fraction

from .blockmodel import (CHOICES, FINISH_SIGNATURES, TOKENS, TRANSPOSES, Arg, Block, BlockDim, BlockStep, Call,
                         CheckedBlock, ChunkedBackward, Value)
from .errors import ErrorSink
from .model import Dim, DType, InputRole, Kernel, Location

DISCARD = "_"
RESERVED = frozenset({"kernels", "finish", "runtime", "nn", "torch", "ctx", "self", "function", "rows"})
_TILES = {Dim.TILES_M: BlockDim(Fraction(1), "tiles(M)"), Dim.TILES_N: BlockDim(Fraction(1), "tiles(N)")}
_KDTYPE = {DType.T: "T", DType.FLOAT32: "float32", DType.INDEX: "index"}


def _fmt(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_block(b: Block, kernels: dict[str, Kernel]) -> CheckedBlock:
    sink = ErrorSink()
    attrs = {a.name: a for a in b.attrs}
    env: dict[str, Value] = {}
    defined_at: dict[str, Location] = {}
    used: set[str] = set()

    def define(name: str, value: Value, loc: Location) -> None:
        if name == DISCARD:
            return
        if name in RESERVED or name in attrs or name.endswith(("_rows", "_chunks")):
            sink.add(loc, f"'{name}' is reserved or an attr; choose another value name")
        elif name in env:
            sink.add(loc, f"'{name}' is already defined (line {defined_at[name].line}); values are assigned once")
        else:
            env[name] = value
            defined_at[name] = loc

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
                sink.add(o.loc, f"output '{o.name}' has shape {_fmt(o.dims)} but its alias '{o.alias}' has {_fmt(src.dims)}")
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
    for name, loc in defined_at.items():
        if name not in used and name not in dict(b.save):
            sink.add(loc, f"'{name}' is never used; remove it, save it, or map a kernel output to '_'")

    # backward: parameters, saved values and the gradients of differentiable outputs
    forward_env = dict(env)
    env.clear()
    defined_at.clear()
    used_back: set[str] = set()
    for p in b.params:
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
    if differentiable_outputs and not b.backward:
        sink.add(b.loc, "the block has differentiable outputs but no backward; add one or mark them 'grad: false'")
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
    for name, loc in saved_locs.items():
        if name not in used_back:
            sink.add(loc, f"saved value '{name}' is never used by the backward; do not save it")
    for name, loc in defined_at.items():
        if name not in used_back and name not in saved_locs and name not in {p.name for p in b.params} \
                and not name.startswith("grad_"):
            sink.add(loc, f"'{name}' is never used; remove it or map a kernel output to '_'")
    values = {**forward_env, **env}
    saved = tuple(name for name, _ in b.save) + tuple(p.name for p in b.params)
    chunks = None
    if b.backward_row_chunks is not None:
        chunks = _chunked_backward(b, backward, values, saved, grads, attrs, sink)
    sink.raise_if_any()
    return CheckedBlock(b, forward, backward, values, saved, tuple(grads), chunks)


def _chunked_backward(b: Block, backward: tuple[Call, ...], values: dict, saved: tuple[str, ...],
                      grads: list[str], attrs: dict, sink) -> ChunkedBackward | None:
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
    # a summed gradient that a plain GEMM makes and no step reads is accumulated by that GEMM (ChunkSum)
    read = {a.value for c in backward for a in c.args if a.is_name}
    summed_by_gemm = tuple(c.outs[0] for c in backward
                           if c.op == "matmul" and c.outs[0] in summed and c.outs[0] not in read)
    dropped = tuple(dict.fromkeys(o for c in backward for o in c.outs if o not in summed_by_gemm))
    return ChunkedBackward(Arg("rows", rows, isinstance(rows, str)), sliced, concatenated, summed, summed_by_gemm,
                           dropped)


def _resolve(step: BlockStep, b: Block, kernels: dict[str, Kernel], env, define, used, sink) -> Call | None:
    if step.op in FINISH_SIGNATURES:
        return _finish(step, b, env, define, used, sink)
    kernel = kernels.get(step.op)
    if kernel is None:
        known = ", ".join(sorted(kernels)) or "none"
        sink.add(step.loc, f"unknown kernel or finish step '{step.op}'; kernels: {known}; finish steps: "
                           f"{', '.join(FINISH_SIGNATURES)}")
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
        want = _KDTYPE.get(i.dtype)
        if want != v.dtype:
            sink.add(loc_of(i.name), f"{kernel.name}.{i.name} takes dtype {want or i.dtype.value}, "
                                     f"but '{ref}' is {v.dtype}")
            ok = False
        if len(v.dims) != len(i.dims):
            sink.add(loc_of(i.name), f"{kernel.name}.{i.name} is [{', '.join(d.value for d in i.dims)}], "
                                     f"but '{ref}' is {_fmt(v.dims)}")
            ok = False
            continue
        for kd, bd in zip(i.dims, v.dims):
            ok &= _bind(kd, bd, sizes, loc_of(i.name), f"{kernel.name}.{i.name}", ref, sink)
    if not ok:
        return None
    outs = []
    for o in kernel.outputs:
        name = step.args[o.name]
        if not isinstance(name, str):
            sink.add(loc_of(o.name), f"{kernel.name}.{o.name} is an output: give it a new value name")
            return None
        dims = tuple(_TILES.get(d) or _unbind(d, sizes) for d in o.dims)
        dtype = _KDTYPE.get(o.dtype, o.dtype.value)
        define(name, Value(dims, dtype), loc_of(o.name))
        outs.append(name)
    return Call(kernel.name, True, tuple(args), tuple(outs), step.loc)


def _bind(kd: Dim, bd: BlockDim, sizes: dict, loc, what: str, ref: str, sink) -> bool:
    factor = {Dim.N_HALF: Fraction(2), Dim.N_DOUBLE: Fraction(1, 2)}.get(kd, Fraction(1))
    key = {Dim.N_HALF: "N", Dim.N_DOUBLE: "N"}.get(kd, kd.value)
    value = bd.scaled(factor)
    if key not in sizes:
        sizes[key] = value
        return True
    if sizes[key] != value:
        sink.add(loc, f"{what}: '{ref}' makes {kd.value} = {bd}, but the earlier arguments make {key} = {sizes[key]}")
        return False
    return True


def _unbind(d: Dim, sizes: dict) -> BlockDim:
    base = sizes["N"] if d.width else sizes[d.value]
    return base.scaled({Dim.N_HALF: Fraction(1, 2), Dim.N_DOUBLE: Fraction(2)}.get(d, Fraction(1)))


def _number(ref, b: Block, loc, what: str, sink, kinds: tuple[str, ...]) -> bool:
    if isinstance(ref, (int, float)):
        if "float" in kinds or isinstance(ref, int):
            return True
        sink.add(loc, f"{what} must be an integer")
        return False
    a = b.attr(ref)
    if a is None or a.kind not in kinds:
        sink.add(loc, f"{what}: '{ref}' must be a number or an attr of kind {' or '.join(kinds)}")
        return False
    return True


def _finish(step: BlockStep, b: Block, env, define, used, sink) -> Call | None:
    sig = FINISH_SIGNATURES[step.op]
    names = [n for n, _ in sig]
    loc_of = lambda k: step.arg_locs.get(k, step.loc)  # noqa: E731
    for key in step.args:
        if key not in names:
            sink.add(loc_of(key), f"{step.op} has no argument '{key}'; expected: {', '.join(names)}")
    ok, args, outs, vals = True, [], [], {}
    for name, kind in sig:
        ref = step.args.get(name)
        if ref is None:
            if kind.endswith("?"):
                continue
            sink.add(step.loc, f"{step.op} is missing '{name}'")
            ok = False
            continue
        if kind == "value":
            v = env.get(ref) if isinstance(ref, str) else None
            if v is None:
                sink.add(loc_of(name), f"{step.op}.{name}: '{ref}' is not defined before this step")
                ok = False
                continue
            used.add(ref)
            vals[name] = v
            args.append(Arg(name, ref, True))
        elif kind in ("size", "size?"):
            ok &= _number(ref, b, loc_of(name), f"{step.op}.{name}", sink, ("int",))
            args.append(Arg(name, ref, isinstance(ref, str)))
        elif kind == "number":
            ok &= _number(ref, b, loc_of(name), f"{step.op}.{name}", sink, ("float", "int"))
            args.append(Arg(name, ref, isinstance(ref, str)))
        elif kind in ("choice", "choice?"):
            a = b.attr(ref) if isinstance(ref, str) else None
            if ref not in CHOICES[name] and not (a and a.kind == "choice" and set(a.choices) <= set(CHOICES[name])):
                sink.add(loc_of(name), f"{step.op}.{name} must be {', '.join(map(repr, CHOICES[name]))} or an attr "
                                       "choosing between them")
                ok = False
            args.append(Arg(name, ref, a is not None))
        elif kind == "transpose?":
            if ref not in TRANSPOSES:
                sink.add(loc_of(name), f"matmul.transpose must be 'none', 'a' or 'b', got '{ref}'")
                ok = False
            args.append(Arg(name, ref, False))
        else:  # out
            if not isinstance(ref, str):
                sink.add(loc_of(name), f"{step.op}.{name} must be a new value name")
                ok = False
            outs.append((ref, name))
    if not ok:
        return None
    result = _finish_types(step, vals, args, sink)
    if result is None:
        return None
    for (ref, name), value in zip(outs, result):
        define(ref, value, loc_of(name))
    return Call(step.op, False, tuple(args), tuple(ref for ref, _ in outs), step.loc)


def _finish_types(step: BlockStep, vals: dict, args: list[Arg], sink) -> list[Value] | None:
    op = step.op
    loc = step.loc
    if op in ("rstd", "sum_tiles", "logsumexp_tiles"):
        x = vals["x"]
        if len(x.dims) != 2 or x.dtype != "float32":
            sink.add(loc, f"{op}.x must be a float32 partial-reduction buffer [rows, tiles], got {_fmt(x.dims)} {x.dtype}")
            return None
        return [Value(x.dims[:1], "float32")]
    if op == "cross_entropy":
        for name, dtype in (("lse", "float32"), ("target_logit", "float32"), ("target", "index")):
            v = vals[name]
            if v.dims != (TOKENS,) or v.dtype != dtype:
                sink.add(loc, f"cross_entropy.{name} must be [M] {dtype}, got {_fmt(v.dims)} {v.dtype}")
                return None
        return [Value((), "float32"), Value((TOKENS,), "float32")]
    a, b_ = vals["a"], vals["b"]  # matmul
    if len(a.dims) != 2 or len(b_.dims) != 2:
        sink.add(loc, f"matmul operands must be matrices, got {_fmt(a.dims)} and {_fmt(b_.dims)}")
        return None
    transpose = next((a.value for a in args if a.param == "transpose"), "none")
    ad = a.dims[::-1] if transpose == "a" else a.dims
    bd = b_.dims[::-1] if transpose == "b" else b_.dims
    if ad[1] != bd[0]:
        sink.add(loc, f"matmul: {_fmt(ad)} @ {_fmt(bd)} do not chain ({ad[1]} != {bd[0]})")
        return None
    return [Value((ad[0], bd[1]), a.dtype if a.dtype == b_.dtype else "float32")]

