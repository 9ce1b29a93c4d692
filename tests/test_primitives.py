"""Every epilogue primitive of the registry (codagen.primitives), run through a generated kernel on the CPU
(Triton's interpreter) and compared with the float64 reference interpreter of the spec (codagen.reference).

Test kernels live in tests/specs/ (one spec per family of primitives; see the table in each spec's comment).
Each is run for float32, float16 and bfloat16 on three shapes: a ragged one that fits one tile, a ragged one
that spans several tiles in both directions with small tiles and every tensor non-contiguous (outputs too),
and one of exact tile multiples.

Tolerances. The reference computes in float64 from the *same* (already rounded) inputs, and the kernel
computes in fp32, so the error is dominated by the final rounding of each output to its dtype: a relative
norm error of at most u, about u/sqrt(3) in practice, with u = 2^-11 = 4.9e-4 (fp16) and 2^-8 = 3.9e-3 (bf16).
The tolerances are 4u: 2e-3 and 1.6e-2. fp32 outputs (float32 kernels, explicit float32 outputs and the
partial-reduction buffers, whatever T is) carry the fp32 arithmetic of the epilogue and the K-long dot
products (u = 6e-8 times a few dozen operations, plus sin/cos of angles up to ~64 for rope): 1e-5. A kernel
with a `cast` step rounds intermediates to the cast dtype; the kernel rounds from fp32 and the reference
from fp64, which can differ by one ulp on the rare element near a rounding boundary, so its outputs get at
least the cast dtype's tolerance.

Under Triton's CPU interpreter (3.9), fp32 -> bf16 conversions truncate instead of rounding to nearest even
(measured: relative error 3.3e-3 against torch's 1.5e-3 on randn), so bf16 outputs show about twice the
error they have on a GPU; the truncation error is below 2u, still inside the 4u tolerance.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from codagen import reference
from codagen.model import Dim, Width
from codagen.runtime import Config
from conftest import DEVICE, all_test_kernels, draw_args, fitting, kernel_model, kernel_types

# numpy warnings from the interpreter, harmless: sigmoid (in tanh, gelu) of large arguments overflows exp to
# inf and gives 0 or 1 as it should; logsumexp partials of masked-off rows take log(0) and are not stored.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")

# FP8 outputs: one step of the FP8 grid (2^-3, 2^-2 relative), the most an element can differ by where the kernel's
# fp32 value and the reference's float64 one fall on either side of a rounding boundary. The quantize test kernel
# reads its tile from an fp32 input, which both see alike, and test_quantize.py compares it bit for bit.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float8_e4m3fn: 2.0**-3,
       torch.float8_e5m2: 2.0**-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (M, N, K, config, strided): N is made even for kernels with N/2-wide tensors.
SHAPES = {
    # ragged, one tile (the interpreter's default tile shape); contiguous tensors
    "ragged-1tile": (37, 50, 29, Config(64, 64, 32, 8, 4, 1), False),
    # ragged, 3 x 3 tiles (and 3 K steps), grouped order; every tensor a non-contiguous view
    "ragged-tiles-strided": (45, 69, 40, Config(16, 32, 16, 2, 4, 1), True),
    # exact tile multiples (EVEN_K, no ragged edge), 2 x 4 tiles, no grouping; contiguous
    "exact-tiles": (32, 64, 32, Config(16, 16, 16, 1, 4, 1), False),
    # the epilogue on two 16-column slices of each tile; the last tile's second slice is all past the edge
    "ragged-tiles-split": (45, 69, 40, Config(16, 32, 16, 2, 4, 1, epilogue_split=2), False),
}

# Inputs whose values must stay in a range: rope angles are position * frequency as in a real model
# (frequencies in (0, 1], positions below 64), so that fp32 angles stay accurate.
SPECIAL = {
    "freqs": lambda shape, g: 0.05 + 0.95 * torch.rand(shape, generator=g),
    "positions": lambda shape, g: torch.randint(0, 64, shape, generator=g),
}


def _needs_even_n(kernel) -> bool:
    """Whether columns come in pairs: some value or tensor is N/2 wide."""
    return any(t.width is Width.HALF for t in kernel_types(kernel.name).values()) or \
        any(Dim.N_HALF in d.dims for d in (*kernel.inputs, *kernel.outputs))


def _whole_groups(kernel, n: int) -> int:
    """N made even for kernels with N/2-wide values, and a multiple of the column group (still ragged against
    the tiles) for kernels with column groups."""
    if _needs_even_n(kernel) and n % 2:
        n += 1
    group = kernel.column_group or 1
    return -(-n // group) * group


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def cast_tolerances(kernel, t_dtype: torch.dtype) -> dict[str, float]:
    """Output name -> the tolerance of the narrowest dtype that a `cast` step upstream of it rounds to
    (`T` being t_dtype, the launch's)."""
    through: dict[str, float] = {}  # value name -> tolerance of the casts it depends on
    written: dict[str, float] = {}
    for step in kernel.steps:
        tol = max([through.get(v, 0.0) for v in step.args.values() if isinstance(v, str)], default=0.0)
        if step.op == "cast":
            tol = max(tol, TOL[DTYPE_NAMES.get(step.args["dtype"], t_dtype)])
        if step.out is not None:
            through[step.out] = tol
        if step.target is not None:
            written[step.target] = tol
    return written


def tolerance(kernel, name: str, out: torch.Tensor, t_dtype: torch.dtype) -> float:
    """By the output's dtype, widened to that of a cast the output depends on."""
    return max(TOL[out.dtype], cast_tolerances(kernel, t_dtype).get(name, 0.0))


def run_and_check(module, kernel, sizes, dtype, config, strided, seed, index_dtype=torch.int64):
    config = fitting(module, config)
    g = torch.Generator().manual_seed(seed)
    args = draw_args(module, sizes, dtype, config, strided=strided, generator=g, index_dtype=index_dtype,
                     special=SPECIAL)
    module.launch(**args.kwargs, config=config)
    expected = reference.run(kernel, kernel_types(kernel.name), args.inputs, config.block_m, config.epilogue_n)
    assert set(expected) == set(args.outputs)
    errors = {}
    for name, out in args.outputs.items():
        assert not torch.isnan(out).any(), f"{name}: NaN in {torch.isnan(out).sum().item()} of {out.numel()} elements"
        assert out.shape == expected[name].shape, name
        errors[name] = rel_err(out, expected[name])
        base, before, mask = args.bases[name]
        torch.testing.assert_close(base[~mask], before[~mask], rtol=0, atol=0, equal_nan=True,
                                   msg=f"{name}: elements outside the output view were written")
    bad = {n: e for n, e in errors.items() if not e <= tolerance(kernel, n, args.outputs[n], dtype)}
    assert not bad, f"relative errors over tolerance: {bad} (all: {errors})"
    return errors


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", all_test_kernels())
def test_kernel_matches_reference(test_kernels, name, dtype, shape):
    module = test_kernels(name)
    kernel = kernel_model(name)
    m, n, k, config, strided = SHAPES[shape]
    n = _whole_groups(kernel, n)
    # index inputs: int32 for the fp16 runs, int64 otherwise
    index_dtype = torch.int32 if dtype == "fp16" else torch.int64
    seed = zlib.crc32(f"{name}/{dtype}/{shape}".encode())
    run_and_check(module, kernel, {"M": m, "N": n, "K": k}, DTYPES[dtype], config, strided, seed, index_dtype)


# The Hopper pipelines on a ragged 3 x 3 tile grid: a persistent grid (fewer programs than tiles), TMA
# descriptors for the GEMM operands, and the loop hints FLATTEN and WARP_SPECIALIZE (which the interpreter
# runs as plain loops: this checks that they reach the kernel and leave its results alone); the last one
# with the epilogue on quarters of each tile.
PIPELINES = {
    "persistent-tma-flatten": Config(16, 32, 16, 2, 4, 1, persistent=True, tma=True, flatten=True),
    "persistent-tma-ws": Config(16, 32, 16, 2, 4, 1, persistent=True, tma=True, warp_specialize=True),
    "persistent-tma-ws-split": Config(16, 32, 16, 2, 4, 1, persistent=True, tma=True, warp_specialize=True,
                                      epilogue_split=4),
}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("name", all_test_kernels())
def test_pipelines_match_reference(test_kernels, monkeypatch, name, pipeline):
    import codagen.runtime

    module = test_kernels(name)
    kernel = kernel_model(name)
    config = fitting(module, PIPELINES[pipeline])
    monkeypatch.setattr(codagen.runtime, "sm_count", lambda device: 4)  # 9 tiles on 4 programs
    jit = getattr(module, f"{module.NAME}_kernel")
    run, passed = jit.run, {}
    monkeypatch.setattr(jit, "run", lambda *a, **kw: passed.update(kw, programs=kw["grid"]) or run(*a, **kw))
    # N = 72 (80 for 16-wide column groups): ragged for 32-wide tiles, yet rows of a [K, N] operand are 16-byte
    # aligned, as TMA needs; so are those of 40 bf16 elements, and of 48 FP8 ones (ragged for 32-deep K steps)
    k = 48 if kernel.fp8_gemm else 40
    run_and_check(module, kernel, {"M": 45, "N": _whole_groups(kernel, 72), "K": k}, torch.bfloat16, config, False,
                  zlib.crc32(f"{name}/{pipeline}".encode()))
    assert passed["programs"] == (4,)
    if kernel.gemm:
        assert passed["TMA"] is True and passed["FLATTEN"] is config.flatten
        assert passed["WARP_SPECIALIZE"] is config.warp_specialize
    assert passed["EPILOGUE_SPLIT"] == config.epilogue_split


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_to_t_rounds_to_the_launch_type(test_kernels, dtype):
    """The tolerances above cannot tell a value rounded to T from one left in fp32; exactness can."""
    module = test_kernels("t_cast_dtypes")
    args = draw_args(module, {"M": 37, "N": 50, "K": 29}, dtype, CFG, generator=torch.Generator().manual_seed(5))
    module.launch(**args.kwargs, config=CFG)
    stored = args.outputs["o_t32"]
    assert stored.dtype == torch.float32 and stored.abs().min() > 0
    torch.testing.assert_close(stored, stored.to(dtype).float(), rtol=0, atol=0)  # representable in T
    acc = args.inputs["a"].double() @ args.inputs["b"].double().T
    assert ((stored.double() - acc).abs() <= acc.abs() * 2.0**-7).all()  # and the rounding of acc, within an ulp


# -- the launcher's argument checks ---------------------------------------------------------------------------
CFG = Config(16, 32, 16, 2, 4, 1)


def _args(module, dtype=torch.float32, sizes=None):
    sizes = sizes or {"M": 20, "N": 40, "K": 12}
    return draw_args(module, sizes, dtype, CFG, generator=torch.Generator().manual_seed(0),
                     special=SPECIAL).kwargs


def test_launch_rejects_shape_mismatch(test_kernels):
    module = test_kernels("t_reduce")
    kwargs = _args(module)
    kwargs["c"] = torch.randn(20, 41, device=DEVICE)
    with pytest.raises(ValueError, match=r"t_reduce: 'c' has N = 41, which does not match N = 40"):
        module.launch(**kwargs, config=CFG)
    kwargs = _args(module)
    kwargs["a"] = torch.randn(20, 12, 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"'a' must have shape \[M, K\], got \(20, 12, 1\)"):
        module.launch(**kwargs, config=CFG)


def test_launch_rejects_dtype_mismatch(test_kernels):
    module = test_kernels("t_reduce")
    kwargs = _args(module)
    kwargs["c"] = kwargs["c"].half()
    with pytest.raises(ValueError, match=r"'c' must have the same dtype as the other T tensors \(torch.float32\)"):
        module.launch(**kwargs, config=CFG)
    module = test_kernels("t_cast_dtypes")  # an explicit float32 input
    kwargs = _args(module, torch.float16)
    kwargs["w"] = kwargs["w"].half()
    with pytest.raises(ValueError, match=r"'w' must be float32, got torch.float16"):
        module.launch(**kwargs, config=CFG)
    module = test_kernels("t_select_accumulate")  # an index input
    kwargs = _args(module)
    kwargs["target"] = kwargs["target"].float()
    with pytest.raises(ValueError, match=r"'target' must be int32 or int64, got torch.float32"):
        module.launch(**kwargs, config=CFG)


def test_launch_rejects_wrong_tile_count(test_kernels):
    module = test_kernels("t_reduce")
    kwargs = _args(module)  # N = 40 with BLOCK_N = 32: 2 tiles
    kwargs["sum_cols"] = torch.empty(20, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"'sum_cols' must have 2 columns \(tiles\(N\) for this tile shape\), got 3"):
        module.launch(**kwargs, config=CFG)
    kwargs = _args(module)  # M = 20 with BLOCK_M = 16: 2 tiles
    kwargs["max_rows"] = torch.empty(40, 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"'max_rows' must have 2 columns \(tiles\(M\) for this tile shape\), got 1"):
        module.launch(**kwargs, config=CFG)


def test_launch_rejects_odd_n_for_pairs(test_kernels):
    """t_reduce splits columns into pairs (swiglu) but declares no N/2 tensor: N must still be even."""
    module = test_kernels("t_reduce")
    kwargs = _args(module, sizes={"M": 20, "N": 41, "K": 12})
    with pytest.raises(ValueError, match=r"t_reduce: N must be even, since columns come in pairs; got N=41"):
        module.launch(**kwargs, config=CFG)


@pytest.mark.parametrize("name", all_test_kernels())
def test_int64_offsets(test_kernels, monkeypatch, name):
    """The INT64 variant (64-bit index arithmetic, chosen for tensors of 2**31 elements or more) on small
    tensors: forced on, it must give the same results."""
    import codagen.runtime

    module = test_kernels(name)
    monkeypatch.setattr(codagen.runtime, "needs_int64", lambda tensors: True)
    monkeypatch.setattr(module, "_PLANS", {})  # launch plans are cached by signature: make a fresh one
    jit = getattr(module, f"{module.NAME}_kernel")
    run, passed = jit.run, {}
    monkeypatch.setattr(jit, "run", lambda *a, **kw: passed.update(kw) or run(*a, **kw))
    m, n, k, config, strided = SHAPES["ragged-tiles-strided"]
    n = _whole_groups(kernel_model(name), n)
    run_and_check(module, kernel_model(name), {"M": m, "N": n, "K": k}, torch.float16, config, strided,
                  zlib.crc32(f"{name}/int64".encode()))
    assert passed["INT64"] is True


LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas"}


@pytest.mark.parametrize("name", all_test_kernels())
def test_launch_passes_only_kernel_parameters(test_kernels, monkeypatch, name):
    """Triton's interpreter silently drops keyword arguments that the kernel does not declare, while compiled
    Triton rejects them ('Keyword argument ... was specified but unrecognised'): check them here."""
    module = test_kernels(name)
    jit = getattr(module, f"{module.NAME}_kernel")
    run = jit.run
    passed = {}

    def checked_run(*args, **kwargs):
        passed.update(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(jit, "run", checked_run)
    kwargs = _args(module, sizes={"M": 20, "N": _whole_groups(kernel_model(name), 40), "K": 12})
    module.launch(**kwargs, config=fitting(module, CFG))
    unknown = set(passed) - set(jit.arg_names) - LAUNCH_OPTIONS - {"grid", "warmup"}
    assert passed and not unknown, f"keywords the kernel does not take: {sorted(unknown)}"
