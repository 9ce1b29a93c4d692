"""NaN and infinities as PyTorch gives them, through every primitive family and the finish steps.

Each test kernel (tests/specs/, one per family of primitives) runs with NaN, +inf and -inf planted in one of
its inputs at a time, and every output must have NaN, +inf and -inf exactly where the float64 reference
(codagen.reference, which is PyTorch's own functions) has them, and the same finite values elsewhere. The
planted elements sit in the first and last rows and columns, which the ragged edge tiles read again as
masked-off lanes (the mainloop wraps rows and columns past the edge around): a masked lane that leaked into
a reduction would show as a NaN or infinity the reference does not have."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from codagen import reference
from codagen.model import DType, InputRole
from codagen.runtime import Config, finish
from conftest import DEVICE, all_test_kernels, draw_args, fitting, inplace_names, kernel_model, kernel_types
from test_primitives import SPECIAL, _whole_groups, rel_err, tolerance

# numpy warnings from the interpreter on the planted values (inf - inf, log(0), exp overflow): what they
# produce is what is checked
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SIZES = {"M": 37, "N": 50, "K": 29}  # ragged: masked lanes in the last row and column tiles
CONFIG = Config(16, 32, 16, 2, 4, 1)  # 3 x 2 tiles
SPECIALS = (float("nan"), float("inf"), float("-inf"))


def _planted(name: str) -> list[str]:
    """The floating inputs of a test kernel (and the prior values of its inplace outputs)."""
    k = kernel_model(name)
    names = [i.name for i in k.inputs if i.dtype is not DType.INDEX and i.name != "positions"]
    return names + [o.name for o in k.outputs if o.inplace]


CASES = [(name, planted) for name in all_test_kernels() for planted in _planted(name)]


def plant(t: torch.Tensor, values=SPECIALS) -> None:
    """NaN, +inf, -inf at the first, a middle and the last element of each dimension, in place."""
    if t.dim() == 0:
        t.fill_(values[0])
        return
    for i, v in enumerate(values):
        at = tuple((0, s // 2, s - 1)[i] for s in t.shape)
        t[at] = v


def assert_same_specials(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float,
                         ref32: torch.Tensor | None = None) -> None:
    """NaN, +inf and -inf where `ref` (float64) has them, or where `ref32`, the same computed in float32, has
    them: fp32 arithmetic can round a value to 0 or infinity that float64 keeps finite and nonzero (gelu of
    -10 is 0 in fp32, and 0 times inf is NaN). Finite elements within `tol` of `ref`."""
    ref = ref.to(out.dtype)  # what the kernel stores: the reference's overflow rounds the same way
    if ref32 is not None:
        ref32 = ref32.to(out.dtype)
    if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # torch's isposinf does not take FP8; fp32 holds it
        out, ref, ref32 = out.float(), ref.float(), None if ref32 is None else ref32.float()
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = test(out), test(ref)
        wrong = got != want
        if ref32 is not None:
            wrong &= got != test(ref32)
        if wrong.any():
            raise AssertionError(f"{name}: {what} in {got.sum().item()} elements, the reference has it in "
                                 f"{want.sum().item()}; they differ at {wrong.nonzero()[:4].tolist()}")
    finite = torch.isfinite(ref) & torch.isfinite(out)
    if finite.any() and ref[finite].norm() > 0:
        err = rel_err(out[finite], ref[finite])
        assert err <= tol, f"{name}: relative error {err} of the finite elements, over {tol}"


def run_planted(module, kernel, planted: str, values=SPECIALS, seed: int = 0) -> None:
    sizes = {**SIZES, "N": _whole_groups(kernel, SIZES["N"])}  # column groups: 56, still ragged against tiles
    config = fitting(module, CONFIG)
    args = draw_args(module, sizes, torch.float32, config, generator=torch.Generator().manual_seed(seed),
                     special=SPECIAL)
    target = args.kwargs[planted]
    if isinstance(target, float):  # a host scalar: one special value
        args.kwargs[planted] = args.inputs[planted] = values[0]
    else:
        plant(target, values)
        if planted in inplace_names(module):
            args.inputs[planted] = target.clone()
    module.launch(**args.kwargs, config=config)
    types = kernel_types(kernel.name)
    expected = reference.run(kernel, types, args.inputs, config.block_m, config.epilogue_n)
    in_fp32 = reference.run(kernel, types, args.inputs, config.block_m, config.epilogue_n, dtype=torch.float32)
    for name, out in args.outputs.items():
        assert_same_specials(name, out, expected[name], tolerance(kernel, name, out, torch.float32), in_fp32[name])


@pytest.mark.parametrize("name, planted", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_specials_match_pytorch(test_kernels, name, planted):
    module, kernel = test_kernels(name), kernel_model(name)
    decl = kernel.input(planted)
    seed = zlib.crc32(f"{name}/{planted}".encode())
    if decl is not None and decl.role is InputRole.GEMM_SCALE:
        # a K-group scale: NaN only. An infinite one multiplies each K step's partial product (docs/fp8.md), and
        # steps of both signs add to NaN where the reference, dequantizing first, may have one sign left; its
        # real case, a group quantized with an infinite amax, is NaN in both (test_fp8_kgroup.py)
        run_planted(module, kernel, planted, (float("nan"),), seed)
    elif decl is not None and (decl.role is InputRole.HOST_SCALAR or decl.dims == ()):
        for value in SPECIALS:  # a scalar holds one value: each in turn
            run_planted(module, kernel, planted, (value,), seed)
    else:
        run_planted(module, kernel, planted, SPECIALS, seed)


def test_max_as_compiled_propagates_nan(test_kernels, monkeypatch):
    """The reduction that compiled kernels run for reduce max (by tile.maximum_nan), which the interpreter
    otherwise replaces by a faster equivalent, on the interpreter."""
    import triton.language as tl

    from codagen.runtime import tile

    monkeypatch.setattr(tile, "_INTERPRETED", tl.constexpr(False))
    for planted in ("a", "c"):
        run_planted(test_kernels("t_reduce"), kernel_model("t_reduce"), planted)


def test_logsumexp_of_a_tile_of_minus_inf(test_kernels):
    """A tile whose every element is -inf: torch.logsumexp gives -inf (and max -inf), not 0."""
    module, kernel = test_kernels("t_reduce"), kernel_model("t_reduce")
    args = draw_args(module, SIZES, torch.float32, CONFIG, generator=torch.Generator().manual_seed(3))
    args.kwargs["c"][:16, :32] = float("-inf")  # the whole first tile of x = acc + c
    module.launch(**args.kwargs, config=CONFIG)
    expected = reference.run(kernel, kernel_types("t_reduce"), args.inputs, CONFIG.block_m, CONFIG.epilogue_n)
    for name in ("lse_cols", "lse_rows", "max_cols", "max_rows"):
        out = args.outputs[name]
        assert (out[:16 if name.endswith("cols") else 32, 0] == float("-inf")).all(), name
        assert_same_specials(name, out, expected[name], 1e-5)


# -- finish steps ---------------------------------------------------------------------------------------------
def test_logsumexp_tiles_follows_torch():
    """Combining per-tile partials: rows with NaN, +inf, -inf, all -inf, and finite values far apart."""
    inf, nan = float("inf"), float("nan")
    partials = torch.tensor([
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [1.0, nan, 3.0, 4.0, 5.0],
        [nan, nan, nan, nan, nan],
        [1.0, inf, 3.0, 4.0, 5.0],
        [inf, -inf, inf, 0.0, 1.0],
        [-inf, -inf, -inf, -inf, -inf],
        [-inf, -inf, -inf, -inf, 2.0],
        [-200.0, 100.0, -inf, 80.0, 0.5],
        [nan, inf, -inf, 1.0, 2.0],
    ], device=DEVICE)
    for width in (5, 3, 1):  # one block of tiles, and the ones after the first holding the special values
        x = partials[:, :width]
        got, want = finish.logsumexp_tiles(x.contiguous()), torch.logsumexp(x.double(), -1)
        assert_same_specials(f"{width} tiles", got, want, 1e-6)


def test_logsumexp_tiles_as_log_softmax_normalizer_follows_torch():
    """inf_max 'nan': the normalizer log_softmax subtracts, NaN where a row's largest value is infinite (and so
    F.cross_entropy's loss of that row), finite rows as torch.logsumexp."""
    inf, nan = float("inf"), float("nan")
    partials = torch.tensor([
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [1.0, nan, 3.0, 4.0, 5.0],
        [1.0, inf, 3.0, 4.0, 5.0],
        [inf, -inf, inf, 0.0, 1.0],
        [-inf, -inf, -inf, -inf, -inf],
        [-inf, -inf, -inf, -inf, 2.0],
        [-200.0, 100.0, -inf, 80.0, 0.5],
    ], device=DEVICE)
    for width in (5, 3, 1):
        x = partials[:, :width].double()
        top = x.max(-1, keepdim=True).values  # torch's log_softmax: x - max - log(sum(exp(x - max)))
        want = (top + (x - top).exp().sum(-1, keepdim=True).log())[:, 0]
        got = finish.logsumexp_tiles(partials[:, :width].contiguous(), inf_max="nan")
        assert_same_specials(f"{width} tiles", got, want, 1e-6)
    with pytest.raises(ValueError, match="inf_max"):
        finish.logsumexp_tiles(partials.contiguous(), inf_max="inf")


