"""Spec names that the generated code once reserved for itself (out, part, key, step, rows, i, m, n, k, x_ptr,
a_desc, ...): the generated code's own names start with '_', so a kernel and a block may use them. Each is
built from specs in tmp_path, imported, and run on the CPU (Triton's interpreter) or the GPU against the float64
reference (codagen.reference) and plain PyTorch."""
from __future__ import annotations

import importlib

import pytest
import torch

from codagen import api, reference
from codagen.runtime import Config
from conftest import DEVICE

# Tensors x and x_ptr, a and a_desc (the names the generated code once made from x and a), outputs out, part,
# key, rows, values i, m, n, k, cols, pid_n, stride_x, x_even, a host scalar step
KERNEL = """\
kernel: names_kernel
doc: A GEMM epilogue whose tensors and values have the names of the generated code's own variables.
gemm: {a: a, b: b, b_layout: nk}
inputs:
  a: [M, K]
  b: [N, K]
  x: [M, N]
  x_ptr: [N]
  a_desc: [M]
  step: scalar
outputs:
  out: [M, N]
  part: [M, tiles(N)]
  key: [M, N]
  rows: [N, tiles(M)]
epilogue:
  - add: {x: acc, y: x, out: i}
  - scale: {x: i, by: x_ptr, out: m}
  - scale: {x: m, by: a_desc, out: n}
  - mul: {x: n, y: step, out: k}
  - store: {x: k, to: out}
  - reduce: {op: sumsq, x: k, axis: cols, to: part}
  - sub: {x: i, y: 1.0, out: cols}
  - mul: {x: cols, y: m, out: pid_n}
  - add: {x: pid_n, y: x, out: stride_x}
  - mul: {x: stride_x, y: 0.5, out: x_even}
  - store: {x: x_even, to: key}
  - reduce: {op: sum, x: m, axis: rows, to: rows}
"""

# A block whose attr, inputs, outputs and values take such names too (forward only)
BLOCK = """\
block: names_block
doc: The kernel above with block values named like the generated code's variables.
attrs:
  dim: int
  step: 0.75
inputs:
  a: {shape: [M, dim], grad: false}
  x: {shape: [M, dim], grad: false}
  x_ptr: {shape: [dim], grad: false}
  a_desc: {shape: [M], grad: false}
  b: {shape: [dim, dim], grad: false}
outputs:
  out: {shape: [M, dim], grad: false}
  key: {shape: [M, dim], grad: false}
  n: {shape: [M], dtype: float32, grad: false}
forward:
  - names_kernel: {a: a, b: b, x: x, x_ptr: x_ptr, a_desc: a_desc, step: step, out: out, part: part, key: key,
                   rows: _}
  - rstd: {x: part, size: dim, eps: 1.0e-6, out: n}
"""

CONFIG = Config(16, 32, 16, 2, 4, 1)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """The specs above built into <tmp>/cg_names/, importable."""
    (tmp_path / "specs" / "blocks").mkdir(parents=True)
    (tmp_path / "specs" / "names_kernel.yaml").write_text(KERNEL, encoding="utf-8")
    (tmp_path / "specs" / "blocks" / "names_block.yaml").write_text(BLOCK, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    api.build(["specs"], out="cg_names")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path / "cg_names"


def _kernel_args(g: torch.Generator, m: int = 37, n: int = 50, k: int = 29) -> dict:
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    return dict(a=rand(m, k), b=rand(n, k), x=rand(m, n), x_ptr=rand(n), a_desc=rand(m), step=0.75)


def test_kernel_with_generated_code_names_matches_reference(package):
    module = importlib.import_module("cg_names.kernels.names_kernel")
    args = _kernel_args(torch.Generator().manual_seed(0))
    m, n = args["x"].shape
    outs = dict(out=torch.full((m, n), float("nan"), device=DEVICE),
                part=torch.full((m, -(-n // CONFIG.epilogue_n)), float("nan"), device=DEVICE),
                key=torch.full((m, n), float("nan"), device=DEVICE),
                rows=torch.full((n, -(-m // CONFIG.block_m)), float("nan"), device=DEVICE))
    module.launch(**args, **outs, config=CONFIG)
    checked = {c.kernel.name: c for c in api.load(["specs"]) if isinstance(c, api.Checked)}["names_kernel"]
    expected = reference.run(checked.kernel, checked.types, args, CONFIG.block_m, CONFIG.epilogue_n)
    assert set(expected) == set(outs)
    for name, got in outs.items():
        torch.testing.assert_close(got.double(), expected[name].to(got.device), rtol=1e-4, atol=1e-4, msg=name)
    # the public op too, with the outputs it allocates
    out, part, key, rows = module.names_kernel(**args)
    torch.testing.assert_close(out, outs["out"]), torch.testing.assert_close(key, outs["key"])


def test_block_with_generated_code_names_matches_plain_pytorch(package):
    blocks = importlib.import_module("cg_names.blocks.names_block")
    g = torch.Generator().manual_seed(1)
    args = _kernel_args(g, m=20, n=32, k=32)
    block = blocks.NamesBlock(32, step=0.75, device=DEVICE)
    out, key, n = block(args["a"], args["x"], args["x_ptr"], args["a_desc"], args["b"])
    i = args["a"].double() @ args["b"].double().T + args["x"].double()
    m = i * args["x_ptr"].double()[None, :]
    k = m * args["a_desc"].double()[:, None] * 0.75
    torch.testing.assert_close(out.double(), k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(key.double(), ((i - 1.0) * m + args["x"].double()) * 0.5, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(n.double(), torch.rsqrt(k.square().mean(1) + 1e-6), rtol=1e-4, atol=1e-4)


def test_generated_files_are_the_same_in_a_second_build(package):
    first = api.generate(["specs"], out="cg_names").files
    assert api.generate(["specs"], out="cg_names").files == first
    assert first["kernels/names_kernel.py"] == (package / "kernels" / "names_kernel.py").read_text(encoding="utf-8")
