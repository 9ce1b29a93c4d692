"""K-group (block-wise) scales of FP8 GEMM operands, DeepSeek-V3's recipe (docs/fp8.md; tests/specs/t_fp8_kgroup.yaml):
the kernel on the interpreter against a float64 product of the operands dequantized with their block scales, on
ragged shapes; a kernel that quantizes with `quantize` (column_group 128) feeding the GEMM, against the float64
product of the unquantized values, within the recipe's bound; the scales of one operand only, with the other's
applied in the epilogue; what is refused (K not whole groups, a scale of the wrong shape, a block_k that crosses
groups, the Hopper backend); and the kernel compiled for sm_90, where its mainloop is FP8 MMAs."""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from codagen.runtime import Config
from conftest import DEVICE, kernel_model, kernel_types

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
U = 2.0**-24  # fp32's unit roundoff
G = 128  # the K group of the test kernels

# (M, N, K, config): M and N ragged against the tiles and N against the 128-row blocks of b; K whole groups
SHAPES = {
    "ragged": (37, 150, 256, Config(16, 32, 32, 2, 4, 1)),  # 4 K steps per group, N's last block partial
    "ragged-split": (45, 69, 128, Config(16, 32, 32, 2, 4, 1, epilogue_split=2)),  # one block of N, partial
    "tile-spans-blocks": (19, 300, 384, Config(16, 256, 64, 8, 4, 1)),  # a tile's columns in two or three blocks
    "step-is-group": (32, 256, 256, Config(32, 128, 128, 1, 4, 1)),  # block_k = group: one step per group
}


