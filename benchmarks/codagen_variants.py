"""codagen's variants of the benchmark's patterns: its generated kernels and blocks (generated/), each a
Variant(pattern key, "codagen", factory) whose factory returns an AutogradRunner.

codagen's weight layouts differ from eager's (interleaved gate/up rows, q/k rows in interleaved-pair order,
per-column RoPE frequencies): prepare converts the inputs, untimed, and to_reference converts outputs and
gradients back to eager's names and layouts for the check. Input sets carry the pattern's inputs plus
"positions" (T,) and "inv_freq" (head_dim/2,) wherever RoPE is involved.
"""
from __future__ import annotations

import torch

from cases import Case, InputSet
from runners import AutogradRunner, Runner, Variant


def codagen_variants(preset, tokens, dtype) -> list:
    """codagen's variants for this preset (Preset), token count and dtype: one per pattern of the preset's model
    family, and for lm_ce.fwdbwd a second one whose weight gradient is summed over the row chunks in fp32
    (grad_sum: float32) instead of the weights' dtype (the default), and (Llama) a third with half the default
    chunk of rows (less memory, more passes over the weight gradient).

    The generated modules are imported when a factory runs, so a broken import fails codagen's rows only.
    Weight relayout (interleaved gate/up rows, q/k rows in interleaved-pair order, per-column RoPE
    frequencies) happens in prepare, untimed; outputs and gradients go back to the eager layout in
    to_reference, untimed. The eps of every codagen block is the preset's (as eager uses it)."""
    family = preset.model.family
    if family != "llama":
        return _family_variants(family)
    notes = {
        "oproj_swiglu.fwd": "kernels out_proj_residual_norm -> finish.rstd -> gate_up_swiglu",
        "oproj_swiglu.fwdbwd": "OprojSwigluFunction (post_attention's first half)",
        "post_attn.fwd": "PostAttentionFunction (n2 = h_next * rstd_next formed untimed, for the check)",
        "down_qkv_rope.fwd": "kernels out_proj_residual_norm -> finish.rstd -> qkv_norm_rope",
        "block.fwd": "PostAttentionFunction -> PreAttentionFunction",
        "block.fwdbwd": "PostAttentionFunction -> PreAttentionFunction",
        "lm_ce.fwd": "lm_head_loss (the forward alone)",
        "lm_ce.fwdbwd": "lm_head_loss (gradients and the norm statistics made in the forward over row chunks)",
    }
    factories = {
        "oproj_swiglu.fwd": _cg_oproj_swiglu,
        "oproj_swiglu.fwdbwd": _cg_oproj_swiglu_block,
        "post_attn.fwd": _cg_post_attn,
        "down_qkv_rope.fwd": _cg_down_qkv_rope,
        "block.fwd": _cg_block,
        "block.fwdbwd": _cg_block,
        "lm_ce.fwd": _cg_lm_ce,
        "lm_ce.fwdbwd": _cg_lm_ce,
    }
    return [Variant(key, "codagen", factory, note=notes[key]) for key, factory in factories.items()] + [
        Variant("lm_ce.fwdbwd", FP32_SUM, lambda case: _cg_lm_ce(case, "float32"),
                note=notes["lm_ce.fwdbwd"] + "; dW summed in fp32"),
        Variant("lm_ce.fwdbwd", FIVE_EIGHTHS_CHUNKS, lambda case: _cg_lm_ce(case, chunk_fraction=0.625),
                note=notes["lm_ce.fwdbwd"] + "; chunks of 5/8 the default rows"),
        Variant("lm_ce.fwdbwd", HALF_CHUNKS, lambda case: _cg_lm_ce(case, chunk_fraction=0.5),
                note=notes["lm_ce.fwdbwd"] + "; chunks of half the default rows")]


FP32_SUM = "codagen grad_sum=float32"  # LmHeadLoss with its weight gradient summed over chunks in fp32
HALF_CHUNKS = "codagen half chunks"  # LmHeadLoss with chunk_rows half its default
# and 5/8 of it (1280 rows): between the default's speed and half chunks' memory (Liger-Kernel's, at Llama-3)
FIVE_EIGHTHS_CHUNKS = "codagen 5/8 chunks"


