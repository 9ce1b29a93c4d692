"""q, k and v as attention takes them, from the fused QKV projection's output, and their gradients back in one pass.

The views themselves cost nothing; their backward is what costs. Through autograd's split, view and transpose, the
three [batch, heads, seq, head_dim] gradients are each copied into the [batch, seq, heads * head_dim] layout and
then concatenated: two passes over the whole gradient, the copies in PyTorch's generic strided kernel (0.42 ms of a
Llama-3.2-1B layer's 32k-token backward on the H200). split_heads' backward writes them in one pass, one kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device
from .launcher import Launcher
from .ops import opaque_op


@Launcher  # Triton's argument binding once per kind of call
@triton.jit
def _merge_heads_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq, width, q_heads, kv_heads,
    q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # program (seq block, batch * all heads): one head's [BLOCK_S, HEAD_DIM] block, read in its own strides and
    # written where that head's columns lie in the [batch * seq, width] output
    b = tl.program_id(1) // (q_heads + 2 * kv_heads)
    head = tl.program_id(1) % (q_heads + 2 * kv_heads)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask = (s < seq)[:, None] & (d < HEAD_DIM)[None, :]
    if head < q_heads:
        h = head
        src = q_ptr + b.to(tl.int64) * q_sb + h.to(tl.int64) * q_sh + s[:, None].to(tl.int64) * q_ss + d[None, :] * q_sd
    elif head < q_heads + kv_heads:
        h = head - q_heads
        src = k_ptr + b.to(tl.int64) * k_sb + h.to(tl.int64) * k_sh + s[:, None].to(tl.int64) * k_ss + d[None, :] * k_sd
    else:
        h = head - q_heads - kv_heads
        src = v_ptr + b.to(tl.int64) * v_sb + h.to(tl.int64) * v_sh + s[:, None].to(tl.int64) * v_ss + d[None, :] * v_sd
    rows = b.to(tl.int64) * seq + s.to(tl.int64)
    dst = out_ptr + rows[:, None] * width + head * HEAD_DIM + d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _merge_heads_fake(q, k, v):
    return q.new_empty(q.shape[0], q.shape[2], (q.shape[1] + 2 * k.shape[1]) * q.shape[3])


@opaque_op("merge_heads", fake=_merge_heads_fake)
def merge_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[batch, q_heads, seq, head_dim] q and [batch, kv_heads, seq, head_dim] k and v, in any strides, -> their
    [batch, seq, (q_heads + 2 * kv_heads) * head_dim] concatenation by heads, in one kernel."""
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[::2] != q.shape[::2] or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"merge_heads: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} and "
                         f"v {tuple(v.shape)} {v.dtype} must share batch, seq, head_dim and dtype, k and v their heads")
    width = (q_heads + 2 * kv_heads) * head_dim
    out = torch.empty(batch, seq, width, dtype=q.dtype, device=q.device)
    if out.numel():
        block_d = triton.next_power_of_2(head_dim)
        block_s = max(1, 4096 // block_d)  # 8 KB of bf16 a program
        with on_device(q.device):
            _merge_heads_kernel[(triton.cdiv(seq, block_s), batch * (q_heads + 2 * kv_heads))](
                q, k, v, out, seq, width, q_heads, kv_heads, *q.stride(), *k.stride(), *v.stride(),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
            )
    return out


def _views(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    return tuple(t.unflatten(-1, (-1, head_dim)).transpose(1, 2)
                 for t in qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))


class _SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_heads, kv_heads, head_dim):
        ctx.shape = (q_heads, kv_heads, head_dim)
        return _views(qkv, q_heads, kv_heads, head_dim)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):  # autograd gives zeros for an output with no gradient
        return merge_heads(grad_q, grad_k, grad_v), None, None, None


def split_heads(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """[batch, seq, (q_heads + 2 * kv_heads) * head_dim] -> q [batch, q_heads, seq, head_dim], k and v [batch,
    kv_heads, seq, head_dim]: views of qkv, as ``view(...).transpose(1, 2)`` makes them, whose gradient comes back
    to qkv in one kernel (merge_heads)."""
    if qkv.dim() != 3 or qkv.shape[-1] != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"split_heads: qkv {tuple(qkv.shape)} is not [batch, seq, (q_heads + 2 * kv_heads) * "
                         f"head_dim] for {q_heads} q heads, {kv_heads} kv heads of {head_dim}")
    if not (torch.is_grad_enabled() and qkv.requires_grad):
        return _views(qkv, q_heads, kv_heads, head_dim)
    return _SplitHeads.apply(qkv, q_heads, kv_heads, head_dim)
