"""Tensor-parallel Llama layers over a process group, built of the same generated kernels as codagen's Llama
assembly (codagen/models/llama.py); what each rank holds and where the all-reduces sit, with their cost:
docs/distributed.md#tensor-parallel-layers.

QKV and gate/up are column-parallel (their epilogues are local to a column or a pair); the out and down
projections are row-parallel: their partial products are all-reduced before the residual add and the norm's
statistics, which are not linear in the product. In the backward each norm's data gradient is linear in the GEMM's
product and the row dot, both sums over the ranks' columns, so each rank's epilogue makes its part (the residual's
gradient counted on rank 0 only) and one all-reduce sums them.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from codagen.runtime import finish

from .vocab_parallel import VocabParallelLmHeadLoss, generated_kernels, process_group


def residual_on_first_rank(grad: torch.Tensor, group) -> torch.Tensor:
    """The residual's gradient as this rank's part of a sum over ranks: itself on rank 0, zeros elsewhere (every
    rank holds the same whole gradient)."""
    return grad if dist.get_rank(group) == 0 else torch.zeros_like(grad)


def layer_shards(shape, rank: int, world: int) -> dict[str, tuple[int, torch.Tensor]]:
    """What rank holds of each sharded weight of a codagen Llama layer (codagen.models.llama.Layer), as
    {parameter name: (dim, indices along dim)}. Refuses a split that is not implemented, by name."""
    for what, n in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads), ("ffn_dim", shape.ffn_dim)):
        if n % world:
            raise NotImplementedError(f"tensor parallelism over {world} ranks needs {what} ({n}) divisible by "
                                      f"{world}; replicating key-value heads or uneven splits is not implemented")
    hd = shape.head_dim

    def heads(first: int, count: int) -> torch.Tensor:
        per = count // world
        return torch.arange((first + rank * per) * hd, (first + (rank + 1) * per) * hd)

    qkv = torch.cat([heads(0, shape.n_heads), heads(shape.n_heads, shape.n_kv_heads),
                     heads(shape.n_heads + shape.n_kv_heads, shape.n_kv_heads)])
    attn = heads(0, shape.n_heads)
    ffn = shape.ffn_dim // world
    mlp = torch.arange(rank * ffn, (rank + 1) * ffn)
    gate_up = torch.stack([2 * mlp, 2 * mlp + 1], 1).reshape(-1)  # the (gate, up) rows of the rank's pairs
    return {"pre.w_qkv": (0, qkv), "post.w_o": (1, attn), "post.w_gate_up": (0, gate_up), "post.w_down": (1, mlp)}


class TensorParallelPreAttentionFunction(torch.autograd.Function):
    """pre_attention (specs/blocks/pre_attention.yaml) on the rank's qkv columns: the forward is the block's; the
    backward's dx and dwn are the rank's parts, summed over ranks."""

    @staticmethod
    def forward(ctx, x, h, rstd, positions, freqs, wn, w_qkv, dim, group):
        qkv = generated_kernels().qkv_norm_rope.qkv_norm_rope(h=h, w_qkv=w_qkv, rstd=rstd, positions=positions,
                                                              freqs=freqs)
        ctx.save_for_backward(x, rstd, positions, freqs, qkv, wn, w_qkv)
        ctx.attrs = (dim, group)
        return x.view_as(x), qkv

    @staticmethod
    def backward(ctx, grad_x_out, grad_qkv):
        kernels = generated_kernels()
        x, rstd, positions, freqs, qkv, wn, w_qkv = ctx.saved_tensors
        dim, group = ctx.attrs
        dz, zdz_part = kernels.rope_bwd_rowdot.rope_bwd_rowdot(qkv=qkv, grad_qkv=grad_qkv, positions=positions,
                                                               freqs=freqs)
        zdz = finish.sum_tiles(x=zdz_part, divide_by=dim)  # the rank's columns' part of the row dot
        grad_x, dwn_part, normed = kernels.norm_dgrad_residual.norm_dgrad_residual(
            dz=dz, w=w_qkv, x=x, rstd=rstd, wn=wn, zdz=zdz, grad_x=residual_on_first_rank(grad_x_out, group))
        grad_wn = finish.sum_tiles(x=dwn_part)
        dist.all_reduce(grad_x, group=group)
        dist.all_reduce(grad_wn, group=group)
        grad_w_qkv = finish.matmul(a=dz, b=normed, transpose="a")
        return grad_x, None, None, None, None, grad_wn, grad_w_qkv, None, None


class TensorParallelPostAttentionFunction(torch.autograd.Function):
    """post_attention (specs/blocks/post_attention.yaml) with a row-parallel out-projection, a column-parallel
    gate/up and a row-parallel down projection: each row-parallel product is all-reduced before the residual add
    and the norm's statistics; in the backward, dx is the sum of the ranks' parts. With mlp_bias
    (post_attention_mlp_bias.yaml), b_gate_up is the rank's columns' bias, added in the gate/up epilogue, and b_down,
    replicated, is added once, to the all-reduced product (None: no bias)."""

    @staticmethod
    def forward(ctx, y, x, wn_next, w_o, wn_mlp, w_gate_up, b_gate_up, w_down, b_down, dim, eps, group):
        kernels = generated_kernels()

        def residual_norm(partial, residual, wn, bias=None):
            dist.all_reduce(partial, group=group)
            x_new = residual + partial if bias is None else residual + partial + bias
            h, ss = kernels.rmsnorm_stats.rmsnorm_stats(x=x_new, wn=wn)
            return x_new, h, finish.rstd(x=ss, size=dim, eps=eps)

        x1, h1, r1 = residual_norm(kernels.matmul.matmul(a=y, b=w_o), x, wn_mlp)
        if b_gate_up is None:
            z1, y1 = kernels.gate_up_swiglu.gate_up_swiglu(h=h1, w_gate_up=w_gate_up, rstd=r1)
        else:
            z1, y1 = kernels.gate_up_bias_swiglu.gate_up_bias_swiglu(h=h1, w_gate_up=w_gate_up, rstd=r1,
                                                                     b_gate_up=b_gate_up)
        x_out, h_next, rstd_next = residual_norm(kernels.matmul.matmul(a=y1, b=w_down), x1, wn_next, b_down)
        ctx.save_for_backward(y, x1, r1, z1, w_o, wn_mlp, w_gate_up, b_gate_up, w_down)
        ctx.attrs = (dim, group, b_down is not None)
        ctx.mark_non_differentiable(h_next, rstd_next)
        return x_out, h_next, rstd_next

    @staticmethod
    def backward(ctx, grad_x_out, _grad_h_next, _grad_rstd_next):
        kernels = generated_kernels()
        y, x1, r1, z1, w_o, wn_mlp, w_gate_up, b_gate_up, w_down = ctx.saved_tensors
        dim, group, down_bias = ctx.attrs
        if b_gate_up is None:
            dz1, zdz1_part, y1 = kernels.swiglu_dgrad.swiglu_dgrad(grad_y=grad_x_out, w_down=w_down, z=z1)
            grad_b_gate_up = None
        else:  # the rank's columns' bias gradient is whole: grad_x_out is
            dz1, zdz1_part, db1_part, y1 = kernels.swiglu_bias_dgrad.swiglu_bias_dgrad(
                grad_y=grad_x_out, w_down=w_down, z=z1, b_gate_up=b_gate_up)
            grad_b_gate_up = finish.sum_tiles(x=db1_part)
        # the replicated down bias: the column sums of the whole grad_x_out, the same on every rank (in fp32, as
        # the norm weights' gradients; autograd casts each to its parameter's dtype)
        grad_b_down = grad_x_out.sum(0, dtype=torch.float32) if down_bias else None
        zdz1 = finish.sum_tiles(x=zdz1_part, divide_by=dim)  # the rank's pairs' part of the row dot
        grad_w_down = finish.matmul(a=grad_x_out, b=y1, transpose="a")
        grad_x, dwn1_part, n1 = kernels.norm_dgrad_residual.norm_dgrad_residual(
            dz=dz1, w=w_gate_up, x=x1, rstd=r1, wn=wn_mlp, zdz=zdz1, grad_x=residual_on_first_rank(grad_x_out, group))
        grad_wn_mlp = finish.sum_tiles(x=dwn1_part)
        dist.all_reduce(grad_x, group=group)
        dist.all_reduce(grad_wn_mlp, group=group)
        grad_w_gate_up = finish.matmul(a=dz1, b=n1, transpose="a")
        grad_y = finish.matmul(a=grad_x, b=w_o)
        grad_w_o = finish.matmul(a=grad_x, b=y, transpose="a")
        return (grad_y, grad_x, None, grad_w_o, grad_wn_mlp, grad_w_gate_up, grad_b_gate_up, grad_w_down, grad_b_down,
                None, None, None)


class _Part(nn.Module):
    """A block's parameters (pre or post), named as in codagen.models.llama.Layer."""


