"""The loader of block specs (kernel calls and finish steps composed into a forward and a backward, what is
saved between them, the module's constructor arguments and parameters): YAML nodes -> the block model of
blockmodel.py. The rules across steps are blockcheck.py's."""
from __future__ import annotations

import re
from fractions import Fraction

from .blockmodel import IN_PLACE, TOKENS, Attr, Block, BlockDim, BlockStep, BlockTensor, GradForwardSpec
from .errors import ErrorSink
from .loader import MAX_GROUP, _is_mapping, _Mapping, _name, doc_text
from .model import DType, Location
from .names import MODULE_KEYWORDS, identifier_problem
from .yamlnodes import Node

_CHOICE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_DIM = re.compile(r"(?:(\d+)\*)?([a-z][a-z0-9_]*)(?:/(\d+))?|(\d+)|M")
# groups(dim), blocks(dim): dim / group, and dim / group rounded up, as the kernels' groups(N), groups(K) and
# blocks(N) are (codagen/dims.py), with the block's `group`
_COUNT = re.compile(r"(groups|blocks)\((.*)\)")
# the dtypes a block value may have: the kernels' (model.DType), the block's type T among them
DTYPES = tuple(d.value for d in DType)
FP8 = (DType.FLOAT8_E4M3FN.value, DType.FLOAT8_E5M2.value)


def parse_dim(text: object) -> BlockDim | None:
    """An attr expression (M, an int attr, k*attr, attr/k, k*attr/k) or a positive number; None if text is not."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return BlockDim(Fraction(text), None)
    if not isinstance(text, str):
        return None
    m = _DIM.fullmatch(text)
    if not m:
        return None
    if text == "M":
        return TOKENS
    if m.group(4):
        return BlockDim(Fraction(int(m.group(4))), None) if int(m.group(4)) > 0 else None
    if int(m.group(3) or 1) == 0:
        return None
    coef = Fraction(int(m.group(1) or 1), int(m.group(3) or 1))
    return BlockDim(coef, m.group(2)) if coef > 0 else None


def parse_block(root: Node, path: str, sha256: str) -> Block:
    sink = ErrorSink()
    if not _is_mapping(root, "a spec", sink):
        sink.raise_if_any()
    top = _Mapping(root, "the block spec", sink)
    keys = ["block", "doc", "attrs", "group", "params", "inputs", "outputs", "forward", "save", "backward",
            "backward_row_chunks", "forward_with_grads"]
    name_node = top.take("block")
    name = _name(name_node, "block", sink) if name_node else None
    doc_node = top.take("doc")
    doc = doc_text(doc_node, sink, "block") if doc_node is not None else ""
    attrs = _attrs(top.take("attrs", required=False), sink)
    group_node = top.take("group", required=False)
    # a group given but wrong (reported) is 0: the dims that count its groups are not reported again
    group = (_group(group_node, sink) or 0) if group_node is not None else None
    params = _tensors(top.take("params", required=False), "params", group, sink, allow_flags=False)
    inputs = _tensors(top.take("inputs"), "inputs", group, sink, allow_flags=True)
    outputs = _tensors(top.take("outputs"), "outputs", group, sink, allow_flags=True)
    forward = _steps(top.take("forward"), "forward", sink)
    save_node = top.take("save", required=False)
    backward_node = top.take("backward", required=False)
    chunks_node = top.take("backward_row_chunks", required=False)
    grad_node = top.take("forward_with_grads", required=False)
    top.finish(keys)
    save: list[tuple[str, Location]] = []
    if save_node is not None:
        if isinstance(save_node.value, list):
            for item in save_node.value:
                n = _name(item, "save", sink)
                if n:
                    save.append((n, item.loc))
        else:
            sink.add(save_node.loc, f"save must be a list of value names, got {save_node.type_name}")
    backward = _steps(backward_node, "backward", sink) if backward_node is not None else ()
    chunks = _rows(chunks_node, "backward_row_chunks", sink) if chunks_node is not None else None
    grad_forward = _grad_forward(grad_node, sink) if grad_node is not None else None
    sink.raise_if_any()
    return Block(name, doc, attrs, params, inputs, outputs, forward, tuple(save), backward, chunks, grad_forward,
                 path, sha256, root.loc, group or None)


def _group(node: Node, sink: ErrorSink) -> int | None:
    """`group`: the columns of a group, which the block's groups(dim) and blocks(dim) count: the column_group or
    gemm.scales.group of the kernels it calls (a call checks it), within the bounds of a column_group."""
    g = node.value
    if isinstance(g, int) and not isinstance(g, bool) and 2 <= g <= MAX_GROUP and g & (g - 1) == 0:
        return g
    sink.add(node.loc, f"group must be a power of two from 2 to {MAX_GROUP} (the columns of a group: the column_group "
                       f"or gemm.scales.group of the kernels the block calls; 128 in DeepSeek-V3's FP8 recipe), got "
                       f"{node.type_name}")
    return None


def _dim(node: Node, what: str, group: int | None, sink: ErrorSink) -> BlockDim | None:
    """One dimension of a block tensor's shape: an attr expression, or groups(...) or blocks(...) of one."""
    count = _COUNT.fullmatch(node.value) if isinstance(node.value, str) else None
    if count is None:
        dim = parse_dim(node.value)
        if dim is None:
            sink.add(node.loc, f"{what}: dimension {node.type_name} must be M, an int attr, k*attr, attr/k, a "
                               "positive number, or groups(...) or blocks(...) of an attr")
        return dim
    kind, inner = count.groups()
    dim = parse_dim(inner)
    if dim is None or dim.symbol in (None, "M"):
        sink.add(node.loc, f"{what}: {kind}(...) counts the groups of an attr expression (an int attr, k*attr or "
                           f"attr/k), got '{inner}'")
        return None
    if not group:
        if group is None:
            sink.add(node.loc, f"{what}: {kind}({inner}) counts groups of columns, and the block declares none; add "
                               "'group: 128' (the column_group or gemm.scales.group of the kernels it calls) at "
                               "the top level")
        return None
    return BlockDim(dim.coef / group, dim.symbol, rounded_up=kind == "blocks")


