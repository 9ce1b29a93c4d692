"""Qwen3 from specs (specs/qwen3/): the QK-norm block against plain PyTorch written from the model's definition,
forward and every gradient, on ragged token counts; the small Qwen3 of codagen/models/qwen3.py trained next to its
plain-PyTorch twin; and the same model against transformers' own Qwen3ForCausalLM when transformers is installed.
Heads are 128 wide (every Qwen3's head_dim, the specs' column_group); widths and token counts stay tiny."""
import pytest
import torch

from codagen import runtime  # noqa: F401  (switches Triton's interpreter on where there is no GPU)
from codagen.convert import LlamaShape
from codagen.models.qwen3 import CodagenQwen3, PlainQwen3, qwen3_from_hf, qwen3_to_hf
from generated.blocks import NormStats, Qwen3PreAttention
from test_blocks import DEVICE, EPS, leaf, rel, rms, rope
from test_llama import random_batches, random_plain, trains_like_plain

HD = 128
SHAPE = LlamaShape(dim=64, ffn_dim=80, n_heads=2, n_kv_heads=1, head_dim=HD, n_layers=2, vocab=97,
                   rope_theta=1000000.0)


def qwen3_pre_attention_plain(x, wn, w_qkv, q_norm, k_norm, positions, freqs, heads, kv_heads):
    """Qwen3's attention input from its definition: RMSNorm, the projection, an RMSNorm of each q and k head with
    q_norm / k_norm (shared by the heads), RoPE on q and k; v as projected."""
    m = x.shape[0]
    q, k, v = (rms(x, wn) @ w_qkv.T).split([heads * HD, kv_heads * HD, kv_heads * HD], dim=1)
    q = rms(q.reshape(m, heads, HD), q_norm).reshape(m, -1)
    k = rms(k.reshape(m, kv_heads, HD), k_norm).reshape(m, -1)
    return rope(torch.cat([q, k, v], dim=1), positions, freqs)


