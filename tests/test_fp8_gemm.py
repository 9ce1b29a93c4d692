"""FP8 GEMM operands (docs/fp8.md; tests/specs/t_fp8_gemm.yaml, t_fp8_gemm_e5m2.yaml): the kernels on the
interpreter against float64 products of the dequantized FP8 inputs, on ragged shapes, within fp32 accumulation's
error bound; what is refused (mainloop "cublas", the Hopper backend, an FP8 tensor as the type T); and both
kernels compiled for sm_90, where their mainloops are FP8 MMAs."""
from __future__ import annotations

import zlib

import pytest
import torch

from codagen.runtime import Config
from conftest import DEVICE, fp8_mma_error, kernel_model, kernel_types

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = 2.0**-24  # fp32's unit roundoff
# (M, N, K, config): ragged against the tiles and K steps, exact ones, one tile over all, epilogue slices
SHAPES = {
    "ragged": (37, 50, 29, Config(16, 32, 32, 2, 4, 1)),
    "ragged-split": (45, 69, 40, Config(16, 32, 32, 2, 4, 1, epilogue_split=2)),
    "exact": (32, 64, 64, Config(16, 16, 32, 1, 4, 1)),
    "one-tile": (19, 22, 13, Config(64, 64, 32, 8, 4, 1)),
}


def fp8_values(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random values of an FP8 format over much of its range: randn times powers of two from 2^-8 to 2^6,
    clamped to the largest value and rounded to the format (subnormals, zeros and ±FP8_MAX among them)."""
    largest = torch.finfo(dtype).max
    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-8, 7, shape, generator=g).float()
    x.view(-1)[:3] = torch.tensor([largest, -largest, 0.0])
    return x.clamp(-largest, largest).to(dtype).to(DEVICE)


def _product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ b^T of the dequantized operands in float64, and |a| @ |b|^T (what fp32 accumulation's error scales
    with: each product of two FP8 values is exact in fp32, each of the K - 1 additions rounds)."""
    a, b = a.cpu().double(), b.cpu().double()
    return a @ b.T, a.abs() @ b.abs().T


@pytest.mark.parametrize("shape", list(SHAPES))
def test_e4m3_by_row_and_column_scales(test_kernels, shape):
    m, n, k, config = SHAPES[shape]
    g = torch.Generator().manual_seed(zlib.crc32(shape.encode()))
    a, b = fp8_values((m, k), E4M3, g), fp8_values((n, k), E4M3, g)
    a_scale, b_scale = (torch.rand(s, generator=g).mul(4).add(2.0**-10).to(DEVICE) for s in (m, n))
    product = torch.full((m, n), float("nan"), device=DEVICE)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    test_kernels("t_fp8_gemm").launch(a, b, a_scale, b_scale, product=product, y=y, config=config)
    want, magnitude = _product(a, b)
    mma = fp8_mma_error(a, b)
    assert ((product.cpu().double() - want).abs() <= k * U * magnitude + mma).all()
    scales = a_scale.cpu().double()[:, None] * b_scale.cpu().double()[None, :]
    want_y, bound_y = want * scales, ((k + 2) * U * magnitude + mma) * scales
    # bf16: within an ulp (the interpreter's conversion from fp32 truncates, the GPU's rounds to nearest)
    assert ((y.cpu().double() - want_y).abs() <= 2.0**-7 * want_y.abs() + 2 * bound_y).all()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_e5m2_by_e4m3_with_tensor_scales(test_kernels, shape):
    m, n, k, config = SHAPES[shape]
    g = torch.Generator().manual_seed(zlib.crc32(f"e5m2/{shape}".encode()))
    dy, w = fp8_values((m, k), E5M2, g), fp8_values((n, k), E4M3, g)
    dy_scale, w_scale = torch.tensor(3.0e-3, device=DEVICE), torch.tensor(-0.75, device=DEVICE)
    dx = torch.full((m, n), float("nan"), device=DEVICE)
    test_kernels("t_fp8_gemm_e5m2").launch(dy, w, dy_scale, w_scale, dx=dx, config=config)
    want, magnitude = _product(dy, w)
    scale = 3.0e-3 * -0.75
    bound = ((k + 3) * U * magnitude + fp8_mma_error(dy, w)) * abs(scale)
    assert ((dx.cpu().double() - want * scale).abs() <= bound).all()


def test_reference_dequantizes(test_kernels):
    """The float64 reference the generic tests compare with reads the FP8 operands as their exact values."""
    from codagen import reference

    g = torch.Generator().manual_seed(7)
    a, b = fp8_values((5, 9), E4M3, g), fp8_values((6, 9), E4M3, g)
    ones_m, ones_n = torch.ones(5, device=DEVICE), torch.ones(6, device=DEVICE)
    out = reference.run(kernel_model("t_fp8_gemm"), kernel_types("t_fp8_gemm"),
                        {"a": a, "b": b, "a_scale": ones_m, "b_scale": ones_n}, 16, 16)
    assert torch.equal(out["product"].cpu(), _product(a, b)[0])


def test_cublas_mainloop_is_refused(test_kernels):
    """torch.mm takes no FP8 operands: Config(mainloop="cublas") is refused at the launch, naming the GEMM's
    place in the spec (torch._scaled_mm is not used yet)."""
    g = torch.Generator().manual_seed(1)
    a, b = fp8_values((8, 16), E4M3, g), fp8_values((8, 16), E4M3, g)
    outs = {"product": torch.empty(8, 8, device=DEVICE),
            "y": torch.empty(8, 8, dtype=torch.bfloat16, device=DEVICE)}
    with pytest.raises(ValueError, match=r"t_fp8_gemm: Config\(mainloop='cublas'\) makes the GEMM's product with "
                                         r"torch.mm, which takes no FP8 operands, and the GEMM at "
                                         r"\S*t_fp8_gemm.yaml:6:7 has FP8 operands"):
        test_kernels("t_fp8_gemm").launch(a, b, torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE), **outs,
                                          config=Config(16, 16, 32, 1, 4, 1, mainloop="cublas"))