def _family_variants(family: str) -> list:
    """Qwen3's and Gemma-2's: the block and LM-head patterns, through the blocks their example models chain
    (codagen/models/qwen3.py, codagen/models/gemma2.py)."""
    if family == "qwen3":
        block, lm_ce = _cg_qwen3_block, _cg_lm_ce
        block_note = "Qwen3PostAttentionFunction -> Qwen3PreAttentionFunction"
        lm_note = "lm_head_loss"
    else:
        block, lm_ce = _cg_gemma2_block, _cg_gemma2_lm_ce
        block_note = "Gemma2PostAttentionFunction -> Gemma2PreAttentionFunction"
        lm_note = "gemma2_lm_head_loss"
    return [Variant("block.fwd", "codagen", block, note=block_note),
            Variant("block.fwdbwd", "codagen", block, note=block_note),
            Variant("lm_ce.fwd", "codagen", lm_ce, note=lm_note + " (the forward alone)"),
            Variant("lm_ce.fwdbwd", "codagen", lm_ce,
                    note=lm_note + " (gradients made in the forward over row chunks)"),
            Variant("lm_ce.fwdbwd", FP32_SUM, lambda case: lm_ce(case, "float32"),
                    note=lm_note + "; dW summed in fp32")]


# -- codagen's factories and the layout helpers they share ------------------------------------------------
def _cg_modules():
    """codagen's runtime, generated kernels and blocks, and the layout converters (imported on first use;
    importing codagen.runtime switches Triton's interpreter on where there is no GPU)."""
    from codagen import convert, runtime  # noqa: F401
    from codagen.runtime import finish
    from generated import blocks, kernels
    return convert, finish, kernels, blocks


def _cg_split_heads(qkv: torch.Tensor, dm) -> tuple:
    """(T, QKV) -> q, k, v as baselines.split_heads makes them, through codagen's split_heads (whose backward
    writes the three gradients into one (T, QKV) tensor in one kernel, as codagen.hf's attention does)."""
    from codagen.runtime.heads import split_heads
    return split_heads(qkv.view(dm.batch, dm.seq, -1), dm.n_q, dm.n_kv, dm.head_dim)


def _cg_freqs(case: Case) -> torch.Tensor:
    """Per-pair RoPE frequencies over the qkv columns (q and k heads: the preset's theta; v: 0)."""
    convert = _cg_modules()[0]
    return convert.rope_freqs(case.preset.model).to(case.device)


def _cg_last_dim(t: torch.Tensor, head_dim: int, to_halves: bool) -> torch.Tensor:
    """Reorder the last dimension (one head's head_dim) between HF's rotate_half order and codagen's
    interleaved pairs, with codagen.convert's row permutation."""
    convert = _cg_modules()[0]
    f = convert.heads_to_halves if to_halves else convert.heads_to_interleaved
    return f(t.movedim(-1, 0), head_dim).movedim(0, -1)


def _cg_weights(case: Case, t: dict) -> dict:
    """The prepared (untimed) inputs: eager tensors as they are, plus codagen's weight layouts, RoPE
    frequencies and positions. New weights are leaves of their own in fwd+bwd patterns."""
    convert = _cg_modules()[0]
    dm, grad = case.dims, case.pattern.backward
    out = dict(t)
    with torch.no_grad():
        if "wg" in t:
            out["w_gate_up"] = convert.interleave_rows(t["wg"], t["wu"]).contiguous().requires_grad_(grad)
        if "wqkv" in t:
            q, k, v = t["wqkv"].split([dm.q_width, dm.kv_width, dm.kv_width])
            out["w_qkv"] = torch.cat([convert.heads_to_interleaved(q, dm.head_dim),
                                      convert.heads_to_interleaved(k, dm.head_dim), v]).requires_grad_(grad)
            out["freqs"] = _cg_freqs(case)
    return out


def _cg_prepare(case: Case):
    """prepare for AutogradRunner: weights re-laid out; in fwd+bwd, q/k upstream gradients permuted into
    codagen's column order (the gradient of a permuted output is the permuted gradient)."""
    hd = case.dims.head_dim

    def prepare(inset: InputSet) -> InputSet:
        up = dict(inset.up)
        for o in ("q", "k"):
            if o in up:
                up[o] = _cg_last_dim(up[o], hd, to_halves=False).contiguous()
        return InputSet(_cg_weights(case, inset.t), up)
    return prepare


def _cg_to_reference(case: Case):
    """to_reference: q/k columns back to rotate_half order; gradients of codagen's weights back to the
    eager weights (w_gate_up -> wg, wu; w_qkv's q and k rows -> halves order)."""
    dm = case.dims
    hd = dm.head_dim

    def to_reference(named: dict, state: InputSet) -> dict:
        convert = _cg_modules()[0]
        d = dict(named)
        for o in ("q", "k"):
            if o in d:
                d[o] = _cg_last_dim(d[o], hd, to_halves=True)
        if "dw_gate_up" in d:
            d["dwg"], d["dwu"] = convert.split_rows(d.pop("dw_gate_up"))
        if "dw_qkv" in d:
            q, k, v = d.pop("dw_qkv").split([dm.q_width, dm.kv_width, dm.kv_width])
            d["dwqkv"] = torch.cat([convert.heads_to_halves(q, hd), convert.heads_to_halves(k, hd), v])
        return d
    return to_reference


