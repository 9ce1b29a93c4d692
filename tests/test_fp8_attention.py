"""FP8 attention projection inputs (docs/fp8.md, "FP8 attention projection inputs"; specs/fp8/): norm_stats_fp8
writes the first layer's normalized input in float8_e4m3fn with 1 x 128 scales, and pre_attention_fp8 projects it
by the block-quantized w_qkv; on random data with ragged token counts, the forward against the float64 computation
without quantization within the bound docs/fp8.md derives, and the backward (bfloat16, from the master weights)
against float64 autograd within BACKWARD_FACTOR times plain bfloat16 PyTorch's error."""
from __future__ import annotations

import pytest
import torch

from codagen.runtime.fp8 import BlockQuantized
from generated.blocks import NormStatsFp8, PostAttentionFp8, PreAttentionFp8
from test_blocks import DEVICE, EPS, leaf, rel, rms, rope
from test_fp8_mlp import BACKWARD_FACTOR, BF16, E4M3, G, SUBNORMAL, U

HEAD_DIM = 16


def _freqs(heads: int) -> torch.Tensor:
    """RoPE's frequencies for q and k heads (HEAD_DIM wide), none for v: [qkv_dim / 2] float32."""
    inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    return torch.cat([inv.repeat(2 * heads), torch.zeros(heads * HEAD_DIM // 2, dtype=torch.float64)]).float()


def _forward_bound(x, wn, w_qkv, w_scale, positions, freqs, x_rel=0.0):
    """qkv of the float64 computation without quantization, and the bound of docs/fp8.md on the block's qkv
    against it (with the bfloat16 store's part of it), and r sqrt(sum_k h_ik^2 (w_2j,k^2 + w_2j+1,k^2)) per pair,
    the scale of the typical error (docs/fp8.md). x_rel: how far (relative) the x the norm producer read may be
    from x (0 for norm_stats_fp8, which reads x; post_attention_fp8 quantizes its fp32 x_out, not the bfloat16)."""
    x, wn, w, f = x.double(), wn.double(), w_qkv.double(), freqs.double()
    k = x.shape[1]
    h = x * wn  # exact in fp32: a product of two bfloat16 values
    r = torch.rsqrt(x.pow(2).mean(-1) + EPS)[:, None]
    h_amax = h.abs().reshape(h.shape[0], -1, G).amax(-1) * (1 + 2.0**-22) * (1 + x_rel)
    err_h = (E4M3 * (1 + x_rel) + x_rel) * h.abs() + SUBNORMAL * (h_amax / 448).repeat_interleave(G, 1)
    full_scale = w_scale.double().repeat_interleave(G, 0).repeat_interleave(G, 1)[:w.shape[0], :w.shape[1]]
    err_w = E4M3 * w.abs() + SUBNORMAL * full_scale
    ha, wa = h.abs(), w.abs()
    product = err_h @ wa.T + ha @ err_w.T + err_h @ err_w.T + 2 * (k + 3) * U * (ha + err_h) @ (wa + err_w).T
    # rstd from fp32 sums of squares (exact squares of bfloat16 values, K additions) and its rsqrt, then z = r acc
    rstd_error = k * U + 2.0**-21 + 1.01 * x_rel  # an x within x_rel moves rsqrt(mean(x^2)) by x_rel / (1 - x_rel)
    z = r * (h @ w.T)
    err_z = r * product * (1 + rstd_error) + rstd_error * z.abs()
    # RoPE mixes each pair: each output within both inputs' errors; the angle's fp32 product and sin / cos
    angle = positions.double()[:, None] * f[None, :]
    turn = angle.abs() * 2.0**-23 + 2.0**-22
    e, o, de, do = z[:, 0::2], z[:, 1::2], err_z[:, 0::2], err_z[:, 1::2]
    pair = de + do + (e.abs() + o.abs()) * turn
    rotated = torch.stack([e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()], 2).reshape(z.shape)
    bound = pair.repeat_interleave(2, 1)
    store = (2.0**-7 + 2 * U) * (rotated.abs() + bound)
    norms = r * (h.pow(2) @ (w[0::2].pow(2) + w[1::2].pow(2)).T).sqrt().repeat_interleave(2, 1)
    return rotated, bound + store, store, norms


@pytest.mark.parametrize("m, dim, heads", [(37, 128, 2), (29, 256, 3)])
def test_pre_attention_fp8(m, dim, heads):
    """Forward: qkv within the bound docs/fp8.md derives against the float64 computation without quantization
    (qkv_dim 96 and 144: a partial last block of w_qkv; one and two groups of K); and within its typical error.
    Backward: x, wn and w_qkv's gradients within BACKWARD_FACTOR times plain bfloat16 PyTorch's error against
    float64 autograd, + 1e-4: pre_attention's backward, quantization passed as the identity."""
    qkv_dim = 3 * heads * HEAD_DIM
    x = leaf(m, dim, dtype=BF16)
    wn = leaf(dim, dtype=BF16, scale=0.1, offset=1.0)
    w_qkv = leaf(qkv_dim, dim, dtype=BF16, scale=dim**-0.5)
    positions = torch.randint(0, 50, (m,), device=DEVICE)
    freqs = _freqs(heads).to(DEVICE)
    up_x, up_qkv = (torch.randn(m, n, dtype=torch.float64, device=DEVICE) for n in (dim, qkv_dim))

    block = PreAttentionFp8(dim, qkv_dim, device=DEVICE)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_qkv.copy_(w_qkv)
    w_fp8, w_scale = BlockQuantized(block.w_qkv).get()
    xb = x.detach().requires_grad_()
    h, h_scale, rstd = NormStatsFp8(dim, EPS)(x.detach(), wn.detach())
    x_out, qkv = block(xb, h, h_scale, rstd, positions, freqs, w_fp8, w_scale)

    want, bound, store, norms = _forward_bound(x.detach(), wn.detach(), w_qkv.detach(), w_scale, positions, freqs)
    err = (qkv.detach().double() - want).abs()
    assert (err <= bound).all()
    assert ((err - store).clamp(min=0) / norms).pow(2).mean().sqrt() <= 0.05

    g = torch.autograd.grad((x_out, qkv), [xb, block.wn, block.w_qkv], (up_x.to(BF16), up_qkv.to(BF16)))
    fused = {"x": g[0], "wn": g[1], "w_qkv": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_qkv))
        qkvp = rope(rms(xp, wnp) @ wp.T, positions, freqs.to(cast))
        return dict(zip(["x", "wn", "w_qkv"], torch.autograd.grad((xp, qkvp), [xp, wnp, wp],
                                                                  (up_x.to(cast), up_qkv.to(cast)))))
    truth, unfused = plain(torch.float64), plain(BF16)
    for name, value in fused.items():
        assert rel(value, truth[name]) <= BACKWARD_FACTOR * rel(unfused[name], truth[name]) + 1e-4, name


def test_post_attention_fp8_feeds_pre_attention_fp8():
    """A later layer: post_attention_fp8's h_next, h_next_scale and rstd_next (quantized from its fp32 x_out) are
    pre_attention_fp8's input, its qkv within the bound above for the bfloat16 x_out, widened by x_out's bfloat16
    step (2^-7, relative), and within the typical error."""
    m, dim, ffn, heads = 21, 128, 128, 2
    qkv_dim = 3 * heads * HEAD_DIM
    post = PostAttentionFp8(dim, ffn, EPS, device=DEVICE)
    pre = PreAttentionFp8(dim, qkv_dim, device=DEVICE)
    with torch.no_grad():
        for p, scale in ((post.w_o, dim), (post.w_gate_up, dim), (post.w_down, ffn), (pre.w_qkv, dim)):
            p.normal_(0, scale**-0.5)
        for p in (post.wn_mlp, pre.wn):
            p.copy_(1 + 0.1 * torch.randn(dim))
        y, x = torch.randn(m, dim, device=DEVICE).to(BF16), torch.randn(m, dim, device=DEVICE).to(BF16)
        x_out, h, h_scale, rstd = post(y, x, pre.wn.detach(), *BlockQuantized(post.w_gate_up).get(),
                                       *BlockQuantized(post.w_down).get())
        positions, freqs = torch.randint(0, 50, (m,), device=DEVICE), _freqs(heads).to(DEVICE)
        w_fp8, w_scale = BlockQuantized(pre.w_qkv).get()
        _, qkv = pre(x_out, h, h_scale, rstd, positions, freqs, w_fp8, w_scale)
    want, bound, store, norms = _forward_bound(x_out, pre.wn.detach(), pre.w_qkv.detach(), w_scale, positions, freqs,
                                               x_rel=2.0**-7 * 1.01)
    err = (qkv.double() - want).abs()
    assert (err <= bound).all()
    assert ((err - store).clamp(min=0) / norms).pow(2).mean().sqrt() <= 0.05
