"""Baselines for the codagen benchmarks: the Llama-layer patterns of docs/design.md, and the same layer's
non-attention block and LM head in Qwen3 and Gemma-2, written the ordinary way, without codagen.

Three kinds of baseline live here, each a plain function of tensors that returns a tuple of tensors:

* **eager**: plain PyTorch, written like a normal HuggingFace Llama block (``F.linear``, an RMSNorm that
  computes in fp32 and casts back before the weight multiply, ``F.silu``, ``rotate_half`` RoPE, a fused
  ``wqkv`` projection split into heads, ``F.cross_entropy`` on fp32 logits). The same functions are what
  ``torch.compile`` compiles (see bench.py).
* **liger**: the same math with Liger-Kernel's pieces where it has them, used as
  ``apply_liger_kernel_to_llama`` uses them: ``LigerRMSNormFunction`` (the op behind ``LigerRMSNorm``,
  llama casting mode, in_place=True as the module's default), ``LigerSiLUMulFunction`` (the op behind
  ``LigerSwiGLUMLP``), ``liger_rotary_pos_emb`` and ``liger_fused_linear_cross_entropy`` (the op behind
  ``LigerFusedLinearCrossEntropyLoss``). Variant ``liger+addnorm`` also replaces each "residual add +
  RMSNorm" by ``LigerFusedAddRMSNormFunction`` (not used by Liger's Llama patch; a stronger baseline).
  Qwen3 and Gemma-2 use what ``apply_liger_kernel_to_qwen3`` / ``apply_liger_kernel_to_gemma2`` put in:
  Qwen3 Llama's pieces, with ``LigerRMSNorm`` also as q_norm and k_norm; Gemma-2 ``LigerRMSNormForGemma2``
  (offset 1, "gemma" casting, in_place=False), ``LigerGELUMulFunction`` (the op behind ``LigerGEGLUMLP``),
  ``liger_rotary_pos_emb`` and the fused linear cross-entropy with the final logit softcap.
* **gemms**: the GEMMs of a pattern alone (``F.linear`` / ``torch.mm``), with nothing between them: the
  speed of light an epilogue-fused kernel is measured against. For forward+backward, each linear layer
  costs three GEMMs (forward, input gradient, weight gradient), as autograd runs them.

The model family (``Dims.family``: llama, qwen3, gemma2) picks the norm, the gated activation, the LM
head's softcap and the block's shape (Qwen3's QK-norm; Gemma-2's norms after the out- and down projections).

Shapes: ``T`` tokens = ``batch * seq``; activations are ``(T, width)``, the attention output
``(T, n_q * head_dim)``. RoPE works on ``q (batch, n_q, seq, head_dim)`` and ``k (batch, n_kv, seq, head_dim)``
views of the fused QKV output, as in HF; ``cos``/``sin`` are ``(1, seq, head_dim)`` (computed once per step in
HF, so they are inputs).

Imports of liger_kernel happen only when a Liger function is built, so this module works without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------------
# shapes


@dataclass(frozen=True)
class Dims:
    """Everything a pattern function needs besides its tensors (all Python constants)."""

    d: int          # model width
    ffn: int        # MLP width
    n_q: int        # query heads
    n_kv: int       # key/value heads
    head_dim: int
    vocab: int
    batch: int
    seq: int
    eps: float
    family: str = "llama"
    softcap: float | None = None    # the LM head's final logit softcap (Gemma-2)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def q_width(self) -> int:
        return self.n_q * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width


# ----------------------------------------------------------------------------------------------------
# eager building blocks (HF Llama style)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: statistics and scaling in fp32, cast back, then the weight multiply."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))   # fp32 (fp64 stays fp64 for the reference)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma2RMSNorm: normalized and scaled by (1 + w) in fp32, then cast back."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(h.dtype))).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """HF ``apply_rotary_pos_emb`` with unsqueeze_dim=1: q/k (B, H, S, hd), cos/sin (1 or B, S, hd)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def split_heads(qkv: torch.Tensor, dm: Dims):
    """(T, QKV) -> q (B, n_q, S, hd), k and v (B, n_kv, S, hd): views, as HF's ``view(...).transpose(1, 2)``."""
    q, k, v = qkv.split([dm.q_width, dm.kv_width, dm.kv_width], dim=-1)
    q = q.view(dm.batch, dm.seq, dm.n_q, dm.head_dim).transpose(1, 2)
    k = k.view(dm.batch, dm.seq, dm.n_kv, dm.head_dim).transpose(1, 2)
    v = v.view(dm.batch, dm.seq, dm.n_kv, dm.head_dim).transpose(1, 2)
    return q, k, v


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """HF LlamaRotaryEmbedding for one sequence: positions (S,), inv_freq (hd/2,) -> cos, sin (1, S, hd)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


def inv_freq_for(head_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


# ----------------------------------------------------------------------------------------------------
# eager patterns. Each builder binds the constants and returns f(*tensors) -> tuple of tensors.


def eager_fns(dm: Dims, impl: str = "eager") -> dict:
    """The pattern functions of dm.family; impl "eager" (plain PyTorch), "liger" or "liger+addnorm" (Llama
    only)."""
    eps = dm.eps
    gemma = dm.family == "gemma2"

    if impl == "eager":
        def norm(x, w):
            return gemma_rms_norm(x, w, eps) if gemma else rms_norm(x, w, eps)

        def add_norm(a, residual, w):          # returns (normed, new residual)
            x = residual + a
            return norm(x, w), x

        def swiglu(g, u):   # Gemma-2: GeGLU with tanh GELU (gelu_pytorch_tanh)
            return F.gelu(g, approximate="tanh") * u if gemma else F.silu(g) * u

        def rope(q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin)

        def lm_loss(h, wv, target):
            logits = F.linear(h, wv)
            if dm.softcap is not None:   # as Gemma2ForCausalLM: in the logits' dtype, before the loss upcasts
                logits = torch.tanh(logits / dm.softcap) * dm.softcap
            return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), target,
                                   ignore_index=-100)
    elif impl in ("liger", "liger+addnorm"):
        from liger_kernel.ops import (LigerFusedAddRMSNormFunction, LigerGELUMulFunction, LigerRMSNormFunction,
                                      LigerSiLUMulFunction)
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        if impl == "liger+addnorm" and dm.family != "llama":
            raise ValueError("liger+addnorm is a Llama baseline (Liger's Qwen3 and Gemma-2 patches do not use it)")

        def norm(x, w):
            # exactly what LigerRMSNorm(hidden, eps).forward passes (offset 0, "llama" casting, in_place=True);
            # for Gemma-2, LigerRMSNormForGemma2's (offset 1, "gemma" casting, in_place=False)
            if gemma:
                return LigerRMSNormFunction.apply(x, w, eps, 1.0, "gemma", False, None)
            return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None)

        if impl == "liger":
            def add_norm(a, residual, w):
                x = residual + a
                return norm(x, w), x
        else:
            def add_norm(a, residual, w):
                y, s = LigerFusedAddRMSNormFunction.apply(a, residual, w, eps, 0.0, "llama", False)
                return y, s

        def swiglu(g, u):   # LigerSwiGLUMLP's op; Gemma-2: LigerGEGLUMLP's
            return LigerGELUMulFunction.apply(g, u) if gemma else LigerSiLUMulFunction.apply(g, u)

        def rope(q, k, cos, sin):
            return liger_rotary_pos_emb(q, k, cos, sin)

        def lm_loss(h, wv, target):
            return liger_fused_linear_cross_entropy(h, wv, target, ignore_index=-100, reduction="mean",
                                                    softcap=dm.softcap)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    def oproj_swiglu(x0, y0, wo, wn1, wg, wu):
        """out-proj + residual + RMSNorm + gate/up + SwiGLU -> (x1, y1)."""
        h1, x1 = add_norm(F.linear(y0, wo), x0, wn1)
        y1 = swiglu(F.linear(h1, wg), F.linear(h1, wu))
        return x1, y1

    def post_attn(x0, y0, wo, wn1, wg, wu, w2, wn2):
        """... + down + residual + next RMSNorm -> (x2, n2): the whole post-attention MLP half."""
        x1, y1 = oproj_swiglu(x0, y0, wo, wn1, wg, wu)
        n2, x2 = add_norm(F.linear(y1, w2), x1, wn2)
        return x2, n2

    def down_qkv_rope(x1, y1, w2, wn2, wqkv, cos, sin):
        """down + residual + RMSNorm + QKV + RoPE -> (x2, q, k, v)."""
        n2, x2 = add_norm(F.linear(y1, w2), x1, wn2)
        q, k, v = split_heads(F.linear(n2, wqkv), dm)
        q, k = rope(q, k, cos, sin)
        return x2, q, k, v

    def block(x0, y0, wo, wn1, wg, wu, w2, wn2, wqkv, cos, sin):
        """The non-attention part of a Llama layer (K1-K4 of docs/design.md): (x0, y0) -> (x2, q, k, v)."""
        x1, y1 = oproj_swiglu(x0, y0, wo, wn1, wg, wu)
        return down_qkv_rope(x1, y1, w2, wn2, wqkv, cos, sin)

    def lm_ce(xf, wnf, wv, target):
        """final RMSNorm + LM head (+ softcap) + cross-entropy (mean over non-ignored tokens) -> (loss,)."""
        return (lm_loss(norm(xf, wnf), wv, target),)

    def qwen3_block(x0, y0, wo, wn1, wg, wu, w2, wn2, wqkv, wqn, wkn, cos, sin):
        """Qwen3's non-attention part: Llama's, with q_norm and k_norm on each head of q and k (applied
        before the transpose, as Qwen3Attention does) before RoPE."""
        x1, y1 = oproj_swiglu(x0, y0, wo, wn1, wg, wu)
        n2, x2 = add_norm(F.linear(y1, w2), x1, wn2)
        q, k, v = F.linear(n2, wqkv).split([dm.q_width, dm.kv_width, dm.kv_width], dim=-1)
        q = norm(q.view(dm.batch, dm.seq, dm.n_q, dm.head_dim), wqn).transpose(1, 2)
        k = norm(k.view(dm.batch, dm.seq, dm.n_kv, dm.head_dim), wkn).transpose(1, 2)
        v = v.view(dm.batch, dm.seq, dm.n_kv, dm.head_dim).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        return x2, q, k, v

    def gemma2_block(x0, y0, wo, wna, wn1, wg, wu, w2, wnm, wn2, wqkv, cos, sin):
        """Gemma-2's non-attention part: out-proj, post-attention norm (wna), residual, pre-feedforward norm
        (wn1), gate/up + GeGLU, down, post-feedforward norm (wnm), residual, next input norm (wn2), QKV, RoPE."""
        x1 = x0 + norm(F.linear(y0, wo), wna)
        h1 = norm(x1, wn1)
        x2 = x1 + norm(F.linear(swiglu(F.linear(h1, wg), F.linear(h1, wu)), w2), wnm)
        q, k, v = split_heads(F.linear(norm(x2, wn2), wqkv), dm)
        q, k = rope(q, k, cos, sin)
        return x2, q, k, v

    if dm.family == "qwen3":
        return {"block": qwen3_block, "lm_ce": lm_ce}
    if gemma:
        return {"block": gemma2_block, "lm_ce": lm_ce}
    return {
        "oproj_swiglu": oproj_swiglu,
        "post_attn": post_attn,
        "down_qkv_rope": down_qkv_rope,
        "block": block,
        "lm_ce": lm_ce,
    }


# ----------------------------------------------------------------------------------------------------
# GEMMs alone


# For each pattern: its linear layers as (A operand, weight) by input name. "~tF" is a stand-in A
# operand of shape (T, ffn) (an intermediate the pattern computes); every other A is a pattern input of
# the right shape (its values don't matter to cuBLAS: any random data of that shape will do).
GEMMS = {
    "oproj_swiglu": [("y0", "wo"), ("x0", "wg"), ("x0", "wu")],
    "post_attn": [("y0", "wo"), ("x0", "wg"), ("x0", "wu"), ("~tF", "w2")],
    "down_qkv_rope": [("y1", "w2"), ("x1", "wqkv")],
    "block": [("y0", "wo"), ("x0", "wg"), ("x0", "wu"), ("~tF", "w2"), ("x0", "wqkv")],
    "lm_ce": [("xf", "wv")],
}


def gemm_operands(base: str, inputs: dict, dm: Dims, dtype, device, gen=None) -> list:
    """[(A, W)] for the pattern's GEMMs, taken from the inputs (stand-ins allocated here, untimed)."""
    standins = {}
    ops = []
    for a_name, w_name in GEMMS[base]:
        if a_name.startswith("~"):
            if a_name not in standins:
                standins[a_name] = torch.randn(dm.tokens, dm.ffn, dtype=dtype, device=device, generator=gen)
            a = standins[a_name]
        else:
            a = inputs[a_name]
        ops.append((a.detach(), inputs[w_name].detach()))
    return ops