def test_cross_entropy_of_a_nan_lse_is_nan():
    lse = torch.tensor([1.0, float("nan"), 2.0], device=DEVICE)
    loss, _ = finish.cross_entropy(lse, torch.zeros(3, device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE),
                                   -100, "mean", classes=3)
    assert loss.isnan()


def test_lm_head_loss_with_one_nan_weight_is_nan_like_cross_entropy():
    """One NaN in w_vocab makes one column of logits NaN: F.cross_entropy gives NaN, and so must the block."""
    from generated.blocks import LmHeadLoss
    from test_blocks import EPS, rms, targets

    m, dim, vocab = 37, 32, 77
    g = torch.Generator().manual_seed(11)
    block = LmHeadLoss(dim, vocab, EPS, -100, "mean", 16, device=DEVICE)
    x = torch.randn(m, dim, generator=g).to(DEVICE)
    target = targets(m, vocab)
    for nan in (False, True):
        with torch.no_grad():
            block.w_vocab.copy_(torch.randn(vocab, dim, generator=g) * dim**-0.5)
            if nan:
                block.w_vocab[40, 7] = float("nan")
        loss = block(x, target)
        plain = F.cross_entropy(rms(x, block.wn.detach()) @ block.w_vocab.detach().T, target, ignore_index=-100)
        assert plain.isnan().item() is nan and loss.isnan().item() is nan


