"""Finish (aux) steps of blocks: small Triton kernels that combine the per-tile partials written by GEMM
epilogues, and the cross-entropy loss. Each reads [rows, tiles] fp32 buffers once; no atomics."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETED, on_device

_SUM, _RSTD, _LOGSUMEXP = 0, 1, 2


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
        if OP == 2:
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
    else:
        out = tl.where(tl.abs(running_max) == float("inf"), 0.0, running_max) + tl.log(total)
    tl.store(out_ptr + rows, out, mask=row_mask)


def _reduce_tiles(x: torch.Tensor, op: int, scale: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"partial-reduction buffers are float32 [rows, tiles], got {x.dtype} {tuple(x.shape)}")
    rows, tiles = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_r = 64
        with on_device(x.device):
            _reduce_tiles_kernel[(triton.cdiv(rows, block_r),)](
                x, out, rows, tiles, x.stride(0), x.stride(1), float(scale), float(eps),
                OP=op, BLOCK_R=block_r, BLOCK_T=min(128, triton.next_power_of_2(max(tiles, 1))),
            )
    return out


# Parameters are named as the finish steps' arguments in block specs: generated blocks pass them by keyword.

def rstd(x: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """RMSNorm's per-row 1 / sqrt(mean(v^2) + eps) from the per-tile partial sums of squares `x` of rows of
    `size` values."""
    return _reduce_tiles(x, _RSTD, 1.0 / size, eps)


def sum_tiles(x: torch.Tensor, divide_by: int | None = None) -> torch.Tensor:
    """Sum of the per-tile partials of each row (or column), optionally divided by a size."""
    return _reduce_tiles(x, _SUM, 1.0 / divide_by if divide_by else 1.0)


def logsumexp_tiles(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(.))) of each row from per-tile log-sum-exp partials."""
    return _reduce_tiles(x, _LOGSUMEXP)


# debug=True keeps the target check below on a GPU: a failed check is a device-side assert, as in PyTorch's
# own CUDA cross-entropy, with no host sync (debug also checks this kernel's integer arithmetic: a small pass)
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
    if INTERPRETED:
        _check_targets(target, classes, ignore_index)
    m = target.shape[0]
    loss = torch.empty((), dtype=torch.float32, device=lse.device)
    weights = torch.empty(m, dtype=torch.float32, device=lse.device)
    with on_device(lse.device):
        _cross_entropy_kernel[(1,)](lse, target_logit, target.contiguous(), loss, weights, m, int(classes),
                                    int(ignore_index), MEAN=reduction == "mean", EMPTY_NAN=empty_mean == "nan",
                                    BLOCK=1024)
    return loss, weights


def row_weights(target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Each row's weight in a cross-entropy loss, as cross_entropy returns them, from the targets alone (for a
    forward that makes the gradient before the loss): 1/valid rows for 'mean', 1 for 'sum', 0 for ignored
    rows. No host sync."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    valid = (target != ignore_index).to(torch.float32)
    return valid / valid.sum().clamp(min=1.0) if reduction == "mean" else valid


def matmul(a: torch.Tensor, b: torch.Tensor, transpose: str = "none") -> torch.Tensor:
    """A plain GEMM (weight gradients, data gradients with no epilogue), a @ b with the operand named by
    `transpose` ('a', 'b' or 'none') transposed: cuBLAS through torch."""
    return torch.matmul(a.T if transpose == "a" else a, b.T if transpose == "b" else b)