def gemms_forward(ops) -> list:
    """Forward GEMMs only: out_i = A_i @ W_i^T (F.linear, as nn.Linear runs it)."""
    return [F.linear(a, w) for a, w in ops]


def gemms_forward_backward(ops) -> None:
    """Forward, then per layer the input-gradient GEMM dA = dY @ W and weight-gradient GEMM dW = dY^T @ A.

    The forward output stands in for the upstream gradient dY (same shape, dense random-like values),
    so the backward GEMMs have exactly autograd's shapes and layouts without extra buffers."""
    outs = [F.linear(a, w) for a, w in ops]
    for (a, w), dy in zip(reversed(ops), reversed(outs)):
        torch.mm(dy, w)          # dA  (T, K)
        torch.mm(dy.t(), a)      # dW  (N, K)


def gemm_flops(base: str, dm: Dims, backward: bool) -> float:
    sizes = {"wo": (dm.d, dm.q_width), "wg": (dm.ffn, dm.d), "wu": (dm.ffn, dm.d), "w2": (dm.d, dm.ffn),
             "wqkv": (dm.qkv_width, dm.d), "wv": (dm.vocab, dm.d)}
    total = sum(2.0 * dm.tokens * n * k for _, w in GEMMS[base] for n, k in [sizes[w]])
    return total * (3 if backward else 1)