# -- blocks: the cross-entropy variants and Qwen3's QK-norm, against PyTorch's autograd on the same math --------
# Each variant's loss as PyTorch computes it from float64 logits z: F.cross_entropy where it defines the loss,
# else its formula with ignored rows selected away (torch.where, as F.cross_entropy's ignore_index does; never a
# product with a 0/1 mask, whose 0 * NaN is NaN). Its gradients are autograd's.
BLOCK_M, BLOCK_DIM, BLOCK_VOCAB, BLOCK_CHUNK = 23, 16, 77, 16  # two chunks of rows, a ragged vocabulary
VALID_ROW, IGNORED_ROW = 2, 5  # tests/test_blocks.targets ignores rows 5 and M - 1


def _selected(rows, target, reduction, weights=None):
    """PyTorch's reduction of per-row losses: ignored rows selected away, 'mean' over the valid rows' weight."""
    valid = target != -100
    w = torch.where(valid, weights.to(rows.dtype), 0.0) if weights is not None else valid.to(rows.dtype)
    picked = torch.where(valid, w * rows, 0.0)
    return {"mean": picked.sum() / w.sum(), "sum": picked.sum(), "none": picked}[reduction]


def _ce_rows(z, target):
    return F.cross_entropy(z, target, ignore_index=-100, reduction="none")


