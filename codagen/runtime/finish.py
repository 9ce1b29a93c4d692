"""Finish (aux) steps of blocks: small Triton kernels that combine the per-tile partials written by GEMM
epilogues, and the cross-entropy loss. Each reads [rows, tiles] fp32 buffers once; no atomics."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETED, on_device
from .launcher import Launcher
from .ops import opaque_op

_SUM, _RSTD, _LOGSUMEXP, _LOG_SOFTMAX_NORM = 0, 1, 2, 3


@Launcher  # Triton's argument binding once per kind of call
@triton.jit
def _reduce_tiles_kernel(
    x_ptr, out_ptr,
    R, T,
    stride_x_r, stride_x_t,
    scale, eps,
    OP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    running_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        mask = row_mask[:, None] & (tiles < T)[None, :]
        ptrs = x_ptr + rows[:, None] * stride_x_r + tiles[None, :] * stride_x_t
        if OP >= 2:
            # partials are per-tile log-sum-exps: combine them with a running max, as online softmax does.
            # The max may drop a NaN partial; the sum keeps it. An infinite max shifts by 0 (torch.logsumexp)
            x = tl.load(ptrs, mask=mask, other=float("-inf"))
            new_max = tl.maximum(running_max, tl.max(x, axis=1))
            safe = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
            total = total * tl.exp(running_max - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
            running_max = new_max
        else:
            total += tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=1)
    if OP == 0:
        out = total * scale
    elif OP == 1:
        out = tl.rsqrt(total * scale + eps)
    elif OP == 2:
        out = tl.where(tl.abs(running_max) == float("inf"), 0.0, running_max) + tl.log(total)
    else:
        # log_softmax's normalizer: an infinite max is subtracted as it is (inf - inf), so the row is NaN
        out = tl.where(tl.abs(running_max) == float("inf"), float("nan"), running_max + tl.log(total))
    tl.store(out_ptr + rows, out, mask=row_mask)


@opaque_op("reduce_tiles", fake=lambda x, op, scale=1.0, eps=0.0: x.new_empty(x.shape[:1]))
def _reduce_tiles(x: torch.Tensor, op: int, scale: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"partial-reduction buffers are float32 [rows, tiles], got {x.dtype} {tuple(x.shape)}")
    rows, tiles = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        # about 4096 partials per program and step: a vocabulary's 1002 tiles in one step of 4 rows, so that
        # 2048 rows make 512 programs (64 rows per program left 32 programs to read 8 MB, 28 us on the H200)
        block_t = min(1024, triton.next_power_of_2(max(tiles, 1)))
        block_r = min(64, 4096 // block_t)
        with on_device(x.device):
            _reduce_tiles_kernel[(triton.cdiv(rows, block_r),)](
                x, out, rows, tiles, x.stride(0), x.stride(1), float(scale), float(eps),
                OP=op, BLOCK_R=block_r, BLOCK_T=block_t,
            )
    return out


@Launcher  # Triton's argument binding once per kind of call
@triton.jit
def _scale_kernel(x_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * tl.load(factor_ptr)).to(x_ptr.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x *= factor in place, factor a [] tensor on x's device: the product of x and the fp32 factor, computed in
    fp32 and rounded once, in one read and write of x; returns x. For bf16 and fp16 x, torch's mul_ by a GPU []
    tensor rounds the factor to x's dtype first (a relative error of up to 2^-9 on every element alike, for
    bf16) and takes its broadcasting path, at under a quarter of the bandwidth: 3.0 ms on the H200 to scale the
    weight and input gradients of Llama-3-8B's LM head (1.25 GB)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous() or factor.numel() != 1:
        return x.mul_(factor)
    if x.numel():
        _scale(x, factor.float().reshape(()))
    return x


@opaque_op("scale", fake=lambda x, factor: None, mutates_args=("x",))
def _scale(x: torch.Tensor, factor: torch.Tensor) -> None:
    block = 4096
    with on_device(x.device):
        _scale_kernel[(triton.cdiv(x.numel(), block),)](x, factor, x.numel(), BLOCK=block)


# Parameters are named as the finish steps' arguments in block specs: generated blocks pass them by keyword.

def rstd(x: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """RMSNorm's per-row 1 / sqrt(mean(v^2) + eps) from the per-tile partial sums of squares `x` of rows of
    `size` values."""
    return _reduce_tiles(x, _RSTD, 1.0 / size, eps)


def sum_tiles(x: torch.Tensor, divide_by: int | None = None) -> torch.Tensor:
    """Sum of the per-tile partials of each row (or column), optionally divided by a size."""
    return _reduce_tiles(x, _SUM, 1.0 / divide_by if divide_by else 1.0)


def logsumexp_tiles(x: torch.Tensor, inf_max: str = "keep") -> torch.Tensor:
    """log(sum(exp(.))) of each row from per-tile log-sum-exp partials. A row whose largest value is +inf or
    -inf (every value -inf) gives torch.logsumexp's +inf or -inf with inf_max 'keep'; with 'nan' it gives NaN,
    as the normalizer that log_softmax and F.cross_entropy subtract, max + log(sum(exp(x - max))), in which
    inf - inf is NaN: a +inf logit makes PyTorch's whole row of log-probabilities, its loss and the gradient of
    every logit of the row NaN."""
    if inf_max not in ("keep", "nan"):
        raise ValueError(f"inf_max must be 'keep' or 'nan', got {inf_max!r}")
    return _reduce_tiles(x, _LOGSUMEXP if inf_max == "keep" else _LOG_SOFTMAX_NORM)


# debug=True keeps the target check below on a GPU: a failed check is a device-side assert, as in PyTorch's
# own CUDA cross-entropy, with no host sync (debug also checks this kernel's integer arithmetic: a small pass)
@Launcher  # Triton's argument binding once per kind of call
@triton.jit(debug=True)
def _cross_entropy_kernel(
    lse_ptr, target_logit_ptr, target_ptr, loss_ptr, weight_ptr,
    M, classes, ignore_index,
    MEAN: tl.constexpr, EMPTY_NAN: tl.constexpr, BLOCK: tl.constexpr,
):
    # one program: a deterministic sum over all rows (M is a token count, this is a small pass)
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        valid = (target != ignore_index) & (rows < M)
        tl.device_assert(((target >= 0) & (target < classes)) | ~valid,
                         "cross_entropy: a target is outside [0, classes) and is not ignore_index")
        lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
        picked = tl.load(target_logit_ptr + rows, mask=valid, other=0.0)
        total += tl.where(valid, lse - picked, 0.0)
        count += valid.to(tl.int32)
    if MEAN:
        # the mean over no rows (every target ignored, or M = 0) is 0 / 0 = NaN, as in PyTorch; EMPTY_NAN
        # off makes it 0. Either way every row's weight, and so every gradient, is 0.
        denom = (tl.sum(count) if EMPTY_NAN else tl.maximum(tl.sum(count), 1)).to(tl.float32)
    else:
        denom = 1.0
    tl.store(loss_ptr, tl.sum(total) / denom)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        tl.store(weight_ptr + rows, tl.where(target != ignore_index, 1.0 / denom, 0.0), mask=rows < M)


def _check_targets(target: torch.Tensor, classes: int, ignore_index: int) -> None:
    """Raise PyTorch's IndexError for a target outside [0, classes) that is not ignore_index. On the host, so
    only where that costs no sync: under the interpreter; on a GPU the kernel's device-side assert checks."""
    outside = ((target < 0) | (target >= classes)) & (target != ignore_index)
    if outside.any():
        raise IndexError(f"Target {target[outside][0].item()} is out of bounds.")


