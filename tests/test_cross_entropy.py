"""The cross-entropy variants of specs/cross_entropy/ (blocks made of the general finish steps) against PyTorch:
torch.nn.functional.cross_entropy where it defines the behaviour (label_smoothing, reduction='none',
ignore_index), else the variant's formula in float64; the loss and every gradient, with and without the
forward that makes the gradients, on ragged shapes and fresh random data. Also the finish steps alone."""
import pytest
import torch
import torch.nn.functional as F

from codagen import runtime  # noqa: F401  (switches Triton's interpreter on where there is no GPU)
from codagen.runtime import finish
from generated.blocks import (LmHeadLossRows, LmHeadLossSmooth, LmHeadLossSoftcap, LmHeadLossWeighted,
                              LmHeadLossZloss)
from test_blocks import DEVICE, EPS, check_fp32, check_low, leaf, rel, rms, targets

M, DIM, VOCAB, CHUNK = 37, 16, 77, 16  # 37 rows in chunks of 16; a vocabulary no multiple of a tile width


def ce_rows(z, target):
    """Each row's cross-entropy in the logits' dtype, 0 where the target is ignored (PyTorch's)."""
    return F.cross_entropy(z, target, ignore_index=-100, reduction="none")


def valid_rows(target, dtype):
    return (target != -100).to(dtype)


def masked(rows, target, reduction, weights=None):
    """A reduction of per-row losses as PyTorch's: ignored rows count for nothing, mean divides by the rest."""
    w = valid_rows(target, rows.dtype) * (1 if weights is None else weights.to(rows.dtype))
    total = (rows * w).sum()
    return {"mean": total / w.sum(), "sum": total, "none": rows * w}[reduction]


# variant -> (block class, its extra constructor arguments, the plain loss of the float64/fp32 logits z)
def zloss(z, t, reduction, extra):
    lse = z.logsumexp(-1)
    return masked(ce_rows(z, t) + 0.3 * lse.square(), t, reduction)


VARIANTS = {
    "zloss": (LmHeadLossZloss, {"z_loss": 0.3}, zloss),
    "smooth": (LmHeadLossSmooth, {"smoothing": 0.2},
               lambda z, t, r, extra: F.cross_entropy(z, t, ignore_index=-100, reduction=r, label_smoothing=0.2)),
    "softcap": (LmHeadLossSoftcap, {"softcap": 1.5},
                lambda z, t, r, extra: F.cross_entropy(1.5 * torch.tanh(z / 1.5), t, ignore_index=-100,
                                                       reduction=r)),
    "weighted": (LmHeadLossWeighted, {},
                 lambda z, t, r, extra: masked(ce_rows(z, t), t, r, extra["token_weights"])),
    "rows": (LmHeadLossRows, {}, lambda z, t, r, extra: F.cross_entropy(z, t, ignore_index=-100, reduction="none")),
}


def run_variant(variant, reduction, dtype, m=M, vocab=VOCAB, target=None, grad=True, chunk=CHUNK):
    cls, kwargs, plain_loss = VARIANTS[variant]
    target = targets(m, vocab) if target is None else target
    x = leaf(m, DIM, dtype=dtype)
    wn = leaf(DIM, dtype=dtype, scale=0.1, offset=1.0)
    w_vocab = leaf(vocab, DIM, dtype=dtype, scale=DIM**-0.5 * 3)
    extra = {}
    if variant == "weighted":
        extra["token_weights"] = torch.rand(m, device=DEVICE) + 0.25
    if variant == "rows":
        block = cls(DIM, vocab, EPS, -100, chunk, device=DEVICE, dtype=dtype)
        upstream = torch.randn(m, device=DEVICE)
    else:
        block = cls(DIM, vocab, EPS, **kwargs, reduction=reduction, chunk_rows=chunk, device=DEVICE, dtype=dtype)
        upstream = torch.tensor(1.7, device=DEVICE)  # the loss's gradient need not be 1
    with torch.no_grad():
        block.wn.copy_(wn), block.w_vocab.copy_(w_vocab)
    xb = x.detach().requires_grad_(grad)
    if not grad:
        with torch.no_grad():
            block.requires_grad_(False)
            fused = {"loss": block(xb, target, *extra.values())}
    else:
        loss = block(xb, target, *extra.values())
        g = torch.autograd.grad(loss, [xb, block.wn, block.w_vocab], upstream)
        fused = {"loss": loss, "x": g[0], "wn": g[1], "w_vocab": g[2]}

    def plain(cast):
        xp, wnp, wp = (t.detach().to(cast).requires_grad_() for t in (x, wn, w_vocab))
        z = (rms(xp, wnp) @ wp.T).to(torch.float64 if cast == torch.float64 else torch.float32)
        lp = plain_loss(z, target, reduction, extra)
        if not grad:
            return {"loss": lp}
        gp = torch.autograd.grad(lp, [xp, wnp, wp], upstream.to(lp.dtype))
        return {"loss": lp, "x": gp[0], "wn": gp[1], "w_vocab": gp[2]}
    return fused, plain