def block_quantize(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (float) quantized to float8_e4m3fn with one scale per rows x cols block (the last ones partial),
    as `quantize` computes it (docs/fp8.md): scale = amax / 448 in fp32 (1 where 0), x / scale rounded to fp32,
    then to the nearest FP8 value. Returns (x_fp8, scales [cdiv(R, rows), cdiv(C, cols)])."""
    r, c = x.shape
    br, bc = -(-r // rows), -(-c // cols)
    padded = torch.zeros(br * rows, bc * cols, dtype=torch.float32)
    padded[:r, :c] = x.float()
    amax = padded.abs().reshape(br, rows, bc, cols).amax(dim=(1, 3))
    scale = (amax.double() / FP8_MAX).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:r, :c]
    q = (x.double() / full.double()).float().clamp(-FP8_MAX, FP8_MAX)
    return q.to(E4M3), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q times its block's scale, in float64."""
    full = scale.double().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return q.double() * full[:q.shape[0], :q.shape[1]]


def operands(m: int, n: int, k: int, g: torch.Generator):
    """Random FP8 operands with block scales spread over powers of two (2^-12 to 2^4): the scales differ from
    group to group, so that a scale applied to the wrong group or block shows."""
    a = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-4, 5, (m, k), generator=g).float()).clamp(-448, 448)
    b = (torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-4, 5, (n, k), generator=g).float()).clamp(-448, 448)
    a_scale = torch.rand(m, k // G, generator=g) * 2.0 ** torch.randint(-12, 4, (m, k // G), generator=g).float()
    b_scale = torch.rand(-(-n // G), k // G, generator=g) * 2.0 ** torch.randint(-12, 4, (-(-n // G), k // G),
                                                                                  generator=g).float()
    return a.to(E4M3), b.to(E4M3), a_scale + 2.0**-14, b_scale + 2.0**-14


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_float64_dequantized_product(test_kernels, shape):
    """product = Σ over K steps of the step's FP8 product times its rows' and columns' scales: against the
    float64 product of the dequantized operands, within fp32's error (each step's dot rounds at most its
    block_k additions, the two scale products and the addition to acc once each)."""
    m, n, k, config = SHAPES[shape]
    g = torch.Generator().manual_seed(zlib.crc32(shape.encode()))
    a, b, a_scale, b_scale = operands(m, n, k, g)
    product = torch.full((m, n), float("nan"), device=DEVICE)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y_scale = torch.tensor(0.375, device=DEVICE)
    test_kernels("t_fp8_kgroup").launch(a.to(DEVICE), b.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE), y_scale,
                                        product=product, y=y, config=config)
    a64, b64 = dequantized(a, a_scale, 1, G), dequantized(b, b_scale, G, G)
    want, magnitude = a64 @ b64.T, a64.abs() @ b64.abs().T
    bound = 2 * (k + 3) * U * magnitude
    assert ((product.cpu().double() - want).abs() <= bound).all()
    # the bound is not loose enough to hide a scale applied to the wrong group: that is off by O(1) relative
    assert (want.abs() > 1e3 * bound).float().mean() > 0.5
    want_y = want * 0.375
    assert ((y.cpu().double() - want_y).abs() <= 2.0**-7 * want_y.abs() + 2 * 0.375 * bound).all()


def test_reference_dequantizes_with_the_block_scales():
    """codagen.reference, the generic tests' oracle (tests/test_primitives.py, test_nan.py), computes the same."""
    from codagen import reference

    g = torch.Generator().manual_seed(3)
    a, b, a_scale, b_scale = operands(5, 130, 256, g)
    out = reference.run(kernel_model("t_fp8_kgroup"), kernel_types("t_fp8_kgroup"),
                        {"a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale, "y_scale": torch.tensor(1.0)}, 16, 16)
    want = dequantized(a, a_scale, 1, G) @ dequantized(b, b_scale, G, G).T
    torch.testing.assert_close(out["product"], want, rtol=1e-15, atol=0)


# -- a kernel that quantizes (column_group 128) feeding the GEMM, and a-scales only ------------------------------
QUANTIZE = """\
kernel: kg_quantize
doc: Activations quantized to float8_e4m3fn per row and 128 columns, DeepSeek-V3's 1 x 128 recipe.
column_group: 128
inputs:
  x: {shape: [M, N], dtype: float32}
outputs:
  x_fp8: {shape: [M, N], dtype: float8_e4m3fn}
  x_scale: {shape: [M, groups(N)], dtype: float32}
epilogue:
  - fp8_scale: {x: x, dtype: float8_e4m3fn, out: s}
  - quantize: {x: x, scale: s, dtype: float8_e4m3fn, out: q}
  - store: {x: q, to: x_fp8}
  - store: {x: s, to: x_scale}
"""

A_ONLY = """\
kernel: kg_a_only
doc: A GEMM of FP8 operands with K-group scales of a only, and a scale per row of w (column of y) in the epilogue.
gemm:
  a: x
  b: w
  scales: {a: x_scale, group: 128}
inputs:
  x: {shape: [M, K], dtype: float8_e4m3fn}
  w: {shape: [N, K], dtype: float8_e4m3fn}
  x_scale: {shape: [M, groups(K)], dtype: float32}
  w_scale: {shape: [N], dtype: float32}
outputs:
  y: {shape: [M, N], dtype: float32}
epilogue:
  - scale: {x: acc, by: w_scale, out: yw}
  - store: {x: yw, to: y}
"""


@pytest.fixture(scope="module")
def kg(tmp_path_factory):
    """The two kernels above built into a package of their own: name -> module."""
    import importlib
    import sys

    from codagen import api

    root = tmp_path_factory.mktemp("kgroup")
    for name, text in (("kg_quantize", QUANTIZE), ("kg_a_only", A_ONLY)):
        (root / f"{name}.yaml").write_text(text, encoding="utf-8")
    api.build([root / "kg_quantize.yaml", root / "kg_a_only.yaml"], out=root / "cg_kgroup")
    sys.path.insert(0, str(root))
    yield lambda name: importlib.import_module(f"cg_kgroup.kernels.{name}")
    sys.path.remove(str(root))


def _quantize(kg, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    x_fp8 = torch.empty(m, k, dtype=E4M3, device=DEVICE)
    x_scale = torch.empty(m, k // G, device=DEVICE)
    kg("kg_quantize").launch(x.to(DEVICE), x_fp8=x_fp8, x_scale=x_scale, config=Config(16, 128, 16, 1, 4, 1))
    return x_fp8, x_scale


@pytest.mark.parametrize("m, n, k", [(37, 150, 256), (20, 77, 384)])
def test_quantize_feeds_the_gemm(test_kernels, kg, m, n, k):
    """x quantized by `quantize` (1 x 128 groups) and w by 128 x 128 blocks, multiplied by the K-group-scaled
    GEMM: equal to the float64 product of the unquantized x and w within the recipe's bound (docs/fp8.md): each
    operand's element off by at most 2^-4 of itself (normal FP8 values) or 2^-10 of its scale (subnormal ones),
    their products summed with fp32's error. Rows of very different magnitudes and a few outliers, which only
    cost their own group precision."""
    g = torch.Generator().manual_seed(zlib.crc32(f"chain/{m}/{n}/{k}".encode()))
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 6, (m, 1), generator=g).float()
    x[3, 5], x[7, 200 % k] = 3e4, -1e-30  # an outlier, and a value its group's scale flushes to 0
    w = torch.randn(n, k, generator=g) * k**-0.5
    x_fp8, x_scale = _quantize(kg, x)
    w_fp8, w_scale = block_quantize(w, G, G)
    assert torch.equal(x_fp8.cpu().view(torch.uint8), block_quantize(x, 1, G)[0].view(torch.uint8))
    product = torch.empty(m, n, device=DEVICE)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    test_kernels("t_fp8_kgroup").launch(x_fp8, w_fp8.to(DEVICE), x_scale, w_scale.to(DEVICE),
                                        torch.tensor(1.0, device=DEVICE), product=product, y=y,
                                        config=Config(16, 32, 32, 2, 4, 1))
    want = x.double() @ w.double().T
    err_x = 2.0**-4 * (1 + 2.0**-20) * x.double().abs() + 2.0**-10 * x_scale.cpu().double().repeat_interleave(G, 1)
    err_w = (2.0**-4 * (1 + 2.0**-20) * w.double().abs()
             + 2.0**-10 * w_scale.double().repeat_interleave(G, 0).repeat_interleave(G, 1)[:n])
    xa, wa = x.double().abs(), w.double().abs()
    bound = err_x @ wa.T + xa @ err_w.T + err_x @ err_w.T + 2 * (k + 3) * U * (xa + err_x) @ (wa + err_w).T
    err = (product.cpu().double() - want).abs()
    assert (err <= bound).all()
    # in practice the roundings add as √K terms: within the standard deviation docs/fp8.md gives
    norms = x.double().norm(dim=1)[:, None] * w.double().norm(dim=1)[None, :]
    assert (err / norms).pow(2).mean().sqrt() <= 0.05


def test_infinite_group_gives_nan_rows(test_kernels, kg):
    """An infinity in a group of x: `quantize` writes an infinite scale and the group's values as ±0 and NaN
    (docs/fp8.md); the GEMM's row is NaN, as the float64 product of the dequantized operands is."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(4, 256, generator=g), torch.randn(40, 256, generator=g) * 0.1
    x[2, 130] = float("inf")
    x_fp8, x_scale = _quantize(kg, x)
    assert torch.isinf(x_scale[2, 1]) and not torch.isinf(x_scale[2, 0])
    w_fp8, w_scale = block_quantize(w, G, G)
    product = torch.empty(4, 40, device=DEVICE)
    test_kernels("t_fp8_kgroup").launch(x_fp8, w_fp8.to(DEVICE), x_scale, w_scale.to(DEVICE),
                                        torch.tensor(1.0, device=DEVICE), product=product,
                                        y=torch.empty(4, 40, dtype=torch.bfloat16, device=DEVICE),
                                        config=Config(16, 32, 32, 1, 4, 1))
    want = dequantized(x_fp8.cpu(), x_scale.cpu(), 1, G) @ dequantized(w_fp8, w_scale, G, G).T
    assert torch.isnan(want[2]).all() and torch.isnan(product[2]).all()
    assert torch.isfinite(product[[0, 1, 3]]).all()


def test_scales_of_a_only_with_per_channel_weight_scales(kg):
    """gemm.scales with `a` only: b's scales, one per row of w (a column of y), are the epilogue's `scale` step,
    as for FP8 operands without K-group scales."""
    g = torch.Generator().manual_seed(5)
    m, n, k = 29, 70, 256
    x, _, x_scale, _ = operands(m, n, k, g)
    w = (torch.randn(n, k, generator=g) * 8).to(E4M3)
    w_scale = torch.rand(n, generator=g) + 0.1
    y = torch.full((m, n), float("nan"), device=DEVICE)
    kg("kg_a_only").launch(x.to(DEVICE), w.to(DEVICE), x_scale.to(DEVICE), w_scale.to(DEVICE), y=y,
                           config=Config(16, 32, 32, 2, 4, 1))
    x64 = dequantized(x, x_scale, 1, G)
    want = x64 @ w.double().T * w_scale.double()[None, :]
    magnitude = x64.abs() @ w.double().abs().T * w_scale.double()[None, :]
    assert ((y.cpu().double() - want).abs() <= 2 * (k + 4) * U * magnitude).all()


# -- what is refused --------------------------------------------------------------------------------------------
def _launch_args(m=8, n=40, k=256, a_groups=None):
    g = torch.Generator().manual_seed(2)
    a, b, a_scale, b_scale = operands(m, n, k - k % G or G, g)
    a = torch.zeros(m, k, dtype=E4M3) if k % G else a
    b = torch.zeros(n, k, dtype=E4M3) if k % G else b
    if a_groups is not None:
        a_scale = torch.ones(m, a_groups)
    return dict(a=a.to(DEVICE), b=b.to(DEVICE), a_scale=a_scale.to(DEVICE), b_scale=b_scale.to(DEVICE),
                y_scale=torch.tensor(1.0, device=DEVICE), product=torch.empty(m, n, device=DEVICE),
                y=torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE))


def test_k_not_whole_groups_is_refused(test_kernels):
    with pytest.raises(ValueError, match=r"t_fp8_kgroup: K must be a multiple of the K-group scales' group 128 "
                                         r"\(gemm.scales: one scale per 128 columns of K\); got K=200"):
        test_kernels("t_fp8_kgroup").launch(**_launch_args(k=200), config=Config(16, 32, 32, 1, 4, 1))


def test_scales_of_the_wrong_shape_are_refused(test_kernels):
    with pytest.raises(ValueError, match=r"t_fp8_kgroup: 'a_scale' must have shape \[M, groups\(K\)\] = \(8, 2\) "
                                         r"for M=8, N=40, K=256 and K group 128, got \(8, 3\)"):
        test_kernels("t_fp8_kgroup").launch(**_launch_args(a_groups=3), config=Config(16, 32, 32, 1, 4, 1))


def test_block_k_crossing_groups_is_refused(test_kernels):
    with pytest.raises(ValueError, match=r"t_fp8_kgroup: the config's block_k 256 does not divide the K group 128 "
                                         r"of the gemm's scales"):
        test_kernels("t_fp8_kgroup").launch(**_launch_args(), config=Config(16, 32, 256, 1, 4, 1))


def test_defaults_and_candidates_keep_within_the_group():
    """The GPU's default takes a block_k of at most the group (the interpreter's is 32, the smallest group); run-time
    tuning leaves out the candidates whose K steps would cross groups (all of them for a group of 32: the default is
    left)."""
    from codagen.runtime import autotune, configs

    assert autotune.pick_config("k", "f", None, 64, 64, 256, torch.device("cpu"), k_group=32).block_k == 32
    default = configs.with_k_group(configs.gpu_default(), 32)
    assert default.block_k == 32
    pool = autotune._candidates("k", 4096, 4096, 4096, torch.device("cpu"), default, False, None, 1, None, False, 32)
    assert pool == [default]
    default = configs.gpu_k_group_default(configs.gpu_default(), 128)
    pool = autotune._candidates("k", 4096, 4096, 4096, torch.device("cpu"), default, False, None, 1, None, False, 128)
    assert len(pool) > 1 and all(128 % c.block_k == 0 for c in pool)
    # FP8 operands: BK 128 first (a stage of bf16's BK 64 in bytes, the default's), then BK 64; a group of 64 keeps
    # BK 64 only
    assert {c.block_k for c in pool} == {64, 128} and pool[0] == default and default.block_k == 128
    default = configs.gpu_k_group_default(configs.gpu_default(), 64)
    pool = autotune._candidates("k", 4096, 4096, 4096, torch.device("cpu"), default, False, None, 1, None, False, 64)
    assert {c.block_k for c in pool} == {64}


def test_tune_candidates_of_fp8_operands():
    """`codagen tune` times an FP8 GEMM at BK 128 first, then at bf16's BK 64, never with the cuBLAS mainloop; with
    K-group scales, the 64-row tiles that hold the mainloop's two tiles unspilled join."""
    from codagen.tune.candidates import FP8_K_GROUP_CANDIDATES, GEMM_CANDIDATES, candidates

    pool = candidates(kernel_model("t_fp8_kgroup"))
    own = GEMM_CANDIDATES + FP8_K_GROUP_CANDIDATES
    assert pool == tuple(dataclasses.replace(c, block_k=128) for c in own) + own
    assert all(c.mainloop != "cublas" for c in pool)


def test_hopper_backend_keeps_the_tl_kernel():
    from codagen.emit import gluon

    (fallback,) = gluon.unlowered(kernel_model("t_fp8_kgroup"), kernel_types("t_fp8_kgroup"))
    assert "t_fp8_kgroup.yaml:4:1: t_fp8_kgroup: FP8 GEMM operands" in str(fallback)


def test_kernel_compiles_for_sm90(test_kernels):
    """The GPU's mainloop multiplies the FP8 tiles as they are, and scales each step's product: the kernel
    compiles to PTX for sm_90 (block_k 64, within the group), in a subprocess (the compiler needs the
    interpreter off), with FP8 wgmma instructions. Not run: no GPU here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_groups import _COMPILE

    module = test_kernels("t_fp8_kgroup")
    built = Path(module.__file__).resolve().parents[2]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), str(built)])}
    run = subprocess.run([sys.executable, "-c", _COMPILE, module.__name__, "--ptx"],
                         capture_output=True, text=True, env=env, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(f"{module.__name__} ") == 2 and "False" not in run.stdout.split()
    assert ".f32.e4m3.e4m3" in run.stdout and "wgmma.mma_async" in run.stdout


def test_codagen_tune_discards_candidates_crossing_groups(test_kernels):
    """`codagen tune` (tune.harness.tune_shape) checks the candidates that keep within the groups against the
    float64 reference and discards the others, saying why."""
    from codagen.tune import harness, shapes
    from conftest import _checked
    from test_tune import FakeTimer

    inside, across = Config(16, 32, 32, 2, 4, 1), Config(16, 32, 256, 2, 4, 1)
    outcome = harness.tune_shape(_checked()["t_fp8_kgroup"], test_kernels("t_fp8_kgroup"), shapes.Shape(37, 150, 256),
                                 torch.device(DEVICE), pool=(inside, across), timer=FakeTimer(), check_rows=37)
    assert outcome.best == inside and [c for c, _ in outcome.timed] == [inside]
    (why,) = [why for c, why in outcome.discarded if c == across]
    assert why.startswith("block_k 256 does not divide the K group 128 of the gemm's scales")


def test_tuning_table_entry_crossing_groups_is_refused_at_its_place(tmp_path):
    """A tuning table's entry whose block_k crosses the K groups is reported at its line and column by `codagen
    build --check` (tune.tables.check_tables) and skipped at a launch (runtime.tables.entries); the same entry
    with a block_k of 64 is used."""
    import json

    import triton

    from codagen.fingerprint import fingerprint
    from codagen.runtime import tables as runtime_tables
    from codagen.tune import tables

    kernel = kernel_model("t_fp8_kgroup")
    path = tmp_path / "tuning" / "h100" / "t_fp8_kgroup.json"
    path.parent.mkdir(parents=True)
    inside = {"backend": "tl", "config": {"block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8,
                                           "num_warps": 8, "num_stages": 3}}
    across = {"backend": "tl", "config": {**inside["config"], "block_m": 64, "block_k": 256}}
    path.write_text(json.dumps({"kernel": "t_fp8_kgroup", "spec": kernel.source, "fingerprint": fingerprint(kernel),
                                "triton": triton.__version__, "gpu": "h100",
                                "shapes": {"4096x4096x4096": inside, "8192x4096x8192": across}}, indent=1))
    line = path.read_text().split("\n").index('  "8192x4096x8192": {') + 1
    _, errors = tables.check_tables(tmp_path / "tuning", [kernel])
    (error,) = errors
    assert (error.line, error.col) == (line, 3)
    assert "entry '8192x4096x8192': block_k 256 does not divide the K group 128 of the gemm's scales" \
        in error.located()
    used = runtime_tables.entries(str(path), fingerprint(kernel), triton.__version__, None, True, False, 128)
    assert list(used) == ["4096x4096x4096"]


def test_gpu_default_of_a_k_group_gemm_holds_two_tiles_without_spilling():
    """A K-group mainloop keeps the accumulator and each step's product: the GPU default keeps both at 64 fp32
    values a thread or fewer (128 x 256 on 8 warps, as 256-wide column groups widen GPU_DEFAULT to, spilled 488
    bytes a thread compiled for sm_90; 64 x 256 none), its K steps one group of up to 128 (FP8 operands: a stage of
    bf16's BK 64 in bytes, one scaling per group); without K-group scales the default is unchanged."""
    from codagen.runtime import autotune
    from codagen.runtime.configs import gpu_default, gpu_k_group_default

    wide = gpu_default(256, 28672)
    assert (wide.block_m, wide.block_n, wide.num_warps) == (128, 256, 8)
    for group, k_group, want in ((256, 128, (64, 256, 128)), (None, 128, (128, 128, 128)), (None, 32, (128, 128, 32)),
                                 (None, 256, (128, 128, 128)), (256, None, (128, 256, 64))):
        config = gpu_k_group_default(gpu_default(group, 28672), k_group)
        assert (config.block_m, config.block_n, config.block_k) == want, (group, k_group)
        if k_group:
            assert config.block_m * config.block_n <= 64 * 32 * config.num_warps
    # run-time tuning of an untuned shape tries that default first, and no candidate crossing the groups
    default = gpu_k_group_default(gpu_default(256, 28672), 128)
    for tile_dependent in (False, True):
        pool = autotune._candidates("gate_up_swiglu_fp8", 8192, 28672, 4096, torch.device("cuda"), default,
                                    tile_dependent, 256, 1, None, cublas=False, k_group=128)
        assert pool[0] == default and all(128 % c.block_k == 0 and c.block_n % 256 == 0 for c in pool)
        assert not tile_dependent or {(c.block_m, c.block_n) for c in pool} == {(64, 256)}
