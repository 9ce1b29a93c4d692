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


def _combine(lse: torch.Tensor, target_logit: torch.Tensor, group, zsum: torch.Tensor | None = None):
    """The whole vocabulary's lse and target logit (and sum of the logits, where zsum is given) from every rank's,
    in one collective. Every rank combines the gathered values in the same order, so all get the same bits."""
    world = dist.get_world_size(group)
    mine = torch.stack([lse, target_logit] + ([] if zsum is None else [zsum]))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    gathered = torch.stack(parts)
    # [M, world]: one partial per rank, as logsumexp_tiles takes one per tile; inf_max nan as the block's
    combined = (finish.logsumexp_tiles(x=gathered[:, 0].T, inf_max="nan"), gathered[:, 1].sum(0))
    return combined if zsum is None else (*combined, gathered[:, 2].sum(0))


# the cross-entropy variants of the single-process blocks (specs/blocks/lm_head_loss.yaml and
# specs/cross_entropy/blocks/): the option that selects each, and its block
VARIANTS = {"plain": "lm_head_loss", "z_loss": "lm_head_loss_zloss", "smoothing": "lm_head_loss_smooth",
            "softcap": "lm_head_loss_softcap", "token_weights": "lm_head_loss_weighted"}


def _logits(kernels, variant, value, h, w_vocab, rstd, target):
    """The slice's logits, its per-tile lse partials and target logit (and per-tile sums of the logits, for label
    smoothing; else None), by the variant's kernel."""
    if variant == "softcap":
        logits, lse_part, target_logit = kernels.lm_head_logits_softcap.lm_head_logits_softcap(
            h=h, w_vocab=w_vocab, rstd=rstd, target=target, softcap=value)
        return logits, lse_part, target_logit, None
    if variant == "smoothing":
        logits, lse_part, zsum_part, target_logit = kernels.lm_head_logits_zsum.lm_head_logits_zsum(
            h=h, w_vocab=w_vocab, rstd=rstd, target=target)
        return logits, lse_part, target_logit, zsum_part
    logits, lse_part, target_logit = kernels.lm_head_logits.lm_head_logits(h=h, w_vocab=w_vocab, rstd=rstd,
                                                                           target=target)
    return logits, lse_part, target_logit, None


def _norm_kernels(kernels, norm_plus_one: bool):
    """The final norm's kernels, forward (statistics and scale) and backward (the data gradient through the LM head
    and the norm): Llama's RMSNorm scale w, or Gemma's 1 + w (norm_plus_one)."""
    if norm_plus_one:
        return kernels.gemma_rmsnorm_stats.gemma_rmsnorm_stats, kernels.gemma_norm_dgrad.gemma_norm_dgrad
    return kernels.rmsnorm_stats.rmsnorm_stats, kernels.norm_dgrad.norm_dgrad


def _dz(kernels, variant, value, vocab, logits, lse, target, weights):
    """The slice's gradient of the loss in its logits (weights: each row's), and the partials of its row dot, by
    the variant's kernel, as the single-process block makes them (with the whole vocabulary's lse and size)."""
    if variant == "z_loss":
        p_weight = finish.mul(x=finish.add(x=finish.mul(x=finish.mul(x=lse, y=value), y=2.0), y=1.0), y=weights)
        return kernels.lm_head_ce_dz_scaled.lm_head_ce_dz_scaled(logits=logits, lse=lse, target=target,
                                                                 p_weight=p_weight, t_weight=weights, dz=logits)
    if variant == "smoothing":
        smoothed = finish.mul(x=weights, y=value)
        return kernels.lm_head_ce_dz_shifted.lm_head_ce_dz_shifted(
            logits=logits, lse=lse, target=target, p_weight=weights, t_weight=finish.sub(x=weights, y=smoothed),
            u_weight=finish.div(x=smoothed, y=vocab), dz=logits)
    if variant == "softcap":
        return kernels.lm_head_ce_dz_softcap.lm_head_ce_dz_softcap(logits=logits, lse=lse, target=target,
                                                                   weights=weights, softcap=value, dz=logits)
    if variant == "token_weights":
        return kernels.lm_head_ce_dz_weighted.lm_head_ce_dz_weighted(logits=logits, lse=lse, target=target,
                                                                     weights=weights, dz=logits)
    return kernels.lm_head_ce_dz.lm_head_ce_dz(logits=logits, lse=lse, target=target, weights=weights, dz=logits)