def _cg_oproj_swiglu(case: Case) -> Runner:
    """oproj_swiglu.fwd: K1 -> R1 -> K2 (docs/design.md), the kernels called directly -> (x1, y1)."""
    _, finish, kernels, _ = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps

    def fwd(x0, y0, wo, wn1, w_gate_up):
        x1, h1, ss1 = kernels.out_proj_residual_norm.out_proj_residual_norm(y0, wo, x0, wn1)
        r1 = finish.rstd(ss1, dm.d, eps)
        _z1, y1 = kernels.gate_up_swiglu.gate_up_swiglu(h1, w_gate_up, r1)
        return x1, y1
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up"))


def _cg_oproj_swiglu_block(case: Case) -> Runner:
    """oproj_swiglu.fwdbwd: the OprojSwiglu block (K1 -> R1 -> K2, then post_attention's backward without the
    down projection: the SwiGLU backward of the given dy1 with no GEMM, B1 and B0) -> (x1, y1)."""
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps

    def fwd(x0, y0, wo, wn1, w_gate_up):
        return blocks.OprojSwigluFunction.apply(y0, x0, wo, wn1, w_gate_up, dm.d, dm.ffn, eps)
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up"), leaves=("x0", "y0", "wo", "wn1", "w_gate_up"))


def _cg_post_attn(case: Case) -> Runner:
    """post_attn.fwd: the PostAttention block -> (x2, h2 = x2 * wn2, r2). Eager's n2 is r2 * h2, which the
    next GEMM's epilogue applies in codagen; it is formed here only for the check (untimed)."""
    _, _, _, blocks = _cg_modules()
    dm, eps, dtype = case.dims, case.preset.model.eps, case.dtype

    def fwd(x0, y0, wo, wn1, w_gate_up, w2, wn2):
        return blocks.PostAttentionFunction.apply(y0, x0, wn2, wo, wn1, w_gate_up, w2, dm.d, dm.ffn, eps)

    def to_reference(named, state):
        return {"x2": named["x2"], "n2": (named["h2"].float() * named["r2"][:, None]).to(dtype)}
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=to_reference,
                          args=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2"), outputs=("x2", "h2", "r2"))


