"""Worker of tests/test_parallel.py, run by torch.distributed.run in 2 or 4 CPU processes over gloo:
`python parallel_worker.py CASE[,CASE...] OUT_DIR SEED` runs the cases one after the other in the same processes
(a start costs more than most cases: each process imports torch, transformers and codagen). Every rank draws the
same data from SEED; rank 0 writes what a case measured as JSON to OUT_DIR/CASE.json, or the traceback of what it
raised, and goes on with the next case. Sizes are tiny: the kernels run through Triton's interpreter.

- vocab_parallel: codagen.parallel's VocabParallelLmHeadLoss (each rank a slice of a vocabulary that the world
  size does not divide) against F.cross_entropy of the final RMSNorm and LM head in float64, and against the
  single-process LmHeadLoss block in fp32: loss and the gradients of x, wn and the LM-head weight.
- vocab_parallel_variants: the same for each cross-entropy variant (z-loss, label smoothing, softcapping, token
  weights; mean, sum and "none"; Gemma-2's head), against F.cross_entropy in float64 and the single-process variant's
  block (z-loss with "none", which no block declares: against float64 alone).
- llama_vocab_parallel: codagen's Llama assembly with its head replaced by a VocabParallelLmHeadLoss, every rank
  on the same batch, against the same model in one process: loss and every gradient.
- tensor_parallel: codagen.parallel's TensorParallelLlama (tensor-parallel layers, vocab-parallel head) made from
  codagen's Llama assembly, every rank on the same batch, against the whole model in one process: loss and every
  gradient (each rank's part of the sharded weights against the same part of the whole model's).
- hf_tensor_parallel_{llama,llama_tied,llama_checkpointing,llama_biases,qwen2,mistral,qwen3}:
  codagen.parallel.apply_tensor_parallel over a tiny transformers LlamaForCausalLM (untied, with tied embeddings,
  with gradient checkpointing, with mlp_bias and attention_bias: the biases of every projection),
  Qwen2ForCausalLM (a qkv bias), MistralForCausalLM (a sliding window shorter than the sequences) or
  Qwen3ForCausalLM (QK-norm: its own block before attention, on the rank's whole heads), every rank on
  the same batches, against the unpatched transformers model in one process: the loss and every gradient (each
  rank's part of the sharded ones against the same part of the whole model's, in codagen's fused layout) at each of
  three AdamW steps, and the weights after them (and the whole weights gathered, full_state_dict, against its
  state_dict()); the gradients of a loss computed from the (gathered) logits of a call without labels; then those
  logits in evaluation, and greedy generate().
- hf_tensor_parallel_autocast_{llama,gemma2}: apply_tensor_parallel under torch.autocast (bf16) over Llama (with
  mlp_bias and attention_bias) and Gemma-2, against the codagen.hf-patched model in one process and the unpatched
  transformers model under the same autocast: the losses, every gradient, and the gradients' dtype;
  hf_tensor_parallel_bf16_llama: the same over the Llama's weights in bf16, without autocast.
- hf_tensor_parallel_2d (4 processes): apply_tensor_parallel over pairs of ranks and DistributedDataParallel across
  the pairs (a 2 x 2 DeviceMesh), each pair on its row of the batch, against the unpatched transformers Llama on the
  whole batch in one process: loss and every gradient.
- hf_tensor_parallel_refusals: what apply_tensor_parallel refuses (TensorParallelError), each before it changes the
  model: the message of each, and whether the model was left unpatched. A family that codagen.hf patches and
  apply_tensor_parallel does not is Qwen2's with its entry taken out of codagen.parallel.hf_families.FAMILIES (every
  family codagen.hf patches has a tensor-parallel form).
- ddp_codagen, ddp_hf: DistributedDataParallel over codagen's Llama assembly, or over a codagen.hf-patched
  transformers Llama, rank r on row r of the batch, against the unwrapped model on the whole batch: loss and every
  gradient.
"""
from __future__ import annotations