class VocabParallelLmHeadLossFunction(torch.autograd.Function):
    """lm_head_loss (or a variant: z-loss, label smoothing, softcapping, token weights) over this rank's vocabulary
    slice: the forward makes the loss (one all-gather of 2 x M values, 3 x M with label smoothing); the backward
    recomputes the slice's logits and its part of the gradients, all-reducing dx and dwn."""

    @staticmethod
    def forward(ctx, x, target, wn, w_vocab, token_weights, vocab_start, vocab, eps, ignore_index, reduction,
                chunk_rows, empty_mean, grad_sum, group, variant, value, norm_plus_one):
        kernels = generated_kernels()
        norm_stats, _ = _norm_kernels(kernels, norm_plus_one)
        dim = wn.shape[0]
        local_target = _local_target(target, vocab_start, w_vocab.shape[0])
        lse_chunks, target_logit_chunks, zsum_chunks = [], [], []
        for rows in runtime.row_chunks(x.shape[0], chunk_rows):
            h, ss = norm_stats(x=x[rows], wn=wn)
            rstd = finish.rstd(x=ss, size=dim, eps=eps)
            # the logits are stored (and dropped) rather than kept in the epilogue as lm_head_logsumexp does: lse
            # is then that of the rounded logits that the backward's dz reads, as in the single-process block
            _logits_rows, lse_part, target_logit, zsum_part = _logits(kernels, variant, value, h, w_vocab, rstd,
                                                                      local_target[rows])
            lse_chunks.append(finish.logsumexp_tiles(x=lse_part, inf_max="nan"))
            target_logit_chunks.append(target_logit)
            if zsum_part is not None:
                zsum_chunks.append(finish.sum_tiles(x=zsum_part))  # the slice's sum of the logits
            del h, ss, rstd, _logits_rows, lse_part, target_logit, zsum_part
        zsum = torch.cat(zsum_chunks) if zsum_chunks else None
        combined = _combine(torch.cat(lse_chunks), torch.cat(target_logit_chunks), group, zsum)
        lse, target_logit = combined[:2]
        if variant in ("plain", "softcap") and reduction != "none":
            loss, _ = finish.cross_entropy(lse=lse, target_logit=target_logit, target=target, classes=vocab,
                                           ignore_index=ignore_index, reduction=reduction, empty_mean=empty_mean)
        else:
            row_loss = finish.sub(x=lse, y=target_logit)
            if variant == "z_loss":
                row_loss = finish.add(x=row_loss, y=finish.mul(x=finish.square(x=lse), y=value))
            elif variant == "smoothing":
                z_mean = finish.div(x=combined[2], y=vocab)
                row_loss = finish.sub(x=row_loss, y=finish.mul(x=finish.sub(x=z_mean, y=target_logit), y=value))
            loss, _ = finish.reduce_loss(x=row_loss, target=target, classes=vocab, ignore_index=ignore_index,
                                         reduction=reduction, token_weights=token_weights, empty_mean=empty_mean)
        ctx.save_for_backward(x, local_target, wn, w_vocab, lse, target, token_weights)
        ctx.attrs = (eps, ignore_index, reduction, chunk_rows, grad_sum, group, variant, value, vocab, norm_plus_one)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        kernels = generated_kernels()
        x, local_target, wn, w_vocab, lse, target, token_weights = ctx.saved_tensors
        eps, ignore_index, reduction, chunk_rows, grad_sum, group, variant, value, vocab, norm_plus_one = ctx.attrs
        norm_stats, norm_dgrad = _norm_kernels(kernels, norm_plus_one)
        dim = wn.shape[0]
        row_weight = finish.row_weights(target=target, ignore_index=ignore_index, reduction=reduction,
                                        token_weights=token_weights)
        if reduction == "none":  # each row's own output gradient: the rows' weights
            row_weight = finish.mul(x=row_weight, y=grad_loss.float())
        # made for an output gradient of scale (near 1, not 1/rows: fp16 keeps its precision), as the block does
        scale = finish.unit_scale(x=row_weight)
        weights = finish.mul(x=row_weight, y=scale)
        grad_x_chunks = []
        grad_wn_sum = runtime.ChunkSum(grad_sum)
        grad_w_vocab_sum = runtime.ChunkSum(grad_sum)
        for rows in runtime.row_chunks(x.shape[0], chunk_rows):
            x_rows = x[rows]
            h, ss = norm_stats(x=x_rows, wn=wn)
            rstd = finish.rstd(x=ss, size=dim, eps=eps)
            logits, _lse_part, _target_logit, _zsum_part = _logits(kernels, variant, value, h, w_vocab, rstd,
                                                                   local_target[rows])
            # the slice's softmax with the whole vocabulary's lse; one-hot only where the target is in the slice
            dz, zdz_part = _dz(kernels, variant, value, vocab, logits, lse[rows], local_target[rows], weights[rows])
            zdz = finish.sum_tiles(x=zdz_part, divide_by=dim)  # the slice's part of the row dot
            grad_x, dwn_part, normed = norm_dgrad(dz=dz, w=w_vocab, x=x_rows, rstd=rstd, wn=wn, zdz=zdz)
            grad_wn_sum.add(finish.sum_tiles(x=dwn_part))
            grad_w_vocab_sum.add_matmul(
                a=dz, b=normed, transpose="a",
                accumulate=lambda a, b, t: kernels.matmul_accumulate.matmul_accumulate(a=a, b=b, total=t, new_total=t),
            )
            grad_x_chunks.append(grad_x)
            del h, ss, rstd, logits, _lse_part, _target_logit, _zsum_part, dz, zdz_part, zdz, grad_x, dwn_part, normed
        factor = 1.0 / scale if reduction == "none" else grad_loss / scale
        grad_x = finish.scale_(x=torch.cat(grad_x_chunks), factor=factor)
        grad_wn = finish.scale_(x=grad_wn_sum.result(), factor=factor)
        grad_w_vocab = finish.scale_(x=grad_w_vocab_sum.result(), factor=factor)
        # x and wn are the same on every rank and reach the loss through every slice: their gradients are sums
        # over the ranks. w_vocab's slice reaches it through this rank's logits only.
        dist.all_reduce(grad_x, group=group)
        dist.all_reduce(grad_wn, group=group)
        return (grad_x, None, grad_wn, grad_w_vocab) + (None,) * 13


