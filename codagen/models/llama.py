"""The Llama family: a Llama built from codagen's generated block modules, the same model in plain PyTorch (Hugging
Face weight layout) as its reference, the weight conversion between them (codagen.convert), and what codagen.hf
patches in a transformers LlamaForCausalLM (HF), and in the models whose layers are Llama's (QWEN2_HF, MISTRAL_HF).

Attention is PyTorch's scaled_dot_product_attention; everything else runs in generated kernels:
NormStats (first layer only) -> [PreAttention -> attention -> PostAttention] x layers -> LmHeadLoss.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..convert import LlamaShape, from_hf, rope_freqs, to_hf
from ..runtime.heads import split_heads
from . import Family, HfMapping, generated_blocks

# the block specs (specs/blocks/) a Llama chains; post_attention_mlp_bias where codagen.hf patches a Llama with
# mlp_bias. A Llama also runs the blocks no family lists (codagen.models.runs_block).
BLOCKS = ("norm_stats", "pre_attention", "post_attention", "post_attention_mlp_bias", "lm_head_loss")


# ---- how codagen.hf runs the blocks in a patched transformers Llama (HF below), and with fp8=True ----

def hf_norm_stats(blocks, x, wn, dim, eps):
    """The first layer's input-norm statistics (every later norm's come from the epilogue before it)."""
    return blocks.NormStatsFunction.apply(x, wn, dim, eps)


def hf_pre_attention(layer, blocks, x, h, rstd, positions, freqs, wn, w_qkv, eps, cast):
    """PreAttention: the input norm (from its statistics), the fused q/k/v projection and RoPE."""
    return blocks.PreAttentionFunction.apply(x, h, rstd, positions, freqs, wn, w_qkv, x.shape[1], w_qkv.shape[0])


def hf_post_attention(layer, blocks, y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, eps, cast):
    """PostAttention: o_proj and the residual, the MLP's norm, SwiGLU MLP and residual, the next norm's statistics.
    With mlp_bias, PostAttentionMlpBias adds the gate/up bias in the block; down_proj's bias is added to its output
    here, so the next norm's statistics are taken again, of the sum."""
    mlp, dim, ffn_dim = layer.mlp, x.shape[1], w_down.shape[1]
    if mlp.gate_up_proj.bias is None:
        return blocks.PostAttentionFunction.apply(y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, dim, ffn_dim, eps)
    x, _, _ = blocks.PostAttentionMlpBiasFunction.apply(y, x, wn_next, w_o, wn_mlp, w_gate_up,
                                                        cast(mlp.gate_up_proj.bias), w_down, dim, ffn_dim, eps)
    x = x + cast(mlp.down_proj.bias)
    h, rstd = blocks.NormStatsFunction.apply(x, wn_next, dim, eps)
    return x, h, rstd


def hf_lm_head_loss(config, blocks, x, target, wn, w_vocab, ignore_index, reduction, chunk_rows):
    """The final norm, the LM head and the cross-entropy, in row chunks (NaN where every label is ignored, as
    PyTorch's mean; the logits' dtype the hidden states')."""
    return blocks.lm_head_loss.lm_head_loss(x, target, wn, w_vocab, w_vocab.shape[1], w_vocab.shape[0],
                                            config.rms_norm_eps, ignore_index, reduction, chunk_rows, "nan", "same")


def hf_norm_stats_fp8(blocks, x, wn, dim, eps):
    """NormStatsFp8: the first layer's normalized input in float8_e4m3fn with 1 x 128 scales, and its rstd."""
    _check_fp8(x)
    h, h_scale, rstd = blocks.NormStatsFp8Function.apply(x, wn, dim, eps)
    return (h, h_scale), rstd


def hf_pre_attention_fp8(layer, blocks, x, h, rstd, positions, freqs, wn, w_qkv, eps, cast):
    """PreAttentionFp8: the q/k/v projection of the FP8 h (with its scales) by the FP8 copy of qkv_proj's weight,
    block-quantized again only after the weight changes (an optimizer step); the backward in bfloat16 from the master
    weight."""
    (h, h_scale), w = h, layer.self_attn.qkv_proj.weight
    w_fp8, w_scale = layer.codagen_fp8_weight(w)
    return blocks.PreAttentionFp8Function.apply(x, h, h_scale, rstd, positions, freqs, w_fp8, w_scale, wn, w_qkv,
                                                x.shape[1], w_qkv.shape[0])


def hf_post_attention_fp8(layer, blocks, y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, eps, cast):
    """PostAttentionFp8: the MLP's normalized input in FP8 from the out-projection's epilogue, the gate/up projection
    by the FP8 copy of gate_up_proj's weight, SwiGLU's output in FP8 from its epilogue, the down projection by the FP8
    copy of down_proj's weight, and the next layer's normalized input in FP8 (the last layer's goes unused: the LM
    head normalizes itself)."""
    gate_up_fp8, gate_up_scale = layer.codagen_fp8_weight(layer.mlp.gate_up_proj.weight)
    down_fp8, down_scale = layer.codagen_fp8_weight(layer.mlp.down_proj.weight)
    x, h, h_scale, rstd = blocks.PostAttentionFp8Function.apply(y, x, wn_next, gate_up_fp8, gate_up_scale, down_fp8,
                                                                down_scale, w_o, wn_mlp, w_gate_up, w_down, x.shape[1],
                                                                w_down.shape[1], eps)
    return x, (h, h_scale), rstd


