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
from conftest import DEVICE, all_test_kernels, draw_args, inplace_names, kernel_model, kernel_types
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
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = test(out), test(ref)
        wrong = got != want
        if ref32 is not None:
            wrong &= got != test(ref32.to(out.dtype))
        if wrong.any():
            raise AssertionError(f"{name}: {what} in {got.sum().item()} elements, the reference has it in "
                                 f"{want.sum().item()}; they differ at {wrong.nonzero()[:4].tolist()}")
    finite = torch.isfinite(ref) & torch.isfinite(out)
    if finite.any() and ref[finite].norm() > 0:
        err = rel_err(out[finite], ref[finite])
        assert err <= tol, f"{name}: relative error {err} of the finite elements, over {tol}"


def run_planted(module, kernel, planted: str, values=SPECIALS, seed: int = 0) -> None:
    sizes = {**SIZES, "N": _whole_groups(kernel, SIZES["N"])}  # column groups: 56, still ragged against tiles
    args = draw_args(module, sizes, torch.float32, CONFIG, generator=torch.Generator().manual_seed(seed),
                     special=SPECIAL)
    target = args.kwargs[planted]
    if isinstance(target, float):  # a host scalar: one special value
        args.kwargs[planted] = args.inputs[planted] = values[0]
    else:
        plant(target, values)
        if planted in inplace_names(module):
            args.inputs[planted] = target.clone()
    module.launch(**args.kwargs, config=CONFIG)
    types = kernel_types(kernel.name)
    expected = reference.run(kernel, types, args.inputs, CONFIG.block_m, CONFIG.epilogue_n)
    in_fp32 = reference.run(kernel, types, args.inputs, CONFIG.block_m, CONFIG.epilogue_n, dtype=torch.float32)
    for name, out in args.outputs.items():
        assert_same_specials(name, out, expected[name], tolerance(kernel, name, out, torch.float32), in_fp32[name])


@pytest.mark.parametrize("name, planted", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_specials_match_pytorch(test_kernels, name, planted):
    module, kernel = test_kernels(name), kernel_model(name)
    decl = kernel.input(planted)
    seed = zlib.crc32(f"{name}/{planted}".encode())
    if decl is not None and (decl.role is InputRole.HOST_SCALAR or decl.dims == ()):
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