def test_k_steps_below_one_fp8_mma_are_refused(test_kernels):
    """An FP8 MMA takes 32 columns of K at least (Triton refuses a smaller FP8 tl.dot on GPUs): block_k 16 is
    refused at the launch, on every device, naming the GEMM's place in the spec."""
    g = torch.Generator().manual_seed(2)
    a, b = fp8_values((8, 64), E4M3, g), fp8_values((8, 64), E4M3, g)
    outs = {"product": torch.empty(8, 8, device=DEVICE),
            "y": torch.empty(8, 8, dtype=torch.bfloat16, device=DEVICE)}
    with pytest.raises(ValueError, match=r"t_fp8_gemm: Config\(block_k=16\), but the GEMM at \S*t_fp8_gemm.yaml:6:7 "
                                         r"has FP8 operands, whose MMAs take K steps of 32 or more"):
        test_kernels("t_fp8_gemm").launch(a, b, torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE), **outs,
                                          config=Config(16, 16, 16, 1, 4, 1))


def test_runtime_tuning_leaves_out_cublas():
    from codagen.runtime import autotune

    default = Config(128, 128, 64, 8, 8, 3)
    pools = {cublas: autotune._candidates("k", 256, 256, 65536, torch.device("cpu"), default, False, None, 1, None,
                                          cublas) for cublas in (True, False)}
    assert any(c.mainloop == "cublas" for c in pools[True])  # K at least 8 times M and N: where it may pay
    assert not any(c.mainloop == "cublas" for c in pools[False])


@pytest.mark.parametrize("name, operand", [("t_fp8_gemm", "float8_e4m3fn 'a'"),
                                           ("t_fp8_gemm_e5m2", "float8_e5m2 'dy'")])
