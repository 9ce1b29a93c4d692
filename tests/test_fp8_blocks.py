"""FP8 in block specs (docs/fp8.md, "FP8 in blocks"): a block's dims groups(...) and blocks(...) of its `group`, and
its FP8 and bfloat16 dtypes, checked against the kernels it calls, each mistake located; a block calling the K-group
kernel (tests/specs/t_fp8_kgroup.yaml), built and run on ragged shapes against the float64 product of the
dequantized operands."""
from __future__ import annotations

import importlib
import shutil
import sys

import pytest
import torch

from codagen import api
from codagen.blockmodel import CheckedBlock
from codagen.errors import ValidationFailed
from conftest import DEVICE, REPO, fp8_mma_error
from test_fp8_kgroup import G, U, dequantized, operands

E4M3 = torch.float8_e4m3fn

BLOCK = """\
block: kg_block
doc: A block around t_fp8_kgroup.
attrs:
  dim: int
  width: int
group: 128
inputs:
  a: {shape: [M, dim], dtype: float8_e4m3fn}
  w: {shape: [width, dim], dtype: float8_e4m3fn}
  sa: {shape: [M, groups(dim)], dtype: float32, grad: false}
  sw: {shape: [blocks(width), groups(dim)], dtype: float32, grad: false}
  s: {shape: [], dtype: float32, grad: false}
outputs:
  p: {shape: [M, width], dtype: float32, grad: false}
  y: {shape: [M, width], dtype: bfloat16, grad: false}
forward:
  - t_fp8_kgroup: {a: a, b: w, a_scale: sa, b_scale: sw, y_scale: s, product: p, y: y}
"""


def _load(tmp_path, text: str):
    shutil.copy(REPO / "tests" / "specs" / "t_fp8_kgroup.yaml", tmp_path / "t_fp8_kgroup.yaml")
    (tmp_path / "kg_block.yaml").write_text(text, encoding="utf-8")
    return api.load([tmp_path])


def test_block_calls_the_k_group_kernel(tmp_path):
    """groups(dim) is dim / 128 and blocks(width) is width / 128 rounded up, the kernel's groups(K) and blocks(N)
    with its K group 128; FP8 inputs have no gradient."""
    (block,) = [c for c in _load(tmp_path, BLOCK) if isinstance(c, CheckedBlock)]
    assert str(block.values["sa"].dims[1]) == "dim/128" and str(block.values["sw"].dims[0]) == "cdiv(width, 128)"
    assert block.values["y"].dtype == "bfloat16" and block.values["a"].dtype == "float8_e4m3fn"
    assert not any(t.grad for t in block.block.inputs)


@pytest.mark.parametrize("old, new, line, col, words", [
    ("group: 128\n", "", 9, 19, "groups(dim) counts groups of columns, and the block declares none; add 'group: "),
    ("group: 128", "group: 100", 6, 8, "group must be a power of two from 2 to 512"),
    ("group: 128", "group: 64", 17, 41, "t_fp8_kgroup.a_scale: 'sa' makes groups(K) = dim/64, but the earlier "
                                        "arguments make K = dim"),
    ("[blocks(width), groups(dim)]", "[width, groups(dim)]", 17, 54,
     "'sw' has width blocks of N, but the call's N = width has cdiv(width, 128)"),
    ("[blocks(width), groups(dim)]", "[blocks(dim), groups(dim)]", 17, 54, "'sw' has cdiv(dim, 128) blocks of N"),
    ("[M, groups(dim)]", "[M, blocks(dim)]", 17, 41, "'sa' has the dimension cdiv(dim, 128), a count of blocks"),
    ("[blocks(width), groups(dim)]", "[blocks(M), groups(dim)]", 11, 16, "blocks(...) counts the groups of an attr"),
    ("a: {shape: [M, dim], dtype: float8_e4m3fn}", "a: {shape: [M, dim], dtype: bfloat16}", 17, 23,
     "t_fp8_kgroup.a takes dtype float8_e4m3fn, but 'a' is bfloat16"),
    ("dtype: float8_e4m3fn}\n  sa", "dtype: float8}\n  sa", 9, 35, "inputs 'w' dtype must be one of T, float32"),
])
def test_block_fp8_mistakes_are_located(tmp_path, old, new, line, col, words):
    assert old in BLOCK
    with pytest.raises(ValidationFailed) as info:
        _load(tmp_path, BLOCK.replace(old, new))
    found = [(e.loc.line, e.loc.col) for e in info.value.errors if words in e.message]
    assert found and found[0] == (line, col), [(e.loc.line, e.loc.col, e.message) for e in info.value.errors]
    if new == "group: 100":  # its dims are not reported again
        assert len(info.value.errors) == 1
    assert all(e.loc.file.endswith("kg_block.yaml") for e in info.value.errors)


def test_fp8_parameter_is_refused(tmp_path):
    text = BLOCK.replace("inputs:\n", "params:\n  wq: {shape: [width, dim], dtype: float8_e4m3fn}\ninputs:\n")
    with pytest.raises(ValidationFailed) as info:
        _load(tmp_path, text)
    assert any("params 'wq': a parameter is trained in its own precision" in e.message and e.loc.line == 8
               for e in info.value.errors)


@pytest.fixture(scope="module")
def kg_block(tmp_path_factory):
    root = tmp_path_factory.mktemp("kg_block")
    _load(root, BLOCK)
    api.build([root / "t_fp8_kgroup.yaml", root / "kg_block.yaml"], out=root / "cg_kg_block")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield importlib.import_module("cg_kg_block.blocks.kg_block")
    sys.path.remove(str(root))


@pytest.mark.parametrize("m, n, k", [(37, 150, 256), (5, 128, 128)])
def test_generated_block_runs_the_k_group_kernel(kg_block, m, n, k):
    """The block's function on ragged M and N (N's last block partial) against the float64 product of the operands
    dequantized with their scales, within the kernel's bound (docs/fp8.md: 2 (K + 3) 2^-24 sum |A s_A| |B s_B|, and on
    Hopper its FP8 MMAs' rounding)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    a, b, a_scale, b_scale = operands(m, n, k, g)
    block = kg_block.KgBlock(dim=k, width=n, device=DEVICE)
    p, y = block(a.to(DEVICE), b.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE), torch.tensor(2.0, device=DEVICE))
    da, db = dequantized(a, a_scale, 1, G), dequantized(b, b_scale, G, G)
    want = da @ db.T
    bound = 2 * (k + 3) * U * (da.abs() @ db.abs().T) + fp8_mma_error(da, db)
    assert ((p.cpu().double() - want).abs() <= bound).all()
    # the product times 2 (exact) in bfloat16: within one bfloat16 step (the interpreter's conversion may truncate)
    assert ((y.double() - 2 * p.double()).abs() <= 2.0**-7 * 2 * p.double().abs()).all()