def _check_fp8(x: torch.Tensor) -> None:
    """The FP8 blocks run bfloat16 activations, and FP8 matrix products (Triton's FP8 tl.dot: sm_89 and later; on
    the CPU, Triton's interpreter)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"apply_codagen(fp8=True): the FP8 blocks run in bfloat16, and the hidden states are "
                        f"{x.dtype}; use bfloat16 parameters, or call the model under "
                        "torch.autocast('cuda', torch.bfloat16)")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        name = torch.cuda.get_device_name(x.device)
        raise RuntimeError(f"apply_codagen(fp8=True): {name} has no FP8 matrix instructions (sm_89 and later: "
                           "Ada, Hopper); patch the model without fp8")


HF = HfMapping(
    model_class="LlamaForCausalLM",
    modeling="transformers.models.llama.modeling_llama",
    model_modules={"norm": "LlamaRMSNorm", "embed_tokens": "Embedding"},
    layer_modules={"input_layernorm": "LlamaRMSNorm", "post_attention_layernorm": "LlamaRMSNorm",
                   "self_attn.o_proj": "Linear", "mlp.down_proj": "Linear",
                   "": "LlamaDecoderLayer", "self_attn": "LlamaAttention", "mlp": "LlamaMLP",
                   "self_attn.q_proj": "Linear", "self_attn.k_proj": "Linear", "self_attn.v_proj": "Linear",
                   "mlp.gate_proj": "Linear", "mlp.up_proj": "Linear"},
    read=("norm", "input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"),
    fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    feeds={
        "norm_stats": ("model.layers.0.input_layernorm.weight",),
        "pre_attention": ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight"),
        "post_attention": ("self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                           "mlp.up_proj.weight", "mlp.down_proj.weight", "next.input_layernorm.weight"),
        # mlp_bias: gate_up's bias in the block, down_proj's added after it
        "post_attention_mlp_bias": ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias",
                                    "mlp.up_proj.bias", "mlp.down_proj.weight", "next.input_layernorm.weight"),
        "lm_head_loss": ("model.norm.weight", "lm_head.weight"),
    },
    norm_stats=hf_norm_stats,
    pre_attention=hf_pre_attention,
    post_attention=hf_post_attention,
    lm_head_loss=hf_lm_head_loss,
    fp8=dict(norm_stats=hf_norm_stats_fp8, pre_attention=hf_pre_attention_fp8, post_attention=hf_post_attention_fp8),
)


# ---- transformers models whose decoder layers are Llama's: codagen.hf patches them with Llama's blocks ----

def _llama_alike(name: str, layer_types) -> HfMapping:
    """Llama's mapping for transformers' <name>ForCausalLM, whose modules are Llama's under the name <name> (its
    modeling file is made from Llama's): the same fused projections, blocks and weights, but no mlp_bias (their
    MLPs have no bias). Their q/k/v biases, where they have them, are added after PreAttention as a Llama's
    attention_bias is (codagen.hf)."""
    def renamed(modules: dict) -> dict:
        return {module: kind.replace("Llama", name) for module, kind in modules.items()}

    return replace(HF, model_class=f"{name}ForCausalLM",
                   modeling=f"transformers.models.{name.lower()}.modeling_{name.lower()}",
                   model_modules=renamed(HF.model_modules), layer_modules=renamed(HF.layer_modules),
                   feeds={block: w for block, w in HF.feeds.items() if block != "post_attention_mlp_bias"},
                   layer_types=layer_types)


def listed_layer_types(config) -> tuple[str, ...]:
    """config.layer_types[i] for each decoder layer, as Qwen2Model and Qwen3Model read it (their configs make it
    from use_sliding_window, sliding_window and max_window_layers where it is not given)."""
    return tuple(config.layer_types[: config.num_hidden_layers])


# Qwen2 and Qwen2.5: biases on q, k and v (not o_proj); each layer's attention type is config.layer_types[i]
QWEN2_HF = _llama_alike("Qwen2", listed_layer_types)
# Mistral: every layer slides over config.sliding_window positions where it is set (MistralModel ignores
# layer_types), else attends to all of them
MISTRAL_HF = _llama_alike("Mistral", lambda config: (
    "full_attention" if config.sliding_window is None else "sliding_attention",) * config.num_hidden_layers)


def attention(qkv: torch.Tensor, shape: LlamaShape, batch: int, seq: int) -> torch.Tensor:
    """Causal GQA attention over [batch * seq, qkv_dim] -> [batch * seq, dim]."""
    hd = shape.head_dim
    q, k, v = split_heads(qkv.view(batch, seq, -1), shape.n_heads, shape.n_kv_heads, hd)
    groups = shape.n_heads // shape.n_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(batch * seq, shape.n_heads * hd)


class Layer(nn.Module):
    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        blocks = generated_blocks()
        self.pre = blocks.PreAttention(shape.dim, shape.qkv_dim, device=device, dtype=dtype)
        self.post = blocks.PostAttention(shape.dim, shape.ffn_dim, shape.eps, device=device, dtype=dtype)


class CodagenLlama(nn.Module):
    def __init__(self, shape: LlamaShape, ignore_index: int = -100, chunk_rows: int = 2048, device=None, dtype=None):
        super().__init__()
        blocks = generated_blocks()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.dim, device=device, dtype=dtype)
        self.norm_stats = blocks.NormStats(shape.dim, shape.eps)
        self.layers = nn.ModuleList(Layer(shape, device, dtype) for _ in range(shape.n_layers))
        self.head = blocks.LmHeadLoss(shape.dim, shape.vocab, shape.eps, ignore_index, "mean", chunk_rows, device=device,
                               dtype=dtype)
        self.register_buffer("freqs", rope_freqs(shape).to(device), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        x = self.embed(tokens).reshape(batch * seq, self.shape.dim)
        positions = torch.arange(seq, device=tokens.device).repeat(batch)
        # every norm's statistics come from the epilogue before it; the first layer's from norm_stats
        h, rstd = self.norm_stats(x, self.layers[0].pre.wn)
        for i, layer in enumerate(self.layers):
            x, qkv = layer.pre(x, h, rstd, positions, self.freqs)
            y = attention(qkv, self.shape, batch, seq)
            wn_next = self.layers[i + 1].pre.wn if i + 1 < len(self.layers) else self.head.wn
            x, h, rstd = layer.post(y, x, wn_next)
        del h, rstd  # the head makes its norm's statistics itself, a chunk of rows at a time
        return self.head(x, targets.reshape(-1))


# ---- the reference: a plain PyTorch Llama in Hugging Face's layout and names ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(shape, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's RoPE cos and sin for positions 0..seq-1, [seq, head_dim], angles in float64 (fp32 tables)."""
    inv = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([angle, angle], dim=-1).to(device)
    return emb.cos().float(), emb.sin().float()


