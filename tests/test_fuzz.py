"""A property-based fuzzer of specs (Hypothesis).

- Well-formed kernel specs, drawn as random epilogue programs over random inputs: the validator accepts
  each, and its generated kernel, run on small ragged shapes under Triton's interpreter (or on the GPU),
  matches the float64 reference interpreter (NaN and infinities where PyTorch has them, as in test_nan.py).
- Mutated specs: a well-formed kernel spec, or one of the repository's block specs, with a value replaced,
  a key renamed or dropped, a list item duplicated, or characters of its text changed. Every rejected spec
  gets errors at file:line:col with one-line printable messages, and no other exception; every accepted one
  generates modules that compile (kernels among them also run and match the reference).

The default run is bounded and deterministic (derandomized: the same examples each time; CI runs it).
`make fuzz` runs CODAGEN_FUZZ_EXAMPLES (20) times as many, random ones (new each run)."""
from __future__ import annotations

import copy
import hashlib
import importlib
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from codagen import api, reference
from codagen.errors import SpecError, ValidationFailed
from codagen.runtime import Config
from conftest import REPO, draw_args
from test_nan import assert_same_specials
from test_primitives import cast_tolerances

# numpy warnings from the interpreter on what random programs compute (overflow, log of a negative, ...):
# the results are checked against the reference, warnings or not
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SCALE = int(os.environ.get("CODAGEN_FUZZ_EXAMPLES", "1"))
FUZZ = settings(deadline=None, database=None, derandomize=SCALE == 1, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
CONFIG = Config(32, 64, 32, 1, 4, 1)
TOL = 1e-3  # fp32 kernels against float64: programs of a dozen steps on randn data stay far inside it


# -- well-formed kernel specs ----------------------------------------------------------------------------------
UNARY = ("silu", "sigmoid", "gelu_tanh", "gelu", "tanh", "relu", "exp", "log", "square", "rsqrt", "neg", "abs")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")


@dataclass
class Program:
    """A kernel spec being drawn: its inputs and outputs (name -> declaration), its steps, and the values in
    scope (name -> (kind, width)), with those not yet read."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    unread: set = field(default_factory=set)
    special: dict = field(default_factory=dict)  # input name -> how draw_args fills it
    gemm: dict | None = None
    count: int = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def define(self, kind: str, width: str | None, prefix: str = "v") -> str:
        name = self.name(prefix)
        self.values[name] = (kind, width)
        self.unread.add(name)
        return name

    def read(self, name) -> object:
        self.unread.discard(name)
        return name

    def of(self, *kinds: str, width: str | None = None) -> list[str]:
        return [n for n, (k, w) in self.values.items() if k in kinds and (width is None or w == width)]

    def write(self, op: str, x: str, dims: list, **extra) -> None:
        target = self.name("o")
        self.outputs[target] = {"shape": dims, **extra} if extra else dims
        self.steps.append({op: {"x": self.read(x), ("into" if op == "accumulate" else "to"): target}})


def _dims(kind: str, width: str | None) -> list[str]:
    return {"tile": ["M", width], "row": ["M"], "col": [width]}[kind]


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """The type of a binary step on values of types a and b, or None where they do not combine."""
    if a == b or b[0] == "scalar":
        return a
    if a[0] == "scalar":
        return b
    if {a[0], b[0]} == {"row", "col"}:
        return ("tile", a[1] or b[1])
    if "tile" in (a[0], b[0]) and a[1] == b[1] or {a[0], b[0]} == {"tile", "row"}:
        return ("tile", a[1] or b[1])
    return None


@st.composite
def programs(draw) -> Program:
    p = Program()
    if draw(st.booleans()):
        layout = draw(st.sampled_from(["nk", "kn"]))
        p.inputs.update(a=["M", "K"], b=["N", "K"] if layout == "nk" else ["K", "N"])
        p.gemm = {"a": "a", "b": "b", "b_layout": layout}
        p.values["acc"] = ("tile", "N")
        p.unread.add("acc")
    else:
        p.inputs["x0"] = ["M", "N"]
        p.values["x0"] = ("tile", "N")
        p.unread.add("x0")
    for kind in draw(st.lists(st.sampled_from(["tile", "half", "row", "col", "half_col", "scalar", "zero_d",
                                               "index", "float32_row"]), max_size=4)):
        name = p.name("in")
        decl, value = {
            "tile": (["M", "N"], ("tile", "N")), "half": (["M", "N/2"], ("tile", "N/2")),
            "row": (["M"], ("row", None)), "col": (["N"], ("col", "N")), "half_col": (["N/2"], ("col", "N/2")),
            "scalar": ("scalar", ("scalar", None)), "zero_d": ([], ("scalar", None)),
            "index": ({"shape": ["M"], "dtype": "index"}, ("index", None)),
            "float32_row": ({"shape": ["M"], "dtype": "float32"}, ("row", None)),
        }[kind]
        p.inputs[name] = decl
        p.values[name] = value
        p.unread.add(name)
    for _ in range(draw(st.integers(1, 10))):
        _step(draw, p)
    for name in [n for n in p.values if n in p.unread]:  # each value is read: what is left is written out
        kind, width = p.values[name]
        if kind in ("tile", "row", "col"):
            p.write("store", name, _dims(kind, width))
        elif kind == "scalar":
            tile = p.of("tile")[0]
            v = p.define("tile", p.values[tile][1])
            p.steps.append({"scale": {"x": p.read(tile), "by": p.read(name), "out": v}})
            p.write("store", v, _dims("tile", p.values[tile][1]))
        elif kind == "index":
            v = p.define("tile", "N")
            p.steps.append({"one_hot": {"index": p.read(name), "out": v}})
            p.write("store", v, ["M", "N"], dtype="float32")
    return p


def _step(draw, p: Program) -> None:
    values = [n for n, (k, _) in p.values.items() if k != "index"]
    tiles = p.of("tile")
    op = draw(st.sampled_from(["unary", "binary", "scale", "reduce", "gated", "select", "one_hot", "store",
                               "accumulate", "cast", "rope"]))
    if op == "unary":
        name = draw(st.sampled_from(UNARY))
        # log and rsqrt read inputs only: of a computed value that cancelled (gelu of -5 is 1 + tanh(...) in
        # fp32), they would turn the rounding that fp32 and float64 differ by into errors of order 1
        x = draw(st.sampled_from([v for v in values if v in p.inputs or v == "acc"] if name in ("log", "rsqrt")
                                 else values))
        out = p.define(*p.values[x])
        p.steps.append({name: {"x": p.read(x), "out": out}})
    elif op == "binary":
        name = draw(st.sampled_from(BINARY))
        x = draw(st.sampled_from(values))
        pool = [y for y in values if _broadcast(p.values[x], p.values[y])]
        # a number on either side, or a value (divisors are inputs or numbers: a quotient of computed values
        # near 0 would amplify the rounding that fp32 and float64 differ by)
        if name == "div":
            pool = [y for y in pool if y in p.inputs or y == "acc"]
        y = draw(st.sampled_from(pool)) if pool and draw(st.booleans()) else \
            draw(st.sampled_from([0.5, -1.5, 2.0, 3.0, 1.0e-3]))
        if isinstance(y, float) and draw(st.booleans()) and name != "div":
            x, y = y, x
        t = p.values[x] if isinstance(y, float) else p.values[y] if isinstance(x, float) else \
            _broadcast(p.values[x], p.values[y])
        out = p.define(*t)
        p.steps.append({name: {"x": p.read(x) if isinstance(x, str) else x,
                               "y": p.read(y) if isinstance(y, str) else y, "out": out}})
    elif op == "scale" and tiles:
        x = draw(st.sampled_from(tiles))
        by = [b for b in values if p.values[b][0] in ("row", "scalar") or p.values[b] == ("col", p.values[x][1])]
        by = draw(st.sampled_from(by)) if by and draw(st.booleans()) else 0.25
        out = p.define("tile", p.values[x][1])
        p.steps.append({"scale": {"x": p.read(x), "by": p.read(by) if isinstance(by, str) else by, "out": out}})
    elif op == "reduce" and tiles:
        x = draw(st.sampled_from(tiles))
        axis = draw(st.sampled_from(["cols", "rows"]))
        dims = ["M", "tiles(N)"] if axis == "cols" else [p.values[x][1], "tiles(M)"]
        target = p.name("o")
        p.outputs[target] = dims
        p.steps.append({"reduce": {"op": draw(st.sampled_from(["sum", "sumsq", "max", "logsumexp"])),
                                   "x": p.read(x), "axis": axis, "to": target}})
    elif op == "gated" and p.of("tile", width="N"):
        x = draw(st.sampled_from(p.of("tile", width="N")))
        out = p.define("tile", "N/2")
        p.steps.append({draw(st.sampled_from(["swiglu", "geglu"])): {"x": p.read(x), "out": out}})
    elif op == "select" and p.of("index") and p.of("tile", width="N"):
        target = p.name("o")
        p.outputs[target] = ["M"]
        p.steps.append({"select": {"x": p.read(draw(st.sampled_from(p.of("tile", width="N")))),
                                   "index": p.read(draw(st.sampled_from(p.of("index")))), "to": target}})
    elif op == "one_hot" and p.of("index"):
        out = p.define("tile", "N")
        p.steps.append({"one_hot": {"index": p.read(draw(st.sampled_from(p.of("index")))), "out": out}})
    elif op in ("store", "accumulate") and p.of("tile", "row", "col"):
        x = draw(st.sampled_from(p.of("tile", "row", "col")))
        kind, width = p.values[x]
        if op == "store":
            p.write("store", x, _dims(kind, width))
        else:
            p.write("accumulate", x, _dims(kind, width), inplace=True)
    elif op == "cast":
        # to T (fp32 at these launches) or float32: exact. A cast to bf16 would differ by the rounding mode
        # (the interpreter truncates), which test_primitives.py covers with its own tolerances
        x = draw(st.sampled_from(values))
        out = p.define(*p.values[x])
        p.steps.append({"cast": {"x": p.read(x), "dtype": draw(st.sampled_from(["float32", "T"])), "out": out}})
    elif op == "rope" and p.of("tile", width="N") and p.of("col", width="N/2"):
        positions = p.of("index") + p.of("row")
        if positions:
            freqs = draw(st.sampled_from(p.of("col", width="N/2")))
            pos = draw(st.sampled_from(positions))
            # angles as in a model: frequencies in (0, 1], positions below 64
            if freqs in p.inputs:
                p.special[freqs] = lambda shape, g: 0.05 + 0.95 * torch.rand(shape, generator=g)
            if pos in p.inputs and p.values[pos][0] == "index":
                p.special[pos] = lambda shape, g: torch.randint(0, 64, shape, generator=g)
            x = draw(st.sampled_from(p.of("tile", width="N")))
            out = p.define("tile", "N")
            p.steps.append({draw(st.sampled_from(["rope", "rope_bwd"])): {
                "x": p.read(x), "positions": p.read(pos), "freqs": p.read(freqs), "out": out}})


def spec_dict(p: Program, name: str) -> dict:
    spec = {"kernel": name, "doc": "A random epilogue program."}
    if p.gemm:
        spec["gemm"] = p.gemm
    used = {v for s in p.steps for body in s.values() for v in body.values() if isinstance(v, str)}
    spec["inputs"] = {n: d for n, d in p.inputs.items() if n in used or n in ("a", "b")}
    spec["outputs"] = p.outputs
    spec["epilogue"] = p.steps
    return spec


def dump(spec: dict) -> str:
    return yaml.safe_dump(spec, sort_keys=False, default_flow_style=None, width=1000)


# -- running what was accepted ----------------------------------------------------------------------------------
class Builds:
    """Specs built into packages of a temporary folder, each imported under a name of its own."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0
        sys.path.insert(0, str(root))

    def build(self, paths: list[Path]) -> str:
        self.count += 1
        package = f"cg_fuzz_{self.count}"
        api.build(paths, out=self.root / package)
        importlib.invalidate_caches()
        return package

    def build_kernel(self, path: Path) -> tuple[object, api.Checked]:
        """The kernel spec at `path` renamed after its text, `fuzzed_<hash>`, built into a package of its own:
        (its imported module, its checked kernel). One process registers one op per kernel name and refuses a
        different kernel under a name already taken, as fuzzed specs, all called alike, would otherwise be."""
        text = path.read_bytes()
        spec = yaml.safe_load(text)
        spec["kernel"] = f"fuzzed_{hashlib.sha256(text).hexdigest()[:16]}"
        renamed = self.root / f"{spec['kernel']}.yaml"
        renamed.write_text(dump(spec), encoding="utf-8")
        (checked,) = api.load([renamed])
        package = self.build([renamed])
        return importlib.import_module(f"{package}.kernels.{spec['kernel']}"), checked


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    b = Builds(tmp_path_factory.mktemp("fuzz"))
    yield b
    sys.path.remove(str(b.root))


def run_against_reference(checked: api.Checked, module, seed: int, special: dict | None = None) -> None:
    """The kernel on small ragged shapes (several tiles each way, N even for pairs) against the reference."""
    g = torch.Generator().manual_seed(seed)
    m, n, k = (int(x) for x in torch.randint(1, 45, (3,), generator=g))
    sizes = {"M": m + 20, "N": 2 * (n // 2) + 66, "K": k}
    args = draw_args(module, sizes, torch.float32, CONFIG, generator=g, special=special or {})
    module.launch(**args.kwargs, config=CONFIG)
    kernel, types = checked.kernel, checked.types
    expected = reference.run(kernel, types, args.inputs, CONFIG.block_m, CONFIG.epilogue_n)
    in_fp32 = reference.run(kernel, types, args.inputs, CONFIG.block_m, CONFIG.epilogue_n, dtype=torch.float32)
    # a value cast to fp32 (or T) is exact in the kernel and rounded in float64: whatever a cast feeds is
    # compared with the reference run in fp32
    cast = {name for name, tol in cast_tolerances(kernel, torch.float32).items() if tol}
    for name, out in args.outputs.items():
        ref = in_fp32[name] if name in cast else expected[name]
        assert_same_specials(f"{kernel.name}.{name}", out, ref, TOL, in_fp32[name])


def build_and_run(builds: Builds, path: Path, special: dict) -> None:
    """Build the spec at `path` (under a kernel name of its own), run its kernel and compare it with the
    reference; any failure is reported with the spec's text (and is the same failure whatever the package,
    the kernel and the temporary folder are called)."""
    try:
        module, checked = builds.build_kernel(path)
        run_against_reference(checked, module, zlib.crc32(path.read_bytes()), special)
    except Exception as e:
        raise AssertionError(f"{type(e).__name__}: {e}\n{path.read_text()}") from None


@settings(FUZZ, max_examples=100 * SCALE)
@given(p=programs())
def test_well_formed_specs_build_and_match_the_reference(builds, tmp_path_factory, p):
    path = tmp_path_factory.mktemp("spec") / "k.yaml"
    path.write_text(dump(spec_dict(p, "fuzzed")), encoding="utf-8")
    note(path.read_text())
    try:
        api.load([path])
    except ValidationFailed as e:
        raise AssertionError(f"a well-formed spec was refused:\n{e}\n{path.read_text()}") from None
    build_and_run(builds, path, p.special)


def test_cast_of_a_host_scalar(builds, tmp_path):
    """Found by the fuzzer: a host scalar is a Python float under the interpreter, which has no .to()."""
    path = tmp_path / "k.yaml"
    path.write_text("kernel: cast_scalar\ndoc: Casts a host scalar.\ninputs: {x: [M, N], s: scalar}\n"
                    "outputs: {y: [M, N]}\nepilogue:\n  - cast: {x: s, dtype: float16, out: sb}\n"
                    "  - scale: {x: x, by: sb, out: xs}\n  - store: {x: xs, to: y}\n")
    build_and_run(builds, path, {})


# -- mutated specs ------------------------------------------------------------------------------------------------
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-10**50, 10**50), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["acc", "M", "N", "K", "N/2", "2*N", "tiles(N)", "T", "index", "scalar",
                                           "cols", "rows", "max", "part", "x_desc", "name", "\x1b[31m", "a\nb",
                                           "", " ", "_", "dim/0", "0*dim", "inf", "1e400"]),
    st.lists(st.sampled_from(["M", "N", "K", "dim", 3]), max_size=3),
    st.dictionaries(st.sampled_from(["shape", "dtype", "x", "out", "inplace", "grad"]),
                    st.sampled_from(["M", "T", "float32", True, 1]), max_size=2),
)