def _rows(node: Node, what: str, sink: ErrorSink) -> str | int | None:
    v = node.value
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if isinstance(v, str):
        return _name(node, what, sink)
    sink.add(node.loc, f"{what} must be a positive number of rows or an int attr, got {node.type_name}")
    return None


def _grad_forward(node: Node, sink: ErrorSink) -> GradForwardSpec | None:
    if not _is_mapping(node, "forward_with_grads", sink):
        return None
    m = _Mapping(node, "forward_with_grads", sink)
    rows_node = m.take("row_chunks")
    sums_node = m.take("sums", required=False)
    scale_node = m.take("grad_scale", required=False)
    before, chunk, after = (m.take(key, required=key == "chunk") for key in ("before", "chunk", "after"))
    m.finish(["row_chunks", "sums", "grad_scale", "before", "chunk", "after"])
    rows = _rows(rows_node, "forward_with_grads.row_chunks", sink) if rows_node is not None else None
    sums = None
    if sums_node is not None:
        sums = _name(sums_node, "forward_with_grads.sums", sink)
    scale = _name(scale_node, "forward_with_grads.grad_scale", sink) if scale_node is not None else None
    steps = [_steps(n, f"forward_with_grads.{key}", sink) if n is not None else ()
             for key, n in (("before", before), ("chunk", chunk), ("after", after))]
    return GradForwardSpec(rows, sums, scale, *steps, node.loc)


def _attrs(node: Node | None, sink: ErrorSink) -> tuple[Attr, ...]:
    """The attrs in the order of the generated constructor's arguments: those without a default first (Python
    allows no other order), each group in spec order."""
    if node is None or not _is_mapping(node, "attrs", sink):
        return ()
    out = []
    for key, value in node.value.items():
        loc = node.key_locs[key]
        name = _name(Node(key, loc), "attr name", sink)
        v = value.value
        if name is None:
            continue
        if name in MODULE_KEYWORDS:
            sink.add(loc, f"attr name: '{name}' is a keyword argument of every generated nn.Module's constructor "
                          f"({', '.join(MODULE_KEYWORDS)}); choose another name")
            continue
        if v in ("int", "float"):
            out.append(Attr(name, v, None, (), loc))
        elif isinstance(v, bool):
            sink.add(value.loc, f"attr '{name}': booleans are not supported; use 'int', 'float', a number or a list")
        elif isinstance(v, int):
            out.append(Attr(name, "int", v, (), loc))
        elif isinstance(v, float):
            out.append(Attr(name, "float", v, (), loc))
        elif isinstance(v, list) and v and all(isinstance(c.value, str) and _CHOICE.fullmatch(c.value) for c in v):
            out.append(Attr(name, "choice", v[0].value, tuple(c.value for c in v), loc))
        else:
            sink.add(value.loc, f"attr '{name}' must be 'int' or 'float' (required), a number (the default) or a "
                                f"list of choices (the first is the default), got {value.type_name}")
    return tuple(sorted(out, key=lambda a: a.default is not None))


