"""The Gemma-2 family: a Gemma-2 built from codagen's generated block modules (specs/gemma2/), the same model in plain PyTorch
(Hugging Face's Gemma2ForCausalLM layout and names) as its reference, the weight conversion between them, and what
codagen.hf patches in a transformers Gemma2ForCausalLM (HF).

Attention, with Gemma-2's logit softcapping and sliding window, is eager PyTorch; everything else runs in
generated kernels: Gemma2NormStats (first layer only) -> [Gemma2PreAttention -> attention ->
Gemma2PostAttention] x layers -> Gemma2LmHeadLoss. Every RMSNorm scales by (1 + w) in fp32, the embeddings
are scaled by sqrt(dim), and the LM head is the embedding matrix (tied), its logits softcapped before the loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..convert import heads_to_halves, heads_to_interleaved, interleave_rows, rope_freqs, split_rows
from ..presets import Gemma2Shape  # the model's dimensions and constants (presets gemma2-2b, gemma2-tiny)
from ..runtime.heads import split_heads
from . import Family, HfMapping, generated_blocks
from .llama import HF as LLAMA_HF
from .llama import rope_tables, rotate

# the block specs a Gemma-2 chains (specs/gemma2/blocks/)
BLOCKS = ("gemma2_norm_stats", "gemma2_pre_attention", "gemma2_post_attention", "gemma2_lm_head_loss")


def attention_mask(seq: int, sliding: bool, shape: Gemma2Shape, device) -> torch.Tensor:
    """Causal, and on sliding layers at most sliding_window positions back: True where a query may attend."""
    i = torch.arange(seq, device=device)
    allowed = i[None, :] <= i[:, None]
    if sliding:
        allowed &= i[:, None] - i[None, :] < shape.sliding_window
    return allowed


def attend(q, k, v, layer: int, shape: Gemma2Shape) -> torch.Tensor:
    """Gemma-2's eager attention on [batch, heads, seq, head_dim]: GQA, scores scaled by
    query_pre_attn_scalar^-1/2 and softcapped, softmax in fp32."""
    groups = shape.n_heads // shape.n_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(2, 3) * shape.query_pre_attn_scalar**-0.5
    scores = torch.tanh(scores / shape.attn_softcap) * shape.attn_softcap
    allowed = attention_mask(q.shape[2], layer % 2 == 0, shape, q.device)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attention(qkv: torch.Tensor, layer: int, shape: Gemma2Shape, batch: int, seq: int) -> torch.Tensor:
    """[batch * seq, qkv_dim] (q and k already rotated) -> [batch * seq, attn_dim]."""
    hd = shape.head_dim
    q, k, v = split_heads(qkv.view(batch, seq, -1), shape.n_heads, shape.n_kv_heads, hd)
    return attend(q, k, v, layer, shape).transpose(1, 2).reshape(batch * seq, shape.attn_dim)


class Layer(nn.Module):
    def __init__(self, shape: Gemma2Shape, device=None, dtype=None):
        super().__init__()
        blocks = generated_blocks()
        self.pre = blocks.Gemma2PreAttention(shape.dim, shape.qkv_dim, device=device, dtype=dtype)
        self.post = blocks.Gemma2PostAttention(shape.dim, shape.attn_dim, shape.ffn_dim, shape.eps, device=device,
                                        dtype=dtype)


class CodagenGemma2(nn.Module):
    def __init__(self, shape: Gemma2Shape, ignore_index: int = -100, chunk_rows: int = 2048, device=None,
                 dtype=None):
        super().__init__()
        self.shape = shape
        blocks = generated_blocks()
        self.norm_stats = blocks.Gemma2NormStats(shape.dim, shape.eps)
        self.layers = nn.ModuleList(Layer(shape, device, dtype) for _ in range(shape.n_layers))
        self.head = blocks.Gemma2LmHeadLoss(shape.dim, shape.vocab, shape.eps, shape.final_softcap, ignore_index, "mean",
                                     chunk_rows, device=device, dtype=dtype)
        self.register_buffer("freqs", rope_freqs(shape).to(device), persistent=False)
        with torch.no_grad():  # Gemma's norm weights start at 0: a scale of 1 + 0
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.zero_()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.shape
        batch, seq = tokens.shape
        w_vocab = self.head.w_vocab  # tied: the embedding matrix is the LM head's
        x = F.embedding(tokens, w_vocab, padding_idx=s.pad_token_id)
        x = (x * torch.tensor(math.sqrt(s.dim), dtype=x.dtype)).reshape(batch * seq, s.dim)
        positions = torch.arange(seq, device=tokens.device).repeat(batch)
        # every norm's statistics come from the epilogue before it; the first layer's from norm_stats
        h, rstd = self.norm_stats(x, self.layers[0].pre.wn)
        for i, layer in enumerate(self.layers):
            x, qkv = layer.pre(x, h, rstd, positions, self.freqs)
            y = attention(qkv, i, s, batch, seq)
            wn_next = self.layers[i + 1].pre.wn if i + 1 < len(self.layers) else self.head.wn
            x, h, rstd = layer.post(y, x, wn_next)
        del h, rstd  # the head makes its norm's statistics itself, a chunk of rows at a time
        return self.head(x, targets.reshape(-1))


def from_hf(sd: dict[str, torch.Tensor], shape: Gemma2Shape) -> dict[str, torch.Tensor]:
    """A Hugging Face Gemma2ForCausalLM state dict -> the state dict of CodagenGemma2: q and k rows in
    interleaved RoPE pairs, gate and up rows interleaved, the norm weights w as they are (the kernels scale
    by 1 + w)."""
    out = {"head.w_vocab": sd["model.embed_tokens.weight"], "head.wn": sd["model.norm.weight"]}
    hd = shape.head_dim
    for i in range(shape.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[q + "pre.wn"] = sd[p + "input_layernorm.weight"]
        out[q + "pre.w_qkv"] = torch.cat([heads_to_interleaved(sd[a + "q_proj.weight"], hd),
                                          heads_to_interleaved(sd[a + "k_proj.weight"], hd), sd[a + "v_proj.weight"]])
        out[q + "post.w_o"] = sd[a + "o_proj.weight"]
        out[q + "post.wn_post_attn"] = sd[p + "post_attention_layernorm.weight"]
        out[q + "post.wn_pre_mlp"] = sd[p + "pre_feedforward_layernorm.weight"]
        out[q + "post.w_gate_up"] = interleave_rows(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"])
        out[q + "post.w_down"] = sd[m + "down_proj.weight"]
        out[q + "post.wn_post_mlp"] = sd[p + "post_feedforward_layernorm.weight"]
    return out


def to_hf(sd: dict[str, torch.Tensor], shape: Gemma2Shape) -> dict[str, torch.Tensor]:
    """from_hf's inverse (lm_head.weight is the embedding matrix, tied)."""
    out = {"model.embed_tokens.weight": sd["head.w_vocab"], "model.norm.weight": sd["head.wn"]}
    hd, attn, kv = shape.head_dim, shape.attn_dim, shape.n_kv_heads * shape.head_dim
    for i in range(shape.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = sd[q + "pre.w_qkv"].split([attn, kv, kv])
        gate, up = split_rows(sd[q + "post.w_gate_up"])
        out.update({
            p + "input_layernorm.weight": sd[q + "pre.wn"],
            p + "self_attn.q_proj.weight": heads_to_halves(wq, hd),
            p + "self_attn.k_proj.weight": heads_to_halves(wk, hd),
            p + "self_attn.v_proj.weight": wv,
            p + "self_attn.o_proj.weight": sd[q + "post.w_o"],
            p + "post_attention_layernorm.weight": sd[q + "post.wn_post_attn"],
            p + "pre_feedforward_layernorm.weight": sd[q + "post.wn_pre_mlp"],
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": sd[q + "post.w_down"],
            p + "post_feedforward_layernorm.weight": sd[q + "post.wn_post_mlp"],
        })
    return out


# ---- codagen.hf: a transformers Gemma2ForCausalLM patched in place ----
# Hugging Face's own embedding (scaled by sqrt(hidden_size) in the weights' dtype), masks (sliding-window on the
# layers of config.layer_types that say so) and attention function (the eager one Gemma-2's layers call, which
# softcaps the scores) stay; the layers, the final norm and the loss run in the Gemma-2 blocks.

# attention implementations whose function drops Gemma-2's score softcap (HF refuses SDPA for Gemma-2 itself)
DROPS_SOFTCAP = ("sdpa", "paged|sdpa", "paged|eager")


def hf_check_config(config, refuse) -> None:
    """Gemma-2's refusals, next to every family's (codagen.hf.check_config): refuse(field, value, why)."""
    if getattr(config, "attention_bias", False):
        refuse("attention_bias", config.attention_bias, "o_proj's bias comes before the post-attention norm, inside "
                                                        "the Gemma2PostAttention block, which has no bias")
    if getattr(config, "use_bidirectional_attention", None):
        refuse("use_bidirectional_attention", config.use_bidirectional_attention, "the patched decoder is causal")
    if config.final_logit_softcapping is None:
        refuse("final_logit_softcapping", None, "the Gemma-2 loss block softcaps the logits (every released Gemma-2 "
                                                "sets 30.0)")
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if config.attn_logit_softcapping is not None and implementation in DROPS_SOFTCAP:
        refuse("_attn_implementation", implementation, "its attention function drops attn_logit_softcapping: use "
                                                       "eager, flash_attention_2/3 or flex_attention")


def hf_norm_stats(blocks, x, wn, dim, eps):
    """The first layer's input-norm statistics, with Gemma's (1 + w) scale."""
    return blocks.Gemma2NormStatsFunction.apply(x, wn, dim, eps)


def hf_pre_attention(layer, blocks, x, h, rstd, positions, freqs, wn, w_qkv, eps, cast):
    """Gemma2PreAttention: Llama's (norm, QKV, RoPE), the norm's (1 + w) scale in its backward."""
    return blocks.Gemma2PreAttentionFunction.apply(x, h, rstd, positions, freqs, wn, w_qkv, x.shape[1], w_qkv.shape[0])


def hf_post_attention(layer, blocks, y, x, wn_next, w_o, wn_post_attn, w_gate_up, w_down, eps, cast):
    """Gemma2PostAttention: o_proj, post-attention norm, residual, pre-feedforward norm, GeGLU MLP,
    post-feedforward norm, residual; Hugging Face's post_attention_layernorm is the norm of the attention's output
    (Llama's is the MLP's input norm, Gemma-2's pre_feedforward_layernorm)."""
    dim, attn_dim, ffn_dim = x.shape[1], w_o.shape[1], w_down.shape[1]
    wn_pre_mlp = cast(layer.pre_feedforward_layernorm.weight)
    wn_post_mlp = cast(layer.post_feedforward_layernorm.weight)
    return blocks.Gemma2PostAttentionFunction.apply(y, x, wn_next, w_o, wn_post_attn, wn_pre_mlp, w_gate_up, w_down,
                                                    wn_post_mlp, dim, attn_dim, ffn_dim, eps)


def hf_lm_head_loss(config, blocks, x, target, wn, w_vocab, ignore_index, reduction, chunk_rows):
    """The final (1 + w) norm, the LM head, the logits softcapped by final_logit_softcapping, the loss."""
    return blocks.gemma2_lm_head_loss.gemma2_lm_head_loss(
        x, target, wn, w_vocab, w_vocab.shape[1], w_vocab.shape[0], config.rms_norm_eps,
        config.final_logit_softcapping, ignore_index, reduction, chunk_rows, "nan", "same")


def hf_final_logits(config, logits):
    """Gemma2ForCausalLM's logits: softcapped, in its own order of operations."""
    cap = config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


HF = HfMapping(
    model_class="Gemma2ForCausalLM",
    modeling="transformers.models.gemma2.modeling_gemma2",
    model_modules={"norm": "Gemma2RMSNorm", "embed_tokens": "Gemma2TextScaledWordEmbedding"},
    layer_modules={"input_layernorm": "Gemma2RMSNorm", "post_attention_layernorm": "Gemma2RMSNorm",
                   "pre_feedforward_layernorm": "Gemma2RMSNorm", "post_feedforward_layernorm": "Gemma2RMSNorm",
                   "self_attn.o_proj": "Linear", "mlp.down_proj": "Linear",
                   "": "Gemma2DecoderLayer", "self_attn": "Gemma2Attention", "mlp": "Gemma2MLP",
                   "self_attn.q_proj": "Linear", "self_attn.k_proj": "Linear", "self_attn.v_proj": "Linear",
                   "mlp.gate_proj": "Linear", "mlp.up_proj": "Linear"},
    read=("norm", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "self_attn.o_proj", "mlp.down_proj"),
    fused=LLAMA_HF.fused,
    feeds={
        "gemma2_norm_stats": ("model.layers.0.input_layernorm.weight",),
        "gemma2_pre_attention": ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                 "self_attn.v_proj.weight"),
        "gemma2_post_attention": ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                  "pre_feedforward_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "post_feedforward_layernorm.weight",
                                  "next.input_layernorm.weight"),
        "gemma2_lm_head_loss": ("model.norm.weight", "lm_head.weight"),
    },
    check_config=hf_check_config,
    # each layer's attention type is config.layer_types[i] (alternating sliding and full by default), as Gemma2Model
    # reads it
    layer_types=lambda config: tuple(config.layer_types[: config.num_hidden_layers]),
    pre_attention=hf_pre_attention,
    post_attention=hf_post_attention,
    activation=("hidden_activation", "gelu_pytorch_tanh", "GeGLU with gelu_pytorch_tanh"),
    layer_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    norm_stats=hf_norm_stats,
    attention_args={"softcap": "attn_logit_softcapping"},
    lm_head_loss=hf_lm_head_loss,
    final_logits=hf_final_logits,
    # Gemma-3's text model and the heads over it, as its causal LM
    refused=dict.fromkeys(("Gemma3ForCausalLM", "Gemma3TextModel", "Gemma3TextForSequenceClassification"), (
        "its layers do not fit the Gemma-2 blocks: its attention normalizes each q and k head (self_attn.q_norm, "
        "self_attn.k_norm) before RoPE, which Gemma2PreAttention does not; its sliding layers rotate with their "
        "own RoPE frequencies (rope_parameters['sliding_attention']), where the patched decoder takes one table; "
        "and its logits are not softcapped (final_logit_softcapping None), which gemma2_lm_head_loss always does")),
)


