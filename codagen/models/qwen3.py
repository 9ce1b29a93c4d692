"""The Qwen3 family: a Qwen3 built from codagen's generated block modules, the same model in plain PyTorch (Hugging
Face weight layout and names, as transformers' Qwen3ForCausalLM) as its reference, the weight conversion, and what
codagen.hf patches in a transformers Qwen3ForCausalLM (HF).

Qwen3 is Llama's layer with QK-norm: an RMSNorm of each q and k head (weights q_norm and k_norm of head_dim
values, shared by the heads) between the QKV projection and RoPE; the embeddings are tied to the LM head at small
sizes. The block before attention adds QK-norm (specs/qwen3/blocks/qwen3_pre_attention.yaml); the one after it
is Llama's for an attention width n_heads * head_dim other than the model's (qwen3_post_attention.yaml, Llama's
kernels); NormStats and LmHeadLoss are Llama's:

    NormStats (first layer only) -> [Qwen3PreAttention -> attention -> Qwen3PostAttention] x layers -> LmHeadLoss

Attention is PyTorch's scaled_dot_product_attention. Each layer owns q_norm and k_norm and spreads them over the
qkv columns for its block (`Layer.wn_qk`); autograd sums their gradients over the heads.
"""
from __future__ import annotations

import torch
from torch import nn

from ..convert import LlamaShape, from_hf, heads_to_halves, heads_to_interleaved, rope_freqs, to_hf
from . import Family, HfMapping, generated_blocks
from .llama import HF as LLAMA_HF
from .llama import PlainLlama, RMSNorm, attention, listed_layer_types

# the block specs a Qwen3 chains (specs/qwen3/blocks/, and Llama's norm_stats and lm_head_loss)
BLOCKS = ("norm_stats", "qwen3_pre_attention", "qwen3_post_attention", "lm_head_loss")
HEAD_DIM = 128  # the column group of specs/qwen3/ (every Qwen3 model has 128-wide heads)


# ---- codagen.hf: a transformers Qwen3ForCausalLM patched in place ----

