"""Block specs are validated like kernel specs: each mistake is reported at its file:line:col."""
import importlib
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from codagen import api, runtime  # noqa: F401  (runtime: Triton's interpreter where there is no GPU)
from codagen.blockmodel import CheckedBlock
from codagen.errors import ValidationFailed

KERNEL = """\
kernel: scale_rows
doc: Scales the GEMM by a row vector.
gemm: {a: a, b: w}
inputs:
  a: [M, K]
  w: [N, K]
  r: {shape: [M], dtype: float32}
outputs:
  res: [M, N]
  parts: [M, tiles(N)]
epilogue:
  - scale: {x: acc, by: r, out: v}
  - store: {x: v, to: res}
  - reduce: {op: sum, x: v, axis: cols, to: parts}
"""

GOOD = """\
block: good
doc: A block around scale_rows.
attrs:
  dim: int
  width: int
params:
  w: [width, dim]
inputs:
  a: [M, dim]
  r: {shape: [M], dtype: float32, grad: false}
outputs:
  res: [M, width]
forward:
  - scale_rows: {a: a, w: w, r: r, res: res, parts: parts}
  - sum_tiles: {x: parts, out: total}
save: [a, r, total]
backward:
  - matmul: {a: grad_res, b: w, out: grad_a}
  - matmul: {a: grad_res, b: a, transpose: a, out: grad_w}
"""


def check(tmp_path, block_text):
    (tmp_path / "k.yaml").write_text(KERNEL)
    (tmp_path / "b.yaml").write_text(textwrap.dedent(block_text))
    with pytest.raises(ValidationFailed) as e:
        api.load([tmp_path])
    return [(err.loc.line, err.message) for err in e.value.errors]


def test_good_block_is_valid_apart_from_what_it_never_uses(tmp_path):
    errors = check(tmp_path, GOOD)
    # r and total are saved but the backward never reads them: both are reported, at the save list
    assert [line for line, _ in errors] == [16, 16]
    assert all("never used by the backward" in m for _, m in errors)


@pytest.mark.parametrize("old, new, line, words", [
    ("  - scale_rows: {a: a,", "  - scale_rowz: {a: a,", 14, "unknown kernel or finish step 'scale_rowz'"),
    ("r: r, res: res, parts: parts}", "r: r, res: res, parts: parts, extra: a}", 14, "has no argument 'extra'"),
    ("r: r, res: res, parts: parts}", "r: r, res: res}", 14, "missing parts"),
    ("{a: a, w: w, r: r,", "{a: a, w: w, r: later,", 14, "'later' is not defined before this step"),
    ("  a: [M, dim]", "  a: [M, width]", 14, "earlier arguments make"),
    ("  r: {shape: [M], dtype: float32, grad: false}", "  r: {shape: [M], grad: false}", 14,
     "takes dtype float32"),
    ("- sum_tiles: {x: parts, out: _}", "- sum_tiles: {x: res, out: _}", 15,
     "partial-reduction buffer"),
    ("save: [a, r, total]", "save: [a, r, total, nothing]", 16, "'nothing' is not a forward value"),
    ("  - matmul: {a: grad_res, b: w, out: grad_a}", "  - matmul: {a: grad_res, b: w, out: grad_q}", 9,
     "never defines 'grad_a'"),
    ("b: a, transpose: a, out: grad_w}", "b: a, transpose: c, out: grad_w}", 19, "must be 'none', 'a' or 'b'"),
    ("  width: int", "  width: [x, y]", 7, "dimension 'width' names no int attr"),
])
def test_block_mistakes_are_located(tmp_path, old, new, line, words):
    text = GOOD.replace("save: [a, r, total]", "save: [a]").replace("  - sum_tiles: {x: parts, out: total}\n",
                                                                       "  - sum_tiles: {x: parts, out: _}\n")
    if old.startswith("save:"):
        text = text.replace("save: [a]", new)
    else:
        assert old in text
        text = text.replace(old, new)
    errors = check(tmp_path, text)
    assert any(words in m for _, m in errors), errors
    assert line in [ln for ln, m in errors if words in m], errors


def test_valid_block_builds(tmp_path):
    text = GOOD.replace("save: [a, r, total]", "save: [a]").replace("  - sum_tiles: {x: parts, out: total}\n",
                                                                       "  - sum_tiles: {x: parts, out: _}\n")
    (tmp_path / "k.yaml").write_text(KERNEL)
    (tmp_path / "b.yaml").write_text(text)
    checked = api.load([tmp_path])
    assert {type(c).__name__ for c in checked} == {"Checked", "CheckedBlock"}