def rotate(x, cos, sin):
    """Hugging Face's RoPE on a head's halves (rotate_half): dim j pairs with j + head_dim/2."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PlainLlama(nn.Module):
    """Parameter names follow transformers' LlamaForCausalLM, so codagen.convert applies to its state dict.
    `tied`: the LM head is the embedding's weight (tie_word_embeddings), with no lm_head of its own."""

    def __init__(self, shape: LlamaShape, ignore_index: int = -100, device=None, dtype=None, tied: bool = False):
        super().__init__()
        self.shape, self.ignore_index = shape, ignore_index
        kw = dict(device=device, dtype=dtype)
        hd = shape.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(shape.vocab, shape.dim, **kw)
        self.model.layers = nn.ModuleList()
        for _ in range(shape.n_layers):
            layer = nn.Module()
            layer.input_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(shape.dim, shape.n_heads * hd, bias=False, **kw)
            layer.self_attn.k_proj = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=False, **kw)
            layer.self_attn.v_proj = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=False, **kw)
            layer.self_attn.o_proj = nn.Linear(shape.n_heads * hd, shape.dim, bias=False, **kw)
            layer.post_attention_layernorm = RMSNorm(shape.dim, shape.eps, **kw)
            layer.mlp = nn.Module()
            layer.mlp.gate_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False, **kw)
            layer.mlp.up_proj = nn.Linear(shape.dim, shape.ffn_dim, bias=False, **kw)
            layer.mlp.down_proj = nn.Linear(shape.ffn_dim, shape.dim, bias=False, **kw)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(shape.dim, shape.eps, **kw)
        self.lm_head = None if tied else nn.Linear(shape.dim, shape.vocab, bias=False, **kw)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.shape
        batch, seq = tokens.shape
        cos, sin = rope_tables(s, seq, tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            n = layer.input_layernorm(x)
            a = layer.self_attn
            q = a.q_proj(n).reshape(batch, seq, s.n_heads, s.head_dim).transpose(1, 2)
            k = a.k_proj(n).reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
            v = a.v_proj(n).reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
            q, k = self.query_key(a, q, k)
            q, k = rotate(q, cos, sin).to(n.dtype), rotate(k, cos, sin).to(n.dtype)
            groups = s.n_heads // s.n_kv_heads
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                               is_causal=True)
            x = x + a.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))
            n = layer.post_attention_layernorm(x)
            m = layer.mlp
            x = x + m.down_proj(F.silu(m.gate_proj(n)) * m.up_proj(n))
        logits = F.linear(self.model.norm(x), self.lm_head_weight()).float()
        return F.cross_entropy(logits.reshape(-1, s.vocab), targets.reshape(-1), ignore_index=self.ignore_index)

    def query_key(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k, [batch, heads, seq, head_dim], as RoPE takes them: Llama's are the projections themselves."""
        return q, k

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight


FAMILY = Family("llama", BLOCKS, CodagenLlama, PlainLlama, from_hf, to_hf, HF, hf_alike=(QWEN2_HF, MISTRAL_HF))
