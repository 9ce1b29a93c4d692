"""Each generated block module against the plain PyTorch computation it replaces, forward and every gradient,
on fresh random data with ragged token counts: fp32 within 1e-4, fp16 within 2x the error of plain fp16
PyTorch (both measured against float64)."""
import pytest
import torch
import torch.nn.functional as F

from codagen import runtime  # noqa: F401  (switches Triton's interpreter on where there is no GPU)
from codagen.convert import interleave_rows
from generated import kernels
from generated.blocks import LmHeadLoss, NormStats, OprojSwiglu, PostAttention, PreAttention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_fp32(fused: dict, plain) -> None:
    """Each fused fp32 output and gradient within 1e-4 of plain(float64)."""
    truth = plain(torch.float64)
    for name, value in fused.items():
        assert rel(value, truth[name]) < 1e-4, name


def check_low(fused: dict, plain, dtype: torch.dtype) -> None:
    """Each fused output and gradient at most 2x the error of plain(dtype) against float64 (docs/design.md)."""
    truth, unfused = plain(torch.float64), plain(dtype)
    for name, value in fused.items():
        assert not value.isnan().any(), name
        assert rel(value, truth[name]) <= 2 * rel(unfused[name], truth[name]) + 1e-4, name


def rms(x, w, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(z, positions, freqs):
    angle = positions[:, None].to(freqs.dtype) * freqs[None, :]
    cos, sin = angle.cos(), angle.sin()
    e, o = z[:, 0::2], z[:, 1::2]
    return torch.stack([e * cos - o * sin, e * sin + o * cos], dim=2).reshape(z.shape)


def leaf(*shape, dtype, scale=1.0, offset=0.0):
    return (offset + scale * torch.randn(*shape, dtype=torch.float64, device=DEVICE)).to(dtype).requires_grad_()


def grads(out, upstream, leaves):
    return torch.autograd.grad(out, leaves, upstream, allow_unused=False)


# ---- post_attention --------------------------------------------------------------------------------------

def post_attention_plain(y, x, wn_next, w_o, wn_mlp, w_gate, w_up, w_down):
    x1 = x + y @ w_o.T
    n1 = rms(x1, wn_mlp)
    x2 = x1 + (F.silu(n1 @ w_gate.T) * (n1 @ w_up.T)) @ w_down.T
    r2 = torch.rsqrt(x2.pow(2).mean(-1) + EPS)
    return x2, x2 * wn_next, r2


def run_post_attention(m, dim, ffn, dtype):
    y, x = leaf(m, dim, dtype=dtype), leaf(m, dim, dtype=dtype)
    wn_next = leaf(dim, dtype=dtype, scale=0.1, offset=1.0)
    w_o, w_gate, w_up = leaf(dim, dim, dtype=dtype, scale=dim**-0.5), leaf(ffn, dim, dtype=dtype, scale=dim**-0.5), \
        leaf(ffn, dim, dtype=dtype, scale=dim**-0.5)
    w_down, wn_mlp = leaf(dim, ffn, dtype=dtype, scale=ffn**-0.5), leaf(dim, dtype=dtype, scale=0.1, offset=1.0)
    upstream = torch.randn(m, dim, dtype=torch.float64, device=DEVICE)
    leaves = [y, x, w_o, wn_mlp, w_gate, w_up, w_down]

    block = PostAttention(dim, ffn, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.w_o.copy_(w_o), block.wn_mlp.copy_(wn_mlp), block.w_down.copy_(w_down)
        block.w_gate_up.copy_(interleave_rows(w_gate, w_up))
    yb, xb = y.detach().requires_grad_(), x.detach().requires_grad_()
    x2, h2, r2 = block(yb, xb, wn_next.detach())
    g = torch.autograd.grad(x2, [yb, xb, block.w_o, block.wn_mlp, block.w_gate_up, block.w_down], upstream.to(dtype))
    fused = {"x_out": x2, "h_next": h2, "rstd_next": r2, "y": g[0], "x": g[1], "w_o": g[2], "wn_mlp": g[3],
             "w_gate": g[4][0::2], "w_up": g[4][1::2], "w_down": g[5]}

    def plain(cast):
        args = [t.detach().to(cast).requires_grad_() for t in leaves]
        x2p, h2p, r2p = post_attention_plain(args[0], args[1], wn_next.detach().to(cast), *args[2:])
        gp = grads(x2p, upstream.to(cast), args)
        return dict(zip(["x_out", "h_next", "rstd_next", "y", "x", "w_o", "wn_mlp", "w_gate", "w_up", "w_down"],
                        [x2p, h2p, r2p, *gp]))
    return fused, plain


# ---- oproj_swiglu ----------------------------------------------------------------------------------------

def run_oproj_swiglu(m, dim, ffn, dtype):
    y, x = leaf(m, dim, dtype=dtype), leaf(m, dim, dtype=dtype)
    w_o, w_gate, w_up = (leaf(n, dim, dtype=dtype, scale=dim**-0.5) for n in (dim, ffn, ffn))
    wn_mlp = leaf(dim, dtype=dtype, scale=0.1, offset=1.0)
    up_x, up_y = torch.randn(m, dim, dtype=torch.float64, device=DEVICE), torch.randn(m, ffn, dtype=torch.float64,
                                                                                      device=DEVICE)
    leaves = [y, x, w_o, wn_mlp, w_gate, w_up]

    block = OprojSwiglu(dim, ffn, EPS, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.w_o.copy_(w_o), block.wn_mlp.copy_(wn_mlp), block.w_gate_up.copy_(interleave_rows(w_gate, w_up))
    yb, xb = y.detach().requires_grad_(), x.detach().requires_grad_()
    x1, y1 = block(yb, xb)
    g = torch.autograd.grad((x1, y1), [yb, xb, block.w_o, block.wn_mlp, block.w_gate_up],
                            (up_x.to(dtype), up_y.to(dtype)))
    names = ["x_out", "y_mlp", "y", "x", "w_o", "wn_mlp", "w_gate", "w_up"]
    fused = dict(zip(names, [x1, y1, *g[:4], g[4][0::2], g[4][1::2]]))

    def plain(cast):
        yp, xp, wop, wnp, wgp, wup = args = [t.detach().to(cast).requires_grad_() for t in leaves]
        x1p = xp + yp @ wop.T
        n1 = rms(x1p, wnp)
        y1p = F.silu(n1 @ wgp.T) * (n1 @ wup.T)
        return dict(zip(names, [x1p, y1p, *grads((x1p, y1p), (up_x.to(cast), up_y.to(cast)), args)]))
    return fused, plain


# ---- pre_attention ---------------------------------------------------------------------------------------

def run_pre_attention(m, dim, heads, dtype):
    hd = 8
    qkv_dim = heads * hd * 3
    x = leaf(m, dim, dtype=dtype)
    wn = leaf(dim, dtype=dtype, scale=0.1, offset=1.0)
    w_qkv = leaf(qkv_dim, dim, dtype=dtype, scale=dim**-0.5)
    positions = torch.randint(0, 50, (m,), device=DEVICE)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.cat([inv.repeat(2 * heads), torch.zeros(heads * hd // 2, dtype=torch.float64)]).float().to(DEVICE)
    up_x = torch.randn(m, dim, dtype=torch.float64, device=DEVICE)
    up_qkv = torch.randn(m, qkv_dim, dtype=torch.float64, device=DEVICE)

    block = PreAttention(dim, qkv_dim, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_qkv.copy_(w_qkv)
    xb = x.detach().requires_grad_()
    h, rstd = NormStats(dim, EPS)(xb.detach(), block.wn.detach())
    x_out, qkv = block(xb, h, rstd, positions, freqs)
    g = torch.autograd.grad((x_out, qkv), [xb, block.wn, block.w_qkv], (up_x.to(dtype), up_qkv.to(dtype)))
    fused = {"qkv": qkv, "x": g[0], "wn": g[1], "w_qkv": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_qkv))
        qkvp = rope(rms(xp, wnp) @ wp.T, positions, freqs.to(cast))
        gp = torch.autograd.grad((xp, qkvp), [xp, wnp, wp], (up_x.to(cast), up_qkv.to(cast)))
        return {"qkv": qkvp, "x": gp[0], "wn": gp[1], "w_qkv": gp[2]}
    return fused, plain


# (runner, tokens, width, FFN width or number of heads, dtype): ragged token counts
LAYER_CASES = [
    (run_post_attention, 37, 48, 40, torch.float32), (run_post_attention, 64, 48, 40, torch.float32),
    (run_post_attention, 29, 64, 48, torch.float16),
    (run_oproj_swiglu, 37, 48, 40, torch.float32), (run_oproj_swiglu, 29, 64, 48, torch.float16),
    (run_pre_attention, 37, 40, 2, torch.float32), (run_pre_attention, 70, 40, 2, torch.float32),
    (run_pre_attention, 45, 32, 2, torch.float16),
]


@pytest.mark.parametrize("run, m, dim, width, dtype", LAYER_CASES,
                         ids=[f"{c[0].__name__[4:]}-{c[1]}-{str(c[4])[6:]}" for c in LAYER_CASES])
def test_layer_blocks(run, m, dim, width, dtype):
    fused, plain = run(m, dim, width, dtype)
    if dtype == torch.float32:
        check_fp32(fused, plain)
    else:
        check_low(fused, plain, dtype)


def test_norm_stats_matches_rmsnorm():
    m, dim = 37, 48
    x = torch.randn(m, dim, device=DEVICE)
    wn = torch.rand(dim, device=DEVICE) + 0.5
    h, rstd = NormStats(dim, EPS)(x, wn)
    truth = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
    assert rel(rstd, truth) < 1e-6
    assert rel(h, x.double() * wn.double()) < 1e-6


# ---- lm_head_loss ----------------------------------------------------------------------------------------

def run_lm_head(m, dim, vocab, target, reduction, dtype, chunk_rows=8192, empty_mean="nan", grad_sum="float32"):
    x = leaf(m, dim, dtype=dtype)
    wn = leaf(dim, dtype=dtype, scale=0.1, offset=1.0)
    w_vocab = leaf(vocab, dim, dtype=dtype, scale=dim**-0.5 * 3)
    block = LmHeadLoss(dim, vocab, EPS, -100, reduction, chunk_rows, empty_mean, grad_sum, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        block.wn.copy_(wn), block.w_vocab.copy_(w_vocab)
    xb = x.detach().requires_grad_()
    loss = block(xb, target)
    upstream = torch.tensor(1.7, device=DEVICE)  # the loss's gradient need not be 1
    g = torch.autograd.grad(loss, [xb, block.wn, block.w_vocab], upstream)
    fused = {"loss": loss, "x": g[0], "wn": g[1], "w_vocab": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_vocab))
        lp = F.cross_entropy((rms(xp, wnp) @ wp.T).to(torch.float64 if cast == torch.float64 else torch.float32),
                             target, ignore_index=-100, reduction=reduction)
        gp = torch.autograd.grad(lp, [xp, wnp, wp], upstream.to(lp.dtype))
        return {"loss": lp, "x": gp[0], "wn": gp[1], "w_vocab": gp[2]}
    return fused, plain


def targets(m, vocab):
    t = torch.randint(0, vocab, (m,), device=DEVICE)
    t[0], t[1], t[5], t[-1] = 0, vocab - 1, -100, -100  # both edge columns and ignored rows
    return t


# (reduction, vocab, rows per chunk) over 37 rows: vocabularies not multiples of the tile width; chunks that
# do not divide the rows, one chunk of exactly all rows, one larger than all rows
LM_CASES = [("mean", 77, 16), ("sum", 130, 16), ("mean", 130, 5), ("sum", 77, 37), ("mean", 77, 64)]


@pytest.mark.parametrize("reduction, vocab, chunk_rows", LM_CASES)
def test_lm_head_loss_fp32(reduction, vocab, chunk_rows):
    m = 37
    fused, plain = run_lm_head(m, 32, vocab, targets(m, vocab), reduction, torch.float32, chunk_rows)
    check_fp32(fused, plain)


@pytest.mark.parametrize("grad_sum", ["float32", "same"])
def test_lm_head_loss_matches_cross_entropy_fp16(grad_sum):
    m, vocab = 41, 90
    fused, plain = run_lm_head(m, 32, vocab, targets(m, vocab), "mean", torch.float16, 16, grad_sum=grad_sum)
    check_low(fused, plain, torch.float16)


@pytest.mark.parametrize("grad_sum, calls", [("same", 7), ("float32", 0)])
def test_lm_head_weight_gradient_accumulates_through_its_kernel(monkeypatch, grad_sum, calls):
    """matmul.accumulate: with the sum in the operands' dtype, every chunk after the first adds its weight
    gradient through matmul_accumulate (an M-contiguous a: dz^T); with an fp32 sum, cuBLAS adds into it."""
    seen = []
    kernel = kernels.matmul_accumulate.matmul_accumulate

    def counted(a, b, total, **outs):
        seen.append((a.stride(), outs["new_total"] is total))
        return kernel(a, b, total, **outs)
    monkeypatch.setattr(kernels.matmul_accumulate, "matmul_accumulate", counted)
    m, vocab = 37, 130
    fused, plain = run_lm_head(m, 32, vocab, targets(m, vocab), "mean", torch.float32, 5, grad_sum=grad_sum)
    check_fp32(fused, plain)
    assert seen == [((1, vocab), True)] * calls


def test_lm_head_loss_without_gradients_makes_none(monkeypatch):
    """Under no_grad, or with no input that wants a gradient, the forward keeps no logits and makes no
    gradient: the kernels of the forward with gradients never run, and the loss is the same."""
    m, dim, vocab = 37, 32, 77
    block = LmHeadLoss(dim, vocab, EPS, chunk_rows=16, device=DEVICE)
    x, target = torch.randn(m, dim, device=DEVICE), targets(m, vocab)
    with_grads = block(x.requires_grad_(), target).detach()
    x.requires_grad_(False)

    def refuse(**_):
        raise AssertionError("the forward with gradients ran")
    for kernel in (kernels.lm_head_logits, kernels.lm_head_ce_dz):
        monkeypatch.setattr(kernel, kernel.__name__.rsplit(".", 1)[1], refuse)
    with torch.no_grad():
        loss = block(x, target)
    block.requires_grad_(False)
    frozen = block(x, target)
    assert loss.grad_fn is None and frozen.grad_fn is None
    assert rel(loss, with_grads) < 1e-5 and rel(frozen, with_grads) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("m", [12, 0])
def test_lm_head_loss_of_no_rows_follows_cross_entropy(reduction, m):
    """Every target ignored, or no rows at all: F.cross_entropy's loss (NaN for a mean, 0 for a sum) and
    gradients (0)."""
    fused, plain = run_lm_head(m, 16, 40, torch.full((m,), -100, device=DEVICE), reduction, torch.float32)
    truth = plain(torch.float32)
    assert truth["loss"].isnan().item() is (reduction == "mean")
    for name, value in fused.items():
        torch.testing.assert_close(value, truth[name].to(value.dtype), equal_nan=True, msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("m", [12, 0])
def test_lm_head_loss_of_no_rows_is_zero_with_empty_mean_zero(reduction, m):
    fused, _ = run_lm_head(m, 16, 40, torch.full((m,), -100, device=DEVICE), reduction, torch.float32,
                           empty_mean="zero")
    for name, value in fused.items():
        assert torch.count_nonzero(value) == 0 and not value.isnan().any(), name


@pytest.mark.parametrize("bad", [40, 45, -5, -101])
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the check is a device-side assert: the next test")
def test_lm_head_loss_refuses_a_target_out_of_bounds_as_cross_entropy_does(bad):
    m, dim, vocab = 9, 16, 40
    target = targets(m, vocab)
    target[6] = bad
    with pytest.raises(IndexError) as plain:
        F.cross_entropy(torch.randn(m, vocab, device=DEVICE), target, ignore_index=-100)
    with pytest.raises(IndexError) as fused:
        run_lm_head(m, dim, vocab, target, "mean", torch.float32)
    assert str(fused.value) == str(plain.value) == f"Target {bad} is out of bounds."


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU; run on the device machine")
def test_lm_head_loss_asserts_on_the_gpu_for_a_target_out_of_bounds():
    """As PyTorch's CUDA cross-entropy: a device-side assert, with no host sync (in a process of its own,
    since it leaves the CUDA context unusable)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nfrom test_blocks import targets, run_lm_head\n"
            "target = targets(9, 40)\ntarget[6] = 45\n"
            "run_lm_head(9, 16, 40, target, 'mean', torch.float32)\ntorch.cuda.synchronize()\n")
    tests = Path(__file__).resolve().parent
    result = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tests.parent)})
    assert result.returncode != 0
    assert "cross_entropy: a target is outside [0, classes) and is not ignore_index" in result.stderr
    assert "device-side assert triggered" in result.stderr


def test_lm_head_logits_exist_one_chunk_at_a_time(monkeypatch):
    """The forward with gradients stores the normed rows, logits and dz for at most chunk_rows rows at a time,
    never M x V, nor a normed copy of all M rows."""
    m, dim, vocab, chunk_rows = 37, 16, 300, 16
    block = LmHeadLoss(dim, vocab, EPS, chunk_rows=chunk_rows, device=DEVICE)
    x = torch.randn(m, dim, device=DEVICE, requires_grad=True)
    rows = []
    for kernel in (kernels.rmsnorm_stats, kernels.lm_head_logits, kernels.lm_head_ce_dz):
        name = kernel.__name__.rsplit(".", 1)[1]

        def recorded(real=getattr(kernel, name), **args):
            out = real(**args)
            rows.append(out[0].shape[0])
            return out
        monkeypatch.setattr(kernel, name, recorded)
    block(x, torch.randint(0, vocab, (m,), device=DEVICE))
    assert rows == [16] * 6 + [5] * 3  # h, logits and dz of each chunk in turn


def test_lm_head_keeps_only_the_gradients_and_scales_them_once():
    """Between forward and backward the block holds the gradients (and the scalar loss gradient they were made
    for), no logits; the backward scales them in place, so that a second backward through the same graph is
    refused rather than scaled twice."""
    m, dim, vocab = 37, 16, 300
    block = LmHeadLoss(dim, vocab, EPS, chunk_rows=16, device=DEVICE)
    x = torch.randn(m, dim, device=DEVICE, requires_grad=True)
    loss = block(x, torch.randint(0, vocab, (m,), device=DEVICE))
    saved = loss.grad_fn.saved_tensors
    assert sum(t.numel() for t in saved) == x.numel() + dim + vocab * dim + 1
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
