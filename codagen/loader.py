"""Located YAML nodes -> the typed kernel model. Structure only: each mapping's known keys are taken out and
whatever is left is an error. Rules across steps live in validate.py."""
from __future__ import annotations

import difflib
import hashlib
from pathlib import Path

from .errors import ErrorSink, SpecError, ValidationFailed
from .model import ACC, BLayout, Dim, DType, Gemm, GemmScales, Input, InputRole, Kernel, Literal, Location, Output, Step
from .names import TAKEN_KERNEL_NAMES, name_problem
from .primitives import PRIMITIVES
from .yamlnodes import MAX_BYTES, Node, load, too_large

MAX_STEPS = 512
MAX_DOC = 1000  # characters
_DIMS = {d.value: d for d in Dim}
_DTYPES = {d.value: d for d in DType}


def read_spec(path: Path, display: str | None = None) -> tuple[Node, str, str]:
    """(root node, display path, sha256 of the bytes) of one spec file."""
    display = display or str(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more: a huge file fails here, before it is read or parsed
            if len(data) > MAX_BYTES:
                size = max(path.stat().st_size, len(data))
                raise ValidationFailed([SpecError(Location(display, 1, 1), too_large(size))])
    except OSError as e:
        raise ValidationFailed([SpecError(Location(display, 1, 1), f"cannot read the spec: {e.strerror}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValidationFailed([SpecError(
            Location(display, line, col),
            f"spec is not UTF-8 text: byte 0x{data[e.start]:02x} ({e.reason}); save the file as UTF-8")]) from None
    try:
        root = load(text, display)
    except SpecError as e:
        raise ValidationFailed([e]) from None
    return root, display, hashlib.sha256(data).hexdigest()


class _Mapping:
    """Takes known keys out of a mapping node; `finish` reports the keys nobody asked for."""

    def __init__(self, node: Node, what: str, sink: ErrorSink):
        self.node, self.what, self.sink = node, what, sink
        self.left = dict(node.value)

    def take(self, key: str, required: bool = True) -> Node | None:
        if key in self.left:
            return self.left.pop(key)
        if required:
            self.sink.add(self.node.loc, f"{self.what} is missing '{key}'")
        return None

    def finish(self, allowed: list[str]) -> None:
        for key in self.left:
            self.sink.add(self.node.key_locs[key],
                          f"unknown key '{_short(key)}' in {self.what};{_did_you_mean(key, allowed)} "
                          f"expected one of: {', '.join(allowed)}")


def _did_you_mean(word: object, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6) if isinstance(word, str) else []
    return f" did you mean '{close[0]}'?" if close else ""


def _short(s: str) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= 40 else s[:40] + "..."


def _is_mapping(node: Node, what: str, sink: ErrorSink) -> bool:
    if not isinstance(node.value, dict):
        sink.add(node.loc, f"{what} must be a mapping, got {node.type_name}")
        return False
    return True


def _name(node: Node, what: str, sink: ErrorSink) -> str | None:
    problem = name_problem(node.value)
    if problem:
        if not isinstance(node.value, str):
            problem = f"expected a name, got {node.type_name}"
        sink.add(node.loc, f"{what}: {problem}")
        return None
    return node.value


def _ref(node: Node, what: str, sink: ErrorSink, number: bool) -> str | Literal | None:
    """A reference to a value (or `acc`), or a number literal where allowed."""
    v = node.value
    if number and isinstance(v, (int, float)) and not isinstance(v, bool):
        return Literal(float(v))
    if v == ACC:
        return ACC
    if isinstance(v, str):
        return _name(node, what, sink)
    expected = "a value name or a number" if number else "a value name"
    sink.add(node.loc, f"{what} must be {expected}, got {node.type_name}")
    return None


def parse_kernel(root: Node, path: str, sha256: str) -> Kernel:
    kernel, errors = parse_kernel_partly(root, path, sha256)
    if errors:
        raise ValidationFailed(errors)
    return kernel


def parse_kernel_partly(root: Node, path: str, sha256: str) -> tuple[Kernel | None, list[SpecError]]:
    """The kernel and the spec's structural errors; with errors, the kernel holds what could be read (the parts
    with errors left out), so that the type checks can report in the same pass what does not follow from those
    (validate.check_partial_kernel), or None where too little could be read (no mapping, a GEMM with errors)."""
    sink = ErrorSink()
    try:
        kernel = _parse_kernel(root, path, sha256, sink)
    except ValidationFailed as e:
        return None, e.errors
    return kernel, sink.errors


def _parse_kernel(root: Node, path: str, sha256: str, sink: ErrorSink) -> Kernel | None:
    if not isinstance(root.value, dict):
        # text is not echoed: a file that is not a spec at all (a link to another file) shows nothing of itself
        got = "text" if isinstance(root.value, str) else root.type_name
        sink.add(root.loc, f"a spec must be a mapping, got {got}; a spec starts with 'kernel:' or 'block:'")
        sink.raise_if_any()
    top = _Mapping(root, "the kernel spec", sink)
    keys = ["kernel", "doc", "gemm", "column_group", "inputs", "outputs", "epilogue"]
    name_node = top.take("kernel")
    name = _name(name_node, "kernel", sink) if name_node else None
    if name in TAKEN_KERNEL_NAMES:
        sink.add(name_node.loc, f"kernel: '{name}' is taken: the op torch.ops.codagen.{name} would be an attribute "
                                "of torch's op namespace; choose another name")
        name = None
    doc_node = top.take("doc")
    doc = doc_text(doc_node, sink) if doc_node is not None else ""
    gemm_node = top.take("gemm", required=False)
    group_node = top.take("column_group", required=False)
    inputs_node = top.take("inputs")
    outputs_node = top.take("outputs")
    steps_node = top.take("epilogue")
    top.finish(keys)

    before = len(sink.errors)
    gemm = _gemm(gemm_node, sink) if gemm_node else None
    group = _column_group(group_node, sink) if group_node else None
    whole = len(sink.errors) == before  # the GEMM and the column groups, which every check of the rest reads
    inputs = _inputs(inputs_node, gemm, sink) if inputs_node else ()
    outputs = _outputs(outputs_node, sink) if outputs_node else ()
    steps = _steps(steps_node, sink) if steps_node else ()
    if not whole:
        return None  # without them, the type checks of the rest would report what follows from their errors
    return Kernel(name or "kernel", doc, gemm, inputs, outputs, steps, path, sha256, root.loc, group,
                  group_node.loc if group_node else None)


MAX_GROUP = 512  # the widest tile (runtime.configs.MAX_BLOCK): a column slice must hold whole groups


def _column_group(node: Node, sink: ErrorSink) -> int | str | None:
    """The width of the kernel's column groups: a power of two, since tiles are powers of two wide and each
    epilogue slice of a tile must hold whole groups; or N, one group, the whole row (one tile spans N)."""
    v = node.value
    if v == "N" or (isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= MAX_GROUP and v & (v - 1) == 0):
        return v
    sink.add(node.loc, f"column_group must be a power of two from 2 to {MAX_GROUP} (tiles are powers of two wide "
                       f"and each holds whole groups) or N (one group: the whole row), got {node.type_name}")
    return None


def doc_text(node: Node, sink: ErrorSink, what: str = "kernel") -> str:
    """The doc, on one line. It becomes part of Python docstrings in generated modules, so text that could
    end or change a string literal (a triple quote, a backslash escape, a final double quote) or is not
    printable is refused. `what` names the thing documented (kernel, block) in the message."""
    if not isinstance(node.value, str) or not node.value.strip():
        sink.add(node.loc, f"doc must be a sentence saying what the {what} computes, got {node.type_name}")
        return ""
    doc = " ".join(node.value.split())
    bad = next((c for c in doc if not c.isprintable()), None)
    if '"""' in doc:
        sink.add(node.loc, 'doc may not contain a triple quote ("""): it goes into the docstring of the '
                           "generated module and would end it; use single quotes or fewer double quotes")
    elif doc.endswith('"'):
        sink.add(node.loc, "doc may not end with a double quote: it goes into a one-line docstring, where a "
                           "fourth quote would end the string early; end the sentence with a period")
    elif "\\" in doc:
        sink.add(node.loc, "doc may not contain a backslash: it goes into a Python docstring, where '\\' starts "
                           "an escape sequence; write the text without it")
    elif bad is not None:
        sink.add(node.loc, f"doc may not contain the unprintable character U+{ord(bad):04X}; remove it")
    elif len(doc) > MAX_DOC:
        sink.add(node.loc, f"doc is {len(doc)} characters long; keep it to one sentence (at most {MAX_DOC}) "
                           "and put longer notes in YAML comments")
    else:
        return doc
    return ""


def _gemm(node: Node, sink: ErrorSink) -> Gemm | None:
    if not _is_mapping(node, "gemm", sink):
        return None
    m = _Mapping(node, "gemm", sink)
    a, b, layout = m.take("a"), m.take("b"), m.take("b_layout", required=False)
    scales_node = m.take("scales", required=False)
    m.finish(["a", "b", "b_layout", "scales"])
    b_layout = BLayout.NK
    if layout is not None:
        try:
            b_layout = BLayout(layout.value)
        except ValueError:
            sink.add(layout.loc, f"gemm.b_layout must be 'nk' (b is [N, K], acc = a @ b^T) or 'kn' "
                                 f"(b is [K, N]), got {layout.type_name}")
    an = _name(a, "gemm.a", sink) if a else None
    bn = _name(b, "gemm.b", sink) if b else None
    before = len(sink.errors)
    scales = _scales(scales_node, sink) if scales_node is not None else None
    if an and bn and len(sink.errors) == before:
        return Gemm(an, bn, b_layout, node.loc, scales)
    return None


MIN_K_GROUP, MAX_K_GROUP = 32, 512  # a K step (block_k, at least 32 for FP8 MMAs) must lie within one group


def _scales(node: Node, sink: ErrorSink) -> GemmScales | None:
    """gemm.scales: {a: <input>, b: <input>, group: <columns of K>}, the K-group scales of FP8 operands."""
    if not _is_mapping(node, "gemm.scales", sink):
        return None
    m = _Mapping(node, "gemm.scales", sink)
    a, b, group = m.take("a", required=False), m.take("b", required=False), m.take("group")
    m.finish(["a", "b", "group"])
    an = _name(a, "gemm.scales.a", sink) if a else None
    bn = _name(b, "gemm.scales.b", sink) if b else None
    if a is None and b is None:
        sink.add(node.loc, "gemm.scales names no scales; give 'a' (an input [M, groups(K)], one scale per row and "
                           "group of K), 'b' (an input [blocks(N), groups(K)], one per group x group block of b) "
                           "or both")
    g = group.value if group is not None else None
    if group is not None and not (isinstance(g, int) and not isinstance(g, bool) and MIN_K_GROUP <= g <= MAX_K_GROUP
                                  and g & (g - 1) == 0):
        sink.add(group.loc, f"gemm.scales.group must be a power of two from {MIN_K_GROUP} to {MAX_K_GROUP} (the "
                            f"columns of K per scale, 128 in DeepSeek-V3's recipe; each K step of the mainloop "
                            f"must lie within one group), got {group.type_name}")
        return None
    if g is None or (a is not None and an is None) or (b is not None and bn is None) or (a is None and b is None):
        return None
    return GemmScales(an, bn, g, node.loc)


def _dims(node: Node, what: str, sink: ErrorSink, allow_tiles: bool) -> tuple[Dim, ...] | None:
    if not isinstance(node.value, list):
        sink.add(node.loc, f"{what} must be a list of dimensions such as [M, N], got {node.type_name}")
        return None
    dims = []
    for d in node.value:
        dim = _DIMS.get(d.value) if isinstance(d.value, str) else None
        if dim is None or (not allow_tiles and dim in (Dim.TILES_M, Dim.TILES_N)):
            allowed = [x.value for x in Dim if allow_tiles or x not in (Dim.TILES_M, Dim.TILES_N)]
            sink.add(d.loc, f"{what}: unknown dimension {d.type_name}; expected one of: {', '.join(allowed)}")
            return None
        dims.append(dim)
    if len(dims) > 2:
        sink.add(node.loc, f"{what} has {len(dims)} dimensions; tensors have at most 2")
        return None
    return tuple(dims)


def _dtype(node: Node, what: str, sink: ErrorSink) -> DType | None:
    dt = _DTYPES.get(node.value) if isinstance(node.value, str) else None
    if dt is None:
        sink.add(node.loc, f"{what} must be one of: {', '.join(_DTYPES)}, got {node.type_name}")
    return dt


def _tensor_decl(node: Node, what: str, sink: ErrorSink, allow_tiles: bool, extra: tuple[str, ...] = ()):
    """[dims] or {shape: [dims], dtype: ..., <extra>: ...} -> (dims, dtype or None, {extra: node})."""
    if isinstance(node.value, list):
        return _dims(node, f"{what} shape", sink, allow_tiles), None, {}
    if not isinstance(node.value, dict):
        sink.add(node.loc, f"{what} must be a shape such as [M, N] or a mapping with 'shape' and 'dtype', "
                           f"got {node.type_name}")
        return None, None, {}
    m = _Mapping(node, what, sink)
    shape, dtype = m.take("shape"), m.take("dtype", required=False)
    extras = {k: m.take(k, required=False) for k in extra}
    m.finish(["shape", "dtype", *extra])
    dims = _dims(shape, f"{what} shape", sink, allow_tiles) if shape else None
    dt = _dtype(dtype, f"{what} dtype", sink) if dtype else None
    return dims, dt, {k: v for k, v in extras.items() if v is not None}


def _inputs(node: Node, gemm: Gemm | None, sink: ErrorSink) -> tuple[Input, ...]:
    if not _is_mapping(node, "inputs", sink):
        return ()
    out = []
    for key, value in node.value.items():
        loc = node.key_locs[key]
        before = len(sink.errors)
        name = _name(Node(key, loc), "input name", sink)
        if name is None:
            continue
        if value.value == "scalar":
            out.append(Input(name, (), DType.FLOAT32, InputRole.HOST_SCALAR, loc))
            continue
        dims, dtype, _ = _tensor_decl(value, f"input '{name}'", sink, allow_tiles=False)
        if dims is None or len(sink.errors) > before:  # a declaration with an error is left out whole
            continue
        role = InputRole.TENSOR
        if gemm and gemm.scales and name in gemm.scales.names:
            role = InputRole.GEMM_SCALE
        elif Dim.K in dims:
            role = InputRole.GEMM_A if gemm and name == gemm.a else InputRole.GEMM_B
        out.append(Input(name, dims, dtype or DType.T, role, loc))
    return tuple(out)


def _outputs(node: Node, sink: ErrorSink) -> tuple[Output, ...]:
    if not _is_mapping(node, "outputs", sink):
        return ()
    out = []
    for key, value in node.value.items():
        loc = node.key_locs[key]
        before = len(sink.errors)
        name = _name(Node(key, loc), "output name", sink)
        if name is None:
            continue
        dims, dtype, extras = _tensor_decl(value, f"output '{name}'", sink, allow_tiles=True, extra=("inplace",))
        if dims is None:
            continue
        inplace = False
        if "inplace" in extras:
            if isinstance(extras["inplace"].value, bool):
                inplace = extras["inplace"].value
            else:
                sink.add(extras["inplace"].loc, f"output '{name}' inplace must be true or false, "
                                                f"got {extras['inplace'].type_name}")
        if len(sink.errors) > before:  # a declaration with an error is left out whole
            continue
        if dtype is None:
            dtype = DType.FLOAT32 if (Dim.TILES_M in dims or Dim.TILES_N in dims) else DType.T
        out.append(Output(name, dims, dtype, inplace, loc))
    return tuple(out)


def _steps(node: Node, sink: ErrorSink) -> tuple[Step, ...]:
    if not isinstance(node.value, list) or not node.value:
        sink.add(node.loc, f"epilogue must be a non-empty list of steps, got {node.type_name}")
        return ()
    if len(node.value) > MAX_STEPS:
        sink.add(node.loc, f"epilogue has {len(node.value)} steps; at most {MAX_STEPS} are allowed")
        return ()
    steps = []
    for item in node.value:
        if not isinstance(item.value, dict) or len(item.value) != 1:
            found = item.type_name
            if isinstance(item.value, dict):
                keys = ", ".join(_short(k) for k in item.value)
                found = f"a mapping with {len(item.value)} keys ({keys}); is a '- ' missing before a step?"
            sink.add(item.loc, "each epilogue step is a mapping with exactly one key, the primitive, "
                               f"such as '- add: {{x: acc, y: x, out: x1}}', got {found}")
            continue
        (op, body), = item.value.items()
        if op not in PRIMITIVES:
            sink.add(item.key_locs[op], f"unknown primitive '{_short(op)}';{_did_you_mean(op, PRIMITIVES)} "
                                        f"expected one of: {', '.join(sorted(PRIMITIVES))}")
            continue
        before = len(sink.errors)
        step = _step(op, body, item.key_locs[op], sink)
        if step and len(sink.errors) == before:  # a step with an error is left out whole
            steps.append(step)
    return tuple(steps)


def _step(op: str, body: Node, loc: Location, sink: ErrorSink) -> Step | None:
    if not _is_mapping(body, f"{op}", sink):
        return None
    signature = PRIMITIVES[op].args
    m = _Mapping(body, op, sink)
    args, arg_locs, out, target, ok = {}, {}, None, None, True
    for arg in signature:
        n = m.take(arg.name)
        if n is None:
            ok = False
            continue
        arg_locs[arg.name] = n.loc
        what = f"{op}.{arg.name}"
        if arg.kind == "enum":
            if n.value not in arg.choices:
                sink.add(n.loc, f"{what} must be {_one_of(arg.choices)}, got {n.type_name};"
                                f"{_did_you_mean(n.value, arg.choices)}".rstrip(";"))
                ok = False
            args[arg.name] = n.value
        elif arg.kind == "value":
            ref = _ref(n, what, sink, arg.number)
            ok &= ref is not None
            args[arg.name] = ref
        else:  # index input, defined value, or written output: all plain names
            name = _name(n, what, sink)
            ok &= name is not None
            if arg.kind == "out":
                out = name
            elif arg.kind == "target":
                target = name
            else:
                args[arg.name] = name
    m.finish([a.name for a in signature])
    return Step(op, args, out, target, loc, arg_locs) if ok else None


def _one_of(choices: tuple[str, ...]) -> str:
    quoted = [f"'{c}'" for c in choices]
    return " or ".join(quoted) if len(quoted) == 2 else "one of " + ", ".join(quoted)