CASES = [("zloss", "mean"), ("zloss", "sum"), ("smooth", "mean"), ("smooth", "sum"), ("softcap", "mean"),
         ("softcap", "sum"), ("weighted", "mean"), ("weighted", "sum"), ("rows", "none")]


@pytest.mark.parametrize("variant, reduction", CASES)
def test_variant_fp32(variant, reduction):
    fused, plain = run_variant(variant, reduction, torch.float32)
    check_fp32(fused, plain)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_without_gradients(variant):
    """The forward alone: no logits stored, the variant's loss from the partials of the LM-head epilogue."""
    fused, plain = run_variant(variant, "none" if variant == "rows" else "mean", torch.float32, m=23, vocab=130,
                               grad=False)
    check_fp32(fused, plain)


@pytest.mark.parametrize("variant", ["smooth", "softcap"])
def test_variant_fp16(variant):
    fused, plain = run_variant(variant, "mean", torch.float16, m=29, vocab=90)
    check_low(fused, plain, torch.float16)


def test_fp16_gradients_of_a_mean_over_many_rows():
    """softmax(z) / M is below fp16's normal range at M = 1000 rows and 3001 classes: gradients made for a loss
    gradient of 1 lost precision there (wn 3-5x plain PyTorch's error, whose loss gradient of 1.7 keeps it a
    little higher). The LM heads make them for grad_scale, the power of two of the rows' largest weight."""
    # one chunk of rows: the scale is the whole loss's however the rows are chunked, and the interpreter runs
    # one chunk of 1000 rows 4x faster than 63 of 16
    fused, plain = run_variant("weighted", "mean", torch.float16, m=1000, vocab=3001, chunk=1024)
    check_low(fused, plain, torch.float16)


@pytest.mark.parametrize("values, scale", [([1e-3, -3e-4], 512.0), ([0.75], 1.0), ([0.5], 1.0), ([1.0], 0.5),
                                           ([3.0, -9.0], 1 / 16), ([0.0, 0.0], 1.0), ([], 1.0), ([float("inf")], 1.0),
                                           ([1e-30], 2.0**99)])