def _cg_down_qkv_rope(case: Case) -> Runner:
    """down_qkv_rope.fwd: K3 -> R2 -> K4, the kernels called directly -> (x2, q, k, v) as views of qkv."""
    _, finish, kernels, _ = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps

    def fwd(x1, y1, w2, wn2, w_qkv, positions, freqs):
        x2, h2, ss2 = kernels.out_proj_residual_norm.out_proj_residual_norm(y1, w2, x1, wn2)
        r2 = finish.rstd(ss2, dm.d, eps)
        qkv = kernels.qkv_norm_rope.qkv_norm_rope(h2, w_qkv, r2, positions, freqs)
        return (x2, *_cg_split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x1", "y1", "w2", "wn2", "w_qkv", "positions", "freqs"))


def _cg_block(case: Case) -> Runner:
    """block.fwd / .fwdbwd: PostAttention(y0, x0, wn2) -> (x2, h2, r2), then PreAttention(x2, h2, r2,
    positions, freqs) -> (x2, qkv), as codagen/models/llama.py chains them. wn2 is PreAttention's norm weight (its
    gradient comes from there; PostAttention only applies it in the forward)."""
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps

    def fwd(x0, y0, wo, wn1, w_gate_up, w2, wn2, w_qkv, positions, freqs):
        x2, h2, r2 = blocks.PostAttentionFunction.apply(y0, x0, wn2, wo, wn1, w_gate_up, w2, dm.d, dm.ffn, eps)
        x2, qkv = blocks.PreAttentionFunction.apply(x2, h2, r2, positions, freqs, wn2, w_qkv, dm.d, dm.qkv_width)
        return (x2, *_cg_split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv", "positions", "freqs"),
                          leaves=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv"))


def _cg_qwen3_block(case: Case) -> Runner:
    """Qwen3's block.fwd / .fwdbwd: Qwen3PostAttention(y0, x0, wn2) -> (x2, h2, r2), then Qwen3PreAttention(x2, h2,
    r2, positions, freqs, wn_qk, v_pass) -> (x2, qkv), as codagen/models/qwen3.py chains them. wn_qk is q_norm (wqn)
    over every q head and k_norm (wkn) over every k head, each in the heads' interleaved-pair order, and 0 over
    v: made in the timed function, as the model's Layer.wn_qk makes it, so that autograd sums its gradient over
    the heads into wqn and wkn in eager's order."""
    convert, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps
    to_interleaved = convert.heads_to_interleaved(torch.arange(dm.head_dim, device=case.device), dm.head_dim)
    prepare_weights = _cg_prepare(case)

    def prepare(inset: InputSet) -> InputSet:
        out = prepare_weights(inset)
        v_pass = torch.zeros(dm.qkv_width, dtype=case.dtype, device=case.device)
        v_pass[dm.q_width + dm.kv_width:] = 1
        out.t["v_pass"] = v_pass
        return out

    def fwd(x0, y0, wo, wn1, w_gate_up, w2, wn2, w_qkv, wqn, wkn, positions, freqs, v_pass):
        x2, h2, r2 = blocks.Qwen3PostAttentionFunction.apply(y0, x0, wn2, wo, wn1, w_gate_up, w2, dm.d, dm.q_width,
                                                             dm.ffn, eps)
        wn_qk = torch.cat([wqn[to_interleaved].repeat(dm.n_q), wkn[to_interleaved].repeat(dm.n_kv),
                           wqn.new_zeros(dm.kv_width)])
        x2, qkv = blocks.Qwen3PreAttentionFunction.apply(x2, h2, r2, positions, freqs, wn_qk, v_pass, wn2, w_qkv,
                                                         dm.d, dm.qkv_width, eps)
        return (x2, *_cg_split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=prepare, to_reference=_cg_to_reference(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv", "wqn", "wkn", "positions",
                                "freqs", "v_pass"),
                          leaves=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv", "wqn", "wkn"))


def _cg_gemma2_block(case: Case) -> Runner:
    """Gemma-2's block.fwd / .fwdbwd: Gemma2PostAttention(y0, x0, wn2) -> (x2, h2, r2), then Gemma2PreAttention(x2,
    h2, r2, positions, freqs) -> (x2, qkv), as codagen/models/gemma2.py chains them; wn2 is the pre-attention block's norm
    weight."""
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps

    def fwd(x0, y0, wo, wna, wn1, w_gate_up, w2, wnm, wn2, w_qkv, positions, freqs):
        x2, h2, r2 = blocks.Gemma2PostAttentionFunction.apply(y0, x0, wn2, wo, wna, wn1, w_gate_up, w2, wnm, dm.d,
                                                              dm.q_width, dm.ffn, eps)
        x2, qkv = blocks.Gemma2PreAttentionFunction.apply(x2, h2, r2, positions, freqs, wn2, w_qkv, dm.d, dm.qkv_width)
        return (x2, *_cg_split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x0", "y0", "wo", "wna", "wn1", "w_gate_up", "w2", "wnm", "wn2", "w_qkv", "positions",
                                "freqs"),
                          leaves=("x0", "y0", "wo", "wna", "wn1", "w_gate_up", "w2", "wnm", "wn2", "w_qkv"))


def _cg_gemma2_lm_ce(case: Case, grad_sum: str = "same") -> Runner:
    """Gemma-2's lm_ce.fwd / .fwdbwd: gemma2_lm_head_loss with the preset's final logit softcap, as _cg_lm_ce
    runs Llama's."""
    import inspect
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps
    head = blocks.gemma2_lm_head_loss
    chunk_rows = inspect.signature(blocks.Gemma2LmHeadLoss).parameters["chunk_rows"].default

    def fwd(xf, wnf, wv, target):
        return (head.gemma2_lm_head_loss(xf, target, wnf, wv, dm.d, dm.vocab, eps, dm.softcap, -100, "mean",
                                         chunk_rows, grad_sum=grad_sum),)
    return AutogradRunner(case.pattern, fwd)


def _cg_lm_ce(case: Case, grad_sum: str = "same", chunk_fraction: float = 1.0) -> Runner:
    """lm_ce.fwd / .fwdbwd: lm_head_loss(xf, target) with wnf as its norm weight and its default chunk_rows (times
    chunk_fraction). lm_head_loss runs the forward alone under no_grad, and otherwise makes the gradients in the
    forward (LmHeadLossFunction), the final norm's statistics a chunk of rows at a time, which autograd.grad then
    scales by the loss's gradient."""
    import inspect
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.model.eps
    chunk_rows = int(inspect.signature(blocks.LmHeadLoss).parameters["chunk_rows"].default * chunk_fraction)

    def fwd(xf, wnf, wv, target):
        return (blocks.lm_head_loss.lm_head_loss(xf, target, wnf, wv, dm.d, dm.vocab, eps, -100, "mean", chunk_rows,
                                                 grad_sum=grad_sum),)
    return AutogradRunner(case.pattern, fwd)