def cross_entropy(lse: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor, ignore_index: int,
                  reduction: str, *, classes: int, empty_mean: str = "nan") -> tuple[torch.Tensor, torch.Tensor]:
    """The loss from per-row lse and target logits over `classes` classes, and each row's weight in it
    (d loss / d row loss): 1/valid rows for 'mean', 1 for 'sum', 0 for ignored rows. A target outside
    [0, classes) that is not ignore_index is an error. `empty_mean`: the mean over no rows (every target
    ignored, or none): 'nan' as PyTorch, or 'zero'."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if empty_mean not in ("nan", "zero"):
        raise ValueError(f"empty_mean must be 'nan' or 'zero', got {empty_mean!r}")
    return _cross_entropy(lse, target_logit, target.contiguous(), int(ignore_index), int(classes),
                          reduction == "mean", empty_mean == "nan")


@opaque_op("cross_entropy", fake=lambda lse, target_logit, target, *_: (lse.new_empty(()),
                                                                              lse.new_empty(target.shape)))
def _cross_entropy(lse: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor, ignore_index: int,
                   classes: int, mean: bool, empty_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if INTERPRETED:
        _check_targets(target, classes, ignore_index)
    m = target.shape[0]
    loss = torch.empty((), dtype=torch.float32, device=lse.device)
    weights = torch.empty(m, dtype=torch.float32, device=lse.device)
    with on_device(lse.device):
        _cross_entropy_kernel[(1,)](lse, target_logit, target, loss, weights, m, classes, ignore_index, MEAN=mean,
                                    EMPTY_NAN=empty_nan, BLOCK=1024)
    return loss, weights


def unit_scale(x: torch.Tensor) -> torch.Tensor:
    """The power of two s that brings the largest |x| into [0.5, 1), as a float32 [] tensor (1 when x is empty,
    all zero or not finite). Multiplying by it is exact in any binary float format: a forward that makes the
    gradients of a mean loss can make them for an output gradient of s instead of 1, so that its half-precision
    intermediates (fp16's range ends at 6e-5, below which precision is lost) hold values near 1 rather than near
    1/rows. No host sync."""
    top = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    top = torch.where((top > 0) & torch.isfinite(top), top, 0.5)  # 0.5: s = 1
    _, exponent = torch.frexp(top)  # top = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones((), device=x.device), -exponent)


def row_weights(target: torch.Tensor, ignore_index: int, reduction: str,
                token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's weight in a loss, as cross_entropy and reduce_loss return them, from the targets (and the
    per-token weights) alone, for a forward that makes the gradient before the loss: w/sum(w of valid rows)
    for 'mean', w for 'sum' and 'none', 0 for ignored rows; w is 1 without token_weights. No host sync."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    valid = (target != ignore_index).to(torch.float32)
    if token_weights is None:
        return valid / valid.sum().clamp(min=1.0) if reduction == "mean" else valid
    weighted = torch.where(target != ignore_index, token_weights.float(), 0.0)
    if reduction != "mean":
        return weighted
    total = weighted.sum()
    # selected, not multiplied: a NaN or infinite total (a NaN weight of a valid row) leaves ignored rows at 0
    return torch.where(target != ignore_index, weighted / torch.where(total == 0, 1.0, total), 0.0)


@Launcher  # Triton's argument binding once per kind of call
@triton.jit(debug=True)
def _reduce_loss_kernel(
    x_ptr, target_ptr, token_weight_ptr, loss_ptr, weight_ptr,
    M, classes, ignore_index,
    REDUCTION: tl.constexpr, WEIGHTED: tl.constexpr, EMPTY_NAN: tl.constexpr, BLOCK: tl.constexpr,
):
    # one program, as _cross_entropy_kernel: a deterministic sum over all rows. REDUCTION 0: mean, 1: sum,
    # 2: none (each row's weighted loss, 0 where ignored)
    total = tl.zeros((BLOCK,), tl.float32)
    weight_total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        valid = (target != ignore_index) & (rows < M)
        tl.device_assert(((target >= 0) & (target < classes)) | ~valid,
                         "reduce_loss: a target is outside [0, classes) and is not ignore_index")
        if WEIGHTED:
            w = tl.load(token_weight_ptr + rows, mask=valid, other=0.0)
        else:
            w = valid.to(tl.float32)
        row = tl.where(valid, w * tl.load(x_ptr + rows, mask=valid, other=0.0), 0.0)
        if REDUCTION == 2:
            tl.store(loss_ptr + rows, row, mask=rows < M)
            tl.store(weight_ptr + rows, w, mask=rows < M)
        total += row
        weight_total += w
    if REDUCTION != 2:
        if REDUCTION == 0:
            # the mean over no weight (every target ignored, or M = 0) is 0 / 0 = NaN, as in PyTorch; EMPTY_NAN
            # off makes it 0. Either way every row's weight, and so every gradient, is 0.
            denom = tl.sum(weight_total)
            if not EMPTY_NAN:
                denom = tl.where(denom == 0.0, 1.0, denom)
            scale = tl.where(denom == 0.0, 0.0, 1.0 / denom)
        else:
            denom = 1.0
            scale = 1.0
        tl.store(loss_ptr, tl.sum(total) / denom)
        for start in range(0, M, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
            valid = target != ignore_index
            if WEIGHTED:
                w = tl.load(token_weight_ptr + rows, mask=valid & (rows < M), other=0.0)
            else:
                w = valid.to(tl.float32)
            tl.store(weight_ptr + rows, tl.where(valid, w * scale, 0.0), mask=rows < M)


def reduce_loss(x: torch.Tensor, target: torch.Tensor, classes: int, ignore_index: int, reduction: str,
                token_weights: torch.Tensor | None = None, *, empty_mean: str = "nan"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss from each row's loss `x` ([M] float32), and each row's weight in it (d loss / d row loss), as
    PyTorch reduces its losses: rows whose target is ignore_index count for nothing; 'mean' divides the sum of
    the others by their number (by the sum of their token_weights when given), 'sum' does not, 'none' gives
    each row's loss ([M], 0 where ignored). token_weights ([M] float32) multiply each row's loss. A target
    outside [0, classes) that is not ignore_index is an error. `empty_mean`: the mean over no rows, 'nan' as
    PyTorch or 'zero'."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if empty_mean not in ("nan", "zero"):
        raise ValueError(f"empty_mean must be 'nan' or 'zero', got {empty_mean!r}")
    for name, t in (("x", x), ("token_weights", token_weights)):
        if t is not None and (t.dtype != torch.float32 or t.shape != target.shape):
            raise ValueError(f"reduce_loss.{name} must be float32 {tuple(target.shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    return _reduce_loss(x.contiguous(), target.contiguous(),
                        None if token_weights is None else token_weights.contiguous(), int(classes),
                        int(ignore_index), ("mean", "sum", "none").index(reduction), empty_mean == "nan")


def _reduce_loss_fake(x, target, token_weights, classes, ignore_index, reduction, empty_nan):
    return x.new_empty(target.shape if reduction == 2 else ()), x.new_empty(target.shape)


@opaque_op("reduce_loss", fake=_reduce_loss_fake)
def _reduce_loss(x: torch.Tensor, target: torch.Tensor, token_weights: torch.Tensor | None, classes: int,
                 ignore_index: int, reduction: int, empty_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if INTERPRETED:
        _check_targets(target, classes, ignore_index)
    m = target.shape[0]
    loss = torch.empty((m,) if reduction == 2 else (), dtype=torch.float32, device=x.device)
    weights = torch.empty(m, dtype=torch.float32, device=x.device)
    weighted = token_weights is not None
    with on_device(x.device):
        _reduce_loss_kernel[(1,)](x, target, token_weights if weighted else x, loss, weights, m, classes,
                                  ignore_index, REDUCTION=reduction, WEIGHTED=weighted, EMPTY_NAN=empty_nan,
                                  BLOCK=1024)
    return loss, weights


# Elementwise steps on row vectors ([M]), partial buffers ([M, tiles]) and scalars, in fp32: a few M-long
# passes, next to the GEMMs' M x N. Operands have one shape, or one is a scalar (a 0-d tensor or a number):
# partial buffers of two kernels may have different tile counts, which must be an error, never a broadcast.

def _operands(op: str, x, y) -> tuple:
    xs, ys = (v.float() if isinstance(v, torch.Tensor) else float(v) for v in (x, y))
    shapes = [v.shape for v in (xs, ys) if isinstance(v, torch.Tensor) and v.dim()]
    if len(shapes) == 2 and shapes[0] != shapes[1]:
        raise ValueError(f"{op}: x is {tuple(shapes[0])} and y is {tuple(shapes[1])}; elementwise finish steps take "
                         "values of one shape, or one value and a scalar")
    return xs, ys


def add(x, y) -> torch.Tensor:
    """x + y in fp32."""
    xs, ys = _operands("add", x, y)
    return torch.add(xs, ys)


def sub(x, y) -> torch.Tensor:
    """x − y in fp32."""
    xs, ys = _operands("sub", x, y)
    return torch.sub(xs, ys)


def mul(x, y) -> torch.Tensor:
    """x · y in fp32."""
    xs, ys = _operands("mul", x, y)
    return torch.mul(xs, ys)


def div(x, y) -> torch.Tensor:
    """x / y in fp32."""
    xs, ys = _operands("div", x, y)
    return torch.div(xs, ys)


def square(x: torch.Tensor) -> torch.Tensor:
    """x² in fp32."""
    return x.float().square()


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[m, index[m]] of each row in fp32, 0 where index[m] is outside [0, columns) (an ignored target)."""
    inside = (index >= 0) & (index < x.shape[1])
    picked = x.gather(1, torch.where(inside, index, 0).long()[:, None])[:, 0].float()
    return torch.where(inside, picked, 0.0)


def matmul(a: torch.Tensor, b: torch.Tensor, transpose: str = "none") -> torch.Tensor:
    """A plain GEMM (weight gradients, data gradients with no epilogue), a @ b with the operand named by
    `transpose` ('a', 'b' or 'none') transposed: cuBLAS through torch."""
    return torch.matmul(a.T if transpose == "a" else a, b.T if transpose == "b" else b)
