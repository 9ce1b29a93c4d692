"""codagen.dims: the meaning of a dim expression, against the cases each place that used to evaluate dims on its
own handled (the launchers' shape checks, the block checker, the float64 reference, the tuner, the emitters)."""
import subprocess
import sys
from fractions import Fraction

import pytest

from codagen import dims
from codagen.model import Dim, Width
from conftest import REPO


def test_the_dims_are_the_spec_models():
    assert dims.DIMS == tuple(d.value for d in Dim)
    assert dims.WIDTHS == tuple(w.value for w in Width)
    assert dims.TILES == (Dim.TILES_M.value, Dim.TILES_N.value)


@pytest.mark.parametrize("dim, base", [("M", "M"), ("K", "K"), ("N", "N"), ("N/2", "N"), ("2*N", "N"),
                                       ("tiles(M)", "M"), ("tiles(N)", "N"), ("groups(N)", "N")])
def test_base(dim, base):
    """The size a dim binds (runtime checks, blockcheck._bind) and a tile count divides (blockcheck._tiles)."""
    assert dims.base(dim) == base
    assert dims.is_tiles(dim) == dim.startswith("tiles(")


@pytest.mark.parametrize("dim, group, scale", [("M", None, 1), ("K", None, 1), ("N", None, 1), ("N/2", None, Fraction(1, 2)),
                                               ("2*N", None, 2), ("groups(N)", 128, Fraction(1, 128)),
                                               ("groups(N)", None, 1)])
def test_scale(dim, group, scale):
    """blockcheck._unbind's factors (groups without a column group: 1), and the widths' 0.5, 1, 2 (reference,
    reduce's tile width)."""
    assert dims.scale(dim, group) == scale


@pytest.mark.parametrize("dim", dims.TILES)
def test_tile_counts_have_no_scale(dim):
    with pytest.raises(ValueError, match="count of tiles"):
        dims.scale(dim)


def test_unknown_dims_are_refused():
    with pytest.raises(ValueError, match="unknown dim 'N/3'"):
        dims.base("N/3")


@pytest.mark.parametrize("dim, size, group, base_size", [
    ("N/2", 80, None, 160),          # runtime bind: N = 2 * size
    ("2*N", 160, None, 80),          # N = size / 2
    ("2*N", 3, None, Fraction(3, 2)),  # odd: not whole (the runtime check reports it before)
    ("groups(N)", 4, 128, 512),      # N = size * group
    ("M", 37, None, 37), ("K", 29, None, 29), ("N", 50, None, 50),
])
def test_base_size_inverts_scale(dim, size, group, base_size):
    """The runtime's bind and blockcheck._bind (size -> N), and the tuner's N per column of a dim (N/2: 2, N: 1,
    2*N: 1/2)."""
    assert dims.base_size(dim, size, group) == base_size
    assert dims.base_size(dim, Fraction(size), group) == base_size  # symbolic sizes (blockcheck, tune) are Fractions
    if base_size.denominator == 1:  # a launcher's bind: integers only, which torch.compile's SymInts take
        assert dims.base_of_size(dim, size, group) == base_size


def test_a_launcher_binds_symbolic_sizes():
    """Under torch.compile's dynamic shapes the sizes a launcher binds are SymInts, which a Fraction does not take:
    base_of_size keeps to integer arithmetic (opcheck's test_aot_dispatch_dynamic runs every generated op so)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_unbacked_symint()
    for dim, group, expected in (("N/2", None, "2*u0"), ("groups(N)", 128, "128*u0"), ("M", None, "u0")):
        assert str(dims.base_of_size(dim, size, group)) == expected


SIZES = {"M": 37, "N": 50, "K": 29}


@pytest.mark.parametrize("dim, tile, group, size", [
    ("M", None, None, 37), ("K", None, None, 29), ("N", None, None, 50),
    ("N/2", None, None, 25), ("2*N", None, None, 100),
    ("tiles(M)", (16, 32), None, 3), ("tiles(N)", (16, 32), None, 2),  # cdiv: 37/16 -> 3, 50/32 -> 2
    ("tiles(N)", (16, 16), None, 4), ("groups(N)", None, 10, 5), ("groups(N)", None, 64, 0),
])
def test_size(dim, tile, group, size):
    """reference.output_dims (n // 2, 2 * n, cdiv by block_m and block_n, n // group) and tune's operand sizes."""
    assert dims.size(dim, SIZES, tile, group) == size


@pytest.mark.parametrize("dim, group, text", [
    ("M", None, "M"), ("K", None, "K"), ("N", None, "N"), ("N/2", None, "N // 2"), ("2*N", None, "2 * N"),
    ("tiles(M)", None, "triton.cdiv(M, config.block_m)"), ("tiles(N)", None, "triton.cdiv(N, config.epilogue_n)"),
    ("groups(N)", 128, "N // 128"),
])
def test_python(dim, group, text):
    """The launcher's size expressions (emit/kernel, the column bounds of emit/epilogue and emit/gluon)."""
    assert dims.python(dim, group) == text


@pytest.mark.parametrize("dim", [d for d in dims.DIMS if not dims.is_tiles(d)])
def test_python_agrees_with_size(dim):
    """The expression a launcher computes is the size the checker and the reference compute."""
    import math
    env = dict(SIZES, N=64, K=64)
    scope = {"math": math, "K_GROUP": 32, "triton": type("triton", (), {"cdiv": lambda a, b: -(-a // b)})}
    assert eval(dims.python(dim, 16), scope, env) == dims.size(dim, env, group=16, k_group=32)


def test_importing_dims_imports_neither_torch_nor_the_generator():
    """`build --check` (no torch) and the runtime (no generator) both read dims."""
    result = subprocess.run([sys.executable, "-c", "import sys, codagen.dims\n"
                             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'yaml')"
                             " or m.startswith('codagen.') and m != 'codagen.dims'))"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


def test_k_group_dims():
    """The K-group scales' dims (gemm.scales): groups(K) is K / k_group, blocks(N) is N / k_group rounded up (a
    weight's last block of rows may be partial); they bind nothing (runtime.checks checks them once M, N, K are
    bound)."""
    sizes = {"M": 37, "N": 300, "K": 256}
    assert dims.size("groups(K)", sizes, k_group=128) == 2
    assert dims.size("blocks(N)", sizes, k_group=128) == 3
    assert dims.size("blocks(N)", {**sizes, "N": 256}, k_group=128) == 2
    assert (dims.base("groups(K)"), dims.base("blocks(N)")) == ("K", "N")
    assert dims.scale("groups(K)", 16, 128) == Fraction(1, 128)
    with pytest.raises(ValueError, match="count of blocks"):
        dims.scale("blocks(N)")
    assert dims.python("groups(K)") == "K // K_GROUP"
    assert dims.python("blocks(N)") == "triton.cdiv(N, K_GROUP)"
