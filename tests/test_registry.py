"""The primitive registry (codagen/primitives): every primitive is complete and tested, the files generated
from it are up to date, and a backend can ask which steps it cannot lower."""
from __future__ import annotations

import dataclasses
import pkgutil
import re

import pytest
import yaml

import codagen.primitives
from codagen import api
from codagen.primitives import FAMILIES, PRIMITIVES, docs, unsupported_steps
from conftest import REPO, TEST_SPECS, kernel_model


def test_generated_files_are_up_to_date():
    stale = docs.outdated()
    assert not stale, f"{stale} differ from what the registry generates; run: python -m codagen.primitives.docs"


def test_every_family_module_is_registered():
    modules = {m.name for m in pkgutil.iter_modules(codagen.primitives.__path__)} - {"base", "docs"}
    assert modules == {f.__name__.rsplit(".", 1)[1] for f in FAMILIES}


@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_primitive_is_complete(name):
    p = PRIMITIVES[name]
    assert "tl" in p.emitters, f"{name} has no tl emitter"
    assert p.doc and p.typing and "\n" not in p.doc + p.typing
    example = yaml.safe_load(p.example)
    assert list(example) == [name], f"{name}: the example is a step of another primitive"
    assert list(example[name]) == [a.name for a in p.args], f"{name}: the example's arguments"
    for arg in p.args:
        if arg.kind == "enum":
            assert example[name][arg.name] in arg.choices


def _used_in_test_specs() -> dict[str, set[tuple[str, str]]]:
    """Primitive -> the (argument, keyword) pairs its steps in tests/specs/t_*.yaml use."""
    used: dict[str, set[tuple[str, str]]] = {}
    for c in api.load(sorted(TEST_SPECS.glob("t_*.yaml"))):
        for step in c.kernel.steps:
            keywords = {(a.name, step.args[a.name]) for a in PRIMITIVES[step.op].args if a.kind == "enum"}
            used.setdefault(step.op, set()).update(keywords)
    return used


def test_every_primitive_has_a_test_spec():
    """test_primitives runs every test spec against the float64 reference: a primitive that no test spec
    uses is not tested."""
    used = _used_in_test_specs()
    missing = [name for name in PRIMITIVES if name not in used]
    assert not missing, f"no spec in tests/specs/t_*.yaml uses {missing}; add a step to the spec of its family"
    unused = [f"{p.name}.{a.name}: {choice}" for p in PRIMITIVES.values() for a in p.args if a.kind == "enum"
              for choice in a.choices if (a.name, choice) not in used[p.name]]
    assert not unused, f"no test spec uses the keywords {unused}"


def test_unsupported_steps_names_the_steps_a_backend_lacks(monkeypatch):
    kernel = kernel_model("t_scale")
    assert unsupported_steps(kernel, "tl") == []
    assert unsupported_steps(kernel, "none") == list(kernel.steps)
    add = PRIMITIVES["add"]
    monkeypatch.setitem(PRIMITIVES, "add", dataclasses.replace(add, emitters={**add.emitters, "partial": None}))
    lacking = unsupported_steps(kernel, "partial")
    assert lacking and [s for s in kernel.steps if s not in lacking] == [s for s in kernel.steps if s.op == "add"]
    assert all(s.loc.file == "tests/specs/t_scale.yaml" and s.loc.line > 1 for s in lacking)


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, re.S)


def test_reference_examples_are_valid_specs(tmp_path):
    """Every YAML block of docs/spec-reference.md that starts with `kernel:` is a spec codagen accepts."""
    blocks = [b for b in _yaml_blocks((REPO / docs.REFERENCE).read_text(encoding="utf-8"))
              if b.lstrip().startswith(("kernel:", "# yaml-language-server"))]
    assert len(blocks) > 10
    for i, block in enumerate(blocks):
        (tmp_path / f"example_{i}.yaml").write_text(block, encoding="utf-8")
    assert len(api.load([tmp_path])) == len(blocks)


def test_reduce_ops_are_named_constants_of_tile():
    from codagen.primitives.reduce import REDUCTIONS
    from codagen.runtime import tile

    values = {r.name: getattr(tile, r.constant.removeprefix("tile.")).value for r in REDUCTIONS}
    assert len(set(values.values())) == len(values), f"two reductions share a code: {values}"


def _long_names_spec() -> str:
    """A spec whose names have the most characters a name may have (48), to test line wrapping."""
    n = lambda s: (s + "_" + "q" * 48)[:48]  # noqa: E731
    x, pos, freqs, rot, z = n("x_in"), n("positions"), n("freqs"), n("rot"), n("zz")
    return f"""kernel: long_names
doc: Every generated line of a kernel with long names fits in 120 columns.
gemm: {{a: a, b: b}}
inputs: {{a: [M, K], b: [N, K], {x}: [M, 2*N], {pos}: {{shape: [M], dtype: index}}, {freqs}: [N]}}
outputs: {{{n('out')}: [M, 2*N], {n('sums')}: [M, tiles(N)], {n('picked')}: [M], {n('by_rows')}: [N, tiles(M)]}}
epilogue:
  - rope: {{x: {x}, positions: {pos}, freqs: {freqs}, out: {rot}}}
  - store: {{x: {rot}, to: {n('out')}}}
  - reduce: {{op: logsumexp, x: {rot}, axis: cols, to: {n('sums')}}}
  - select: {{x: {rot}, index: {pos}, to: {n('picked')}}}
  - add: {{x: acc, y: {freqs}, out: {z}}}
  - reduce: {{op: sumsq, x: {z}, axis: rows, to: {n('by_rows')}}}
"""


def test_epilogue_lines_fit_and_comments_show_the_steps(tmp_path):
    """Every line of a kernel module fits in 120 columns (its header aside) once the line breaker has run, the
    code still parses, and each step's comment is the step as written (no line numbers: inserting a step changes
    no other line), a cast that a store converted already saying so."""
    from codagen.emit.epilogue import emit_epilogue
    from codagen.emit.kernel import render_kernel
    from codagen.primitives import step_text

    (tmp_path / "long_names.yaml").write_text(_long_names_spec(), encoding="utf-8")
    checked = [c for c in api.load([REPO / "specs", TEST_SPECS, tmp_path]) if isinstance(c, api.Checked)]
    for c in checked:
        module = render_kernel(c.kernel, c.types, "codagen build")
        too_long = [line for line in module.splitlines()[2:] if len(line) > 120]
        assert not too_long, f"{c.kernel.name}: {too_long}"
        compile(module, c.kernel.name, "exec")
        shown = [line[2:].removesuffix("  (rounded with the store above)")
                 for line in emit_epilogue(c.kernel, c.types) if line.startswith("# ")]
        assert shown == [step_text(s) for s in c.kernel.steps]
