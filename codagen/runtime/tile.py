"""Device functions that generated epilogues call on fp32 tiles. Pairs are interleaved columns (2j, 2j+1): a
tile computed in registers (the accumulator) holds them side by side, and split_pairs separates them; a tile
loaded from memory twice as wide as N is loaded as its even and odd columns, and the `_pairs` functions take
those two halves directly, so no register shuffle is needed.

NaN and infinities behave as in PyTorch: a NaN anywhere in what a function reads makes its result NaN, and
masked-off lanes neither add nor hide one (they are replaced before any arithmetic that could see them)."""
import torch
import triton
import triton.language as tl

from . import INTERPRETED

# Which reduction partial_reduce computes (its OP): the reduce primitive's ops (codagen/primitives/reduce.py)
SUM = tl.constexpr(0)
SUMSQ = tl.constexpr(1)
MAX = tl.constexpr(2)
LOGSUMEXP = tl.constexpr(3)
_INTERPRETED = tl.constexpr(INTERPRETED)
# compiled by Triton's NVIDIA backend: PTX inline assembly is there (not in the interpreter, nor on ROCm)
_PTX = tl.constexpr(not INTERPRETED and torch.version.hip is None)
_LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    # tl has no tanh on every backend (the interpreter included); 2*sigmoid(2x) - 1 is exact in fp32 terms
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def sigmoid(x):
    """1 / (1 + e^-x) in fp32. Compiled for NVIDIA GPUs, from PTX's approximate 2^x and reciprocal with
    subnormals flushed (ex2.approx.ftz, rcp.approx.ftz; relative error about 2^-22): tl.sigmoid's exp and
    division keep the subnormal range at 7 more instructions per element, a fifth of swiglu_dgrad's
    epilogue (compiled for sm_90). NaN gives NaN, -inf 0 and +inf 1, as tl.sigmoid."""
    if _PTX:
        s = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + _exp2_flushed(x * -_LOG2_E)],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = tl.sigmoid(x)
    return s


@triton.jit
def exp_flushed(x):
    """exp(x) in fp32, a result below 2**-126 flushed to 0: compiled for NVIDIA GPUs, PTX's ex2.approx.ftz of
    x * log2(e), as tl.exp but for the subnormal range, which tl.exp keeps at 3 more instructions an element
    (the `exp` primitive, and log-sum-exp terms, each at most 1)."""
    if _PTX:
        e = _exp2_flushed(x * _LOG2_E)
    else:
        e = tl.exp(x)
    return e