def _paths(node, path=()):
    """Every (path, value) of a YAML tree, the root included."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@st.composite
def mutated(draw, tree) -> str:
    """The YAML text of `tree` after one to three mutations of its data, then maybe of its characters."""
    tree = copy.deepcopy(tree)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(tree) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _at(tree, path[:-1]), path[-1]
        how = draw(st.sampled_from(["replace", "replace", "drop", "rename", "duplicate", "swap"]))
        if how == "replace":
            parent[key] = draw(JUNK)
        elif how == "drop":
            del parent[key]
        elif how == "rename" and isinstance(parent, dict):
            new = draw(st.one_of(st.sampled_from([*(str(k) for k in parent), "acc", "part", "first_row", "y_desc",
                                                  "fuzzed_epilogue", "name", "training", "x_sum", "Bad", "1x"]),
                                 st.text(max_size=6)))
            parent[new] = parent.pop(key)
        elif how == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif how == "swap":
            others = [p for p in paths if p != path and not p[:len(path)] == path and not path[:len(p)] == p]
            if others:
                other = draw(st.sampled_from(others))
                a, b = _at(tree, path), _at(tree, other)
                parent[key], _at(tree, other[:-1])[other[-1]] = b, a
    text = yaml.safe_dump(tree, sort_keys=False, default_flow_style=None, width=draw(st.sampled_from([60, 1000])),
                          allow_unicode=True)
    for _ in range(draw(st.integers(0, 2))):  # character edits: delete, insert or replace one
        at = draw(st.integers(0, len(text)))
        piece = draw(st.sampled_from(["", ":", " ", "\n", "-", "{", "[", "]", "'", '"', "&a ", "*a", "!!", "#",
                                      "\t", "\x00", "\u2028", "é", "1e5", "\\", "!!bool ", "!!int ", "!!float "]))
        text = text[:at] + piece + text[at + draw(st.integers(0, 2)):]
    return text


def check_errors(errors: list[SpecError], path: Path) -> None:
    lines = path.read_bytes().count(b"\n") + 2
    for e in errors:
        assert isinstance(e, SpecError)
        assert e.loc.file == str(path) and 1 <= e.loc.line <= lines and e.loc.col >= 1, str(e)
        assert e.message.isprintable() and e.message, f"not one printable line: {e.message!r}"


def load_or_errors(path: Path):
    """The checked specs, or None after checking the errors: anything but ValidationFailed fails the test."""
    try:
        return api.load([path.parent])
    except ValidationFailed as e:
        check_errors(e.errors, path)
        return None



@settings(FUZZ, max_examples=400 * SCALE)
@given(data=st.data())
def test_mutated_kernel_specs_get_located_errors_or_build(builds, tmp_path_factory, data):
    p = data.draw(programs(), label="program")
    text = data.draw(mutated(spec_dict(p, "fuzzed")), label="mutated")
    folder = tmp_path_factory.mktemp("mutant")
    path = folder / "k.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    note(repr(text))
    checked = load_or_errors(path)
    event("accepted" if checked else "refused")
    if checked:  # generated modules that compile (api.generate checks), run like the well-formed ones
        build_and_run(builds, path, p.special)


BLOCKS = sorted((REPO / "specs" / "blocks").glob("*.yaml"))
KERNELS = {yaml.safe_load(path.read_text(encoding="utf-8"))["kernel"]: path
           for path in (REPO / "specs").rglob("*.yaml") if "blocks" not in path.parts}


def called_kernels(block: Path) -> set[Path]:
    """The kernel specs that a block names, as a step or as a value (matmul's accumulate: a kernel); a mutant
    that calls another kernel gets a located error."""
    def names(node):
        if isinstance(node, dict):
            return [n for key, value in node.items() for n in [key, *names(value)]]
        return [n for item in node for n in names(item)] if isinstance(node, list) else [node]
    return {KERNELS[name] for name in names(yaml.safe_load(block.read_text(encoding="utf-8"))) if name in KERNELS}


@settings(FUZZ, max_examples=150 * SCALE)
@given(data=st.data())
def test_mutated_block_specs_get_located_errors_or_build(tmp_path_factory, data):
    block = data.draw(st.sampled_from(BLOCKS), label="block")
    text = data.draw(mutated(yaml.safe_load(block.read_text(encoding="utf-8"))), label="mutated")
    folder = tmp_path_factory.mktemp("block")
    for kernel in called_kernels(block):  # only these: loading and generating every kernel spec is most of the time
        (folder / kernel.name).write_bytes(kernel.read_bytes())
    path = folder / "b.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    note(repr(text))
    checked = load_or_errors(path)
    event("accepted" if checked else "refused")
    if checked:
        api.generate([folder], out=folder / "gen")  # every module compiles
