"""Finish steps and the partials they combine: a kernel's `reduce: {op: ...}` output is a Partial(op, dims)
in the block, and a finish step takes only the partials of the reductions it declares (sum_tiles: sum and
sumsq; rstd: sumsq; logsumexp_tiles: logsumexp); any other is refused at the value's file:line:col."""

import pytest
import yaml

from codagen import api
from codagen.blockmodel import CheckedBlock, Partial
from codagen.errors import ValidationFailed
from codagen.finish_steps import FINISH_STEPS
from codagen.primitives.reduce import REDUCTIONS

STATS_KERNEL = """\
kernel: tile_stats
doc: A GEMM and one partial reduction of its tile ({op} along {axis}).
gemm: {{a: a, b: w}}
inputs:
  a: [M, K]
  w: [N, K]
outputs:
  parts: {shape}
epilogue:
  - reduce: {{op: {op}, x: acc, axis: {axis}, to: parts}}
"""

STATS_BLOCK = """\
block: stats
doc: A reduction of a GEMM, finished.
attrs:
  dim: int
  width: int
  eps: 1.0e-6
inputs:
  a: {{shape: [M, dim], grad: false}}
  w: {{shape: [width, dim], grad: false}}
outputs:
  total: {{shape: [{rows}], dtype: float32, grad: false}}
forward:
  - tile_stats: {{a: a, w: w, parts: parts}}
  {between}
  - {finish}: {{x: {x}, {extra}out: total}}
"""
EXTRA = {"sum_tiles": "", "rstd": "size: width, eps: eps, ", "logsumexp_tiles": ""}


def _write(tmp_path, op: str, finish: str, axis: str = "cols", between: str = "", x: str = "parts") -> str:
    shape, rows = ("[M, tiles(N)]", "M") if axis == "cols" else ("[N, tiles(M)]", "width")
    (tmp_path / "k.yaml").write_text(STATS_KERNEL.format(op=op, axis=axis, shape=shape))
    if not between:
        between = "- mul: {x: parts, y: 1.0, out: unused}"  # a step that keeps the line numbers, removed below
    text = STATS_BLOCK.format(rows=rows, between=between, finish=finish, x=x, extra=EXTRA[finish])
    text = text.replace("  - mul: {x: parts, y: 1.0, out: unused}\n", "")
    (tmp_path / "b.yaml").write_text(text)
    return text


def _errors(tmp_path) -> list[str]:
    with pytest.raises(ValidationFailed) as e:
        api.load([tmp_path])
    return [str(err) for err in e.value.errors]


def _finish_x(text: str, finish: str) -> str:
    """line:col of the finish step's x value in the block's text."""
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith(f"  - {finish}:"))
    return f"{line}:{text.splitlines()[line - 1].index('{x: ') + 5}"


@pytest.mark.parametrize("op, finish", [
    ("sum", "sum_tiles"), ("sumsq", "sum_tiles"), ("sumsq", "rstd"), ("logsumexp", "logsumexp_tiles"),
])
@pytest.mark.parametrize("axis", ["cols", "rows"])
def test_partials_of_a_reduction_a_finish_step_combines_are_valid(tmp_path, op, finish, axis):
    _write(tmp_path, op, finish, axis)
    block = next(c for c in api.load([tmp_path]) if isinstance(c, CheckedBlock))
    assert block.values["parts"] == Partial(op, block.values["parts"].dims)
    assert block.values["parts"].dtype == "float32"


