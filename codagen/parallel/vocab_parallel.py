"""The final RMSNorm, LM head and cross-entropy with the vocabulary split across the ranks of a process group
(the algebra, and where the collectives sit: docs/distributed.md#vocab-parallel-lm-head-and-cross-entropy).

Each rank runs the single-process block's kernels (specs/blocks/lm_head_loss.yaml) on its rows of the LM-head
weight, over row chunks. Forward: its slice's lse and target logit, one all-gather, the same combination on every
rank. Backward: its slice's logits again and dz with the global lse, then dx and dwn as its part of sums over the
vocabulary, all-reduced; dW of its slice is local.
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from codagen import runtime
from codagen.runtime import finish


def generated_kernels():
    """The committed generated kernels, next to the blocks that codagen.models' assemblies are built of."""
    from codagen.models import generated_blocks

    return importlib.import_module(generated_blocks().__name__.rpartition(".")[0] + ".kernels")


def process_group(group):
    """The process group of `group`: a ProcessGroup, None (the default group), or a 1-D DeviceMesh (for a dimension
    of a larger mesh, pass mesh["tp"])."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"codagen.parallel takes a 1-D DeviceMesh (e.g. mesh['tp']), got one of {group.ndim} "
                             "dimensions")
        return group.get_group()
    return group


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, stop) of a [vocab, dim] LM-head weight that `rank` of `world` holds: contiguous slices
    whose sizes differ by at most one, the first vocab % world one row longer (torch.tensor_split's split), so
    that a vocabulary not divisible by the world size splits too."""
    if not 0 <= rank < world:
        raise ValueError(f"vocab_range: rank {rank} is not in [0, {world})")
    if vocab < world:
        raise ValueError(f"vocab_range: a vocabulary of {vocab} cannot be split over {world} ranks (a rank would "
                         "hold no rows); use fewer ranks")
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _local_target(target: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Targets as column indices of this rank's slice; -1 (outside every tile: no target logit, no one-hot)
    where the target is another rank's. Ignored rows need nothing here: their weight in the loss and in dz is 0."""
    inside = (target >= start) & (target < start + rows)
    return torch.where(inside, target - start, -1)


def _combine(lse: torch.Tensor, target_logit: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's lse and target logit from every rank's, in one collective. Every rank combines the
    gathered values in the same order, so all get the same bits."""
    world = dist.get_world_size(group)
    mine = torch.stack([lse, target_logit])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    gathered = torch.stack(parts)
    # [M, world]: one partial per rank, as logsumexp_tiles takes one per tile; inf_max nan as the block's
    return finish.logsumexp_tiles(x=gathered[:, 0].T, inf_max="nan"), gathered[:, 1].sum(0)


class VocabParallelLmHeadLossFunction(torch.autograd.Function):
    """lm_head_loss over this rank's vocabulary slice: the forward makes the loss (one all-gather of 2 x M
    values); the backward recomputes the slice's logits and its part of the gradients, all-reducing dx and
    dwn."""

    @staticmethod
    def forward(ctx, x, target, wn, w_vocab, vocab_start, vocab, eps, ignore_index, reduction, chunk_rows,
                empty_mean, grad_sum, group):
        kernels = generated_kernels()
        dim = wn.shape[0]
        local_target = _local_target(target, vocab_start, w_vocab.shape[0])
        lse_chunks, target_logit_chunks = [], []
        for rows in runtime.row_chunks(x.shape[0], chunk_rows):
            h, ss = kernels.rmsnorm_stats.rmsnorm_stats(x=x[rows], wn=wn)
            rstd = finish.rstd(x=ss, size=dim, eps=eps)
            # the logits are stored (and dropped) rather than kept in the epilogue as lm_head_logsumexp does: lse
            # is then that of the rounded logits that the backward's dz reads, as in the single-process block
            _logits, lse_part, target_logit = kernels.lm_head_logits.lm_head_logits(
                h=h, w_vocab=w_vocab, rstd=rstd, target=local_target[rows])
            lse_chunks.append(finish.logsumexp_tiles(x=lse_part, inf_max="nan"))
            target_logit_chunks.append(target_logit)
            del h, ss, rstd, _logits, lse_part, target_logit
        lse, target_logit = _combine(torch.cat(lse_chunks), torch.cat(target_logit_chunks), group)
        loss, _ = finish.cross_entropy(lse=lse, target_logit=target_logit, target=target, classes=vocab,
                                       ignore_index=ignore_index, reduction=reduction, empty_mean=empty_mean)
        ctx.save_for_backward(x, local_target, wn, w_vocab, lse, target)
        ctx.attrs = (eps, ignore_index, reduction, chunk_rows, grad_sum, group)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        kernels = generated_kernels()
        x, local_target, wn, w_vocab, lse, target = ctx.saved_tensors
        eps, ignore_index, reduction, chunk_rows, grad_sum, group = ctx.attrs
        dim = wn.shape[0]
        row_weight = finish.row_weights(target=target, ignore_index=ignore_index, reduction=reduction)
        # made for an output gradient of scale (near 1, not 1/rows: fp16 keeps its precision), as the block does
        scale = finish.unit_scale(x=row_weight)
        weights = finish.mul(x=row_weight, y=scale)
        grad_x_chunks = []
        grad_wn_sum = runtime.ChunkSum(grad_sum)
        grad_w_vocab_sum = runtime.ChunkSum(grad_sum)
        for rows in runtime.row_chunks(x.shape[0], chunk_rows):
            x_rows = x[rows]
            h, ss = kernels.rmsnorm_stats.rmsnorm_stats(x=x_rows, wn=wn)
            rstd = finish.rstd(x=ss, size=dim, eps=eps)
            logits, _lse_part, _target_logit = kernels.lm_head_logits.lm_head_logits(
                h=h, w_vocab=w_vocab, rstd=rstd, target=local_target[rows])
            # the slice's softmax with the whole vocabulary's lse; one-hot only where the target is in the slice
            dz, zdz_part = kernels.lm_head_ce_dz.lm_head_ce_dz(
                logits=logits, lse=lse[rows], target=local_target[rows], weights=weights[rows], dz=logits)
            zdz = finish.sum_tiles(x=zdz_part, divide_by=dim)  # the slice's part of the row dot
            grad_x, dwn_part, normed = kernels.norm_dgrad.norm_dgrad(
                dz=dz, w=w_vocab, x=x_rows, rstd=rstd, wn=wn, zdz=zdz)
            grad_wn_sum.add(finish.sum_tiles(x=dwn_part))
            grad_w_vocab_sum.add_matmul(
                a=dz, b=normed, transpose="a",
                accumulate=lambda a, b, t: kernels.matmul_accumulate.matmul_accumulate(a=a, b=b, total=t, new_total=t),
            )
            grad_x_chunks.append(grad_x)
            del h, ss, rstd, logits, _lse_part, _target_logit, dz, zdz_part, zdz, grad_x, dwn_part, normed
        factor = grad_loss / scale
        grad_x = finish.scale_(x=torch.cat(grad_x_chunks), factor=factor)
        grad_wn = finish.scale_(x=grad_wn_sum.result(), factor=factor)
        grad_w_vocab = finish.scale_(x=grad_w_vocab_sum.result(), factor=factor)
        # x and wn are the same on every rank and reach the loss through every slice: their gradients are sums
        # over the ranks. w_vocab's slice reaches it through this rank's logits only.
        dist.all_reduce(grad_x, group=group)
        dist.all_reduce(grad_wn, group=group)
        return grad_x, None, grad_wn, grad_w_vocab, None, None, None, None, None, None, None, None, None


def vocab_parallel_lm_head_loss(x, target, wn, w_vocab, vocab_start, vocab, eps, ignore_index=-100,
                                reduction="mean", chunk_rows=2048, empty_mean="nan", grad_sum="same", group=None):
    """The loss of lm_head_loss (final RMSNorm, LM head, cross-entropy) with this rank holding the rows
    [vocab_start, vocab_start + len(w_vocab)) of the [vocab, dim] LM-head weight, every rank of `group` (the
    default process group if None) calling it on the same x, target and wn, with slices that cover the
    vocabulary once (`vocab_range`). Returns the same loss on every rank; the backward gives each rank the whole
    gradient of x and wn and its slice's of w_vocab."""
    if reduction not in ("mean", "sum"):
        raise NotImplementedError(f"vocab_parallel_lm_head_loss: reduction {reduction!r} is not implemented "
                                  "(mean and sum are)")
    if x.dim() != 2 or w_vocab.dim() != 2 or x.shape[1] != w_vocab.shape[1] or wn.shape != (x.shape[1],):
        raise ValueError(f"vocab_parallel_lm_head_loss: x [M, dim], wn [dim] and w_vocab [rows, dim] expected, got "
                         f"{tuple(x.shape)}, {tuple(wn.shape)}, {tuple(w_vocab.shape)}")
    return VocabParallelLmHeadLossFunction.apply(x, target, wn, w_vocab, int(vocab_start), int(vocab), eps,
                                                 ignore_index, reduction, chunk_rows, empty_mean, grad_sum, group)


class VocabParallelLmHeadLoss(nn.Module):
    """LmHeadLoss (the generated lm_head_loss block's module, with the same arguments) over this rank's slice of
    the vocabulary: `w_vocab` holds the rows `vocab_range(vocab, rank, world)` of the LM-head weight, `wn` the whole
    final norm weight. Every rank of `group` (a process group, a 1-D DeviceMesh, or None: the default group) calls
    it with the same x and targets and gets the same loss, the whole gradients of x and wn, and its slice's of
    w_vocab."""

    def __init__(self, dim, vocab, eps, ignore_index=-100, reduction="mean", chunk_rows=2048, empty_mean="nan",
                 grad_sum="same", *, group=None, device=None, dtype=None):
        super().__init__()
        self.dim, self.vocab, self.eps = dim, vocab, eps
        self.ignore_index, self.reduction, self.chunk_rows = ignore_index, reduction, chunk_rows
        self.empty_mean, self.grad_sum, self.group = empty_mean, grad_sum, process_group(group)
        group = self.group
        self.vocab_start, stop = vocab_range(vocab, dist.get_rank(group), dist.get_world_size(group))
        self.wn = nn.Parameter(torch.empty((dim,), device=device, dtype=dtype))
        self.w_vocab = nn.Parameter(torch.empty((stop - self.vocab_start, dim), device=device, dtype=dtype))
        runtime.reset_parameters(self)

    @classmethod
    def from_lm_head_loss(cls, head: nn.Module, group=None) -> "VocabParallelLmHeadLoss":
        """This rank's part of a whole LmHeadLoss (same attributes; the weights copied, w_vocab's slice only)."""
        # made on the meta device: no random initialization, which would draw from the RNG as many numbers as
        # this rank's slice holds, a count that differs between ranks where the world size does not divide vocab
        parallel = cls(head.dim, head.vocab, head.eps, head.ignore_index, head.reduction, head.chunk_rows,
                       head.empty_mean, head.grad_sum, group=group, device="meta", dtype=head.wn.dtype)
        parallel.to_empty(device=head.wn.device)
        with torch.no_grad():
            parallel.wn.copy_(head.wn)
            parallel.w_vocab.copy_(head.w_vocab[parallel.vocab_start: parallel.vocab_start + len(parallel.w_vocab)])
        return parallel

    def forward(self, x, target):
        return vocab_parallel_lm_head_loss(x, target, self.wn, self.w_vocab, self.vocab_start, self.vocab, self.eps,
                                           self.ignore_index, self.reduction, self.chunk_rows, self.empty_mean,
                                           self.grad_sum, self.group)