# ----------------------------------------------------------------------------------------------------
# inputs


def make_tensor(name: str, dm: Dims, dtype, device, gen, theta: float) -> torch.Tensor:
    """One named input with realistic scales (never zeros): activations ~N(0,1), weights ~N(0, 1/fan_in),
    norm weights ~1 + 0.1 N(0,1) (Gemma-2's, which scale by 1 + w: 0.1 N(0,1)), cos/sin from HF's rotary
    embedding, targets uniform with every 97th token set to ignore_index (-100)."""
    T, D, Fw = dm.tokens, dm.d, dm.ffn

    def randn(*shape, scale=1.0):
        t = torch.randn(*shape, dtype=torch.float32, device=device, generator=gen)
        return (t * scale).to(dtype)

    if name in ("x0", "x1", "xf"):
        return randn(T, D)
    if name == "y0":               # the attention output
        return randn(T, dm.q_width)
    if name == "y1":
        return randn(T, Fw)
    if name == "wo":
        return randn(D, dm.q_width, scale=1 / math.sqrt(dm.q_width))
    if name in ("wg", "wu"):
        return randn(Fw, D, scale=1 / math.sqrt(D))
    if name == "w2":
        return randn(D, Fw, scale=1 / math.sqrt(Fw))
    if name == "wqkv":
        return randn(dm.qkv_width, D, scale=1 / math.sqrt(D))
    if name == "wv":
        return randn(dm.vocab, D, scale=2 / math.sqrt(D))
    if name in ("wn1", "wn2", "wnf", "wna", "wnm", "wqn", "wkn"):   # wqn, wkn: Qwen3's q_norm and k_norm
        n = dm.head_dim if name in ("wqn", "wkn") else D
        around = 0.0 if dm.family == "gemma2" else 1.0
        return (around + 0.1 * torch.randn(n, dtype=torch.float32, device=device, generator=gen)).to(dtype)
    if name in ("cos", "sin"):
        cos, sin = rope_tables(torch.arange(dm.seq, device=device), inv_freq_for(dm.head_dim, theta, device), dtype)
        return cos if name == "cos" else sin
    if name == "target":
        t = torch.randint(0, dm.vocab, (T,), device=device, generator=gen)
        t[::97] = -100
        return t
    if name == "positions":        # for kernels that compute RoPE in-kernel (codagen): position of each token
        return torch.arange(dm.seq, device=device, dtype=torch.int32).repeat(dm.batch)
    if name == "inv_freq":         # per-pair frequencies (hd/2,), fp32
        return inv_freq_for(dm.head_dim, theta, device)
    raise KeyError(name)


def output_shape(name: str, dm: Dims):
    T = dm.tokens
    return {
        "x1": (T, dm.d), "x2": (T, dm.d), "n2": (T, dm.d), "y1": (T, dm.ffn),
        "q": (dm.batch, dm.n_q, dm.seq, dm.head_dim),
        "k": (dm.batch, dm.n_kv, dm.seq, dm.head_dim),
        "v": (dm.batch, dm.n_kv, dm.seq, dm.head_dim),
        "loss": (),
    }[name]