def _variant(z_loss, smoothing, softcap, token_weights) -> tuple[str, float | None]:
    """The cross-entropy variant that the options select, and its value; more than one is refused, as no
    single-process block combines them."""
    chosen = [(name, v) for name, v, off in (("z_loss", z_loss, 0.0), ("smoothing", smoothing, 0.0),
                                             ("softcap", softcap, None)) if v != off and v is not None]
    if token_weights is not None:
        chosen.append(("token_weights", None))
    if len(chosen) > 1:
        raise NotImplementedError(f"vocab_parallel_lm_head_loss: {' and '.join(n for n, _ in chosen)} together are "
                                  "not implemented (no single-process block combines them either)")
    if not chosen:
        return "plain", None
    name, value = chosen[0]
    return name, None if value is None else float(value)


def vocab_parallel_lm_head_loss(x, target, wn, w_vocab, vocab_start, vocab, eps, ignore_index=-100,
                                reduction="mean", chunk_rows=2048, empty_mean="nan", grad_sum="same", group=None, *,
                                z_loss=0.0, smoothing=0.0, softcap=None, token_weights=None, norm_plus_one=False):
    """The loss of lm_head_loss (final RMSNorm, LM head, cross-entropy) with this rank holding the rows
    [vocab_start, vocab_start + len(w_vocab)) of the [vocab, dim] LM-head weight, every rank of `group` (the
    default process group if None) calling it on the same x, target and wn, with slices that cover the
    vocabulary once (`vocab_range`). Returns the same loss on every rank; the backward gives each rank the whole
    gradient of x and wn and its slice's of w_vocab. reduction: "mean", "sum" or "none" (each row's loss, 0 where
    ignored).

    At most one of the single-process blocks' variants: z_loss (lm_head_loss_zloss: + z_loss * lse^2 per row),
    smoothing (lm_head_loss_smooth: label smoothing), softcap (lm_head_loss_softcap: the logits capped as
    softcap * tanh(z / softcap), Gemma-2's), token_weights ([M], lm_head_loss_weighted: each row's loss weighted,
    the mean divided by the valid rows' weights); the same on every rank. norm_plus_one: the final norm scales by
    1 + wn, as Gemma's (gemma2_lm_head_loss, with softcap), rather than by wn."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_lm_head_loss: reduction must be 'mean', 'sum' or 'none', got "
                         f"{reduction!r}")
    if x.dim() != 2 or w_vocab.dim() != 2 or x.shape[1] != w_vocab.shape[1] or wn.shape != (x.shape[1],):
        raise ValueError(f"vocab_parallel_lm_head_loss: x [M, dim], wn [dim] and w_vocab [rows, dim] expected, got "
                         f"{tuple(x.shape)}, {tuple(wn.shape)}, {tuple(w_vocab.shape)}")
    variant, value = _variant(z_loss, smoothing, softcap, token_weights)
    if token_weights is not None:
        if token_weights.shape != target.shape:
            raise ValueError(f"vocab_parallel_lm_head_loss: token_weights {tuple(token_weights.shape)} must have "
                             f"the targets' shape {tuple(target.shape)}")
        token_weights = token_weights.detach().float()
    return VocabParallelLmHeadLossFunction.apply(x, target, wn, w_vocab, token_weights, int(vocab_start), int(vocab),
                                                 eps, ignore_index, reduction, chunk_rows, empty_mean, grad_sum,
                                                 group, variant, value, bool(norm_plus_one))


class VocabParallelLmHeadLoss(nn.Module):
    """LmHeadLoss (the generated lm_head_loss block's module, with the same arguments), or one of its variants
    (z_loss, smoothing, softcap, token_weights: vocab_parallel_lm_head_loss; norm_plus_one with softcap: Gemma-2's
    head, Gemma2LmHeadLoss), over this rank's slice of the vocabulary: `w_vocab` holds the rows
    `vocab_range(vocab, rank, world)` of the LM-head weight, `wn` the whole final norm weight. Every rank of `group`
    (a process group, a 1-D DeviceMesh, or None: the default group) calls it with the same x and targets (and token
    weights, with token_weights=True) and gets the same loss, the whole gradients of x and wn, and its slice's of
    w_vocab."""

    def __init__(self, dim, vocab, eps, ignore_index=-100, reduction="mean", chunk_rows=2048, empty_mean="nan",
                 grad_sum="same", *, z_loss=0.0, smoothing=0.0, softcap=None, token_weights=False,
                 norm_plus_one=False, group=None, device=None, dtype=None):
        super().__init__()
        self.dim, self.vocab, self.eps = dim, vocab, eps
        self.ignore_index, self.reduction, self.chunk_rows = ignore_index, reduction, chunk_rows
        self.empty_mean, self.grad_sum, self.group = empty_mean, grad_sum, process_group(group)
        self.z_loss, self.smoothing, self.softcap, self.token_weights = z_loss, smoothing, softcap, token_weights
        self.norm_plus_one = norm_plus_one
        _variant(z_loss, smoothing, softcap, torch.empty(0) if token_weights else None)  # one variant at most
        group = self.group
        self.vocab_start, stop = vocab_range(vocab, dist.get_rank(group), dist.get_world_size(group))
        self.wn = nn.Parameter(torch.empty((dim,), device=device, dtype=dtype))
        self.w_vocab = nn.Parameter(torch.empty((stop - self.vocab_start, dim), device=device, dtype=dtype))
        runtime.reset_parameters(self)

    @classmethod
    def from_lm_head_loss(cls, head: nn.Module, group=None) -> "VocabParallelLmHeadLoss":
        """This rank's part of a whole LmHeadLoss, or of a variant's block (LmHeadLossZloss, LmHeadLossSmooth,
        LmHeadLossSoftcap, LmHeadLossWeighted, LmHeadLossRows, and Gemma-2's Gemma2LmHeadLoss: same attributes; the
        weights copied, w_vocab's slice only)."""
        # made on the meta device: no random initialization, which would draw from the RNG as many numbers as
        # this rank's slice holds, a count that differs between ranks where the world size does not divide vocab
        weighted = type(head).__name__ == "LmHeadLossWeighted"
        parallel = cls(head.dim, head.vocab, head.eps, head.ignore_index, getattr(head, "reduction", "none"),
                       head.chunk_rows, getattr(head, "empty_mean", "nan"), getattr(head, "grad_sum", "same"),
                       z_loss=getattr(head, "z_loss", 0.0), smoothing=getattr(head, "smoothing", 0.0),
                       softcap=getattr(head, "softcap", None), token_weights=weighted,
                       norm_plus_one=type(head).__name__ == "Gemma2LmHeadLoss", group=group, device="meta",
                       dtype=head.wn.dtype)
        parallel.to_empty(device=head.wn.device)
        with torch.no_grad():
            parallel.wn.copy_(head.wn)
            parallel.w_vocab.copy_(head.w_vocab[parallel.vocab_start: parallel.vocab_start + len(parallel.w_vocab)])
        return parallel

    def forward(self, x, target, token_weights=None):
        if (token_weights is not None) != bool(self.token_weights):
            raise ValueError("VocabParallelLmHeadLoss: token_weights are " + (
                "required (token_weights=True)" if self.token_weights else "not taken (token_weights=False)"))
        return vocab_parallel_lm_head_loss(x, target, self.wn, self.w_vocab, self.vocab_start, self.vocab, self.eps,
                                           self.ignore_index, self.reduction, self.chunk_rows, self.empty_mean,
                                           self.grad_sum, self.group, z_loss=self.z_loss, smoothing=self.smoothing,
                                           softcap=self.softcap, token_weights=token_weights,
                                           norm_plus_one=self.norm_plus_one)
