"""Gemma-2's post-attention (specs/gemma2/blocks/gemma2_post_attention.yaml) with a row-parallel out-projection, a
column-parallel gate/up (GeGLU) and a row-parallel down projection, built of the block's kernels; where its
all-reduces sit: docs/distributed.md#a-transformers-model-tensor-parallel.

Gemma-2 normalizes each projection's output before the residual add (its post-attention and post-feedforward
norms): a norm of the whole row, so each row-parallel product is all-reduced before that norm's statistics, then
the block's own kernel applies the norm, the residual add and the next norm's statistics to the whole rows. In the
backward the post-norms' gradients are of whole (replicated) rows, computed alike on every rank; the pre-feedforward
norm's data gradient is linear in the gate/up GEMM's product and row dot, sums over the ranks' pairs, so each rank
makes its part (the residual's gradient on rank 0 only) and one all-reduce sums them, as in Llama's
(codagen.parallel.tensor_parallel).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from codagen.runtime import finish

from .tensor_parallel import residual_on_first_rank
from .vocab_parallel import generated_kernels


def _whole_rstd(partial: torch.Tensor, dim: int, eps: float, group) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-parallel product made whole (all-reduce), and its RMSNorm's rstd: a norm needs the whole row."""
    dist.all_reduce(partial, group=group)
    # the sum of squares in fp32 as one partial per row (the single-process block's GEMM epilogue makes one per tile)
    return partial, finish.rstd(x=partial.float().square().sum(1, keepdim=True), size=dim, eps=eps)


class TensorParallelGemma2PostAttentionFunction(torch.autograd.Function):
    """gemma2_post_attention on the rank's heads and (gate, up) pairs: the out and down projections' partial products
    all-reduced before the post-attention and post-feedforward norms; in the backward, the pre-feedforward norm's
    dx and weight gradient are the sums of the ranks' parts."""

    @staticmethod
    def forward(ctx, y, x, wn_next, w_o, wn_post_attn, wn_pre_mlp, w_gate_up, w_down, wn_post_mlp, dim, eps, group):
        kernels = generated_kernels()
        o1, r_o1 = _whole_rstd(kernels.matmul.matmul(a=y, b=w_o), dim, eps, group)
        x1, h1, ss1 = kernels.gemma_post_norm_residual.gemma_post_norm_residual(o=o1, rstd=r_o1, wn=wn_post_attn, x=x,
                                                                                wn_next=wn_pre_mlp)
        r1 = finish.rstd(x=ss1, size=dim, eps=eps)
        z1, y1 = kernels.gate_up_geglu.gate_up_geglu(h=h1, w_gate_up=w_gate_up, rstd=r1)
        o2, r_o2 = _whole_rstd(kernels.matmul.matmul(a=y1, b=w_down), dim, eps, group)
        x_out, h_next, ss2 = kernels.gemma_post_norm_residual.gemma_post_norm_residual(
            o=o2, rstd=r_o2, wn=wn_post_mlp, x=x1, wn_next=wn_next)
        rstd_next = finish.rstd(x=ss2, size=dim, eps=eps)
        ctx.save_for_backward(y, o1, r_o1, x1, r1, z1, o2, r_o2, w_o, wn_post_attn, wn_pre_mlp, w_gate_up, w_down,
                              wn_post_mlp)
        ctx.attrs = (dim, group)
        ctx.mark_non_differentiable(h_next, rstd_next)
        return x_out, h_next, rstd_next

    @staticmethod
    def backward(ctx, grad_x_out, _grad_h_next, _grad_rstd_next):
        kernels = generated_kernels()
        (y, o1, r_o1, x1, r1, z1, o2, r_o2, w_o, wn_post_attn, wn_pre_mlp, w_gate_up, w_down,
         wn_post_mlp) = ctx.saved_tensors
        dim, group = ctx.attrs

        def post_norm_backward(g, o, rstd, wn):
            """The gradients of a post-norm's input and weight, of whole rows: the same on every rank."""
            dot_part, dwn_part = kernels.gemma_post_norm_rowdot.gemma_post_norm_rowdot(g=g, o=o, rstd=rstd, wn=wn)
            dot = finish.sum_tiles(x=dot_part, divide_by=dim)
            dout = kernels.gemma_post_norm_dgrad.gemma_post_norm_dgrad(g=g, o=o, rstd=rstd, wn=wn, dot=dot)
            return dout, finish.sum_tiles(x=dwn_part)

        do2, grad_wn_post_mlp = post_norm_backward(grad_x_out, o2, r_o2, wn_post_mlp)
        dz1, zdz1_part, y1 = kernels.geglu_dgrad.geglu_dgrad(grad_y=do2, w_down=w_down, z=z1)
        zdz1 = finish.sum_tiles(x=zdz1_part, divide_by=dim)  # the rank's pairs' part of the row dot
        grad_w_down = finish.matmul(a=do2, b=y1, transpose="a")
        grad_x, dwn_pre_mlp_part, n1 = kernels.gemma_norm_dgrad_residual.gemma_norm_dgrad_residual(
            dz=dz1, w=w_gate_up, x=x1, rstd=r1, wn=wn_pre_mlp, zdz=zdz1,
            grad_x=residual_on_first_rank(grad_x_out, group))
        grad_wn_pre_mlp = finish.sum_tiles(x=dwn_pre_mlp_part)
        dist.all_reduce(grad_x, group=group)
        dist.all_reduce(grad_wn_pre_mlp, group=group)
        grad_w_gate_up = finish.matmul(a=dz1, b=n1, transpose="a")
        do1, grad_wn_post_attn = post_norm_backward(grad_x, o1, r_o1, wn_post_attn)
        grad_y = finish.matmul(a=do1, b=w_o)
        grad_w_o = finish.matmul(a=do1, b=y, transpose="a")
        return (grad_y, grad_x, None, grad_w_o, grad_wn_post_attn, grad_wn_pre_mlp, grad_w_gate_up, grad_w_down,
                grad_wn_post_mlp, None, None, None)


def gemma2_post_attention(layer, y, x, wn_next, cast, group):
    """TensorParallelGemma2PostAttentionFunction on a patched Gemma-2 layer (codagen.parallel.hf_families):
    transformers' post_attention_layernorm is the norm of the attention's output."""
    attn, mlp = layer.self_attn, layer.mlp
    return TensorParallelGemma2PostAttentionFunction.apply(
        y, x, wn_next, cast(attn.o_proj.weight), cast(layer.post_attention_layernorm.weight),
        cast(layer.pre_feedforward_layernorm.weight), cast(mlp.gate_up_proj.weight), cast(mlp.down_proj.weight),
        cast(layer.post_feedforward_layernorm.weight), layer.dim, layer.eps, group)