LINEAR_KERNEL = """\
kernel: plain_mm
doc: A GEMM and nothing else.
gemm: {a: a, b: w}
inputs:
  a: [M, K]
  w: [N, K]
outputs:
  res: [M, N]
epilogue:
  - store: {x: acc, to: res}
"""

# `transpose: a` is the literal 'a' although a value is named `a` too; the backward runs in row chunks
LINEAR = """\
block: linear
doc: A linear layer whose backward runs in chunks of rows.
attrs:
  dim: int
  width: int
  chunk: 5
params:
  w: [width, dim]
inputs:
  a: [M, dim]
outputs:
  res: [M, width]
forward:
  - plain_mm: {a: a, w: w, res: res}
save: [a]
backward_row_chunks: chunk
backward:
  - matmul: {a: grad_res, b: w, out: grad_a}
  - matmul: {a: grad_res, b: a, transpose: a, out: grad_w}
"""


def test_chunked_backward_is_decided_by_the_check(tmp_path):
    (tmp_path / "k.yaml").write_text(LINEAR_KERNEL)
    (tmp_path / "b.yaml").write_text(LINEAR)
    (block,) = [c for c in api.load([tmp_path]) if isinstance(c, CheckedBlock)]
    chunks = block.chunks
    assert (chunks.rows.value, chunks.rows.is_name) == ("chunk", True)
    assert chunks.sliced == ("a", "grad_res")
    assert (chunks.concatenated, chunks.summed, chunks.summed_by_gemm) == (("grad_a",), ("grad_w",), ("grad_w",))
    assert chunks.dropped == ("grad_a",)
    transpose = [arg for arg in block.backward[1].args if arg.param == "transpose"]
    assert [(arg.value, arg.is_name) for arg in transpose] == [("a", False)]


def test_generated_block_runs_its_chunked_backward(tmp_path):
    """The generated module of LINEAR against float64 autograd, with a ragged token count over 5-row chunks."""
    (tmp_path / "k.yaml").write_text(LINEAR_KERNEL)
    (tmp_path / "b.yaml").write_text(LINEAR)
    api.build([tmp_path], out=tmp_path / "cg_linear_block")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        module = importlib.import_module("cg_linear_block.blocks.linear")
    finally:
        sys.path.remove(str(tmp_path))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = module.Linear(24, 40, device=device, dtype=torch.float32)
    with torch.no_grad():
        layer.w.normal_()
    a = torch.randn(13, 24, device=device, requires_grad=True)
    upstream = torch.randn(13, 40, device=device)
    res = layer(a)
    got = [res, *torch.autograd.grad(res, [a, layer.w], upstream)]
    a64, w64 = a.detach().double().requires_grad_(), layer.w.detach().double().requires_grad_()
    res64 = a64 @ w64.T
    want = [res64, *torch.autograd.grad(res64, [a64, w64], upstream.double())]
    for name, g, w in zip(["res", "grad a", "grad w"], got, want):
        assert ((g.double() - w).norm() / w.norm()).item() < 1e-5, name


NO_ROWS = """\
block: no_rows
doc: A block whose backward has nothing with the token dimension to cut into chunks.
attrs:
  dim: int
params:
  w: [dim, dim]
inputs:
  a: {shape: [M, dim], grad: false}
outputs:
  res: {shape: [M, dim], grad: false}
forward:
  - plain_mm: {a: a, w: w, res: res}
backward_row_chunks: 4
backward:
  - matmul: {a: w, b: w, out: grad_w}
"""

FORWARD_ONLY = LINEAR.split("save:")[0].replace("  res: [M, width]", "  res: {shape: [M, width], grad: false}") \
    + "backward_row_chunks: chunk\n"


@pytest.mark.parametrize("block_text, words", [
    (LINEAR.replace("backward_row_chunks: chunk", "backward_row_chunks: width_x"),
     "backward_row_chunks 'width_x' names no int attr"),
    (NO_ROWS, "needs a saved value or an output gradient with the token dimension M"),
    (FORWARD_ONLY, "backward_row_chunks is given but the block has no backward"),
])
def test_chunked_backward_mistakes(tmp_path, block_text, words):
    (tmp_path / "k.yaml").write_text(LINEAR_KERNEL)
    (tmp_path / "b.yaml").write_text(block_text)
    with pytest.raises(ValidationFailed) as e:
        api.load([tmp_path])
    assert any(words in err.message for err in e.value.errors), e.value