def _tensors(node: Node | None, what: str, group: int | None, sink: ErrorSink,
             allow_flags: bool) -> tuple[BlockTensor, ...]:
    if node is None or not _is_mapping(node, what, sink):
        return ()
    out = []
    for key, value in node.value.items():
        loc = node.key_locs[key]
        name = _name(Node(key, loc), f"{what} name", sink)
        if name is None:
            continue
        dtype, grad, alias, shape = "T", True, None, value
        if isinstance(value.value, dict):
            m = _Mapping(value, f"{what} '{name}'", sink)
            shape = m.take("shape")
            dt = m.take("dtype", required=False)
            g = m.take("grad", required=False) if allow_flags else None
            a = m.take("alias", required=False) if allow_flags else None
            m.finish(["shape", "dtype"] + (["grad", "alias"] if allow_flags else []))
            if dt is not None:
                if dt.value in DTYPES:
                    dtype = dt.value
                else:
                    sink.add(dt.loc, f"{what} '{name}' dtype must be one of {', '.join(DTYPES)}, got "
                                     f"{dt.type_name}")
            if g is not None:
                if isinstance(g.value, bool):
                    grad = g.value
                else:
                    sink.add(g.loc, f"{what} '{name}' grad must be true or false, got {g.type_name}")
            if a is not None:
                alias = _name(a, f"{what} '{name}' alias", sink)
            if shape is None:
                continue
        if not isinstance(shape.value, list):
            sink.add(shape.loc, f"{what} '{name}' must be a shape such as [M, dim], got {shape.type_name}")
            continue
        dims = [_dim(d, f"{what} '{name}'", group, sink) for d in shape.value]
        if None in dims:
            continue
        if dtype in FP8 and what == "params":
            sink.add(loc, f"params '{name}': a parameter is trained in its own precision, and {dtype} is an FP8 "
                          "copy of one; make it an input with 'grad: false' (docs/fp8.md)")
            continue
        # index values and FP8 copies have no gradient (an FP8 input is a quantized copy: the gradient flows to
        # what it was made from)
        out.append(BlockTensor(name, tuple(dims), dtype, grad and dtype != "index" and dtype not in FP8, alias, loc))
    return tuple(out)


def _steps(node: Node | None, what: str, sink: ErrorSink) -> tuple[BlockStep, ...]:
    if node is None:
        return ()
    if not isinstance(node.value, list) or not node.value:
        sink.add(node.loc, f"{what} must be a non-empty list of steps, got {node.type_name}")
        return ()
    steps = []
    for item in node.value:
        if not isinstance(item.value, dict) or len(item.value) != 1:
            sink.add(item.loc, f"each {what} step is a mapping with one key, a kernel or finish op, such as "
                               "'- rstd: {x: ss, size: dim, eps: eps, out: r}'")
            continue
        (op, body), = item.value.items()
        oploc = item.key_locs[op]
        # the step's op and keys name a kernel or finish op and its arguments: identifiers, so that what
        # reaches a message is printable
        if _identifier(op, oploc, f"{what} step", sink) is None or not _is_mapping(body, op, sink):
            continue
        args, locs, in_place = {}, {}, {}
        for key, value in body.value.items():
            locs[key] = body.key_locs[key]
            if _identifier(key, locs[key], f"{op} argument", sink) is None:
                continue
            if key == IN_PLACE:
                in_place = _in_place(value, op, sink)
                continue
            v = value.value
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                sink.add(value.loc, f"{op}.{key} must be a value name, an attr or a number, got {value.type_name}")
                continue
            if isinstance(v, str) and v != "_" and _name(value, f"{op}.{key}", sink) is None:
                continue
            args[key] = v
            locs[key] = value.loc
        steps.append(BlockStep(op, args, oploc, locs, in_place))
    return tuple(steps)


def _in_place(node: Node, op: str, sink: ErrorSink) -> dict[str, str]:
    """`in_place: {output: value}`: kernel outputs written over the memory of values the call reads."""
    if not _is_mapping(node, f"{op}.{IN_PLACE}", sink):
        return {}
    pairs = {}
    for key, value in node.value.items():
        if _identifier(key, node.key_locs[key], f"{op}.{IN_PLACE} output", sink) is None:
            continue
        if _name(value, f"{op}.{IN_PLACE}.{key}", sink) is None:
            continue
        pairs[key] = value.value
    return pairs


def _identifier(text: str, loc: Location, what: str, sink: ErrorSink) -> str | None:
    problem = identifier_problem(text)
    if problem:
        sink.add(loc, f"{what}: {problem}")
        return None
    return text
