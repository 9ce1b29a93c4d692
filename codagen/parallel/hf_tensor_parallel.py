"""Tensor parallelism for a codagen.hf-patched transformers causal LM (docs/distributed.md#a-transformers-model):

    from codagen.parallel import apply_tensor_parallel
    model = apply_tensor_parallel(LlamaForCausalLM.from_pretrained(path), group)  # patched, then sharded

Each decoder layer keeps its modules and parameter names and holds its rank's part of the fused projections, as
codagen's own TensorParallelLlama does (`layer_shards`): qkv_proj and gate_up_proj (and their biases)
column-parallel, o_proj and down_proj row-parallel (their biases replicated, added once). The block before
attention is TensorParallelPreAttentionFunction, or the family's own block (Qwen3's, Gemma-2's) on the rank's heads
with its replicated inputs' gradients summed over the ranks (_ToRanks); the rest after attention is the family's
(hf_families: Llama's TensorParallelPostAttentionFunction, Gemma-2's); attention is Hugging Face's own function on
the rank's heads. The embedding and the LM head are vocab-parallel: rank r holds the rows `vocab_range(V, r, P)` of
each (one parameter where they are tied), the embedding's lookup is summed over the ranks (one all-reduce of the
[M, hidden] output), the loss is codagen.parallel's vocab-parallel lm_head_loss (with the family's head: Gemma-2's
(1 + w) norm and softcap), and the logits, where a call asks for them (no labels, generate(), return_logits), are
the slices' gathered.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.llama import HF as LLAMA  # Llama's blocks: its pre-attention has a tensor-parallel form of its own
from .hf_families import FAMILIES
from .tensor_parallel import TensorParallelPreAttentionFunction, layer_shards
from .vocab_parallel import process_group, vocab_parallel_lm_head_loss, vocab_range


class TensorParallelError(NotImplementedError):
    """A model, a configuration or a call that codagen's tensor parallelism does not support; the message names it."""


def _refuse(what: str) -> None:
    raise TensorParallelError(f"codagen.parallel.apply_tensor_parallel: {what}")


# ---- the collectives as autograd functions: the activations are replicated, and so are their gradients ----

