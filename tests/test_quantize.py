"""FP8 quantization (codagen/primitives/quantize.py, docs/fp8.md): the t_quantize kernel on the interpreter
against the float64 reference, FP8 values bit for bit and scales exactly, on data made to reach its edges; and
the reference against the recipe written out independently, with the error bound docs/fp8.md states."""
from __future__ import annotations

import pytest
import torch

from codagen import reference
from codagen.primitives.quantize import BY_DTYPE
from codagen.runtime import Config
from conftest import DEVICE, kernel_model, kernel_types

GROUP = 8  # t_quantize's column_group
OUTPUTS = {"float8_e4m3fn": ("x_e4m3", "x_e4m3_scale"), "float8_e5m2": ("x_e5m2", "x_e5m2_scale")}
# (M, N, config): ragged against the tiles; N whole groups, as the launch requires
SHAPES = {
    "ragged-tiles": (45, 72, Config(16, 32, 16, 2, 4, 1)),
    "ragged-split": (45, 72, Config(16, 32, 16, 2, 4, 1, epilogue_split=2)),
    "one-tile": (37, 48, Config(64, 64, 32, 8, 4, 1)),
}


def edge_rows(m: int, n: int, seed: int) -> torch.Tensor:
    """randn rows scaled by magnitudes from 1e-30 to 1e30 (every tenth row), a zero row, a row whose first group
    is zero, a group of one value among zeros, a group of equal values (each the amax: FP8_MAX exactly), and
    values on FP8 ties (x / scale halfway between FP8 neighbours)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    x *= torch.logspace(-30, 30, 7)[torch.arange(m) % 7][:, None] ** (torch.arange(m) % 10 == 0)[:, None]
    x[3] = 0.0
    x[4, :GROUP] = 0.0
    x[5, :GROUP] = 0.0
    x[5, 2] = -3.0
    x[6, :GROUP] = 2.5
    x[7, :GROUP] = torch.tensor([448.0, 1.1875, 1.3125, 3.25, 17.0, -1.0625, 0.0087890625, -224.0])  # scale 1 ties
    return x


def _run(module, x: torch.Tensor, config: Config) -> dict[str, torch.Tensor]:
    m, n = x.shape
    outs = {values: torch.empty(m, n, dtype=getattr(torch, dtype)) for dtype, (values, _) in OUTPUTS.items()}
    outs |= {scales: torch.full((m, n // GROUP), float("nan")) for _, scales in OUTPUTS.values()}
    outs = {k: v.to(DEVICE) for k, v in outs.items()}
    module.launch(x=x.to(DEVICE), **outs, config=config)
    return {k: v.cpu() for k, v in outs.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_is_the_reference_bit_for_bit(test_kernels, shape):
    m, n, config = SHAPES[shape]
    x = edge_rows(m, n, seed=len(shape))
    got = _run(test_kernels("t_quantize"), x, config)
    kernel = kernel_model("t_quantize")
    want = reference.run(kernel, kernel_types("t_quantize"), {"x": x}, config.block_m, config.epilogue_n)
    for dtype, (values, scales) in OUTPUTS.items():
        bits, want_bits = got[values].view(torch.uint8), want[values].to(getattr(torch, dtype)).view(torch.uint8)
        assert torch.equal(bits, want_bits), f"{values}: {(bits != want_bits).sum().item()} of {bits.numel()} differ"
        assert torch.equal(got[scales], want[scales].float()), scales


@pytest.mark.parametrize("dtype", list(BY_DTYPE))
def test_reference_is_the_recipe(dtype):
    """The reference's values and scales, against the recipe of docs/fp8.md written out here: per row and group
    of 8, scale = fp32(amax / FP8_MAX) (1 for a zero group), values = RNE(clamp(fp32(x / scale))), and the
    error bound: |values · scale − x| ≤ 2^-(mantissa+1) |x| where x / scale is normal, else half the smallest
    subnormal step (2^(min_exponent − mantissa − 1)) times the scale."""
    fmt, fp8 = BY_DTYPE[dtype], getattr(torch, dtype)
    kernel = kernel_model("t_quantize")
    x = edge_rows(45, 72, seed=3)
    want = reference.run(kernel, kernel_types("t_quantize"), {"x": x}, 16, 32)
    values, scales = (want[n] for n in OUTPUTS[dtype])
    amax = x.abs().reshape(45, 9, GROUP).amax(-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), (amax.double() / fmt.max).float())
    assert torch.equal(scales.float(), scale)
    assert scale[3].eq(1).all() and scale[4, 0] == 1 and scale[5, 0] == 3.0 / fmt.max
    wide = scale.repeat_interleave(GROUP, 1)
    q = (x.double() / wide.double()).float()
    assert torch.equal(values.to(fp8).view(torch.uint8), q.clamp(-fmt.max, fmt.max).to(fp8).view(torch.uint8))
    assert values[6, :GROUP].eq(fmt.max).all()  # each value the group's amax
    assert values.abs().max() <= fmt.max
    error = (values.double() * wide.double() - x.double()).abs()
    normal = q.abs() >= 2.0 ** fmt.min_exponent
    assert (error[normal] <= 2.0 ** -(fmt.mantissa + 1) * x.double().abs()[normal]).all()
    subnormal_step = 2.0 ** (fmt.min_exponent - fmt.mantissa)
    assert (error[~normal] <= subnormal_step / 2 * wide.double()[~normal]).all()


def test_kernel_compiles_for_sm90(test_kernels):
    """The GPU takes another path than the interpreter (tl.div_rn, the bitcasts of tile.round_fp8, stores to FP8
    pointers): t_quantize compiles to PTX for sm_90, in a subprocess (the compiler needs the interpreter off),
    and the PTX divides with IEEE rounding (div.rn.f32), keeps the rounding to the FP8 grid (the add of 1.5 · 2^23,
    fused into an FMA, and its subtraction), converts to both formats, and keeps tile.to_fp8's code for a NaN
    (the test for NaN, and the or with 0x7F) after the conversion. Not run: no GPU here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_groups import _COMPILE

    module = test_kernels("t_quantize")
    built = Path(module.__file__).resolve().parents[2]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), str(built)])}
    run = subprocess.run([sys.executable, "-c", _COMPILE, module.__name__, "--ptx"], capture_output=True, text=True,
                         env=env, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(f"{module.__name__} ") == 2 and "False" not in run.stdout.split()
    assert "div.rn.f32" in run.stdout and "e4m3x2.f32" in run.stdout and "e5m2x2.f32" in run.stdout
    assert "0f4B400000" in run.stdout and "0fCB400000" in run.stdout
    assert "setp.nan.f32" in run.stdout and ", 127;" in run.stdout


# as SHAPES, N whole groups of 16
HALF_SHAPES = {name: (m, 80 if n == 72 else n, config) for name, (m, n, config) in SHAPES.items()}


@pytest.mark.parametrize("shape", list(HALF_SHAPES))
def test_half_width_value_groups_are_half_as_wide(test_kernels, shape):
    """t_quantize_half: SwiGLU's N/2-wide output quantized with column_group 16, each group 8 of its columns,
    against the float64 recipe written out: the scales within fp32's rounding of silu (2^-20, relative) of
    amax / 448 over each 8 columns of y, every value within its e4m3 bound (docs/fp8.md: 2^-4 of itself, or 2^-10
    of its scale), and the dequantized store equal to the values times their group's scale."""
    m, n, config = HALF_SHAPES[shape]
    g = torch.Generator().manual_seed(7 + len(shape))
    x = torch.randn(m, n, generator=g) * 2.0 ** torch.randint(-12, 4, (m, 1), generator=g).float()  # exp stays finite
    x[3] = 0.0  # a row of zeros: scale 1
    x[4, :16] = 0.0  # its first group
    x[5, 17] = 3e4  # an outlier, which costs its own group precision only
    outs = {"y": torch.empty(m, n // 2, dtype=torch.float8_e4m3fn), "y_scale": torch.empty(m, n // 16),
            "y_dequantized": torch.empty(m, n // 2)}
    outs = {k: v.to(DEVICE) for k, v in outs.items()}
    test_kernels("t_quantize_half").launch(x=x.to(DEVICE), **outs, config=config)
    q, scale, dequantized = (outs[k].cpu() for k in ("y", "y_scale", "y_dequantized"))
    x64 = x.double()
    y = torch.nn.functional.silu(x64[:, 0::2]) * x64[:, 1::2]
    amax = y.abs().reshape(m, n // 16, 8).amax(-1)
    want_scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448)
    assert ((scale.double() - want_scale).abs() <= 2.0**-20 * want_scale).all()
    per_value = scale.double().repeat_interleave(8, 1)
    bound = (2.0**-4 + 2.0**-18) * y.abs() + 2.0**-10 * per_value
    assert ((q.double() * per_value - y).abs() <= bound).all()
    assert torch.equal(dequantized, q.float() * scale.repeat_interleave(8, 1))