@triton.jit
def _exp2_flushed(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


# bf16 is the upper half of an fp32's bits. A thread holds a tile's elements two by two (adjacent columns) in one
# 32-bit register, as they arrive from memory and leave for it: there a conversion is a shift or a mask of the
# register, and two roundings one instruction. The compiler's conversions extract each half first (compiled for
# sm_90: 2 instructions for an odd element's widening, a round trip through bf16 of 2 elements in 5): in
# swiglu_dgrad's Hopper epilogue these save 6% of its instructions; in the tl swiglu_bwd_rowdot 9-14%, and its
# spill (64x128 tiles, 4 warps) or a fifth of its registers (32x128, 8 warps). Elementwise: whichever two elements
# a register holds, the result is the same.
_WIDEN_BF16_PAIR = tl.constexpr("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000;")
_ROUND_BF16_PAIR = tl.constexpr(  # the pair rounded ($0, $1), and as bf16 ($2) for a store
    "{ cvt.rn.bf16x2.f32 $2, $4, $3; shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }")


@triton.jit
def widen(x):
    """A tile read from memory, in fp32 (exactly)."""
    if _PTX and x.dtype == tl.bfloat16:
        wide = tl.inline_asm_elementwise(_WIDEN_BF16_PAIR, "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        wide = x.to(tl.float32)
    return wide


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """An fp32 tile rounded to DTYPE (to nearest, even on ties) and back to fp32: the `cast` primitive."""
    rounded, _ = round_for_store(x, DTYPE)
    return rounded


@triton.jit
def round_for_store(x, DTYPE: tl.constexpr):
    """round_to, and the tile in DTYPE itself, for a store of the same value: one conversion for both."""
    if _PTX and DTYPE == tl.bfloat16:
        rounded, stored = tl.inline_asm_elementwise(_ROUND_BF16_PAIR, "=r,=r,=r,r,r", [x],
                                                    dtype=(tl.float32, tl.bfloat16), is_pure=True, pack=2)
    else:
        stored = x.to(DTYPE)
        rounded = stored.to(tl.float32)
    return rounded, stored


@triton.jit
def round_pairs_for_store(even, odd, DTYPE: tl.constexpr):
    """round_for_store of a tile of pairs held as its halves: both halves rounded, and the pairs joined in
    DTYPE. A pair is one 32-bit register in DTYPE, which the store takes as it is."""
    if _PTX and DTYPE == tl.bfloat16:
        even_rounded, odd_rounded, bits = tl.inline_asm_elementwise(
            _ROUND_BF16_PAIR, "=r,=r,=r,r,r", [even, odd], dtype=(tl.float32, tl.float32, tl.int32), is_pure=True,
            pack=1)
        stored = join_pairs(bits.to(tl.int16), (bits >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)
    else:
        even_rounded = even.to(DTYPE).to(tl.float32)
        odd_rounded = odd.to(DTYPE).to(tl.float32)
        stored = join_pairs(even, odd).to(DTYPE)
    return even_rounded, odd_rounded, stored


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@triton.jit
def gelu_tanh_grad(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)


@triton.jit
def split_pairs(x):
    """[BM, 2P] interleaved -> (even columns, odd columns), each [BM, P]."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def join_pairs(even, odd):
    """Inverse of split_pairs."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], even.shape[1] * 2))


@triton.jit
def _column_half(x, SECOND: tl.constexpr):
    left, right = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))
    if SECOND:
        x = right
    else:
        x = left
    return x


@triton.jit
def column_slice(x, PART: tl.constexpr, PARTS: tl.constexpr):
    """Columns [PART * w, (PART + 1) * w) of x, w = width / PARTS; PARTS is 1, 2, 4 or 8 (halves of halves)."""
    if PARTS >= 2:
        x = _column_half(x, PART // (PARTS // 2))
    if PARTS >= 4:
        x = _column_half(x, (PART // (PARTS // 4)) % 2)
    if PARTS == 8:
        x = _column_half(x, PART % 2)
    return x


@triton.jit
def swiglu_pairs(gate, up):
    return silu(gate) * up


@triton.jit
def swiglu(x):
    gate, up = split_pairs(x)
    return swiglu_pairs(gate, up)


@triton.jit
def geglu_pairs(gate, up):
    return gelu_tanh(gate) * up


@triton.jit
def geglu(x):
    gate, up = split_pairs(x)
    return geglu_pairs(gate, up)


@triton.jit
def swiglu_bwd_pairs(dy, gate, up):
    """Gradient of swiglu at the saved pair (gate, up): (d gate, d up). silu(gate) is made as swiglu_pairs
    makes it, so that an epilogue that also recomputes swiglu shares it; d silu / d gate is
    sig * (1 + gate * (1 - sig)) = sig + silu * (1 - sig), one multiply fewer."""
    sig = sigmoid(gate)
    silu_gate = silu(gate)
    return dy * up * (sig + silu_gate * (1.0 - sig)), dy * silu_gate


@triton.jit
def swiglu_bwd(dy, x):
    """Gradient of swiglu at the saved pairs x, interleaved as (d gate, d up)."""
    gate, up = split_pairs(x)
    d_gate, d_up = swiglu_bwd_pairs(dy, gate, up)
    return join_pairs(d_gate, d_up)


@triton.jit
def geglu_bwd_pairs(dy, gate, up):
    return dy * up * gelu_tanh_grad(gate), dy * gelu_tanh(gate)


@triton.jit
def geglu_bwd(dy, x):
    gate, up = split_pairs(x)
    d_gate, d_up = geglu_bwd_pairs(dy, gate, up)
    return join_pairs(d_gate, d_up)


# pi/2 in three parts for the reduction of sincos: the first two have 8 and 11 significant bits, so that their
# products with a quadrant count of up to 12 bits are exact in fp32 (times 4: 2*pi in three parts alike)
_HALF_PI_1 = tl.constexpr(1.5703125)
_HALF_PI_2 = tl.constexpr(4.837512969970703125e-4)
_HALF_PI_3 = tl.constexpr(7.549790126404332e-08)


@triton.jit
def sincos(angle):
    """(sin, cos) of fp32 angles. tl.sin and tl.cos compile to libdevice's sinf and cosf, each with its own
    reduction and a slow path for huge angles that needs a stack in local memory; RoPE's epilogue evaluates
    both on every pair of a tile. Here one reduction serves both: angle = k * period + r, with k split into
    its high and low 12 bits so that every product with the first two parts of the period is exact.

    Compiled for NVIDIA GPUs: the period is 2*pi and PTX's sin.approx and cos.approx take r, which is within
    0.1 of [-pi, pi] (their absolute error: 2**-21.4 there) and itself within 1.3e-7 of the exact remainder
    (float32 emulation on the CPU): within 1e-6 of the exact values for the fp32 angle up to |angle| = 2**20,
    in 16 instructions fewer than the polynomials below (a third of qkv_norm_rope's epilogue, compiled for
    sm_90). Elsewhere (the interpreter): the period is pi/2, |r| <= pi/4, and sinf's and cosf's minimax
    polynomials on r (Cephes), which k's quadrant picks and signs: within 2e-7 up to 2**20. Both: within 1e-4
    up to 2**23; beyond, where the fp32 angle is itself off by up to half a radian, the error reaches 0.05.
    NaN and infinities give NaN."""
    if _PTX:
        sin, cos = _sincos_ptx(angle)
    else:
        sin, cos = _sincos_polynomial(angle)
    return sin, cos


@triton.jit
def _reduce_angle(angle, QUARTERS: tl.constexpr):
    """(k, r): angle = k * period + r, period = QUARTERS * pi/2, |r| about period/2 at most."""
    k = tl.floor(angle * (0.6366197723675814 / QUARTERS) + 0.5)
    k_high = (k * (1.0 / 4096.0)).to(tl.int32).to(tl.float32) * 4096.0  # toward zero: |k_high| <= |k|
    k_low = k - k_high
    r = angle - k_high * (QUARTERS * _HALF_PI_1)
    r = r - k_low * (QUARTERS * _HALF_PI_1)
    r = r - k_high * (QUARTERS * _HALF_PI_2)
    r = r - k_low * (QUARTERS * _HALF_PI_2)
    r = r - k * (QUARTERS * _HALF_PI_3)
    return k, r


@triton.jit
def _sincos_ptx(angle):
    _, r = _reduce_angle(angle, 4)
    sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
    cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
    return sin, cos


@triton.jit
def _sincos_polynomial(angle):
    k, r = _reduce_angle(angle, 1)
    z = r * r
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    quadrant = k.to(tl.int32)
    odd = (quadrant & 1) != 0
    sin = tl.where(odd, cos_r, sin_r)
    cos = tl.where(odd, sin_r, cos_r)
    sin = tl.where((quadrant & 2) != 0, -sin, sin)
    cos = tl.where(((quadrant + 1) & 2) != 0, -cos, cos)
    return sin, cos


@triton.jit
def rope_pairs(even, odd, positions, freqs, INVERSE: tl.constexpr):
    """Rotate each pair (even, odd) by the angle position * frequency; INVERSE rotates back (the backward)."""
    sin, cos = sincos(positions[:, None] * freqs[None, :])
    if INVERSE:
        sin = -sin
    return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def rope(x, positions, freqs, INVERSE: tl.constexpr):
    even, odd = split_pairs(x)
    even, odd = rope_pairs(even, odd, positions, freqs, INVERSE)
    return join_pairs(even, odd)


@triton.jit
def rope_by_columns(x, positions, column_freqs, INVERSE: tl.constexpr):
    """rope of a tile of interleaved pairs given each column's frequency (a pair's two columns share one): the
    angles are made in the tile's own layout and split as the tile is, so no value changes layout (the Hopper
    kernels, whose accumulator layout a vector of half the width cannot take)."""
    angle, _ = split_pairs(positions[:, None] * column_freqs[None, :])
    sin, cos = sincos(angle)
    if INVERSE:
        sin = -sin
    even, odd = split_pairs(x)
    return join_pairs(even * cos - odd * sin, even * sin + odd * cos)


@triton.jit
def _expand(v, AXIS: tl.constexpr):
    if AXIS == 2:
        return v[:, :, None]
    elif AXIS == 1:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def maximum_nan(x, y):
    """max(x, y), NaN if either is NaN (torch.maximum). tl.maximum's default and tl.max drop a NaN; this form
    costs the same (one max.NaN.f32 on sm_80 and later)."""
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _safe_shift(big):
    # as torch.logsumexp: an infinite (or all -inf) maximum shifts by 0, so that exp(x - shift) stays exact:
    # +inf then sums to +inf, a row of -inf to 0 (its log: -inf)
    return tl.where(tl.abs(big) == float("inf"), 0.0, big)


@triton.jit
def partial_reduce(x, mask, OP: tl.constexpr, AXIS: tl.constexpr):
    """Reduce a tile along AXIS (1: over columns, one value per row; 0: over rows), ignoring masked-off
    elements. OP: SUM, SUMSQ (sum of squares), MAX or LOGSUMEXP. A NaN in the unmasked elements gives NaN."""
    if OP == SUM:
        out = tl.sum(tl.where(mask, x, 0.0), axis=AXIS)
    elif OP == SUMSQ:
        out = tl.sum(tl.where(mask, x * x, 0.0), axis=AXIS)
    elif OP == MAX:
        x = tl.where(mask, x, float("-inf"))
        if _INTERPRETED:
            # the interpreter runs a reduction by a function of ours element by element (~40 us each): there,
            # tl.max and a sum that is NaN when an element is give the same result
            out = tl.max(x, axis=AXIS) + tl.sum(tl.where(x != x, x, 0.0), axis=AXIS)
        else:
            # tl.max drops NaN; reducing by maximum_nan costs the same on a GPU
            out = tl.reduce(x, AXIS, maximum_nan)
    else:
        # an OP of another reduction must not pass for one of these (a new one needs its own branch)
        tl.static_assert(OP == LOGSUMEXP, "partial_reduce: OP must be SUM, SUMSQ, MAX or LOGSUMEXP")
        # online-softmax partial: max, then the sum of exponentials below it, folded into one number. The
        # max may drop a NaN: the NaN reaches the sum through exp
        big = tl.max(tl.where(mask, x, float("-inf")), axis=AXIS)
        safe = _safe_shift(big)
        total = tl.sum(tl.where(mask, exp_flushed(x - _expand(safe, AXIS)), 0.0), axis=AXIS)
        out = safe + tl.log(total)  # a row of -inf (or of masked-off lanes): log(0) = -inf
    return out


@triton.jit
def partial_reduce_pairs(even, odd, mask, OP: tl.constexpr):
    """partial_reduce over columns (one value per row) of a tile held as its even and odd columns; the mask
    is the pairs'. The halves are combined element by element first: one reduction across threads, not two."""
    if OP == LOGSUMEXP:
        big = tl.max(tl.where(mask, tl.maximum(even, odd), float("-inf")), axis=1)
        safe = _safe_shift(big)
        total = tl.sum(tl.where(mask, exp_flushed(even - safe[:, None]) + exp_flushed(odd - safe[:, None]), 0.0),
                       axis=1)
        out = safe + tl.log(total)
    elif OP == MAX:
        out = partial_reduce(maximum_nan(even, odd), mask, OP, 1)
    elif OP == SUMSQ:
        out = partial_reduce(even * even + odd * odd, mask, SUM, 1)
    else:
        tl.static_assert(OP == SUM, "partial_reduce_pairs: OP must be SUM, SUMSQ, MAX or LOGSUMEXP")
        out = partial_reduce(even + odd, mask, OP, 1)
    return out


@triton.jit
def group_reduce(x, mask, GROUP: tl.constexpr, OP: tl.constexpr):
    """Reduce each group of GROUP adjacent columns of a tile: [BM, BN] -> [BM, BN // GROUP]. The tile holds whole
    groups, so a group is all in range or all masked off (its value is then unused)."""
    x = tl.reshape(x, (x.shape[0], x.shape[1] // GROUP, GROUP))
    mask = tl.reshape(mask, (mask.shape[0], mask.shape[1] // GROUP, GROUP))
    return partial_reduce(x, mask, OP, 2)


@triton.jit
def expand_groups(v, GROUP: tl.constexpr):
    """A value per group, [BM, G], over its groups' columns: [BM, G * GROUP]."""
    wide = tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], GROUP))
    return tl.reshape(wide, (v.shape[0], v.shape[1] * GROUP))


@triton.jit
def store_selected(ptrs, x, cols, index, n_cols, row_mask, first_tile, STEP: tl.constexpr):
    """Per row, store the element of x in column index[row], from the tile that holds that column; rows
    whose index is outside [0, n_cols) (an ignore_index) get 0, stored by the first tile of the row. `cols`:
    the tile's columns of x, STEP apart (2: one half of pairs). Columns are compared in int32, the index
    clamped to -1 outside first (an int64 comparison takes two instructions an element), and whether the
    tile holds a row's column is arithmetic on the row, not a second reduction over the tile."""
    inside = (index >= 0) & (index < n_cols)
    column = tl.where(inside, index, -1).to(tl.int32)
    picked = tl.sum(tl.where(cols[None, :] == column[:, None], x, 0.0), axis=1)
    offset = column - tl.min(cols, axis=0)
    owned = inside & (offset >= 0) & (offset < STEP * cols.shape[0]) & (offset % STEP == 0)
    tl.store(ptrs, picked, mask=row_mask & owned)
    # a scalar `if`, not `mask & first_tile`: Triton's interpreter (3.9) broadcasts a scalar bool as int32
    if first_tile:
        # picked is 0 there; where() rather than zeros_like, which makes a layout of its own (no Gluon lowering)
        tl.store(ptrs, tl.where(inside, picked, 0.0), mask=row_mask & ~inside)


@triton.jit
def one_hot(cols, first_col, index, n_cols):
    """1.0 where a tile's column is its row's index, else 0.0; none in rows whose index is outside [0, n_cols).
    `cols`: the tile's columns, from first_col. Compared in int32 within the tile: each row's index becomes
    its place in the tile, or -1, once per row (an int64 comparison takes two instructions an element)."""
    inside = (index >= first_col) & (index < first_col + cols.shape[0]) & (index < n_cols)
    place = tl.where(inside, index - first_col, -1).to(tl.int32)
    return tl.where((cols - first_col).to(tl.int32)[None, :] == place[:, None], 1.0, 0.0)


@triton.jit
def accumulate(ptrs, x, mask):
    """Read-modify-write: ptrs += x, adding in fp32."""
    total = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + x
    tl.store(ptrs, total.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def fp8_scale(amax, MAX: tl.constexpr):
    """amax / MAX, correctly rounded (div_rn: `/` may be approximate on the GPU); 1 where that is 0 (a zero group,
    or amax so small that the quotient underflows), whose values are then 0 however they are scaled."""
    scale = tl.div_rn(amax, MAX)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def round_fp8(q, MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """q saturated to ±MAX and rounded to the nearest value of an FP8 format (MANTISSA bits, smallest normal
    2^MIN_EXPONENT), ties to even, in fp32 arithmetic: an fp32 on the FP8 grid, which a cast to the format keeps
    exactly. Written out rather than cast because the interpreter's cast to FP8 truncates and does not saturate;
    the same arithmetic runs on the GPU, so both agree bit for bit. NaN stays NaN, the sign of a zero is kept."""
    magnitude = tl.minimum(tl.abs(q), MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = magnitude.to(tl.int32, bitcast=True)
    # the grid's spacing at this magnitude, 2^(exponent - MANTISSA); subnormals share the smallest normal's
    exponent = tl.maximum((bits >> 23) & 0xFF, MIN_EXPONENT + 127)
    inverse = ((254 - exponent + MANTISSA) << 23).to(tl.float32, bitcast=True)
    spacing = ((exponent - MANTISSA) << 23).to(tl.float32, bitcast=True)
    # magnitude / spacing < 2^(MANTISSA + 1) is exact; adding and removing 1.5 * 2^23 rounds it to an integer,
    # ties to even (fp32's spacing is 1 there). The compiler fuses the product and the add into an FMA, the
    # same number since the product is exact, and keeps the subtraction (checked in the PTX for sm_90)
    units = magnitude * inverse
    rounded = ((units + 12582912.0) - 12582912.0) * spacing
    sign = q.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(q, FP8: tl.constexpr):
    """q, a value on the FP8 grid (round_fp8's) or NaN, converted to FP8 (tl.float8e4nv or tl.float8e5) as torch
    converts it: a grid value exactly, a NaN to 0x7F with its sign (a NaN in both formats). The conversion of a
    grid value is exact everywhere, but the interpreter's makes a number of a NaN (384 in float8e4nv) and the
    GPU's gives PTX's code for it, so a NaN's code is set here, on the bits."""
    code = q.to(FP8).to(tl.uint8, bitcast=True)
    sign = (q.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8) & 0x80
    return tl.where(q != q, sign | 0x7F, code).to(FP8, bitcast=True)


@triton.jit
def fp8_to_float(x):
    """FP8 values (tl.float8e4nv or tl.float8e5) in fp32, exactly, NaN and infinities included: the interpreter's
    conversion makes numbers of those (480 of float8e4nv's NaN, 65536 of float8e5's infinity), so where a code is
    one of them the value is set from the bits. For the interpreter's upcast of FP8 GEMM operands (UPCAST_DOT)."""
    value = x.to(tl.float32)
    code = x.to(tl.uint8, bitcast=True)
    magnitude = code & 0x7F
    if x.dtype == tl.float8e5:  # the exponent's bits all ones: infinity (mantissa 0) or NaN
        infinity = tl.where(code >= 0x80, float("-inf"), float("inf"))
        return tl.where(magnitude >= 0x7C, tl.where(magnitude == 0x7C, infinity, float("nan")), value)
    else:  # float8e4nv (e4m3fn): no infinity; NaN is S.1111.111
        return tl.where(magnitude == 0x7F, float("nan"), value)