def test_generated_block_modules_keep_lines_short_and_pass_arguments_by_keyword():
    """Below the provenance header: lines of at most 120 characters, and every kernel or finish call by keyword."""
    blocks = sorted((Path(__file__).resolve().parent.parent / "generated" / "blocks").glob("[!_]*.py"))
    assert blocks
    for path in blocks:
        lines = path.read_text().splitlines()
        assert all(len(line) <= 120 for line in lines[1:]), path.name
        calls = re.findall(r"(?:kernels\.\w+\.\w+|finish\.\w+|\.add_matmul)\(([^()]*)\)", path.read_text())
        assert calls, path.name
        for args in calls:
            assert all(re.fullmatch(r"\w+=\S+", a.strip()) for a in args.split(",") if a.strip()), (path.name, args)


# -- forward_with_grads ------------------------------------------------------------------------------------
SPECS = Path(__file__).resolve().parent.parent / "specs"


def test_forward_with_grads_is_decided_by_the_check():
    """lm_head_loss: what its chunk loop slices, concatenates, sums (the weight's by its GEMM) and saves."""
    (block,) = [c for c in api.load([SPECS]) if isinstance(c, CheckedBlock) and c.block.name == "lm_head_loss"]
    g = block.grad_forward
    assert [c.op for c in g.before] == ["row_weights", "unit_scale", "mul"]
    assert [c.op for c in g.after] == ["cross_entropy"] and g.grad_scale == "scale"
    chunks = g.chunks
    assert (chunks.rows.value, chunks.sums.value, chunks.sums.is_name) == ("chunk_rows", "grad_sum", True)
    assert chunks.sliced == ("x", "target", "weights")
    assert chunks.concatenated == ("target_logit", "lse", "grad_x")
    assert (chunks.summed, chunks.summed_by_gemm) == (("grad_wn", "grad_w_vocab"), ("grad_w_vocab",))
    assert g.output == "loss" and block.saved == ("grad_x", "grad_wn", "grad_w_vocab", "scale")
    assert block.grads == ("grad_x", "", "grad_wn", "grad_w_vocab")
    assert [name for name, _, rows in block.passes() if rows] == ["forward with gradients"]


def lm_head_mistake(tmp_path, old: str, new: str) -> list[str]:
    specs = tmp_path / "specs"
    shutil.copytree(SPECS, specs)
    path = specs / "blocks" / "lm_head_loss.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    with pytest.raises(ValidationFailed) as e:
        api.load([specs])
    return [f"{err.loc.line}: {err.message}" for err in e.value.errors]