def test_unit_scale_is_the_power_of_two_that_brings_the_largest_value_near_1(values, scale):
    s = finish.unit_scale(torch.tensor(values, dtype=torch.float32, device=DEVICE))
    assert s.shape == () and s.dtype == torch.float32 and s.item() == scale


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_CASES = [(variant, dtype) for variant in sorted(VARIANTS) for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("variant, dtype", [pytest.param(*c, marks=GPU) for c in GPU_CASES],
                         ids=[f"{v}-{str(d)[6:]}" for v, d in GPU_CASES])
def test_variant_on_the_gpu(variant, dtype):
    """Several tiles in every direction and several chunks of rows, in both half types."""
    fused, plain = run_variant(variant, "none" if variant == "rows" else "mean", dtype, m=1000, vocab=3001)
    check_low(fused, plain, dtype)


def test_variants_differ_from_plain_cross_entropy():
    """Each variant's reference is its own: with these settings, none equals plain cross-entropy's, so that a
    block falling back to plain cross-entropy fails its test."""
    z = torch.randn(M, VOCAB, dtype=torch.float64) * 3
    t = targets(M, VOCAB).cpu()
    # Each kept row's target is its largest logit, so smoothing's uniform term is well above the row's loss.
    t = torch.where(t == -100, t, z.argmax(1))
    base = F.cross_entropy(z, t, ignore_index=-100)
    rows = F.cross_entropy(z, t, ignore_index=-100, reduction="none")
    # Weights that grow with the row's loss, so the weighted mean is above the plain one by a margin; random
    # weights uncorrelated with the loss can land within any fixed tolerance of it.
    weights = 0.25 + rows / rows.max()
    for name, (_, _, loss) in VARIANTS.items():
        if name != "rows":
            assert abs(loss(z, t, "mean", {"token_weights": weights}) - base) > 1e-3, name


@pytest.mark.parametrize("variant", ["smooth", "rows"])
def test_variant_of_no_rows_follows_cross_entropy(variant):
    """Every target ignored: NaN for mean as PyTorch (0 per row for 'none'), zero gradients."""
    m = 9
    fused, plain = run_variant(variant, "none" if variant == "rows" else "mean", torch.float32, m=m,
                               target=torch.full((m,), -100, device=DEVICE))
    want = plain(torch.float64)
    assert torch.equal(fused["loss"].isnan(), want["loss"].isnan())
    for name in ("x", "wn", "w_vocab"):
        assert not fused[name].any(), name


def test_variant_refuses_a_target_out_of_bounds():
    if torch.cuda.is_available():
        pytest.skip("a device-side assert on a GPU (tests/test_blocks.py checks it in a process of its own)")
    target = targets(M, VOCAB)
    target[3] = VOCAB
    with pytest.raises(IndexError, match=f"Target {VOCAB} is out of bounds"):
        run_variant("smooth", "mean", torch.float32, target=target)


@pytest.mark.parametrize("grad", [True, False])
def test_variant_refuses_a_choice_its_spec_does_not_declare(grad):
    """lm_head_loss_zloss declares reduction mean and sum: "none" is refused where the call enters, with and
    without the forward that makes the gradients (it returned each row's loss, and failed in the backward)."""
    block = LmHeadLossZloss(DIM, VOCAB, EPS, reduction="none", chunk_rows=CHUNK, device=DEVICE)
    x = leaf(M, DIM, dtype=torch.float32)
    with (torch.enable_grad() if grad else torch.no_grad()), pytest.raises(
            ValueError, match=r"lm_head_loss_zloss: reduction must be 'mean' or 'sum' \(the choices "
                              r"specs/cross_entropy/blocks/lm_head_loss_zloss.yaml declares\), got 'none'"):
        block(x, targets(M, VOCAB))


# ---- the finish steps alone ------------------------------------------------------------------------------

def test_reduce_loss_matches_pytorch_reductions():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(41, 13, generator=g, dtype=torch.float64)
    t = torch.randint(0, 13, (41,), generator=g)
    t[[0, 7, 40]] = -100
    rows = (z.logsumexp(1) - finish.gather(z, t).double()).float()
    weights = torch.rand(41, generator=g) + 0.5
    for reduction in ("mean", "sum", "none"):
        loss, row_weights = finish.reduce_loss(rows.to(DEVICE), t.to(DEVICE), 13, -100, reduction)
        assert rel(loss, F.cross_entropy(z, t, reduction=reduction)) < 1e-6, reduction
        weighted, w_rows = finish.reduce_loss(rows.to(DEVICE), t.to(DEVICE), 13, -100, reduction,
                                              weights.to(DEVICE))
        assert rel(weighted, masked(ce_rows(z, t), t, reduction, weights.double())) < 1e-6, reduction
        # each row's weight is d loss / d row loss, as row_weights makes it from the targets alone
        for got, token_weights in ((row_weights, None), (w_rows, weights.to(DEVICE))):
            assert torch.allclose(got, finish.row_weights(t.to(DEVICE), -100, reduction, token_weights)), reduction
            assert torch.allclose(got.cpu().double(), torch.autograd.functional.jacobian(
                lambda r: masked(r, t, reduction, token_weights.cpu() if token_weights is not None else None)
                .sum(), rows.double())), reduction


def test_elementwise_finish_steps_refuse_two_shapes():
    """Partial buffers of two kernels may have different tile counts: an error, never a broadcast."""
    with pytest.raises(ValueError, match=r"x is \(5, 3\) and y is \(5, 1\)"):
        finish.add(torch.ones(5, 3), torch.ones(5, 1))
    assert torch.equal(finish.mul(torch.full((4,), 2.0), 1.5), torch.full((4,), 3.0))
    assert torch.equal(finish.sub(1.0, torch.tensor(0.25)), torch.tensor(0.75))