# variant -> (block class name, constructor arguments after (dim, vocab, eps), reduction, loss of (z, target,
# token_weights))
CE_BLOCKS = {
    "plain": ("LmHeadLoss", {"ignore_index": -100, "reduction": "mean"}, "mean",
              lambda z, t, w: F.cross_entropy(z, t, ignore_index=-100)),
    "plain-sum": ("LmHeadLoss", {"ignore_index": -100, "reduction": "sum"}, "sum",
                  lambda z, t, w: F.cross_entropy(z, t, ignore_index=-100, reduction="sum")),
    "zloss": ("LmHeadLossZloss", {"z_loss": 0.3, "reduction": "mean"}, "mean",
              lambda z, t, w: _selected(_ce_rows(z, t) + 0.3 * z.logsumexp(-1).square(), t, "mean")),
    "rows": ("LmHeadLossRows", {}, "none", lambda z, t, w: _ce_rows(z, t)),
    "weighted": ("LmHeadLossWeighted", {"reduction": "mean"}, "mean",
                 lambda z, t, w: _selected(_ce_rows(z, t), t, "mean", w)),
    "weighted-sum": ("LmHeadLossWeighted", {"reduction": "sum"}, "sum",
                     lambda z, t, w: _selected(_ce_rows(z, t), t, "sum", w)),
    "smooth": ("LmHeadLossSmooth", {"smoothing": 0.2, "reduction": "mean"}, "mean",
               lambda z, t, w: F.cross_entropy(z, t, ignore_index=-100, label_smoothing=0.2)),
    "softcap": ("LmHeadLossSoftcap", {"softcap": 1.5, "reduction": "mean"}, "mean",
                lambda z, t, w: F.cross_entropy(1.5 * torch.tanh(z / 1.5), t, ignore_index=-100)),
}
# (input, element) planted: a valid and an ignored row of x, one norm weight, an element of w_vocab in a
# column no row targets and one in column 0, row 0's target; a valid and an ignored row's token weight
CE_PLANTS = [("x", (VALID_ROW, 3)), ("x", (IGNORED_ROW, 7)), ("wn", (4,)), ("w_vocab", (40, 5)),
             ("w_vocab", (0, 9)), ("token_weights", (VALID_ROW,)), ("token_weights", (IGNORED_ROW,))]
CE_CASES = [(variant, planted, at, value) for variant in CE_BLOCKS for planted, at in CE_PLANTS
            if planted != "token_weights" or variant.startswith("weighted") for value in SPECIALS]


