"""The line breaker of generated modules (codagen/emit/layout.py): every line fits, the code means what it meant,
and a module already laid out stays as it is."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from codagen.emit.layout import WIDTH, layout

REPO = Path(__file__).resolve().parent.parent
LONG = "q" * 40

STATEMENTS = [
    f"def launch(a_{LONG}, b_{LONG}, c_{LONG}, *, out_{LONG}, config=None) -> None:\n    pass",
    f"x_{LONG}_even, x_{LONG}_odd = tile.split_pairs(tl.load(x_{LONG}_ptr + rows[:, None] * stride_x_{LONG}_m, "
    "mask=tile_mask, other=0.0).to(tl.float32))",
    f"ptrs = a_{LONG}_ptr + (rows % M)[:, None] * stride_a_{LONG}_m + offs_k[None, :] * stride_a_{LONG}_k",
    f"a_{LONG}, b_{LONG}, c_{LONG}, d_{LONG} = ctx.saved_tensors",
    f"(a_{LONG}, b_{LONG}, c_{LONG}, d_{LONG}) = f(a_{LONG}, b_{LONG}, c_{LONG}, d_{LONG}, e=b_{LONG})",
    f"return a_{LONG}, b_{LONG}, c_{LONG}, d_{LONG}",
    f"x = (a_{LONG} if a_{LONG} is not None else torch.empty((M, N), dtype=torch.float32, device=device_{LONG}),)",
    f"s.add_matmul(a=a_{LONG}, b=b_{LONG}, accumulate=lambda a, b, t: kernels.k_{LONG}.k(a=a, b=b, total=t))",
    f'd = runtime.Decl("x, (y", ("M", "N"), "T", output=True, in_place_of=("a_{LONG}", "b_{LONG}", "c_{LONG}"))',
    f"y = 1  # a comment after the code that is far too long to stay on its line: {LONG} {LONG} {LONG}",
    f'"""A docstring of one line, too long for it: {LONG} {LONG} {LONG}."""',
]


def _meaning(source: str) -> str:
    """The module's syntax tree, the whitespace inside its strings (docstrings) collapsed."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = " ".join(node.value.split())
    return ast.dump(tree)


@pytest.mark.parametrize("statement", STATEMENTS)
@pytest.mark.parametrize("indent", [0, 8])
def test_a_long_statement_fits_and_means_the_same(statement, indent):
    source = "".join(" " * indent + line + "\n" for line in statement.split("\n"))
    source = f"if True:\n    if True:\n{source}" if indent else source
    laid_out = layout(source)
    assert all(len(line) <= WIDTH for line in laid_out.splitlines()), laid_out
    assert _meaning(laid_out) == _meaning(source)
    assert layout(laid_out) == laid_out


def test_generated_modules_are_laid_out_already():
    for path in sorted((REPO / "generated").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert layout(source) == source, path