@pytest.mark.parametrize("old, new, words", [
    ("  row_chunks: chunk_rows", "  row_chunks: rows_per", "row_chunks 'rows_per' names no int attr"),
    ("  sums: grad_sum", "  sums: bfloat16", "sums must be 'float32', 'same' or an attr"),
    ("  sums: grad_sum", "  sums: reduction", "sums must be 'float32', 'same' or an attr"),
    ("  loss: {shape: [], dtype: float32}\n", "  loss: {shape: [], dtype: float32}\n  per_row: [M]\n",
     "needs exactly one differentiable output, a scalar"),
    ("    - matmul: {a: dz, b: normed, transpose: a, out: grad_w_vocab, accumulate: matmul_accumulate}\n", "",
     "never defines 'grad_w_vocab'"),
    ("accumulate: matmul_accumulate}", "accumulate: matmul_accumulated}",
     "matmul.accumulate: 'matmul_accumulated' is no kernel spec among those given"),
    ("accumulate: matmul_accumulate}", "accumulate: matmul}", "kernel 'matmul' ("),
    ("accumulate: matmul_accumulate}", "accumulate: matmul}", ") must add its GEMM to a total"),
    ("accumulate: matmul_accumulate}", "accumulate: lm_head_logits}", "kernel 'lm_head_logits'"),
    ("  sums: grad_sum", "  sums: float32", "matmul.accumulate: the gradients are summed in float32 here"),
    ("  - logsumexp_tiles: {x: lse_part, inf_max: nan, out: lse}\n  - cross_entropy",
     "  - logsumexp_tiles: {x: lse_part, inf_max: nan, out: lse}\n"
     "  - matmul: {a: h, b: h, transpose: a, out: hh, accumulate: matmul_accumulate}\n  - cross_entropy",
     "matmul.accumulate: only a parameter's gradient that its GEMM sums over row chunks"),
    ("inf_max: nan, out: lse}\n  - cross_entropy", "inf_max: inf, out: lse}\n  - cross_entropy",
     "logsumexp_tiles.inf_max"),
    ("  after:\n", "  after:\n    - sum_tiles: {x: dwn_part, out: wn_total}\n",
     "'dwn_part' is made on each chunk of rows without the token dimension M"),
    ("forward_with_grads:\n", "backward_row_chunks: 4\nforward_with_grads:\n",
     "the block has no backward, save or backward_row_chunks besides"),
    ("  grad_scale: scale", "  grad_scale: weights_total", "grad_scale: 'weights_total' is not made by "
                                                            "forward_with_grads.before"),
    ("  grad_scale: scale", "  grad_scale: weights", "grad_scale 'weights' must be a [] float32 value"),
    ("    - unit_scale: {x: row_weight", "    - unit_scale: {x: target", "unit_scale.x must be float32, got index"),
    ("size: dim,", "size: -1,", "rstd.size must be positive, got -1"),
    ("divide_by: dim,", "divide_by: 0,", "sum_tiles.divide_by must be positive, got 0"),
    ("classes: vocab,", "classes: 0,", "cross_entropy.classes must be positive, got 0"),
])
def test_forward_with_grads_mistakes_are_reported(tmp_path, old, new, words):
    errors = lm_head_mistake(tmp_path, old, new)
    assert any(words in e for e in errors), errors


# Finish steps on row vectors, composed as a loss (line 17: the kernel call, 18-21: the finish steps)
ROW_STEPS = """\
block: row_steps
doc: A loss made of finish steps on row vectors.
attrs:
  dim: int
  width: int
  lam: 0.5
  red: [mean, sum]
params:
  w: [width, dim]
inputs:
  a: [M, dim]
  r: {shape: [M], dtype: float32, grad: false}
  target: {shape: [M], dtype: index}
outputs:
  loss: {shape: [], dtype: float32, grad: false}
forward:
  - scale_rows: {a: a, w: w, r: r, res: _, parts: parts}
  - sum_tiles: {x: parts, out: total}
  - mul: {x: total, y: lam, out: scaled}
  - add: {x: scaled, y: 1.0, out: shifted}
  - reduce_loss: {x: shifted, target: target, classes: width, ignore_index: -100, reduction: red, loss: loss,
                  weights: _}
"""


def test_row_finish_steps_are_valid(tmp_path):
    (tmp_path / "k.yaml").write_text(KERNEL)
    (tmp_path / "b.yaml").write_text(ROW_STEPS)
    checked = next(c for c in api.load([tmp_path]) if isinstance(c, CheckedBlock))
    assert [c.op for c in checked.forward] == ["scale_rows", "sum_tiles", "mul", "add", "reduce_loss"]
    assert str(checked.values["parts"].dims[1]) == "tiles(width)"


@pytest.mark.parametrize("old, new, line, words", [
    ("mul: {x: total, y: lam", "mul: {x: parts, y: total", 19, "x is [M, tiles(width)] and y is [M]"),
    ("add: {x: scaled, y: 1.0", "add: {x: target, y: 1.0", 20, "add.x is an index value"),
    ("mul: {x: total, y: lam", "mul: {x: total, y: later", 19, "'later' is not defined before this step"),
    ("mul: {x: total, y: lam", "mul: {x: 2, y: lam", 19, "both operands are numbers"),
    ("  red: [mean, sum]", "  red: [mean, none]", 21, "the loss's shape must not depend on an attr"),
    ("reduction: red", "reduction: avg", 21, "must be 'mean', 'sum', 'none'"),
    ("reduce_loss: {x: shifted", "reduce_loss: {x: parts", 21, "reduce_loss.x must be [M] float32"),
    ("reduction: red, loss", "reduction: red, token_weights: target, loss", 21,
     "reduce_loss.token_weights must be [M] float32"),
    ("- sum_tiles: {x: parts", "- sum_tiles: {x: r", 18, "partial-reduction buffer [rows, tiles(...)]"),
    # sizes given as numbers are positive; ignore_index is any integer (-100 above), never a fraction or a bool
    ("sum_tiles: {x: parts,", "sum_tiles: {x: parts, divide_by: 0,", 18, "sum_tiles.divide_by must be positive, got 0"),
    ("sum_tiles: {x: parts,", "sum_tiles: {x: parts, divide_by: -1,", 18, "divide_by must be positive, got -1"),
    ("classes: width,", "classes: 0,", 21, "reduce_loss.classes must be positive, got 0"),
    ("classes: width,", "classes: -5,", 21, "reduce_loss.classes must be positive, got -5"),
    ("ignore_index: -100,", "ignore_index: -1.5,", 21, "reduce_loss.ignore_index must be an integer"),
    ("ignore_index: -100,", "ignore_index: lam,", 21, "'lam' must be a number or an attr of kind int"),
])
def test_row_finish_step_mistakes_are_located(tmp_path, old, new, line, words):
    assert old in ROW_STEPS
    errors = check(tmp_path, ROW_STEPS.replace(old, new))
    assert line in [ln for ln, m in errors if words in m], errors