def run_qwen3_pre_attention(m, dim, heads, kv_heads, dtype):
    qkv_dim = (heads + 2 * kv_heads) * HD
    x = leaf(m, dim, dtype=dtype)
    wn, q_norm, k_norm = (leaf(n, dtype=dtype, scale=0.2, offset=1.0) for n in (dim, HD, HD))
    w_qkv = leaf(qkv_dim, dim, dtype=dtype, scale=dim**-0.5)
    positions = torch.randint(0, 50, (m,), device=DEVICE)
    inv = 1.0 / 1e6 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    freqs = torch.cat([inv.repeat(heads + kv_heads), torch.zeros(kv_heads * HD // 2, dtype=torch.float64)])
    freqs = freqs.float().to(DEVICE)
    up_x = torch.randn(m, dim, dtype=torch.float64, device=DEVICE)
    up_qkv = torch.randn(m, qkv_dim, dtype=torch.float64, device=DEVICE)
    names = ["qkv", "x", "wn", "w_qkv", "q_norm", "k_norm"]

    block = Qwen3PreAttention(dim, qkv_dim, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_qkv.copy_(w_qkv)
    xb, qn, kn = (t.detach().requires_grad_() for t in (x, q_norm, k_norm))
    wn_qk = torch.cat([qn.repeat(heads), kn.repeat(kv_heads), qn.new_zeros(kv_heads * HD)])
    v_pass = torch.cat([torch.zeros((heads + kv_heads) * HD), torch.ones(kv_heads * HD)]).to(DEVICE, dtype)
    h, rstd = NormStats(dim, EPS)(xb.detach(), block.wn.detach())
    x_out, qkv = block(xb, h, rstd, positions, freqs, wn_qk, v_pass)
    g = torch.autograd.grad((x_out, qkv), [xb, block.wn, block.w_qkv, qn, kn], (up_x.to(dtype), up_qkv.to(dtype)))
    fused = dict(zip(names, [qkv, *g]))

    def plain(cast):
        args = [t.detach().to(cast).requires_grad_() for t in (x, wn, w_qkv, q_norm, k_norm)]
        qkvp = qwen3_pre_attention_plain(*args, positions, freqs.to(cast), heads, kv_heads)
        gp = torch.autograd.grad((args[0], qkvp), args, (up_x.to(cast), up_qkv.to(cast)))
        return dict(zip(names, [qkvp, *gp]))
    return fused, plain


@pytest.mark.parametrize("m, dim, heads, kv_heads", [(37, 40, 2, 1), (70, 64, 4, 2)], ids=["37-gqa2", "70-gqa2"])
def test_qwen3_pre_attention_matches_its_definition(m, dim, heads, kv_heads):
    fused, plain = run_qwen3_pre_attention(m, dim, heads, kv_heads, torch.float32)
    truth = plain(torch.float64)
    for name, value in fused.items():
        assert rel(value, truth[name]) < 1e-4, name


def test_qwen3_pre_attention_fp16_within_twice_plain():
    fused, plain = run_qwen3_pre_attention(29, 32, 2, 1, torch.float16)
    truth, unfused = plain(torch.float64), plain(torch.float16)
    for name, value in fused.items():
        assert not value.isnan().any(), name
        assert rel(value, truth[name]) <= 2 * rel(unfused[name], truth[name]) + 1e-4, name


def test_converters_round_trip_exactly():
    sd = random_plain(SHAPE, PlainQwen3).state_dict()
    back = qwen3_to_hf(qwen3_from_hf(sd, SHAPE), SHAPE)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    assert torch.equal(back["lm_head.weight"], sd["model.embed_tokens.weight"])  # tied


def test_two_layer_qwen3_trains_like_plain_pytorch():
    torch.manual_seed(2)
    plain = random_plain(SHAPE, PlainQwen3)
    fused = CodagenQwen3(SHAPE, chunk_rows=24).to(DEVICE)
    fused.load_state_dict(qwen3_from_hf(plain.state_dict(), SHAPE))
    assert fused.head.w_vocab is fused.embed.weight
    trains_like_plain(plain, fused, random_batches(SHAPE.vocab), lambda sd: qwen3_to_hf(sd, SHAPE))


def test_qwen3_matches_transformers():
    """The loss and every gradient against transformers' Qwen3ForCausalLM with tied embeddings, in fp32."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.dim, intermediate_size=SHAPE.ffn_dim,
        num_hidden_layers=SHAPE.n_layers, num_attention_heads=SHAPE.n_heads, num_key_value_heads=SHAPE.n_kv_heads,
        head_dim=HD, rms_norm_eps=SHAPE.eps, rope_theta=SHAPE.rope_theta,
        tie_word_embeddings=True)
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(config).to(DEVICE).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # not all ones, so that QK-norm's weights matter
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    fused = CodagenQwen3(SHAPE, chunk_rows=24).to(DEVICE)
    fused.load_state_dict(qwen3_from_hf(hf.state_dict(), SHAPE))
    tokens = torch.randint(0, SHAPE.vocab, (2, 19), device=DEVICE)
    targets = torch.randint(0, SHAPE.vocab, (2, 19), device=DEVICE)
    targets[:, -1] = -100
    targets[1, 3] = -100
    # transformers predicts labels[t + 1] from token t: its labels are the targets one step later
    labels = torch.cat([torch.full((2, 1), -100, device=DEVICE), targets[:, :-1]], dim=1)
    expected = hf(input_ids=tokens, labels=labels).loss
    loss = fused(tokens, targets)
    assert abs(loss.item() - expected.item()) <= 1e-4 * abs(expected.item()), (loss.item(), expected.item())
    expected.backward()
    loss.backward()
    grads = qwen3_to_hf({n: p.grad for n, p in fused.named_parameters(remove_duplicate=False)}, SHAPE)
    for name, p in hf.named_parameters():
        assert rel(grads[name], p.grad) < 1e-4, name