class TensorParallelLayer(nn.Module):
    """This rank's part of a codagen.models.llama.Layer (`layer_shards`), with the rank's RoPE frequencies."""

    def __init__(self, layer: nn.Module, shape, group=None):
        super().__init__()
        group = process_group(group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.shape, self.group = shape, group
        # attention on the rank's heads
        self.local_shape = dataclasses.replace(shape, n_heads=shape.n_heads // world,
                                               n_kv_heads=shape.n_kv_heads // world)
        self.pre, self.post = _Part(), _Part()
        shards = layer_shards(shape, rank, world)
        for name, p in layer.named_parameters():
            part, attr = name.split(".")
            value = p.detach()
            if name in shards:
                dim, index = shards[name]
                value = value.index_select(dim, index)
            setattr(getattr(self, part), attr, nn.Parameter(value.clone()))
        # the rank's RoPE frequencies: freqs holds one per (even, odd) pair of qkv columns
        self.register_buffer("qkv_pairs", shards["pre.w_qkv"][1][::2] // 2, persistent=False)

    def forward(self, x, h, rstd, positions, freqs, wn_next, batch, seq):
        from codagen.models.llama import attention

        dim = self.shape.dim
        x, qkv = TensorParallelPreAttentionFunction.apply(x, h, rstd, positions, freqs[self.qkv_pairs],
                                                          self.pre.wn, self.pre.w_qkv, dim, self.group)
        y = attention(qkv, self.local_shape, batch, seq)
        return TensorParallelPostAttentionFunction.apply(y, x, wn_next, self.post.w_o, self.post.wn_mlp,
                                                         self.post.w_gate_up, None, self.post.w_down, None, dim,
                                                         self.shape.eps, self.group)


class TensorParallelLlama(nn.Module):
    """codagen's Llama assembly (codagen.models.llama.CodagenLlama) with tensor-parallel layers and a vocab-parallel
    LM head over `group` (a process group, a 1-D DeviceMesh, or None: the default group), made from a whole model
    (its weights copied, each rank keeping its part). Every rank of the group must be fed the same tokens and
    targets; each gets the same loss, the whole gradients of the replicated weights (embedding, norm weights) and
    its part's of the others."""

    def __init__(self, model: nn.Module, group=None):
        super().__init__()
        group = process_group(group)
        self.shape, self.group = model.shape, group
        self.embed = copy.deepcopy(model.embed)
        self.norm_stats = copy.deepcopy(model.norm_stats)
        self.layers = nn.ModuleList(TensorParallelLayer(layer, model.shape, group) for layer in model.layers)
        self.head = VocabParallelLmHeadLoss.from_lm_head_loss(model.head, group)
        self.register_buffer("freqs", model.freqs.clone(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        x = self.embed(tokens).reshape(batch * seq, self.shape.dim)
        positions = torch.arange(seq, device=tokens.device).repeat(batch)
        h, rstd = self.norm_stats(x, self.layers[0].pre.wn)
        for i, layer in enumerate(self.layers):
            wn_next = self.layers[i + 1].pre.wn if i + 1 < len(self.layers) else self.head.wn
            x, h, rstd = layer(x, h, rstd, positions, self.freqs, wn_next, batch, seq)
        del h, rstd
        return self.head(x, targets.reshape(-1))