@pytest.mark.parametrize("op, finish, combines, hint", [
    ("max", "sum_tiles", "sum or sumsq", "no finish step combines max partials"),
    ("logsumexp", "sum_tiles", "sum or sumsq", "logsumexp partials are combined by logsumexp_tiles"),
    ("sum", "rstd", "sumsq", "sum partials are combined by sum_tiles"),
    ("max", "rstd", "sumsq", "no finish step combines max partials"),
    ("sum", "logsumexp_tiles", "logsumexp", "sum partials are combined by sum_tiles"),
    ("max", "logsumexp_tiles", "logsumexp", "no finish step combines max partials"),
])
@pytest.mark.parametrize("axis", ["cols", "rows"])
def test_partials_of_another_reduction_are_refused_where_they_are_passed(tmp_path, op, finish, combines, hint, axis):
    """A kernel writing max partials that a block finishes with sum_tiles validated before (a silent numerical
    bug: the sum of per-tile maxima); so did rstd over sum partials."""
    text = _write(tmp_path, op, finish, axis)
    where = f"{tmp_path / 'b.yaml'}:{_finish_x(text, finish)}"
    errors = _errors(tmp_path)
    assert errors == [f"{where}: {finish}.x: 'parts' holds the partials of reduce op {op} (kernel 'tile_stats', "
                      f"output 'parts'), and {finish} combines those of {combines}; {hint}"], errors


@pytest.mark.parametrize("between, x", [
    ("- mul: {x: parts, y: 0.5, out: half}", "half"),
    ("- div: {x: parts, y: width, out: half}", "half"),
    ("- add: {x: parts, y: parts, out: half}", "half"),
    ("- sub: {x: parts, y: parts, out: half}", "half"),
])
def test_partials_keep_their_reduction_through_linear_finish_steps(tmp_path, between, x):
    """Σ_t (s · p_t) = s · Σ_t p_t: partials combined by summing stay partials of their reduction when scaled by a
    scalar or added to partials of the same reduction."""
    _write(tmp_path, "sumsq", "rstd", between=between, x=x)
    block = next(c for c in api.load([tmp_path]) if isinstance(c, CheckedBlock))
    assert block.values[x] == Partial("sumsq", block.values["parts"].dims)
    text = _write(tmp_path, "max", "sum_tiles", between=between, x=x)
    assert f"b.yaml:{_finish_x(text, 'sum_tiles')}: sum_tiles.x: '{x}' is no partials" in "\n".join(_errors(tmp_path))


@pytest.mark.parametrize("between", [
    "- add: {x: parts, y: 1.0, out: half}",  # a number per tile: the sum would depend on the tile count
    "- mul: {x: parts, y: parts, out: half}",
    "- square: {x: parts, out: half}",
])
def test_partials_changed_otherwise_are_no_partials(tmp_path, between):
    text = _write(tmp_path, "sum", "sum_tiles", between=between, x="half")
    errors = "\n".join(_errors(tmp_path))
    assert f"b.yaml:{_finish_x(text, 'sum_tiles')}: sum_tiles.x: 'half' is no partials" in errors, errors


# ---- the registry (codagen/finish_steps): every step complete, its runtime function taking its arguments, the
# docs generated from it ------------------------------------------------------------------------------------------

def test_every_family_module_is_registered():
    import pkgutil

    import codagen.finish_steps
    from codagen.finish_steps import FAMILIES

    modules = {m.name for m in pkgutil.iter_modules(codagen.finish_steps.__path__)} - {"base", "docs"}
    assert modules == {f.__name__.rsplit(".", 1)[1] for f in FAMILIES}


@pytest.mark.parametrize("name", list(FINISH_STEPS))
def test_finish_step_is_complete(name):
    step = FINISH_STEPS[name]
    assert step.doc and "\n" not in step.doc + step.example
    assert [a.name for a in step.args] == list(dict.fromkeys(a.name for a in step.args)), "an argument twice"
    assert step.outs, f"{name} defines no value"
    example = yaml.safe_load(step.example)
    assert list(example) == [name], f"{name}: the example is a step of another finish step"
    given = example[name]
    assert set(given) <= {a.name for a in step.args}, f"{name}: the example's arguments"
    assert {a.name for a in step.args if not a.optional} <= set(given), f"{name}: the example leaves out a required one"
    for a in step.args:
        if a.kind in ("choice", "keyword"):
            assert a.choices, f"{name}.{a.name} has no choices"
        if a.kind == "keyword" and a.name in given:
            assert given[a.name] in a.choices, f"{name}: the example's {a.name}"
    # partials: the argument and the reductions it takes go together, and name reductions that exist
    assert bool(step.combines) == any(a.kind == "partials" for a in step.args), name
    assert set(step.combines) <= {r.name for r in REDUCTIONS}, name