def test_hopper_backend_keeps_the_tl_kernel(name, operand):
    from codagen.emit import gluon

    line = {"t_fp8_gemm": 4, "t_fp8_gemm_e5m2": 3}[name]  # the line of `kernel:`
    (fallback,) = gluon.unlowered(kernel_model(name), kernel_types(name))
    assert f"{name}.yaml:{line}:1: {name}: FP8 GEMM operands ({operand})" in str(fallback)
    assert "it keeps the tl kernel only" in str(fallback)


def test_fp8_tensor_is_not_the_type_t(test_kernels):
    """An FP8 tensor passed where a kernel takes its type T (a bf16 GEMM's operand) is refused, not multiplied."""
    from conftest import draw_args

    module, config = test_kernels("t_scale"), Config(16, 16, 16, 1, 4, 1)
    kwargs = draw_args(module, {"M": 4, "N": 8, "K": 16}, torch.bfloat16, config).kwargs
    kwargs["a"] = kwargs["a"].to(E4M3)
    with pytest.raises(ValueError, match=r"t_scale: 'a' must be float16, bfloat16 or float32, got torch.float8_e4m3fn"):
        module.launch(**kwargs, config=config)


def test_kernels_compile_for_sm90(test_kernels):
    """The GPU's mainloop multiplies the FP8 tiles as they are (the interpreter's upcasts them): both kernels
    compile to PTX for sm_90, in a subprocess (the compiler needs the interpreter off), with FP8 wgmma
    instructions, e4m3 by e4m3 and e5m2 by e4m3. Not run: no GPU here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_groups import _COMPILE

    modules = [test_kernels(name) for name in ("t_fp8_gemm", "t_fp8_gemm_e5m2")]
    built = Path(modules[0].__file__).resolve().parents[2]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), str(built)])}
    run = subprocess.run([sys.executable, "-c", _COMPILE, *(m.__name__ for m in modules), "--ptx"],
                         capture_output=True, text=True, env=env, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(run.stdout.count(f"{m.__name__} ") == 2 for m in modules) and "False" not in run.stdout.split()
    assert ".f32.e4m3.e4m3" in run.stdout and ".f32.e5m2.e4m3" in run.stdout
    assert "wgmma.mma_async" in run.stdout



def test_tuning_table_entry_with_cublas_is_refused_at_its_place(tmp_path):
    """A tuning table's entry that asks an FP8 kernel for mainloop "cublas" is reported at its line and column
    by `codagen build --check` (tune.tables.check_tables) and skipped at a launch (runtime.tables.entries), like
    every entry no launch can use; the same entry with mainloop "triton" is used."""
    import json

    import triton

    from codagen import tablefile
    from codagen.fingerprint import fingerprint
    from codagen.runtime import tables as runtime_tables
    from codagen.tune import tables

    kernel = kernel_model("t_fp8_gemm")
    path = tmp_path / "tuning" / "h100" / "t_fp8_gemm.json"
    path.parent.mkdir(parents=True)
    entry = {"backend": "tl", "config": {"block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8,
                                          "num_warps": 8, "num_stages": 3}}
    cublas = {"backend": "tl", "config": {**entry["config"], "mainloop": "cublas"}}
    path.write_text(json.dumps({"kernel": "t_fp8_gemm", "spec": kernel.source, "fingerprint": fingerprint(kernel),
                                "triton": triton.__version__, "gpu": "h100",
                                "shapes": {"4096x4096x4096": entry, "8192x4096x65536": cublas}}, indent=1))
    line = path.read_text().split("\n").index('  "8192x4096x65536": {') + 1
    _, errors = tables.check_tables(tmp_path / "tuning", [kernel])
    (error,) = errors
    assert (error.line, error.col) == (line, 3)
    assert "entry '8192x4096x65536': mainloop 'cublas' makes the GEMM's product with torch.mm, which takes no FP8" \
        in error.located()
    used = runtime_tables.entries(str(path), fingerprint(kernel), triton.__version__, None, True, False)
    assert list(used) == ["4096x4096x4096"]
    assert len(tablefile.read_table(path, None, True).entries) == 2  # a kernel whose GEMM torch.mm makes: both