class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the ranks of each rank's part (all-reduce). Backward: the output's gradient, the same
    whole one on every rank, is each part's."""

    @staticmethod
    def forward(ctx, part, group):
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ToRanks(torch.autograd.Function):
    """Forward: a replicated input, as it is. Backward: each rank's part of its gradient (through its slice only),
    summed over the ranks (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """Forward: each rank's [..., rows] slice of the last dimension, gathered in rank order into [..., vocab] (padded
    to the longest slice for the all-gather, slices differing by one row). Backward: the rank's columns of the
    gradient."""

    @staticmethod
    def forward(ctx, part, vocab, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranges = [vocab_range(vocab, r, world) for r in range(world)]
        longest = max(stop - start for start, stop in ranges)
        padded = F.pad(part, (0, longest - part.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        ctx.range = ranges[rank]
        return torch.cat([p[..., : stop - start] for p, (start, stop) in zip(parts, ranges)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.range
        return grad[..., start:stop], None, None


# ---- the vocab-parallel embedding and head ----

class VocabParallelEmbedding(nn.Module):
    """The rank's rows [vocab_start, vocab_start + len(weight)) of a [num_embeddings, dim] embedding: each rank
    looks up the tokens of its slice (zeros for the others'), and one all-reduce sums the ranks' lookups. Every
    rank gets the whole embedding of every token; its weight's gradient is its slice's. padding_idx as
    nn.Embedding's (no gradient to that row), on the rank that holds it. embed_scale: a scalar tensor that the sum
    is multiplied by, in the weight's dtype, as Gemma-2's scaled embedding (Gemma2TextScaledWordEmbedding) does;
    None: none."""

    def __init__(self, weight: nn.Parameter, num_embeddings: int, vocab_start: int, padding_idx, group,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.shape[1]
        self.vocab_start, self.padding_idx, self.group = vocab_start, padding_idx, group
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < rows)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < rows else None
        part = F.embedding(torch.where(inside, local, 0), self.weight, padding_idx=local_pad)
        part = part * inside.unsqueeze(-1).to(part.dtype)  # another rank's token: zeros, and no gradient to row 0
        whole = _SumOverRanks.apply(part, self.group)
        return whole if self.embed_scale is None else whole * self.embed_scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
                f"{self.vocab_start + self.weight.shape[0]})")


class TensorParallelHead:
    """A tensor-parallel causal LM's state that codagen.hf's patched forward reads (model.codagen_tensor_parallel):
    the group and the rank's slice of the vocabulary."""

    def __init__(self, group, vocab: int, vocab_start: int, loss_options: dict):
        self.group, self.vocab, self.vocab_start = group, vocab, vocab_start
        self.loss_options = loss_options  # the family's head (Gemma-2's softcap and (1 + w) norm); {}: Llama's

    def loss(self, x, target, wn, w_vocab, eps, ignore_index, reduction, chunk_rows):
        """lm_head_loss, or the family's head, over the rank's slice (codagen.parallel.vocab_parallel_lm_head_loss)."""
        return vocab_parallel_lm_head_loss(x, target, wn, w_vocab, self.vocab_start, self.vocab, eps, ignore_index,
                                           reduction, chunk_rows, "nan", "same", self.group, **self.loss_options)

    def logits(self, hidden: torch.Tensor, w_vocab: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits of the final norm's output: the rank's slice's, gathered."""
        part = F.linear(_ToRanks.apply(hidden, self.group), w_vocab)
        return _GatherVocab.apply(part, self.vocab, self.group)


# ---- the tensor-parallel decoder layer ----

def _decoder_layer_class():
    from codagen.hf import CodagenDecoderLayer, _rotated

    class TensorParallelDecoderLayer(CodagenDecoderLayer):
        """A CodagenDecoderLayer holding its rank's part of the fused projections (apply_tensor_parallel sets it): the
        same modules and parameter names; qkv_proj's rows of the rank's heads and gate_up_proj's of its (gate, up)
        pairs, o_proj's and down_proj's matching columns. Before attention: TensorParallelPreAttentionFunction, or
        the family's own block on the rank's heads; after it, the family's (hf_families.FAMILIES); attention is
        Hugging Face's, on the rank's heads."""

        def forward(self, hidden_states, norm_stats, next_norm_weight, *, blocks, positions, rope_freqs, attention,
                    attention_mask, position_ids, score_scale=1.0, dtype=None, cache=None, attentions=None,
                    **attention_kwargs):
            cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
            batch, seq, dim = hidden_states.shape
            attn, eps, group = self.self_attn, self.eps, self.tensor_parallel_group
            x = hidden_states.reshape(batch * seq, dim)
            wn = cast(self.input_layernorm.weight)
            mapping = self.hf_mapping
            # the family's (Gemma-2's (1 + w) scale), replicated
            h, rstd = norm_stats if norm_stats is not None else mapping.norm_stats(blocks, x, wn, dim, eps)
            freqs = rope_freqs[self.qkv_pairs]  # the RoPE frequencies of the rank's qkv columns
            if mapping.pre_attention is LLAMA.pre_attention:
                x, qkv = TensorParallelPreAttentionFunction.apply(x, h, rstd, positions, freqs, wn,
                                                                  cast(attn.qkv_proj.weight), dim, group)
            else:
                # the family's own block (Qwen3's QK-norm, Gemma-2's (1 + w) norm) on the rank's qkv columns, its
                # replicated inputs (x, the norm weights) through _ToRanks: the block's backward makes the rank's
                # part of their gradients, summed over the ranks there (the weights' before their cast: in their
                # own dtype). The residual is x itself, outside the block, so that its gradient is counted once.
                def replicated(t):
                    return _ToRanks.apply(t, group)

                def replicated_weight(t):
                    return cast(replicated(t))

                _, qkv = mapping.pre_attention(self, blocks, replicated(x), h, rstd, positions, freqs,
                                               replicated_weight(self.input_layernorm.weight),
                                               cast(attn.qkv_proj.weight), eps, replicated_weight)
            if attn.qkv_proj.bias is not None:  # the rank's columns' bias (Qwen2's), rotated as in codagen.hf
                qkv = qkv + _rotated(cast(attn.qkv_proj.bias), positions, freqs)
            y = self.attend(qkv.view(batch, seq, -1), attention, attention_mask, position_ids, score_scale, cache,
                            attentions, attention_kwargs)
            if attn.o_proj.bias is not None:
                x = x + cast(attn.o_proj.bias)  # replicated, added once: the residual is the same on every rank
            x, h, rstd = FAMILIES[mapping.model_class].post_attention(self, y.reshape(batch * seq, -1), x,
                                                                      cast(next_norm_weight), cast, group)
            return torch.ops.aten._unsafe_view(x, (batch, seq, dim)), (h, rstd)

    return TensorParallelDecoderLayer


_LAYER_CLASS = None


def _layer_class():
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _LAYER_CLASS = _decoder_layer_class()
    return _LAYER_CLASS


# ---- apply_tensor_parallel ----

def _shard(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    """module.<name> replaced by the rows (dim 0) or columns (dim 1) `index` of it, a new parameter."""
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(p.detach().index_select(dim, index.to(p.device)).clone(),
                                       requires_grad=p.requires_grad))


def _check(model, world: int):
    """Refuse, before anything is changed, what apply_tensor_parallel does not support; else the model's
    codagen.hf mapping."""
    from codagen import hf, lora

    if hasattr(model, "codagen_tensor_parallel"):
        _refuse("this model is already tensor-parallel")
    if lora.is_peft(model) or any(lora.is_peft(m) for m in model.modules()):
        _refuse("a PEFT (LoRA) model under tensor parallelism is not supported: shard the base model, or train the "
                "adapters with data parallelism (DDP, FSDP2)")
    mapping, kind = hf._mapping_of(model)
    if kind != "ForCausalLM":
        _refuse(f"expected a transformers causal LM that codagen.hf patches (LlamaForCausalLM, ...), got "
                f"{type(model).__name__}; a decoder alone or a classification or question-answering head is not "
                "supported")
    if mapping.model_class not in FAMILIES:
        _refuse(f"a {mapping.model_class} is not supported: its layers have no tensor-parallel form yet; "
                f"{', '.join(FAMILIES)} are supported")
    config = model.config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, field)
        if n % world:
            _refuse(f"config.{field} = {n} is not divisible by the world size {world}; replicating key-value heads "
                    "or uneven splits is not implemented")
    if config.vocab_size < world:
        _refuse(f"config.vocab_size = {config.vocab_size} cannot be split over {world} ranks")
    rows = [getattr(getattr(m, "weight", None), "shape", (None,))[0]
            for m in (model.get_submodule("model.embed_tokens"), model.get_submodule("lm_head"))]
    if rows != [config.vocab_size] * 2:
        _refuse(f"the embedding and the LM head must have config.vocab_size = {config.vocab_size} rows, got {rows}")
    if any(type(p) is not nn.Parameter for p in model.parameters()):
        _refuse("the model's parameters are not plain tensors (FSDP2's DTensors?): apply apply_tensor_parallel to "
                "the whole model before any other wrapping")
    if any(p.is_meta for p in model.parameters()):
        _refuse("the model's weights are on the meta device; load them first (each rank then keeps its part)")
    fp8_blocks = (mapping.fp8 or {}).values()
    if any(getattr(layer, "hf_mapping", mapping).pre_attention in fp8_blocks for layer in model.model.layers):
        _refuse("a model patched with apply_codagen(fp8=True) is not supported: its FP8 blocks have no "
                "tensor-parallel form yet; patch it without fp8")
    return mapping


def apply_tensor_parallel(model, group=None, **apply_codagen_kwargs):
    """Make a transformers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or
    Gemma2ForCausalLM (unpatched, or patched by codagen.hf.apply_codagen) tensor-parallel over `group` (a process
    group, a 1-D DeviceMesh, or None: the default group), in place, and return it. Every rank must call it on the
    same whole model and then feed the model the same batch; each gets the same loss, the whole gradients of the
    replicated parameters (the norms, Qwen3's q_norm and k_norm, the out and down projections' biases) and its
    part's of the others. apply_codagen_kwargs (chunk_rows, return_logits) go to apply_codagen where the model is
    not patched yet. Make the optimizer afterwards.

    Rank r of P keeps, of each decoder layer, the rows of qkv_proj (and its bias) of its num_attention_heads / P
    query and num_key_value_heads / P key-value heads and o_proj's matching columns, and a contiguous 1/P of the
    (gate, up) pairs of gate_up_proj (and of its bias, mlp_bias) and down_proj's matching columns; of the embedding
    and the LM head, the rows vocab_range(vocab_size, r, P) (one parameter where they are tied). state_dict() gives
    the rank's parts under Hugging Face's names. Raises TensorParallelError, naming what, for what is not supported:
    a PEFT model, another family, head counts or an intermediate size not divisible by P, a model already
    sharded."""
    from codagen import hf

    group = process_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hf_mapping = _check(model, world)
    patched = any(isinstance(layer, hf.CodagenDecoderLayer) for layer in model.model.layers)
    if not patched:
        hf.apply_codagen(model, **apply_codagen_kwargs)
    elif apply_codagen_kwargs:
        _refuse(f"the model is patched already: {', '.join(apply_codagen_kwargs)} cannot be applied")
    config, llama = model.config, model.model
    hd = llama.layers[0].self_attn.head_dim
    from codagen.presets import LlamaShape

    shape = LlamaShape(dim=config.hidden_size, ffn_dim=config.intermediate_size, n_heads=config.num_attention_heads,
                       n_kv_heads=config.num_key_value_heads, head_dim=hd, n_layers=config.num_hidden_layers,
                       vocab=config.vocab_size, rope_theta=10000.0, eps=config.rms_norm_eps)
    shards = layer_shards(shape, rank, world)
    qkv_dim, qkv_rows = shards["pre.w_qkv"]
    layer_class = _layer_class()
    for layer in llama.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _shard(attn.qkv_proj, "weight", qkv_dim, qkv_rows)
        if attn.qkv_proj.bias is not None:
            _shard(attn.qkv_proj, "bias", 0, qkv_rows)
        _shard(attn.o_proj, "weight", *shards["post.w_o"])
        _shard(mlp.gate_up_proj, "weight", *shards["post.w_gate_up"])
        if mlp.gate_up_proj.bias is not None:  # mlp_bias: the rank's pairs' bias; down_proj's is replicated
            _shard(mlp.gate_up_proj, "bias", *shards["post.w_gate_up"])
        _shard(mlp.down_proj, "weight", *shards["post.w_down"])
        attn.o_proj.in_features = attn.o_proj.weight.shape[1]
        mlp.down_proj.in_features = mlp.down_proj.weight.shape[1]
        # attention on the rank's heads (num_key_value_groups, their ratio, is unchanged)
        attn.num_heads, attn.num_key_value_heads = shape.n_heads // world, shape.n_kv_heads // world
        layer.__class__ = layer_class
        layer.tensor_parallel_group = group
        layer.register_buffer("qkv_pairs", (qkv_rows[::2] // 2).to(attn.qkv_proj.weight.device), persistent=False)

    # the vocab-parallel embedding and LM head: the rank's rows, one parameter where they are tied
    vocab = config.vocab_size
    start, stop = vocab_range(vocab, rank, world)
    embed, head = llama.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    rows = torch.arange(start, stop, device=embed.weight.device)
    _shard(embed, "weight", 0, rows)
    llama.embed_tokens = VocabParallelEmbedding(embed.weight, vocab, start, embed.padding_idx, group,
                                                getattr(embed, "embed_scale", None))
    if tied:
        head.weight = llama.embed_tokens.weight
    else:
        _shard(head, "weight", 0, rows.to(head.weight.device))
    head.out_features = stop - start
    model.codagen_tensor_parallel = TensorParallelHead(group, vocab, start,
                                                       FAMILIES[hf_mapping.model_class].loss_options(config))
    return model


# ---- the whole model's weights again ----

# the Hugging Face parameters (state_dict() names, by their ending) that a rank holds a part of -> the dimension
# along which the ranks' parts follow each other in rank order (a head's rows, a (gate, up) pair's, a vocabulary
# slice's)
SHARDED = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
           "self_attn.q_proj.bias": 0, "self_attn.k_proj.bias": 0, "self_attn.v_proj.bias": 0,
           "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.gate_proj.bias": 0, "mlp.up_proj.bias": 0,
           "self_attn.o_proj.weight": 1,
           "mlp.down_proj.weight": 1, "model.embed_tokens.weight": 0, "lm_head.weight": 0}


def _gather(part: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' parts of a tensor joined along dim in rank order (parts whose sizes along dim may differ, as the
    vocabulary's slices do: padded for the all-gather)."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=part.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([part.shape[dim]], device=part.device), group=group)
    sizes = [int(n) for n in sizes]
    padded = part.new_zeros(part.shape[:dim] + (max(sizes),) + part.shape[dim + 1:])
    padded.narrow(dim, 0, part.shape[dim]).copy_(part)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole model's state_dict() in Hugging Face's layout and names, on every rank of the group, from a model
    made tensor-parallel by apply_tensor_parallel: each sharded weight's parts gathered (one all-gather each), the
    replicated ones as they are. What save_pretrained(path, state_dict=...) on one rank, or an unpatched model's
    load_state_dict(), takes; every rank must call it."""
    state = getattr(model, "codagen_tensor_parallel", None)
    if state is None:
        _refuse("full_state_dict takes a model made tensor-parallel by apply_tensor_parallel")
    whole = {}
    for name, value in model.state_dict().items():
        dim = next((d for suffix, d in SHARDED.items() if name == suffix or name.endswith("." + suffix)), None)
        whole[name] = value if dim is None else _gather(value.detach(), dim, state.group)
    return whole