def _masks_match(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """NaN, +inf and -inf at the same elements; the finite elements close (float32 against float64)."""
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        g, w = test(got), test(want)
        if not torch.equal(g, w):
            raise AssertionError(f"{name}: {what} in {g.sum().item()} elements, PyTorch has it in {w.sum().item()}; "
                                 f"they differ at {(g != w).nonzero()[:4].tolist()}")
    finite = torch.isfinite(want)
    if finite.any() and want[finite].norm() > 0:
        err = rel_err(got[finite], want[finite])
        assert err < 1e-3, f"{name}: relative error {err} of the finite elements"


def _ce_block_run(variant: str, planted: str, at: tuple, value: float, grad: bool = True):
    import generated.blocks as blocks
    from test_blocks import EPS, rms, targets

    cls, kwargs, reduction, loss_of = CE_BLOCKS[variant]
    seed = zlib.crc32(f"{variant}/{planted}/{at}".encode())
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # targets()
    m, dim, vocab = BLOCK_M, BLOCK_DIM, BLOCK_VOCAB
    values = {"x": torch.randn(m, dim, generator=g, dtype=torch.float64),
              "wn": 1.0 + 0.1 * torch.randn(dim, generator=g, dtype=torch.float64),
              "w_vocab": 3 * dim**-0.5 * torch.randn(vocab, dim, generator=g, dtype=torch.float64),
              "token_weights": torch.rand(m, generator=g, dtype=torch.float64) + 0.25}
    values[planted][at] = value
    values = {k: v.float().to(DEVICE) for k, v in values.items()}
    target = targets(m, vocab)
    target[target == 40] = 41  # column 40 of w_vocab is no row's target
    upstream = (torch.randn(m, generator=g) if reduction == "none" else torch.tensor(1.7)).to(DEVICE)
    block = getattr(blocks, cls)(dim, vocab, EPS, **kwargs, chunk_rows=BLOCK_CHUNK, device=DEVICE)
    with torch.no_grad():
        block.wn.copy_(values["wn"]), block.w_vocab.copy_(values["w_vocab"])
    extra = (values["token_weights"],) if variant.startswith("weighted") else ()
    x = values["x"].clone().requires_grad_(grad)
    names = ("x", "wn", "w_vocab")
    if grad:
        loss = block(x, target, *extra)
        fused = dict(zip(("loss", *names), (loss, *torch.autograd.grad(loss, [x, block.wn, block.w_vocab],
                                                                       upstream))))
    else:
        with torch.no_grad():
            block.requires_grad_(False)
            fused = {"loss": block(x, target, *extra)}
    leaves = [values[n].double().requires_grad_() for n in names]
    z = rms(leaves[0], leaves[1]) @ leaves[2].T
    loss = loss_of(z, target, values["token_weights"].double())
    want = {"loss": loss}
    if grad:
        want.update(zip(names, torch.autograd.grad(loss, leaves, upstream.double())))
    return fused, want


@pytest.mark.parametrize("variant, planted, at, value", CE_CASES,
                         ids=[f"{v}-{p}{list(a)}-{x}" for v, p, a, x in CE_CASES])
def test_cross_entropy_block_specials_match_pytorch(variant, planted, at, value):
    """One NaN, +inf or -inf in one input: the loss and every gradient have NaN and infinities where PyTorch's
    do (a +inf logit makes F.cross_entropy's row NaN, and autograd's gradient of every logit of the row NaN;
    a NaN token weight of an ignored row is never read), with the forward that makes the gradients."""
    fused, want = _ce_block_run(variant, planted, at, value)
    for name, got in fused.items():
        _masks_match(f"{variant} {name}", got, want[name])


@pytest.mark.parametrize("variant, planted, at, value", CE_CASES[::4],
                         ids=[f"{v}-{p}{list(a)}-{x}" for v, p, a, x in CE_CASES[::4]])
def test_cross_entropy_block_specials_without_gradients(variant, planted, at, value):
    """The forward alone (no logits stored, the loss from the LM-head epilogue's partials) too."""
    fused, want = _ce_block_run(variant, planted, at, value, grad=False)
    _masks_match(f"{variant} loss", fused["loss"], want["loss"])


# Qwen3's QK-norm block: q and k heads normalized, v heads passed through. PyTorch never computes a statistic of
# a v head, so a NaN or infinity in one v column must stay in that column (and its RoPE partner) and in the
# gradients PyTorch's autograd gives, never spread over the head through its unused rstd.
QK_HEADS, QK_KV_HEADS, QK_DIM, QK_M = 2, 1, 40, 19
QK_V0 = (QK_HEADS + QK_KV_HEADS) * 128  # the first v column
QK_PLANTS = [("x", (3, 5)), ("wn", (7,)), ("w_qkv", (10, 4)), ("w_qkv", (2 * 128 + 9, 11)), ("w_qkv", (QK_V0 + 6, 2)),
             ("w_qkv", (QK_V0 + 101, 30)), ("q_norm", (17,)), ("k_norm", (64,)), ("freqs", (3,))]
QK_CASES = [(planted, at, value) for planted, at in QK_PLANTS for value in SPECIALS]


@pytest.mark.parametrize("planted, at, value", QK_CASES, ids=[f"{p}{list(a)}-{v}" for p, a, v in QK_CASES])
def test_qwen3_pre_attention_specials_match_pytorch(planted, at, value):
    """One NaN, +inf or -inf in one input of Qwen3PreAttention (a q, k or v row of w_qkv among them): qkv and every
    gradient have NaN and infinities where PyTorch's definition of the layer and its autograd have them."""
    from generated.blocks import NormStats, Qwen3PreAttention
    from test_blocks import EPS
    from test_qwen3 import qwen3_pre_attention_plain

    heads, kv_heads, dim, m, hd = QK_HEADS, QK_KV_HEADS, QK_DIM, QK_M, 128
    qkv_dim = (heads + 2 * kv_heads) * hd
    g = torch.Generator().manual_seed(zlib.crc32(f"qk/{planted}/{at}".encode()))
    inv = 1.0 / 1e6 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    values = {"x": torch.randn(m, dim, generator=g, dtype=torch.float64),
              "wn": 1.0 + 0.2 * torch.randn(dim, generator=g, dtype=torch.float64),
              "w_qkv": dim**-0.5 * torch.randn(qkv_dim, dim, generator=g, dtype=torch.float64),
              "q_norm": 1.0 + 0.2 * torch.randn(hd, generator=g, dtype=torch.float64),
              "k_norm": 1.0 + 0.2 * torch.randn(hd, generator=g, dtype=torch.float64),
              "freqs": torch.cat([inv.repeat(heads + kv_heads), torch.zeros(kv_heads * hd // 2, dtype=torch.float64)])}
    values[planted][at] = value
    values = {k: v.float().to(DEVICE) for k, v in values.items()}
    positions = torch.randint(1, 50, (m,), generator=g).to(DEVICE)
    up_x = torch.randn(m, dim, generator=g, dtype=torch.float64).to(DEVICE)
    up_qkv = torch.randn(m, qkv_dim, generator=g, dtype=torch.float64).to(DEVICE)
    names = ["qkv", "x", "wn", "w_qkv", "q_norm", "k_norm"]

    block = Qwen3PreAttention(dim, qkv_dim, EPS, device=DEVICE)
    with torch.no_grad():
        block.wn.copy_(values["wn"]), block.w_qkv.copy_(values["w_qkv"])
    xb, qn, kn = (values[n].clone().requires_grad_() for n in ("x", "q_norm", "k_norm"))
    wn_qk = torch.cat([qn.repeat(heads), kn.repeat(kv_heads), qn.new_zeros(kv_heads * hd)])
    v_pass = torch.cat([torch.zeros((heads + kv_heads) * hd), torch.ones(kv_heads * hd)]).to(DEVICE)
    h, rstd = NormStats(dim, EPS)(xb.detach(), block.wn.detach())
    x_out, qkv = block(xb, h, rstd, positions, values["freqs"], wn_qk, v_pass)
    got = torch.autograd.grad((x_out, qkv), [xb, block.wn, block.w_qkv, qn, kn], (up_x.float(), up_qkv.float()))
    fused = dict(zip(names, [qkv, *got]))

    leaves = [values[n].double().requires_grad_() for n in ("x", "wn", "w_qkv", "q_norm", "k_norm")]
    qkv_plain = qwen3_pre_attention_plain(*leaves, positions, values["freqs"].double(), heads, kv_heads)
    want = dict(zip(names, [qkv_plain, *torch.autograd.grad((leaves[0], qkv_plain), leaves, (up_x, up_qkv))]))
    for name, value_got in fused.items():
        _masks_match(f"Qwen3PreAttention {name}", value_got, want[name])
