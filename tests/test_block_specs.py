"""Block specs are validated like kernel specs: each mistake is reported at its file:line:col."""
import textwrap

import pytest

from codagen import api
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
  part: [M, tiles(N)]
epilogue:
  - scale: {x: acc, by: r, out: v}
  - store: {x: v, to: res}
  - reduce: {op: sum, x: v, axis: cols, to: part}
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
  - scale_rows: {a: a, w: w, r: r, res: res, part: part}
  - sum_tiles: {x: part, out: total}
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
    ("r: r, res: res, part: part}", "r: r, res: res, part: part, extra: a}", 14, "has no argument 'extra'"),
    ("r: r, res: res, part: part}", "r: r, res: res}", 14, "missing part"),
    ("{a: a, w: w, r: r,", "{a: a, w: w, r: later,", 14, "'later' is not defined before this step"),
    ("  a: [M, dim]", "  a: [M, width]", 14, "earlier arguments make"),
    ("  r: {shape: [M], dtype: float32, grad: false}", "  r: {shape: [M], grad: false}", 14,
     "takes dtype float32"),
    ("- sum_tiles: {x: part, out: _}", "- sum_tiles: {x: res, out: _}", 15,
     "partial-reduction buffer"),
    ("save: [a, r, total]", "save: [a, r, total, nothing]", 16, "'nothing' is not a forward value"),
    ("  - matmul: {a: grad_res, b: w, out: grad_a}", "  - matmul: {a: grad_res, b: w, out: grad_q}", 9,
     "never defines 'grad_a'"),
    ("b: a, transpose: a, out: grad_w}", "b: a, transpose: c, out: grad_w}", 19, "must be 'none', 'a' or 'b'"),
    ("  width: int", "  width: [x, y]", 7, "dimension 'width' names no int attr"),
])
def test_block_mistakes_are_located(tmp_path, old, new, line, words):
    text = GOOD.replace("save: [a, r, total]", "save: [a]").replace("  - sum_tiles: {x: part, out: total}\n",
                                                                       "  - sum_tiles: {x: part, out: _}\n")
    if old.startswith("save:"):
        text = text.replace("save: [a]", new)
    else:
        assert old in text
        text = text.replace(old, new)
    errors = check(tmp_path, text)
    assert any(words in m for _, m in errors), errors
    assert line in [ln for ln, m in errors if words in m], errors


def test_valid_block_builds(tmp_path):
    text = GOOD.replace("save: [a, r, total]", "save: [a]").replace("  - sum_tiles: {x: part, out: total}\n",
                                                                       "  - sum_tiles: {x: part, out: _}\n")
    (tmp_path / "k.yaml").write_text(KERNEL)
    (tmp_path / "b.yaml").write_text(text)
    checked = api.load([tmp_path])
    assert {type(c).__name__ for c in checked} == {"Checked", "CheckedBlock"}