def hf_check_config(config, refuse) -> None:
    """Qwen3's refusals, next to every family's (codagen.hf.check_config): refuse(field, value, why)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != HEAD_DIM:
        refuse("head_dim", head_dim, f"the Qwen3 kernels normalize q and k heads of {HEAD_DIM} columns (their column "
                                     "group), as every released Qwen3 has")
    if getattr(config, "attention_bias", False):
        refuse("attention_bias", config.attention_bias, "Qwen3's q and k biases come before QK-norm, inside the "
                                                        "Qwen3PreAttention block, which has no bias")


def hf_pre_attention(layer, blocks, x, h, rstd, positions, freqs, wn, w_qkv, eps, cast):
    """Qwen3PreAttention on a patched layer: QK-norm's weight per qkv column made of the layer's own q_norm and
    k_norm (Hugging Face's, each permuted within the head as the q and k rows are: codagen.convert), so their
    gradients are summed over the heads by autograd."""
    attn = layer.self_attn
    hd, nq, nkv = attn.head_dim, attn.num_heads, attn.num_key_value_heads
    q_norm = heads_to_interleaved(cast(attn.q_norm.weight), hd)
    k_norm = heads_to_interleaved(cast(attn.k_norm.weight), hd)
    zeros = q_norm.new_zeros((nq + nkv) * hd)
    wn_qk = torch.cat([q_norm.repeat(nq), k_norm.repeat(nkv), zeros[: nkv * hd]])
    v_pass = torch.cat([zeros, zeros.new_ones(nkv * hd)]).to(x.dtype)
    dim = x.shape[1]
    return blocks.Qwen3PreAttentionFunction.apply(x, h, rstd, positions, freqs, wn_qk, v_pass, wn, w_qkv, dim,
                                                  w_qkv.shape[0], eps)


def hf_post_attention(layer, blocks, y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, eps, cast):
    """Qwen3PostAttention: Llama's, for an attention width n_heads * head_dim other than hidden_size."""
    dim, attn_dim, ffn_dim = x.shape[1], w_o.shape[1], w_down.shape[1]
    return blocks.Qwen3PostAttentionFunction.apply(y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, dim, attn_dim,
                                                   ffn_dim, eps)


HF = HfMapping(
    model_class="Qwen3ForCausalLM",
    modeling="transformers.models.qwen3.modeling_qwen3",
    model_modules={"norm": "Qwen3RMSNorm", "embed_tokens": "Embedding"},
    layer_modules={"input_layernorm": "Qwen3RMSNorm", "post_attention_layernorm": "Qwen3RMSNorm",
                   "self_attn.o_proj": "Linear", "mlp.down_proj": "Linear",
                   "self_attn.q_norm": "Qwen3RMSNorm", "self_attn.k_norm": "Qwen3RMSNorm",
                   "": "Qwen3DecoderLayer", "self_attn": "Qwen3Attention", "mlp": "Qwen3MLP",
                   "self_attn.q_proj": "Linear", "self_attn.k_proj": "Linear", "self_attn.v_proj": "Linear",
                   "mlp.gate_proj": "Linear", "mlp.up_proj": "Linear"},
    read=("norm", "input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj",
          "self_attn.q_norm", "self_attn.k_norm"),
    fused=LLAMA_HF.fused,
    feeds={
        "norm_stats": ("model.layers.0.input_layernorm.weight",),
        "qwen3_pre_attention": ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                "self_attn.v_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"),
        "qwen3_post_attention": ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                 "next.input_layernorm.weight"),
        "lm_head_loss": ("model.norm.weight", "lm_head.weight"),
    },
    check_config=hf_check_config,
    attention_modules=("q_norm", "k_norm"),
    # sliding-window layers as Qwen2's (use_sliding_window, max_window_layers): the attention after the block is
    # transformers' own, with its sliding-window mask and window
    layer_types=listed_layer_types,
    norm_stats=LLAMA_HF.norm_stats,
    pre_attention=hf_pre_attention,
    post_attention=hf_post_attention,
    lm_head_loss=LLAMA_HF.lm_head_loss,
    lora_refused={name: "QK-norm, between the projection and RoPE, is not linear: the adapter's product cannot be "
                        "added after the Qwen3PreAttention block (v_proj, o_proj and the MLP's take LoRA)"
                  for name in ("self_attn.q_proj", "self_attn.k_proj")},
)


class Layer(nn.Module):
    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        if shape.head_dim != HEAD_DIM:
            raise ValueError(f"the Qwen3 kernels normalize heads of {HEAD_DIM} columns, got head_dim={shape.head_dim}")
        self.shape = shape
        blocks = generated_blocks()
        self.pre = blocks.Qwen3PreAttention(shape.dim, shape.qkv_dim, shape.eps, device=device, dtype=dtype)
        self.q_norm = nn.Parameter(torch.ones(shape.head_dim, device=device, dtype=dtype))
        self.k_norm = nn.Parameter(torch.ones(shape.head_dim, device=device, dtype=dtype))
        self.post = blocks.Qwen3PostAttention(shape.dim, shape.n_heads * shape.head_dim, shape.ffn_dim, shape.eps,
                                       device=device, dtype=dtype)

    def wn_qk(self) -> torch.Tensor:
        """q_norm over every q head, k_norm over every k head, 0 over v: the QK-norm weight per qkv column."""
        s = self.shape
        v = self.q_norm.new_zeros(s.n_kv_heads * s.head_dim)
        return torch.cat([self.q_norm.repeat(s.n_heads), self.k_norm.repeat(s.n_kv_heads), v])


