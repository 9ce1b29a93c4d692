"""Gemma-2 from specs alone (specs/gemma2/): each generated block against the plain PyTorch computation of the
model's definition (Gemma's (1 + w) RMSNorms in fp32, post-norms, GeGLU with tanh GELU, softcapped logits),
forward and every gradient on ragged shapes; the example model trained 10 steps like its plain-PyTorch twin;
and the model against transformers' own Gemma2ForCausalLM. GPU cases (marker gpu) in bf16 and fp16."""
import pytest
import torch
import torch.nn.functional as F

from codagen import runtime  # noqa: F401  (switches Triton's interpreter on where there is no GPU)
from codagen.convert import interleave_rows
from codagen.models.gemma2 import CodagenGemma2, Gemma2Shape, PlainGemma2, from_hf, to_hf
from generated.blocks import Gemma2LmHeadLoss, Gemma2NormStats, Gemma2PostAttention, Gemma2PreAttention
from test_blocks import DEVICE, EPS, check_fp32, check_low, grads, leaf, rel, rope, targets
from test_llama import trains_like_plain

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gemma_rms(x, w, eps=EPS):
    """Gemma's RMSNorm in the inputs' precision: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def norm_weight(dim, dtype):
    return leaf(dim, dtype=dtype, scale=0.2)  # around Gemma's 0: scales around 1


# ---- gemma2_post_attention -------------------------------------------------------------------------------

POST_NAMES = ["x_out", "h_next", "rstd_next", "y", "x", "w_o", "wn_post_attn", "wn_pre_mlp", "w_gate", "w_up",
              "w_down", "wn_post_mlp"]


def run_post_attention(m, dim, attn_dim, ffn, dtype):
    y, x = leaf(m, attn_dim, dtype=dtype), leaf(m, dim, dtype=dtype)
    w_o = leaf(dim, attn_dim, dtype=dtype, scale=attn_dim**-0.5)
    w_gate, w_up = (leaf(ffn, dim, dtype=dtype, scale=dim**-0.5) for _ in range(2))
    w_down = leaf(dim, ffn, dtype=dtype, scale=ffn**-0.5)
    wn_pa, wn_pm, wn_pf, wn_next = (norm_weight(dim, dtype) for _ in range(4))
    upstream = torch.randn(m, dim, dtype=torch.float64, device=DEVICE)
    leaves = [y, x, w_o, wn_pa, wn_pm, w_gate, w_up, w_down, wn_pf]

    block = Gemma2PostAttention(dim, attn_dim, ffn, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for name, value in (("w_o", w_o), ("wn_post_attn", wn_pa), ("wn_pre_mlp", wn_pm), ("w_down", w_down),
                            ("wn_post_mlp", wn_pf)):
            getattr(block, name).copy_(value)
        block.w_gate_up.copy_(interleave_rows(w_gate, w_up))
    yb, xb = y.detach().requires_grad_(), x.detach().requires_grad_()
    x2, h2, r2 = block(yb, xb, wn_next.detach())
    g = torch.autograd.grad(x2, [yb, xb, block.w_o, block.wn_post_attn, block.wn_pre_mlp, block.w_gate_up,
                                 block.w_down, block.wn_post_mlp], upstream.to(dtype))
    fused = dict(zip(POST_NAMES, [x2, h2, r2, *g[:5], g[5][0::2], g[5][1::2], g[6], g[7]]))

    def plain(cast):
        yp, xp, wop, wpa, wpm, wgp, wup, wdp, wpf = args = [t.detach().to(cast).requires_grad_() for t in leaves]
        x1 = xp + gemma_rms(yp @ wop.T, wpa)
        n1 = gemma_rms(x1, wpm)
        x2p = x1 + gemma_rms((F.gelu(n1 @ wgp.T, approximate="tanh") * (n1 @ wup.T)) @ wdp.T, wpf)
        r2p = torch.rsqrt(x2p.pow(2).mean(-1) + EPS)
        return dict(zip(POST_NAMES, [x2p, x2p * (1 + wn_next.detach().to(cast)), r2p,
                                     *grads(x2p, upstream.to(cast), args)]))
    return fused, plain


# ---- gemma2_pre_attention --------------------------------------------------------------------------------

def run_pre_attention(m, dim, heads, dtype, hd=8):
    qkv_dim = heads * hd * 3
    x = leaf(m, dim, dtype=dtype)
    wn = norm_weight(dim, dtype)
    w_qkv = leaf(qkv_dim, dim, dtype=dtype, scale=dim**-0.5)
    positions = torch.randint(0, 50, (m,), device=DEVICE)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.cat([inv.repeat(2 * heads), torch.zeros(heads * hd // 2, dtype=torch.float64)]).float().to(DEVICE)
    up_x = torch.randn(m, dim, dtype=torch.float64, device=DEVICE)
    up_qkv = torch.randn(m, qkv_dim, dtype=torch.float64, device=DEVICE)

    block = Gemma2PreAttention(dim, qkv_dim, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_qkv.copy_(w_qkv)
    xb = x.detach().requires_grad_()
    h, rstd = Gemma2NormStats(dim, EPS)(xb.detach(), block.wn.detach())
    x_out, qkv = block(xb, h, rstd, positions, freqs)
    g = torch.autograd.grad((x_out, qkv), [xb, block.wn, block.w_qkv], (up_x.to(dtype), up_qkv.to(dtype)))
    fused = {"h": h, "rstd": rstd, "qkv": qkv, "x": g[0], "wn": g[1], "w_qkv": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_qkv))
        qkvp = rope(gemma_rms(xp, wnp) @ wp.T, positions, freqs.to(cast))
        gp = torch.autograd.grad((xp, qkvp), [xp, wnp, wp], (up_x.to(cast), up_qkv.to(cast)))
        return {"h": xp * (1 + wnp), "rstd": torch.rsqrt(xp.pow(2).mean(-1) + EPS), "qkv": qkvp, "x": gp[0],
                "wn": gp[1], "w_qkv": gp[2]}
    return fused, plain


# ---- gemma2_lm_head_loss ---------------------------------------------------------------------------------

def run_lm_head(m, dim, vocab, dtype, softcap=2.0, chunk_rows=16):
    x = leaf(m, dim, dtype=dtype)
    wn = norm_weight(dim, dtype)
    w_vocab = leaf(vocab, dim, dtype=dtype, scale=dim**-0.5 * 3)
    target = targets(m, vocab)
    block = Gemma2LmHeadLoss(dim, vocab, EPS, softcap, chunk_rows=chunk_rows, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_vocab.copy_(w_vocab)
    xb = x.detach().requires_grad_()
    loss = block(xb, target)
    g = torch.autograd.grad(loss, [xb, block.wn, block.w_vocab])
    fused = {"loss": loss, "x": g[0], "wn": g[1], "w_vocab": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_vocab))
        z = (gemma_rms(xp, wnp) @ wp.T).to(torch.float64 if cast == torch.float64 else torch.float32)
        lp = F.cross_entropy(softcap * torch.tanh(z / softcap), target, ignore_index=-100)
        return dict(zip(["loss", "x", "wn", "w_vocab"], [lp, *torch.autograd.grad(lp, [xp, wnp, wp])]))
    return fused, plain


# (runner, its sizes, dtype): ragged token counts; attn_dim differs from dim, as in Gemma-2's models
CASES = [
    (run_post_attention, (37, 48, 64, 40), torch.float32), (run_post_attention, (29, 64, 48, 72), torch.float16),
    (run_pre_attention, (37, 40, 2), torch.float32), (run_pre_attention, (45, 32, 2), torch.float16),
    (run_lm_head, (37, 32, 77), torch.float32), (run_lm_head, (29, 32, 90), torch.float16),
]


def check(run, sizes, dtype):
    fused, plain = run(*sizes, dtype)
    if dtype == torch.float32:
        check_fp32(fused, plain)
    else:
        check_low(fused, plain, dtype)


@pytest.mark.parametrize("run, sizes, dtype", CASES, ids=[f"{c[0].__name__[4:]}-{str(c[2])[6:]}" for c in CASES])
def test_gemma2_blocks(run, sizes, dtype):
    check(run, sizes, dtype)


# On the GPU, at sizes with several tiles in every direction, in both half types
GPU_CASES = [(run, sizes, dtype) for dtype in (torch.bfloat16, torch.float16)
             for run, sizes in ((run_post_attention, (1000, 512, 384, 1400)), (run_pre_attention, (1000, 512, 8)),
                                (run_lm_head, (1000, 512, 3001)))]


@pytest.mark.parametrize("run, sizes, dtype", [pytest.param(*c, marks=GPU) for c in GPU_CASES],
                         ids=[f"{c[0].__name__[4:]}-{str(c[2])[6:]}" for c in GPU_CASES])
def test_gemma2_blocks_on_the_gpu(run, sizes, dtype):
    check(run, sizes, dtype)


# ---- the model -------------------------------------------------------------------------------------------

# head_dim * heads (96) is not dim (64), as in Gemma-2's models; a sliding window shorter than the sequence
SHAPE = Gemma2Shape(dim=64, ffn_dim=80, n_heads=4, n_kv_heads=2, head_dim=24, n_layers=2, vocab=97,
                    query_pre_attn_scalar=24, sliding_window=7)


def random_plain(shape):
    model = PlainGemma2(shape).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


def batch(seq=19):
    tokens = torch.randint(0, SHAPE.vocab, (2, seq), device=DEVICE)
    tokens[0, 3] = SHAPE.pad_token_id  # the padding row gets no gradient from the lookup
    targets_ = torch.randint(0, SHAPE.vocab, (2, seq), device=DEVICE)
    targets_[:, -1] = -100
    return tokens, targets_


def test_gemma2_converters_round_trip_exactly():
    sd = random_plain(SHAPE).state_dict()
    back = to_hf(from_hf(sd, SHAPE), SHAPE)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_two_layer_gemma2_trains_like_plain_pytorch():
    torch.manual_seed(2)
    plain = random_plain(SHAPE)
    fused = CodagenGemma2(SHAPE, chunk_rows=24).to(DEVICE)
    fused.load_state_dict(from_hf(plain.state_dict(), SHAPE))
    trains_like_plain(plain, fused, (batch() for _ in range(5)), lambda sd: to_hf(sd, SHAPE))


def test_gemma2_matches_transformers():
    """Loss and every gradient of transformers' Gemma2ForCausalLM (eager attention, fp32), whose loss shifts
    the labels by one position."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.Gemma2Config(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.dim, intermediate_size=SHAPE.ffn_dim,
        num_hidden_layers=SHAPE.n_layers, num_attention_heads=SHAPE.n_heads, num_key_value_heads=SHAPE.n_kv_heads,
        head_dim=SHAPE.head_dim, query_pre_attn_scalar=SHAPE.query_pre_attn_scalar,
        sliding_window=SHAPE.sliding_window, rms_norm_eps=SHAPE.eps, pad_token_id=SHAPE.pad_token_id,
        attn_implementation="eager")
    hf = transformers.Gemma2ForCausalLM(config).to(DEVICE).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
    fused = CodagenGemma2(SHAPE).to(DEVICE)
    fused.load_state_dict(from_hf(hf.state_dict(), SHAPE))
    tokens, labels = batch()
    labels[1, 5] = -100
    hf_loss = hf(input_ids=tokens, labels=labels).loss
    hf_loss.backward()
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    loss = fused(tokens, shifted)
    loss.backward()
    assert rel(loss, hf_loss) < 1e-4
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    grads_ = to_hf({name: p.grad for name, p in fused.named_parameters()}, SHAPE)
    for name, g in grads_.items():
        assert rel(g, hf_grads[name]) < 1e-4, name