def test_a_size_out_of_range_is_located_at_its_value(tmp_path):
    """file:line:col of the number itself, as every spec error; a negative ignore_index is no error."""
    (tmp_path / "k.yaml").write_text(KERNEL)
    spoiled = ROW_STEPS.replace("sum_tiles: {x: parts,", "sum_tiles: {x: parts, divide_by: 0,")
    (tmp_path / "b.yaml").write_text(spoiled.replace("ignore_index: -100", "ignore_index: -7"))
    with pytest.raises(ValidationFailed) as e:
        api.load([tmp_path])
    col = spoiled.splitlines()[17].index("0,") + 1
    assert f"{tmp_path / 'b.yaml'}:18:{col}: sum_tiles.divide_by must be positive, got 0" in str(e.value)
    assert "ignore_index" not in str(e.value)


def test_reference_block_examples_are_valid_blocks(tmp_path):
    """Every YAML block of docs/spec-reference.md that starts with `block:` is a block codagen accepts, against
    the kernels of specs/; and every finish step is documented with each of its arguments."""
    from codagen.finish_steps import FINISH_STEPS

    text = (Path(__file__).resolve().parent.parent / "docs" / "spec-reference.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("block:")]
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        (tmp_path / f"example_{i}.yaml").write_text(block, encoding="utf-8")
    specs = Path(__file__).resolve().parent.parent / "specs"
    names = {c.block.name for c in api.load([specs, tmp_path]) if isinstance(c, CheckedBlock)}
    assert {re.match(r"block: (\w+)", b).group(1) for b in blocks} <= names
    table = text[text.index("### Finish steps"):text.index("**The loss steps**")]
    rows = re.findall(r"^\| `\w+`.*$", table, re.M)
    for op, step in FINISH_STEPS.items():
        row = next((r for r in rows if f"`{op}`" in r.split("|")[1]), None)
        assert row is not None, f"finish step {op} is not documented"
        for arg in step.args:
            assert f"`{arg.name}" in row, f"{op}.{arg.name} is not documented"


def test_a_kernel_named_like_a_finish_step_is_not_called_silently(tmp_path):
    """A block step is the finish step of its name; a kernel of that name gets a hint, not a silent swap."""
    (tmp_path / "k.yaml").write_text(KERNEL.replace("kernel: scale_rows", "kernel: square"))
    (tmp_path / "b.yaml").write_text(ROW_STEPS.replace("- scale_rows:", "- square:"))
    with pytest.raises(ValidationFailed) as e:
        api.load([tmp_path])
    assert any("is the finish step, not the kernel of that name" in err.message and err.loc.line == 17
               for err in e.value.errors), e.value.errors


# ---- outputs written over a value: in_place ------------------------------------------------------------------

SHIFT_KERNEL = """\
kernel: shift_rows
doc: Adds a row vector to a tile (no GEMM).
inputs:
  x: [M, N]
  r: {shape: [M], dtype: float32}
outputs:
  y: [M, N]
epilogue:
  - add: {x: x, y: r, out: v}
  - store: {x: v, to: y}
"""

SHIFTED_TWICE = """\
block: shifted_twice
doc: Shifts the rows twice, the second time over the first result.
attrs:
  dim: int
inputs:
  x: {{shape: [M, dim], grad: false}}
  r: {{shape: [M], dtype: float32, grad: false}}
outputs:
  z: {{shape: [M, dim], grad: false}}{extra_output}
forward:
  - shift_rows: {{x: x, r: r, y: once{first}}}
  - shift_rows: {{x: once, r: r, y: z{second}}}{extra_step}
"""


def shifted_twice(first="", second=", in_place: {y: once}", extra_output="", extra_step="") -> str:
    return SHIFTED_TWICE.format(first=first, second=second, extra_output=extra_output, extra_step=extra_step)


def _load_shift(tmp_path, block: str):
    (tmp_path / "k.yaml").write_text(SHIFT_KERNEL)
    (tmp_path / "b.yaml").write_text(block)
    return api.load([tmp_path])


@pytest.mark.parametrize("kwargs, words", [
    ({"second": ", in_place: {z: once}"}, "'z' is not an output of kernel 'shift_rows'"),
    ({"second": ", in_place: {y: r}"}, "'r' is not what this call passes as 'x', the input y may be written over"),
    ({"first": ", in_place: {y: x}", "second": ""}, "'x' is not made by an earlier step"),
    ({"extra_step": "\n  - shift_rows: {x: once, r: r, y: again}", "extra_output": "\n  again: [M, dim]"},
     "'once' is read again at line 14"),
    ({"extra_output": "\n  once: {shape: [M, dim], grad: false}"}, "'once' is used after these steps"),
    ({"second": ", in_place: once"}, "shift_rows.in_place must be a mapping"),
], ids=["not-an-output", "not-an-overwritable-input", "block-input", "read-later", "block-output", "not-a-mapping"])
def test_in_place_is_checked(tmp_path, kwargs, words):
    with pytest.raises(ValidationFailed) as info:
        _load_shift(tmp_path, shifted_twice(**kwargs))
    listing = "\n".join(map(str, info.value.errors))
    assert words in listing, listing


STATS_FINISH_IN_PLACE = """\
block: finish_in_place
doc: A finish step cannot write over a value.
attrs:
  dim: int
inputs:
  x: {shape: [M, dim], grad: false}
  r: {shape: [M], dtype: float32, grad: false}
outputs:
  s: {shape: [M], dtype: float32, grad: false}
forward:
  - shift_rows: {x: x, r: r, y: once}
  - sum_tiles: {x: once, out: s, in_place: {out: once}}
"""


def test_in_place_is_for_kernel_calls(tmp_path):
    block = STATS_FINISH_IN_PLACE
    (tmp_path / "b.yaml").write_text(block)
    (tmp_path / "k.yaml").write_text(SHIFT_KERNEL)
    with pytest.raises(ValidationFailed) as info:
        api.load([tmp_path])
    assert "sum_tiles.in_place: only kernel calls write outputs over a value" in "\n".join(map(str, info.value.errors))


def test_in_place_block_writes_over_its_value(tmp_path):
    """The generated block passes the value as the output, and the result is the float64 one; the kernel's
    function writes over exactly what it is given, and refuses memory that only overlaps an argument."""
    (tmp_path / "k.yaml").write_text(SHIFT_KERNEL)
    (tmp_path / "b.yaml").write_text(shifted_twice())
    api.build([tmp_path], out=tmp_path / "cg_in_place")
    source = (tmp_path / "cg_in_place" / "blocks" / "shifted_twice.py").read_text()
    assert "z = kernels.shift_rows.shift_rows(x=once, r=r, y=once)" in source
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        block = importlib.import_module("cg_in_place.blocks.shifted_twice")
        kernel = importlib.import_module("cg_in_place.kernels.shift_rows")
    finally:
        sys.path.remove(str(tmp_path))
    x, r = torch.randn(37, 29), torch.randn(37)
    z = block.ShiftedTwice(29)(x, r)
    torch.testing.assert_close(z.double(), x.double() + 2 * r.double()[:, None], rtol=1e-6, atol=1e-6)
    once = x.clone()
    out = kernel.shift_rows(once, r, y=once)
    assert out.data_ptr() == once.data_ptr()
    torch.testing.assert_close(out.double(), x.double() + r.double()[:, None], rtol=1e-6, atol=1e-6)
    buffer = torch.randn(38, 29)
    with pytest.raises(ValueError, match="output 'y' overlaps input 'x'"):
        kernel.shift_rows(buffer[1:], r, y=buffer[:-1])