import copy
import functools
import json
import sys
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from codagen.models import generated_blocks
from codagen.parallel import TensorParallelLlama, VocabParallelLmHeadLoss, layer_shards, vocab_range
from codagen.training import leave_process_group

EPS = 1e-5


def reference_loss(x, target, wn, w_vocab, ignore_index, reduction):
    """The final RMSNorm, LM head and cross-entropy in plain PyTorch."""
    xn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * wn
    return F.cross_entropy(xn @ w_vocab.T, target, ignore_index=ignore_index, reduction=reduction)


def whole_rel(part: torch.Tensor, ref_part: torch.Tensor) -> float:
    """|a - b| / |b| over tensors split across the ranks, each rank holding `part` (and `ref_part`)."""
    sums = torch.stack([(part.double() - ref_part.double()).square().sum(), ref_part.double().square().sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def vocab_parallel(seed: int) -> dict:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    rows, dim, vocab = 23, 32, 45  # 45 = 1 mod 2 and mod 4: the slices differ in size
    x = torch.randn(rows, dim, generator=g)
    wn = 1 + 0.2 * torch.randn(dim, generator=g)
    w_vocab = 0.3 * torch.randn(vocab, dim, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=g)
    # a target in every rank's slice, whatever the draw
    for r in range(world):
        start, stop = vocab_range(vocab, r, world)
        target[r] = torch.randint(start, stop, (), generator=g)
    cases = []
    # ignore_index -100 on 3 rows, with chunks of 5 rows; then the sum, with an ignore_index inside rank 1's slice
    # (every target equal to it ignored) and one chunk
    start1 = vocab_range(vocab, 1, world)[0]
    for reduction, ignore_index, chunk_rows in (("mean", -100, 5), ("sum", start1, 64)):
        t = target.clone()
        if ignore_index == -100:
            t[world + torch.randperm(rows - world, generator=g)[:3]] = -100  # not the rows set above
        else:
            t[world] = ignore_index
        whole = generated_blocks().LmHeadLoss(dim, vocab, EPS, ignore_index, reduction, chunk_rows)
        with torch.no_grad():
            whole.wn.copy_(wn)
            whole.w_vocab.copy_(w_vocab)
        parallel = VocabParallelLmHeadLoss.from_lm_head_loss(whole)
        start, stop = parallel.vocab_start, parallel.vocab_start + len(parallel.w_vocab)

        xs = x.clone().requires_grad_()
        loss = parallel(xs, t)
        loss.backward()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())

        xw = x.clone().requires_grad_()
        whole(xw, t).backward()
        whole_loss = whole(xw.detach(), t)  # the forward without gradients too

        x64, wn64, w64 = (v.double().requires_grad_() for v in (x, wn, w_vocab))
        ref = reference_loss(x64, t, wn64, w64, ignore_index, reduction)
        ref.backward()
        cases.append(dict(
            reduction=reduction, ignore_index=ignore_index, ignored=int((t == ignore_index).sum()),
            slices_with_target=sum(int(((t >= a) & (t < b) & (t != ignore_index)).any())
                                   for a, b in (vocab_range(vocab, r, world) for r in range(world))),
            same_loss_on_every_rank=len({v.item() for v in losses}) == 1,
            loss_vs_f64=abs(loss.item() - ref.item()) / abs(ref.item()),
            x_vs_f64=rel(xs.grad, x64.grad), wn_vs_f64=rel(parallel.wn.grad, wn64.grad),
            w_vocab_vs_f64=whole_rel(parallel.w_vocab.grad, w64.grad[start:stop]),
            loss_vs_block=abs(loss.item() - whole_loss.item()) / abs(whole_loss.item()),
            x_vs_block=rel(xs.grad, xw.grad), wn_vs_block=rel(parallel.wn.grad, whole.wn.grad),
            w_vocab_vs_block=whole_rel(parallel.w_vocab.grad, whole.w_vocab.grad[start:stop]),
        ))
    return dict(cases=cases)


def reference_variant(x, target, wn, w_vocab, ignore_index, variant, value, token_weights, reduction):
    """A cross-entropy variant of the final RMSNorm and LM head in plain PyTorch (F.cross_entropy)."""
    xn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * (1 + wn if variant == "gemma2" else wn)
    z = xn @ w_vocab.T
    if variant in ("softcap", "gemma2"):
        z = value * torch.tanh(z / value)
    if variant == "smoothing":
        return F.cross_entropy(z, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=value)
    rows = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none")
    valid = (target != ignore_index).to(z.dtype)
    if variant == "z_loss":
        rows = rows + value * torch.logsumexp(z, -1).square() * valid
    weights = valid if token_weights is None else valid * token_weights.to(z.dtype)
    if reduction == "none":
        return rows * weights
    total = (rows * weights).sum()
    return total / weights.sum() if reduction == "mean" else total


def vocab_parallel_variants(seed: int) -> dict:
    """Each cross-entropy variant of the single-process blocks over the vocabulary split across the ranks, against
    F.cross_entropy in float64 and against the block in one process."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    rows, dim, vocab = 23, 32, 45
    x = torch.randn(rows, dim, generator=g)
    wn = 1 + 0.2 * torch.randn(dim, generator=g)
    w_vocab = 0.5 * torch.randn(vocab, dim, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=g)
    for r in range(world):  # a target in every rank's slice
        start, stop = vocab_range(vocab, r, world)
        target[r] = torch.randint(start, stop, (), generator=g)
    target[world + torch.randperm(rows - world, generator=g)[:3]] = -100
    token_weights = torch.rand(rows, generator=g) * 2
    grad_rows = torch.randn(rows, generator=g)  # the output gradient of reduction "none"
    blocks = generated_blocks()
    cases = []
    for variant, value, reduction in (("z_loss", 0.05, "mean"), ("z_loss", 0.05, "sum"), ("smoothing", 0.1, "mean"),
                                      ("smoothing", 0.2, "sum"), ("softcap", 1.5, "mean"),
                                      ("token_weights", None, "mean"), ("token_weights", None, "sum"),
                                      ("plain", None, "none"), ("z_loss", 0.05, "none"), ("gemma2", 1.5, "mean")):
        weights = token_weights if variant == "token_weights" else None
        if (variant, reduction) == ("z_loss", "none"):  # no single-process block declares it: float64 alone
            whole = None
            parallel = VocabParallelLmHeadLoss(dim, vocab, EPS, -100, reduction, 5, z_loss=value)
            with torch.no_grad():
                parallel.wn.copy_(wn)
                parallel.w_vocab.copy_(w_vocab[parallel.vocab_start: parallel.vocab_start + len(parallel.w_vocab)])
        elif variant == "z_loss":
            whole = blocks.LmHeadLossZloss(dim, vocab, EPS, value, -100, reduction, 5)
        elif variant == "smoothing":
            whole = blocks.LmHeadLossSmooth(dim, vocab, EPS, value, -100, reduction, 5)
        elif variant == "softcap":
            whole = blocks.LmHeadLossSoftcap(dim, vocab, EPS, value, -100, reduction, 5)
        elif variant == "gemma2":  # the final norm's scale 1 + w, and the softcap
            whole = blocks.Gemma2LmHeadLoss(dim, vocab, EPS, value, -100, reduction, 5)
        elif variant == "token_weights":
            whole = blocks.LmHeadLossWeighted(dim, vocab, EPS, -100, reduction, 5)
        else:
            whole = blocks.LmHeadLossRows(dim, vocab, EPS, -100, 5)
        if whole is not None:
            with torch.no_grad():
                whole.wn.copy_(wn)
                whole.w_vocab.copy_(w_vocab)
            parallel = VocabParallelLmHeadLoss.from_lm_head_loss(whole)
        start, stop = parallel.vocab_start, parallel.vocab_start + len(parallel.w_vocab)

        def run(module, x_in):
            loss = module(x_in, target) if weights is None else module(x_in, target, weights)
            (loss if reduction != "none" else (loss * grad_rows).sum()).backward()
            return loss.detach()

        xs = x.clone().requires_grad_()
        loss = run(parallel, xs)
        if whole is not None:
            xw = x.clone().requires_grad_()
            whole_loss = run(whole, xw)
        x64, wn64, w64 = (v.double().requires_grad_() for v in (x, wn, w_vocab))
        ref = reference_variant(x64, target, wn64, w64, -100, variant, value, weights, reduction)
        (ref if reduction != "none" else (ref * grad_rows.double()).sum()).backward()
        losses = [torch.zeros_like(loss) for _ in range(world)]
        dist.all_gather(losses, loss)
        cases.append(dict(
            variant=variant, reduction=reduction, same_loss_on_every_rank=all(torch.equal(v, loss) for v in losses),
            loss_vs_f64=rel(loss, ref.detach()), x_vs_f64=rel(xs.grad, x64.grad),
            wn_vs_f64=rel(parallel.wn.grad, wn64.grad),
            w_vocab_vs_f64=whole_rel(parallel.w_vocab.grad, w64.grad[start:stop]),
            **({} if whole is None else dict(
                loss_vs_block=rel(loss, whole_loss), x_vs_block=rel(xs.grad, xw.grad),
                wn_vs_block=rel(parallel.wn.grad, whole.wn.grad),
                w_vocab_vs_block=whole_rel(parallel.w_vocab.grad, whole.w_vocab.grad[start:stop]))),
        ))
    return dict(cases=cases)


def tiny_llama(n_heads=2, n_kv_heads=1):
    from codagen.models.llama import CodagenLlama
    from codagen.presets import LlamaShape

    shape = LlamaShape(dim=32, ffn_dim=48, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=32 // n_heads,
                       n_layers=2, vocab=37, rope_theta=10000.0, eps=EPS)
    model = CodagenLlama(shape, chunk_rows=8)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0, 0.15)
    return model


def tiny_hf_llama():
    import transformers

    from codagen.hf import apply_codagen

    config = transformers.LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      rms_norm_eps=EPS, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    return apply_codagen(model)


def grads_against(model, reference) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        worst = max(worst, rel(p.grad, ref[name].grad))
    return worst


def llama_vocab_parallel(seed: int) -> dict:
    torch.manual_seed(seed)
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    model.head = VocabParallelLmHeadLoss.from_lm_head_loss(model.head)
    tokens = torch.randint(0, 37, (2, 9))
    targets = torch.randint(0, 37, (2, 9))
    targets[0, :2] = -100
    loss = model(tokens, targets)
    loss.backward()
    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    head = model.head
    start, stop = head.vocab_start, head.vocab_start + len(head.w_vocab)
    worst = 0.0
    for name, p in model.named_parameters():
        if name == "head.w_vocab":
            worst = max(worst, whole_rel(p.grad, ref[name].grad[start:stop]))
        else:
            worst = max(worst, rel(p.grad, ref[name].grad))
    return dict(loss=loss.item(), ref_loss=ref_loss.item(), max_rel_grad=worst)


def tensor_parallel(seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    tokens = torch.randint(0, 37, (2, 9))
    targets = torch.randint(0, 37, (2, 9))
    targets[1, 3:5] = -100
    reference = tiny_llama(n_heads=4, n_kv_heads=world)  # GQA on 2 ranks, MHA on 4
    model = TensorParallelLlama(copy.deepcopy(reference), init_device_mesh("cpu", (world,)))  # a mesh, or a group
    loss = model(tokens, targets)
    loss.backward()
    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    shards = layer_shards(reference.shape, rank, world)
    start, stop = model.head.vocab_start, model.head.vocab_start + len(model.head.w_vocab)
    worst, names = 0.0, []
    for name, p in model.named_parameters():
        names.append(name)
        ref_grad = ref[name].grad
        within_layer = name.split(".", 2)[-1]
        if name == "head.w_vocab":
            worst = max(worst, whole_rel(p.grad, ref_grad[start:stop]))
        elif name.startswith("layers.") and within_layer in shards:
            dim, index = shards[within_layer]
            worst = max(worst, whole_rel(p.grad, ref_grad.index_select(dim, index)))
        else:  # replicated: the whole gradient on every rank
            worst = max(worst, rel(p.grad, ref_grad))
    return dict(loss=loss.item(), ref_loss=ref_loss.item(), max_rel_grad=worst,
                same_params=sorted(names) == sorted(ref))


def hf_reference(family: str, tied: bool, world: int, **fields):
    """A tiny transformers causal LM of `family` (unpatched), with 4 query heads and `world` key-value heads, and
    the config's `fields`."""
    import transformers

    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[family]
    extra = {"mistral": dict(sliding_window=4),  # a window shorter than the sequences
             "qwen3": dict(head_dim=128),  # QK-norm's heads: 128 columns (codagen.models.qwen3)
             # its sliding layers' window shorter than the sequences; eager attention (SDPA drops the score softcap)
             "gemma2": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4)}.get(family, {})
    attention = "eager" if family == "gemma2" else "sdpa"
    config = config_class(**extra, **fields, vocab_size=37, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=world,
                          max_position_embeddings=32, rms_norm_eps=EPS, tie_word_embeddings=tied,
                          attn_implementation=attention, pad_token_id=0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    return model


def in_rank_layout(reference, model, tensors: dict, rank: int, world: int) -> dict:
    """The reference's tensors (its parameters, or their gradients, by the reference's names) as the tensor-parallel
    model holds them: by its parameter names, its rank's part of each sharded one, in codagen's fused layout."""
    from codagen.convert import heads_to_interleaved, interleave_rows
    from codagen.presets import LlamaShape

    config = reference.config
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = LlamaShape(dim=config.hidden_size, ffn_dim=config.intermediate_size, n_heads=config.num_attention_heads,
                       n_kv_heads=config.num_key_value_heads, head_dim=hd, n_layers=config.num_hidden_layers,
                       vocab=config.vocab_size)
    shards = layer_shards(shape, rank, world)
    start, stop = vocab_range(config.vocab_size, rank, world)
    out = {}
    for name, _ in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if name.endswith("qkv_proj." + leaf):
            base = prefix.rpartition(".")[0]
            q, k, v = (tensors[f"{base}.{p}_proj.{leaf}"] for p in "qkv")
            whole = torch.cat([heads_to_interleaved(q, hd), heads_to_interleaved(k, hd), v])
            out[name] = whole.index_select(0, shards["pre.w_qkv"][1])
        elif name.endswith("gate_up_proj." + leaf):
            base = prefix.rpartition(".")[0]
            whole = interleave_rows(tensors[f"{base}.gate_proj.{leaf}"], tensors[f"{base}.up_proj.{leaf}"])
            out[name] = whole.index_select(*shards["post.w_gate_up"])
        elif name.endswith("o_proj.weight"):
            out[name] = tensors[name].index_select(*shards["post.w_o"])
        elif name.endswith("down_proj.weight"):
            out[name] = tensors[name].index_select(*shards["post.w_down"])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = tensors[name][start:stop]
        else:  # replicated
            out[name] = tensors[name]
    return out


def worst_against(model, expected: dict, values: dict) -> float:
    """The largest relative difference of values[name] (this rank's) from expected[name], over the model's
    parameters: over the whole tensor (all ranks' parts) for sharded ones."""
    worst = 0.0
    for name, p in model.named_parameters():
        if p.shape == expected[name].shape and not (name.startswith("model.layers") and "proj" in name
                                                    or name in ("model.embed_tokens.weight", "lm_head.weight")):
            worst = max(worst, rel(values[name], expected[name]))
        else:
            worst = max(worst, whole_rel(values[name], expected[name]))
    return worst


def hf_tensor_parallel(family: str, tied: bool, seed: int, checkpointing: bool = False, **fields) -> dict:
    from codagen.parallel import apply_tensor_parallel, full_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = hf_reference(family, tied, world, **fields)
    model = apply_tensor_parallel(copy.deepcopy(reference), init_device_mesh("cpu", (world,)))
    if checkpointing:  # each layer's call, its collectives included, runs again in the backward
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    names = [n for n, _ in model.named_parameters()]
    # a small lr, and Adam's eps at 1e-4: with its default (1e-8) Adam's first step is about lr * sign(g), also for an
    # element whose gradient is near 0 (1e-7 at some seeds), where fp32 rounding decides the sign: one such element
    # of o_proj made the next steps' gradients differ by 8e-5 (Mistral, seed 461914508). With eps 1e-4 a gradient
    # below it steps by about lr * g / eps, continuous in g. A codagen.hf-patched model in one process drifts from
    # the unpatched one alike. A wrong step (a tied weight's gradient counted twice, a shard's missing) still differs
    # by ~1e-3.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, eps=1e-4, weight_decay=0.1)
    steps = []
    for _step in range(3):
        tokens = torch.randint(0, 37, (2, 9))
        labels = tokens.clone()
        labels[1, :3] = -100
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        ref_loss = reference(input_ids=tokens, labels=labels).loss
        ref_loss.backward()
        ref_grads = in_rank_layout(reference, model, {n: p.grad for n, p in reference.named_parameters()}, rank,
                                   world)
        grads = {n: p.grad for n, p in model.named_parameters()}
        steps.append(dict(loss=loss.item(), ref_loss=ref_loss.item(),
                          max_rel_grad=worst_against(model, ref_grads, grads)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_params = in_rank_layout(reference, model, dict(reference.named_parameters()), rank, world)
    max_rel_param = worst_against(model, ref_params, dict(model.named_parameters()))
    # the whole model's weights gathered, in Hugging Face's layout, against the reference's after the same steps
    whole, ref_state = full_state_dict(model), reference.state_dict()
    common = [k for k in ref_state if k in whole]
    full_state = dict(same_keys=sorted(whole) == sorted(ref_state),
                      same_shapes=all(whole[k].shape == ref_state[k].shape for k in common),
                      max_rel=max(rel(whole[k], ref_state[k]) for k in common if ref_state[k].is_floating_point()))
    # a loss of the caller's own on the gathered logits (a call without labels): its gradients
    tokens = torch.randint(0, 37, (2, 7))
    for m in (model, reference):
        logits = m(input_ids=tokens).logits
        (logits.logsumexp(-1).mean() + logits[..., 5].square().mean()).backward()
    ref_grads = in_rank_layout(reference, model, {n: p.grad for n, p in reference.named_parameters()}, rank, world)
    logits_grad = worst_against(model, ref_grads, {n: p.grad for n, p in model.named_parameters()})
    # a call without labels in evaluation: the whole vocabulary's logits, gathered; then greedy generate()
    model.eval()
    reference.eval()
    tokens = torch.randint(1, 37, (2, 6))
    with torch.no_grad():
        logits, ref_logits = model(input_ids=tokens).logits, reference(input_ids=tokens).logits
        generated = model.generate(tokens, max_new_tokens=3, do_sample=False)
        ref_generated = reference.generate(tokens, max_new_tokens=3, do_sample=False)
    return dict(steps=steps, max_rel_param=max_rel_param, full_state=full_state, logits=rel(logits, ref_logits),
                logits_grad=logits_grad,
                same_logits_shape=list(logits.shape) == list(ref_logits.shape),
                same_generate=generated.tolist() == ref_generated.tolist(), tied=tied,
                params=len(names), embed_is_head=model.lm_head.weight is model.model.embed_tokens.weight)


def by_hf_names(patched, tensors: dict) -> dict:
    """A codagen.hf-patched model's tensors (its parameters, or their gradients, by its parameter names) by Hugging
    Face's names and in its layout: each fused projection split back by its module (unfuse)."""
    out = {}
    for name, t in tensors.items():
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            out[name] = t
            continue
        prefix, kind = name.split(f"{fused}.")
        owner = patched.get_submodule(prefix.rstrip("."))
        for part, value in zip(owner.parts, owner.unfuse(t)):
            out[f"{prefix}{part}.{kind}"] = value
    return out


def hf_tensor_parallel_autocast(family: str, seed: int, bf16_params: bool = False, **fields) -> dict:
    """apply_tensor_parallel under torch.autocast (bf16, fp32 weights, as Trainer's bf16=True runs), or over bf16
    weights (bf16_params), against the codagen.hf-patched model in one process alike (the same kernels in bf16) and
    against the unpatched transformers model alike: the loss and every gradient, and the gradients' dtype."""
    from codagen.hf import apply_codagen
    from codagen.parallel import apply_tensor_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = hf_reference(family, False, world, **fields)
    if bf16_params:
        reference = reference.to(torch.bfloat16)
    patched = apply_codagen(copy.deepcopy(reference))
    model = apply_tensor_parallel(copy.deepcopy(reference))
    tokens = torch.randint(0, 37, (2, 9))
    labels = tokens.clone()
    labels[1, :3] = -100
    losses = []
    for m in (model, patched, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_params):
            loss = m(input_ids=tokens, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad for n, p in model.named_parameters()}
    patched_grads = in_rank_layout(reference, model, by_hf_names(patched, {n: p.grad for n, p in
                                                                          patched.named_parameters()}), rank, world)
    ref_grads = in_rank_layout(reference, model, {n: p.grad for n, p in reference.named_parameters()}, rank, world)
    return dict(loss=losses[0], patched_loss=losses[1], ref_loss=losses[2],
                grads_vs_patched=worst_against(model, patched_grads, grads),
                grads_vs_ref=worst_against(model, ref_grads, grads),
                patched_grads_vs_ref=worst_against(model, ref_grads, patched_grads),
                grads_dtype=sorted({str(g.dtype) for g in grads.values()}))


def hf_tensor_parallel_2d(data_parallel: str, seed: int) -> dict:
    """A 2-D mesh: apply_tensor_parallel over each pair of ranks (the mesh's "tp" dimension) and, across the pairs
    ("dp"), DDP or FSDP2 (`data_parallel` "ddp" or "fsdp2": fully_shard on each decoder layer and the root over "dp"),
    each pair on its row of the batch (no ignored labels: every row has as many tokens, and the average of the rows'
    mean losses' gradients is the whole batch's), against the unpatched transformers Llama on the whole batch in one
    process: the loss and every gradient (each rank's part of the tensor-parallel ones, gathered over "dp")."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from codagen.parallel import apply_tensor_parallel

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank, dp_group = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    torch.manual_seed(seed)
    reference = hf_reference("llama", False, 2)
    model = apply_tensor_parallel(copy.deepcopy(reference), mesh["tp"])
    if data_parallel == "ddp":
        model = DistributedDataParallel(model, process_group=dp_group)
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    tokens = torch.randint(0, 37, (world // 2, 9))
    mine = tokens[dp_rank: dp_rank + 1]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    ref_loss = reference(input_ids=tokens, labels=tokens).loss
    ref_loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=dp_group)
    tp_model = model.module if data_parallel == "ddp" else model
    ref_grads = in_rank_layout(reference, tp_model, {n: p.grad for n, p in reference.named_parameters()}, tp_rank, 2)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in tp_model.named_parameters()}
    return dict(loss=mean_loss.item() / (world // 2), ref_loss=ref_loss.item(),
                max_rel_grad=worst_against(tp_model, ref_grads, grads))


def hf_tensor_parallel_refusals(seed: int) -> dict:
    import peft
    import transformers

    from codagen.hf import CodagenDecoderLayer, apply_codagen
    from codagen.parallel import TensorParallelError, apply_tensor_parallel
    from codagen.parallel.hf_families import FAMILIES

    torch.manual_seed(seed)
    small = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)

    def llama(**changes):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**small, **changes}))

    made = {
        "kv_heads": lambda: llama(num_key_value_heads=1),
        "family": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)),
        "peft": lambda: peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"])),
        "classifier": lambda: transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**small)),
        "twice": lambda: apply_tensor_parallel(llama()),
        # patched before, with FP8 blocks (which take hidden and intermediate sizes in groups of 128)
        "fp8": lambda: apply_codagen(llama(hidden_size=128, intermediate_size=128), fp8=True),
    }
    refusals = {}
    for name, make in made.items():
        model = make()
        try:
            with mock.patch.dict(FAMILIES):
                if name == "family":  # a family that codagen.hf patches and apply_tensor_parallel would not
                    del FAMILIES["Qwen2ForCausalLM"]
                apply_tensor_parallel(model)
        except TensorParallelError as e:
            unpatched = not any(isinstance(m, CodagenDecoderLayer) for m in model.modules())
            refusals[name] = dict(message=str(e), unpatched=unpatched)
        else:
            refusals[name] = None
    return dict(refusals=refusals)


def ddp(kind: str, seed: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    tokens = torch.randint(0, 37, (world, 9))
    reference = tiny_llama() if kind == "codagen" else tiny_hf_llama()
    model = DistributedDataParallel(copy.deepcopy(reference))
    mine = tokens[rank: rank + 1]
    # no ignored targets: every rank has as many tokens, and DDP's average of the ranks' mean losses' gradients is
    # the gradient of the whole batch's mean
    if kind == "codagen":
        loss, ref_loss = model(mine, mine), reference(tokens, tokens)
    else:
        loss = model(input_ids=mine, labels=mine).loss
        ref_loss = reference(input_ids=tokens, labels=tokens).loss
    loss.backward()
    ref_loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return dict(loss=mean_loss.item() / world, ref_loss=ref_loss.item(),
                max_rel_grad=grads_against(model.module, reference))


CASES = {"vocab_parallel": vocab_parallel,
         "vocab_parallel_variants": vocab_parallel_variants,
         "llama_vocab_parallel": llama_vocab_parallel,
         "tensor_parallel": tensor_parallel,
         "ddp_codagen": functools.partial(ddp, "codagen"),
         "ddp_hf": functools.partial(ddp, "hf"),
         "hf_tensor_parallel_llama": functools.partial(hf_tensor_parallel, "llama", False),
         "hf_tensor_parallel_llama_tied": functools.partial(hf_tensor_parallel, "llama", True),
         "hf_tensor_parallel_qwen2": functools.partial(hf_tensor_parallel, "qwen2", False),
         "hf_tensor_parallel_llama_checkpointing": functools.partial(hf_tensor_parallel, "llama", False,
                                                                     checkpointing=True),
         "hf_tensor_parallel_mistral": functools.partial(hf_tensor_parallel, "mistral", False),
         "hf_tensor_parallel_qwen3": functools.partial(hf_tensor_parallel, "qwen3", False),
         "hf_tensor_parallel_gemma2": functools.partial(hf_tensor_parallel, "gemma2", True),
         "hf_tensor_parallel_llama_biases": functools.partial(hf_tensor_parallel, "llama", False, mlp_bias=True,
                                                              attention_bias=True),
         "hf_tensor_parallel_autocast_llama": functools.partial(hf_tensor_parallel_autocast, "llama", mlp_bias=True,
                                                                attention_bias=True),
         "hf_tensor_parallel_autocast_gemma2": functools.partial(hf_tensor_parallel_autocast, "gemma2"),
         "hf_tensor_parallel_bf16_llama": functools.partial(hf_tensor_parallel_autocast, "llama", bf16_params=True,
                                                            mlp_bias=True, attention_bias=True),
         "hf_tensor_parallel_refusals": hf_tensor_parallel_refusals,
         "hf_tensor_parallel_2d": functools.partial(hf_tensor_parallel_2d, "ddp"),
         "hf_tensor_parallel_2d_fsdp2": functools.partial(hf_tensor_parallel_2d, "fsdp2")}


def main(cases: str, out_dir: str, seed: int) -> None:
    dist.init_process_group("gloo")
    for case in cases.split(","):
        try:
            result = dict(world=dist.get_world_size(), **CASES[case](seed))
        except Exception:  # the next cases still run; the test of this one shows the traceback
            result = dict(error=traceback.format_exc())
        if dist.get_rank() == 0:
            with open(Path(out_dir) / f"{case}.json", "w") as f:
                json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