@pytest.mark.parametrize("name", list(FINISH_STEPS))
def test_runtime_function_takes_the_arguments(name):
    """The generated block calls finish.<name>(...) with every argument the spec gives, by keyword: the
    function takes each (a kernel argument goes to runtime.ChunkSum.add_matmul instead), has a default for
    each optional one, and needs none the step lacks."""
    import inspect

    from codagen.runtime import ChunkSum

    step = FINISH_STEPS[name]
    params = inspect.signature(step.runtime).parameters
    passed = [a for a in step.args if a.kind not in ("out", "kernel")]
    for a in passed:
        assert a.name in params, f"finish.{name} takes no '{a.name}'"
        assert params[a.name].kind is not inspect.Parameter.POSITIONAL_ONLY
        if a.optional:
            assert params[a.name].default is not inspect.Parameter.empty, f"finish.{name}: '{a.name}' has no default"
    needed = [p for p, v in params.items() if v.default is inspect.Parameter.empty
              and v.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    assert set(needed) <= {a.name for a in passed if not a.optional}, f"finish.{name} needs {needed}"
    for a in step.args:
        if a.kind == "kernel":
            assert a.name in inspect.signature(ChunkSum.add_matmul).parameters


def test_generated_docs_are_up_to_date():
    """The finish-step kinds and table of docs/spec-reference.md, and the reductions' table that names the
    steps combining each, are generated from the registry (CI: python -m codagen.primitives.docs --check)."""
    from codagen.primitives import docs

    stale = docs.outdated()
    assert not stale, f"{stale} differ from what the registries generate; run: python -m codagen.primitives.docs"
    text = (docs.ROOT / docs.REFERENCE).read_text(encoding="utf-8")
    for name, step in FINISH_STEPS.items():
        assert f"| `{name}` |" in text and f"`- {step.example}`" in text, name


def test_a_new_finish_step_is_one_registry_entry(tmp_path, monkeypatch):
    """docs/contributing.md's worked example: a step combining max partials, declared once, is what the checker
    accepts for them, names in its messages and writes into the docs."""
    from codagen.finish_steps import FinishArg, FinishStep
    from codagen.finish_steps.partials import _per_row
    from codagen.primitives import docs

    max_tiles = FinishStep("max_tiles", (FinishArg("x", "partials", what="`[rows, tiles]` float32"),
                                         FinishArg("out", "out")),
                           "`[rows]` float32: the largest value of each row, from per-tile maxima",
                           "max_tiles: {x: top_part, out: top}", check=_per_row, combines=("max",))
    _write(tmp_path, "max", "sum_tiles")
    assert "max partials are combined by" not in "\n".join(_errors(tmp_path))
    monkeypatch.setitem(FINISH_STEPS, "max_tiles", max_tiles)
    assert "max partials are combined by max_tiles" in "\n".join(_errors(tmp_path))
    EXTRA["max_tiles"] = ""
    try:
        _write(tmp_path, "max", "max_tiles")
        block = next(c for c in api.load([tmp_path]) if isinstance(c, CheckedBlock))
    finally:
        del EXTRA["max_tiles"]
    assert [c.op for c in block.forward] == ["tile_stats", "max_tiles"]
    assert "| `max` | `max x` | `max` | `max_tiles` |" in docs.reduction_table()
    assert "| `max_tiles` | `x` partials of `max` `[rows, tiles]` float32, `out` out |" in docs.finish_table()
