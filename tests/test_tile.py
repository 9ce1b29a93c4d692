"""Device functions of codagen.runtime.tile alone, under the interpreter, against float64."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from codagen.runtime import tile


@triton.jit
def _sincos(angle_ptr, sin_ptr, cos_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sin, cos = tile.sincos(tl.load(angle_ptr + offsets))
    tl.store(sin_ptr + offsets, sin)
    tl.store(cos_ptr + offsets, cos)


def _errors(angle: torch.Tensor) -> tuple[float, float]:
    """Largest absolute errors of tile.sincos against float64 sin and cos of the same fp32 angles."""
    sin, cos = torch.empty_like(angle), torch.empty_like(angle)
    _sincos[(angle.numel() // 4096,)](angle, sin, cos, BLOCK=4096)
    exact = angle.double()
    return (sin.double() - exact.sin()).abs().max().item(), (cos.double() - exact.cos()).abs().max().item()


def test_sincos_within_two_tenths_of_a_micro_radian_up_to_a_million():
    """Fresh random angles of each magnitude, both signs, and those nearest multiples of pi/2, where the
    reduction cancels most: RoPE's angles are position * frequency, up to about 2**20 for a 1M-token context."""
    for magnitude in (1.0, 100.0, 1e4, 2.0**17, 2.0**20):
        angle = (torch.rand(16 * 4096, dtype=torch.float64) * 2 - 1).mul(magnitude).float()
        assert max(_errors(angle)) < 2e-7, magnitude
    quarter_turns = torch.randint(1, int(2**20 / (math.pi / 2)), (16 * 4096,), dtype=torch.float64)
    assert max(_errors((quarter_turns * (math.pi / 2)).float())) < 2e-7


def test_sincos_within_a_ten_thousandth_up_to_two_to_the_23():
    """Up to 2**23, where the fp32 angle itself is off by up to 0.25 rad, sincos adds less than 1e-4."""
    angle = (torch.rand(16 * 4096, dtype=torch.float64) * 2 - 1).mul(2.0**23).float()
    assert max(_errors(angle)) < 1e-4


def test_sincos_of_nan_and_infinities_is_nan():
    angle = torch.randn(4096)
    angle[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    sin, cos = torch.empty_like(angle), torch.empty_like(angle)
    _sincos[(1,)](angle, sin, cos, BLOCK=4096)
    assert sin[:3].isnan().all() and cos[:3].isnan().all()
    assert sin[3:].isfinite().all() and cos[3:].isfinite().all()


@triton.jit
def _row_reduce(x_ptr, out_ptr, PAIRS: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr):
    rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK)
    x = tl.load(x_ptr + rows[:, None] * BLOCK + cols[None, :])
    if PAIRS:
        even, odd = tile.split_pairs(x)
        out = tile.partial_reduce_pairs(even, odd, (tl.arange(0, BLOCK // 2) < BLOCK)[None, :], OP)
    else:
        out = tile.partial_reduce(x, (cols < BLOCK)[None, :], OP, 1)
    tl.store(out_ptr + rows, out)


@pytest.mark.parametrize("pairs", [False, True])
def test_partial_reduce_refuses_an_op_it_does_not_know(pairs):
    """A reduction code of no known reduction is a compile-time error, not silently a sum or a logsumexp (the
    branches for the known ones are checked against float64 where the kernels using them are)."""
    x, out = torch.randn(16, 16), torch.empty(16)
    _row_reduce[(1,)](x, out, PAIRS=pairs, OP=tile.SUM, BLOCK=16)
    torch.testing.assert_close(out.double(), x.double().sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="OP must be SUM, SUMSQ, MAX or LOGSUMEXP"):
        _row_reduce[(1,)](x, out, PAIRS=pairs, OP=7, BLOCK=16)


@triton.jit
def _round_fp8(q_ptr, out_ptr, held_ptr, FP8: tl.constexpr, MAX: tl.constexpr, MANTISSA: tl.constexpr,
               MIN_EXPONENT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(q_ptr + offsets)
    rounded = tile.round_fp8(q, MAX, MANTISSA, MIN_EXPONENT)
    tl.store(out_ptr + offsets, tile.to_fp8(rounded, FP8))
    tl.store(held_ptr + offsets, rounded)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_round_fp8_is_torchs_rounding_bit_for_bit(dtype):
    """Every FP8 value and every midpoint between neighbours (the ties, to even), each nudged by one fp32 ulp
    either way, past the largest value, subnormals, signed zeros and NaNs of either sign: tile.round_fp8 then
    tile.to_fp8 to the FP8 output equals torch's round-to-nearest-even cast of the value clamped to ±FP8_MAX,
    bit for bit, a NaN's code (0x7F with its sign) included (the interpreter's own cast makes 384 of a NaN)."""
    from codagen.primitives.quantize import BY_DTYPE, round_fp8
    fmt, fp8 = BY_DTYPE[dtype], getattr(torch, dtype)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    specials = [fmt.max * 1.01, 1e30, -1e30, 2.0 ** -30, -0.0, float("nan"), -float("nan")]
    base = torch.cat([grid, mids, torch.tensor(specials)])
    q = torch.cat([base, base.nextafter(torch.tensor(float("inf"))), base.nextafter(torch.tensor(-float("inf"))),
                   torch.randn(4096) * fmt.max / 4])
    q = torch.cat([q, q.new_zeros(-q.numel() % 1024)])
    out, held = torch.empty(q.shape, dtype=fp8), torch.empty_like(q)
    _round_fp8[(q.numel() // 1024,)](q, out, held, getattr(tl, fmt.triton), fmt.max, fmt.mantissa,
                                     fmt.min_exponent, BLOCK=1024)
    want = round_fp8(q, fmt)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    nan = q.isnan()
    assert held[nan].isnan().all() and set(out.view(torch.uint8)[nan].tolist()) == {0x7F, 0xFF}


@triton.jit
def _fp8_to_float(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tile.fp8_to_float(tl.load(x_ptr + offsets)))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_to_float_is_torchs_on_every_code(dtype):
    """tile.fp8_to_float, which the interpreter's FP8 mainloop upcasts with, on all 256 codes: torch's values,
    NaNs and infinities included (the interpreter's own conversion makes 480 of float8_e4m3fn's NaN and 65536
    of float8_e5m2's infinity)."""
    codes = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype))
    out = torch.empty(256)
    _fp8_to_float[(1,)](codes, out, BLOCK=256)
    want = codes.float()
    assert torch.equal(out.isnan(), want.isnan()) and want.isnan().any()
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])
