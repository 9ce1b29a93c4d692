"""Weight layouts: Hugging Face Llama checkpoints <-> codagen's interleaved layout, both directions.

codagen's pairwise epilogue steps work on interleaved column pairs (2j, 2j+1), so
- gate/up: `w_gate_up` rows are [g0, u0, g1, u1, ...] (HF keeps gate_proj and up_proj apart);
- q/k: within each head, HF's `rotate_half` pairs dimension j with j + head_dim/2; codagen permutes the rows of
  q_proj and k_proj so those pairs sit side by side. Attention scores q . k do not change, since q and k get
  the same permutation; v and o_proj are untouched.
"""
from __future__ import annotations

import torch

from .presets import LlamaShape

__all__ = ["LlamaShape", "from_hf", "heads_to_halves", "heads_to_interleaved", "interleave_rows", "rope_freqs",
           "split_rows", "to_hf"]


def _pairs_order(head_dim: int) -> torch.Tensor:
    """Row order that brings rotate_half's pairs (j, j + head_dim/2) together as (2j, 2j+1)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def heads_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    order = _pairs_order(head_dim)
    return w.reshape(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def heads_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    inverse = torch.argsort(_pairs_order(head_dim))
    return w.reshape(-1, head_dim, *w.shape[1:])[:, inverse].reshape(w.shape)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def split_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w[0::2], w[1::2]


def rope_freqs(shape: LlamaShape) -> torch.Tensor:
    """Per-pair frequencies over the qkv columns: each q and k head's inverse frequencies, 0 for v (unrotated)."""
    inv = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim)
    rotated = inv.repeat(shape.n_heads + shape.n_kv_heads)
    return torch.cat([rotated, torch.zeros(shape.n_kv_heads * shape.head_dim // 2, dtype=torch.float64)]).float()


def from_hf(sd: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """A Hugging Face LlamaForCausalLM state dict -> the state dict of codagen.models.llama.CodagenLlama."""
    out = {"embed.weight": sd["model.embed_tokens.weight"]}
    hd = shape.head_dim
    for i in range(shape.n_layers):
        p = f"model.layers.{i}."
        q = heads_to_interleaved(sd[p + "self_attn.q_proj.weight"], hd)
        k = heads_to_interleaved(sd[p + "self_attn.k_proj.weight"], hd)
        out[f"layers.{i}.pre.wn"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.pre.w_qkv"] = torch.cat([q, k, sd[p + "self_attn.v_proj.weight"]])
        out[f"layers.{i}.post.w_o"] = sd[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.post.wn_mlp"] = sd[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.post.w_gate_up"] = interleave_rows(sd[p + "mlp.gate_proj.weight"],
                                                            sd[p + "mlp.up_proj.weight"])
        out[f"layers.{i}.post.w_down"] = sd[p + "mlp.down_proj.weight"]
    out["head.wn"] = sd["model.norm.weight"]
    out["head.w_vocab"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


def to_hf(sd: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """The inverse of from_hf."""
    out = {"model.embed_tokens.weight": sd["embed.weight"]}
    hd = shape.head_dim
    nq, nk = shape.n_heads * hd, shape.n_kv_heads * hd
    for i in range(shape.n_layers):
        p = f"model.layers.{i}."
        q, k, v = sd[f"layers.{i}.pre.w_qkv"].split([nq, nk, nk])
        gate, up = split_rows(sd[f"layers.{i}.post.w_gate_up"])
        out[p + "input_layernorm.weight"] = sd[f"layers.{i}.pre.wn"]
        out[p + "self_attn.q_proj.weight"] = heads_to_halves(q, hd)
        out[p + "self_attn.k_proj.weight"] = heads_to_halves(k, hd)
        out[p + "self_attn.v_proj.weight"] = v
        out[p + "self_attn.o_proj.weight"] = sd[f"layers.{i}.post.w_o"]
        out[p + "post_attention_layernorm.weight"] = sd[f"layers.{i}.post.wn_mlp"]
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = sd[f"layers.{i}.post.w_down"]
    out["model.norm.weight"] = sd["head.wn"]
    out["lm_head.weight"] = sd["head.w_vocab"]
    return out