# ---- the reference: a plain PyTorch Gemma-2 in Hugging Face's layout and names ----

class RMSNorm(nn.Module):
    """Gemma's: normalized in fp32, scaled by (1 + w) in fp32, then rounded to the input's dtype."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class PlainGemma2(nn.Module):
    """Parameter names follow transformers' Gemma2ForCausalLM (lm_head tied to the embeddings), so from_hf
    and to_hf apply to its state dict."""

    def __init__(self, shape: Gemma2Shape, ignore_index: int = -100, device=None, dtype=None):
        super().__init__()
        self.shape, self.ignore_index = shape, ignore_index
        kw = dict(device=device, dtype=dtype)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(shape.vocab, shape.dim, padding_idx=shape.pad_token_id, **kw)
        self.model.layers = nn.ModuleList()
        for _ in range(shape.n_layers):
            layer = nn.Module()
            layer.input_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(shape.dim, shape.attn_dim, bias=False, **kw)
            layer.self_attn.k_proj = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False, **kw)
            layer.self_attn.v_proj = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False, **kw)
            layer.self_attn.o_proj = nn.Linear(shape.attn_dim, shape.dim, bias=False, **kw)
            layer.post_attention_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            layer.pre_feedforward_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            layer.mlp = nn.Module()
            layer.mlp.gate_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False, **kw)
            layer.mlp.up_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False, **kw)
            layer.mlp.down_proj = nn.Linear(shape.ffn_dim, shape.dim, bias=False, **kw)
            layer.post_feedforward_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(shape.dim, shape.eps, **kw)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.shape
        batch, seq = tokens.shape
        cos, sin = rope_tables(s, seq, tokens.device)
        embed = self.model.embed_tokens
        x = embed(tokens) * torch.tensor(math.sqrt(s.dim), dtype=embed.weight.dtype)
        for i, layer in enumerate(self.model.layers):
            n = layer.input_layernorm(x)
            a = layer.self_attn
            q = a.q_proj(n).reshape(batch, seq, s.n_heads, s.head_dim).transpose(1, 2)
            k = a.k_proj(n).reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
            v = a.v_proj(n).reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin).to(n.dtype), rotate(k, cos, sin).to(n.dtype)
            y = attend(q, k, v, i, s).transpose(1, 2).reshape(batch, seq, s.attn_dim)
            x = x + layer.post_attention_layernorm(a.o_proj(y))
            m = layer.mlp
            n = layer.pre_feedforward_layernorm(x)
            x = x + layer.post_feedforward_layernorm(
                m.down_proj(F.gelu(m.gate_proj(n), approximate="tanh") * m.up_proj(n)))
        logits = F.linear(self.model.norm(x), embed.weight).float()
        logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return F.cross_entropy(logits.reshape(-1, s.vocab), targets.reshape(-1), ignore_index=self.ignore_index)


FAMILY = Family("gemma2", BLOCKS, CodagenGemma2, PlainGemma2, from_hf, to_hf, HF)