class CodagenQwen3(nn.Module):
    def __init__(self, shape: LlamaShape, ignore_index: int = -100, chunk_rows: int = 2048, tie_embeddings=True,
                 device=None, dtype=None):
        super().__init__()
        blocks = generated_blocks()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.dim, device=device, dtype=dtype)
        self.norm_stats = blocks.NormStats(shape.dim, shape.eps)
        self.layers = nn.ModuleList(Layer(shape, device, dtype) for _ in range(shape.n_layers))
        self.head = blocks.LmHeadLoss(shape.dim, shape.vocab, shape.eps, ignore_index, "mean", chunk_rows, device=device,
                               dtype=dtype)
        if tie_embeddings:
            self.head.w_vocab = self.embed.weight  # one parameter: its gradient sums both uses
        self.register_buffer("freqs", rope_freqs(shape).to(device), persistent=False)
        nq = (shape.n_heads + shape.n_kv_heads) * shape.head_dim
        v_pass = torch.cat([torch.zeros(nq), torch.ones(shape.n_kv_heads * shape.head_dim)])
        self.register_buffer("v_pass", v_pass.to(device=device, dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        x = self.embed(tokens).reshape(batch * seq, self.shape.dim)
        positions = torch.arange(seq, device=tokens.device).repeat(batch)
        h, rstd = self.norm_stats(x, self.layers[0].pre.wn)
        for i, layer in enumerate(self.layers):
            x, qkv = layer.pre(x, h, rstd, positions, self.freqs, layer.wn_qk(), self.v_pass)
            y = attention(qkv, self.shape, batch, seq)
            wn_next = self.layers[i + 1].pre.wn if i + 1 < len(self.layers) else self.head.wn
            x, h, rstd = layer.post(y, x, wn_next)
        del h, rstd  # the head makes its norm's statistics itself, a chunk of rows at a time
        return self.head(x, targets.reshape(-1))


def qwen3_from_hf(sd: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen3ForCausalLM state dict -> the state dict of CodagenQwen3: Llama's conversion, plus
    q_norm and k_norm permuted within the head as the q and k rows are (an RMS is the same in any order)."""
    out = from_hf(sd, shape)
    for i in range(shape.n_layers):
        p = f"model.layers.{i}.self_attn."
        out[f"layers.{i}.q_norm"] = heads_to_interleaved(sd[p + "q_norm.weight"], shape.head_dim)
        out[f"layers.{i}.k_norm"] = heads_to_interleaved(sd[p + "k_norm.weight"], shape.head_dim)
    return out


def qwen3_to_hf(sd: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """The inverse of qwen3_from_hf."""
    out = to_hf(sd, shape)
    for i in range(shape.n_layers):
        p = f"model.layers.{i}.self_attn."
        out[p + "q_norm.weight"] = heads_to_halves(sd[f"layers.{i}.q_norm"], shape.head_dim)
        out[p + "k_norm.weight"] = heads_to_halves(sd[f"layers.{i}.k_norm"], shape.head_dim)
    return out


# ---- the reference: a plain PyTorch Qwen3 in Hugging Face's layout and names ----

class PlainQwen3(PlainLlama):
    """Parameter names follow transformers' Qwen3ForCausalLM: Llama's, with each attention's q_norm and k_norm
    (an RMSNorm of every q and k head before RoPE), and the LM head tied to the embedding."""

    def __init__(self, shape: LlamaShape, ignore_index: int = -100, device=None, dtype=None):
        super().__init__(shape, ignore_index, device, dtype, tied=True)
        for layer in self.model.layers:
            layer.self_attn.q_norm = RMSNorm(shape.head_dim, shape.eps, device=device, dtype=dtype)
            layer.self_attn.k_norm = RMSNorm(shape.head_dim, shape.eps, device=device, dtype=dtype)

    def query_key(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.q_norm(q), attn.k_norm(k)


FAMILY = Family("qwen3", BLOCKS, CodagenQwen3, PlainQwen3, qwen3_from_hf, qwen3_to_hf, HF)
