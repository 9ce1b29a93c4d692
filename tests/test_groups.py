"""Column groups (`column_group`, `group_reduce`, group values [M, groups(N)]): the tile constraint they imply,
kept by every path that chooses a tile shape (the defaults, run-time tuning, `codagen tune`'s candidates) and
refused with a clear message where a caller or a spec breaks it. The values themselves are checked against the
float64 reference with the other primitives (tests/test_primitives.py, tests/specs/t_group_reduce.yaml)."""
from __future__ import annotations

import pytest
import torch

from codagen import api
from codagen.errors import ValidationFailed
from codagen.runtime import Config, configs
from codagen.tune.candidates import candidates
from conftest import DEVICE, draw_args

CFG = Config(16, 32, 16, 2, 4, 1)  # 32-wide tiles: whole groups of 8


def _args(module, n=48, m=20):
    return draw_args(module, {"M": m, "N": n, "K": 12}, torch.float32, CFG,
                     generator=torch.Generator().manual_seed(0)).kwargs


def test_launch_refuses_tiles_that_cut_a_group(test_kernels):
    module = test_kernels("t_group_reduce")
    kwargs = _args(module)
    module.launch(**kwargs, config=CFG)  # 32 columns per slice: whole groups
    split = Config(16, 16, 16, 2, 4, 1, epilogue_split=4)  # the epilogue on 4 columns at a time
    with pytest.raises(ValueError, match=r"t_group_reduce: the config's epilogue runs on 4 columns at a time "
                                         r"\(block_n 16 / epilogue_split 4\), which is not a multiple of the spec's "
                                         r"column_group 8; use a block_n of 32 or more"):
        module.launch(**_args(module), config=split)


def test_launch_refuses_n_that_is_not_whole_groups(test_kernels):
    module = test_kernels("t_group_reduce")
    kwargs = _args(module, n=44)
    with pytest.raises(ValueError, match=r"t_group_reduce: N must be a multiple of the column group width 8 "
                                         r"\(whole groups\); got N=44"):
        module.launch(**kwargs, config=CFG)


def test_launch_checks_group_values_against_n(test_kernels):
    module = test_kernels("t_group_reduce")
    kwargs = _args(module)
    kwargs["g_in"] = torch.randn(20, 7, device=DEVICE)  # N = 48 has 6 groups of 8
    with pytest.raises(ValueError, match=r"'g_in' has groups\(N\) = 7, which does not match N = 48"):
        module.launch(**kwargs, config=CFG)


def test_the_default_tile_is_widened_to_whole_groups(test_kernels):
    """Without a config, the op and the launcher agree on a tile that holds whole groups, here and on a GPU."""
    module = test_kernels("t_group_reduce")
    kwargs = _args(module, n=72)
    inputs = {d.name: kwargs[d.name] for d in module.DECLS if not d.output or d.name == "g_acc"}
    outs = module.t_group_reduce(**inputs)  # allocates its outputs with the default config
    assert outs[0].shape == (20, 9)
    assert configs.widened(configs.INTERPRETER_DEFAULT, 128).block_n == 128
    assert configs.widened(configs.GPU_DEFAULT, 256).block_n == 256
    assert configs.widened(configs.GPU_DEFAULT, 64) == configs.GPU_DEFAULT
    split = Config(128, 128, 64, epilogue_split=2)
    assert configs.widened(split, 128).epilogue_n == 128
    # slices of 512 columns would need a 1024-wide tile: the widest tile, its epilogue whole
    assert (configs.widened(split, 512).block_n, configs.widened(split, 512).epilogue_split) == (512, 1)


def test_runtime_candidates_hold_whole_groups():
    for tile_dependent in (False, True):
        pool = configs.runtime_candidates(True, tile_dependent, 256)
        assert pool and all(c.epilogue_n % 256 == 0 for c in pool)
    assert configs.runtime_candidates(False, True, None) == configs.runtime_candidates(False, True)


def _kernel(tmp_path, group: int):
    (tmp_path / "heads.yaml").write_text(f"""\
kernel: heads
doc: Per-head RMS of a projection.
column_group: {group}
gemm: {{a: a, b: b}}
inputs: {{a: [M, K], b: [N, K]}}
outputs: {{o: [M, N]}}
epilogue:
  - group_reduce: {{op: sumsq, x: acc, out: ss}}
  - scale: {{x: acc, by: ss, out: y}}
  - store: {{x: y, to: o}}
""", encoding="utf-8")
    (checked,) = api.load([tmp_path / "heads.yaml"])
    return checked.kernel


def test_tuner_candidates_hold_whole_groups(tmp_path):
    pool = candidates(_kernel(tmp_path, 256), ("gluon",))
    assert pool and all(c.epilogue_n % 256 == 0 for c in pool)
    assert all(c.backend == "tl" for c in pool)  # the Hopper kernels are 128 wide: none fits


def test_tuner_without_a_fitting_candidate_points_at_column_group(tmp_path):
    kernel = _kernel(tmp_path, 512)
    with pytest.raises(ValidationFailed) as info:
        candidates(kernel)
    (error,) = info.value.errors
    assert (error.loc.line, error.loc.col) == (3, 15)
    assert error.message == ("column_group 512: no tuning candidate of heads has epilogue slices that hold whole "
                             "groups (the widest is 256 columns); use a column_group of at most 256")


_COMPILE = """\
import importlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTER = {"T": "*bf16", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "index": "*i64",
           "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}
for path in [a for a in sys.argv[1:] if a != "--ptx"]:
    module = importlib.import_module(path)
    fn, decls = getattr(module, module.NAME + "_kernel"), {d.name: d for d in module.DECLS}
    for split in (1, 2):
        consts = dict(BLOCK_M=128, BLOCK_N=128 * split, BLOCK_K=64, GROUP_M=8, EVEN_K=False, UPCAST_DOT=False,
                      DOT_PRECISION="tf32", TMA=False, FLATTEN=False, WARP_SPECIALIZE=False, EPILOGUE_SPLIT=split,
                      INT64=False, ACC_IN=False)
        consts = {n: v for n, v in consts.items() if n in fn.arg_names}  # a kernel without a GEMM has no BLOCK_K
        consts.update({n: None for n in fn.arg_names if n.endswith("_desc") or n == "_acc_ptr"})
        signature = {n: "constexpr" if n in consts else POINTER[decls[n[1:-4]].dtype] if n.endswith("_ptr")
                     else "i32" if n.startswith("_stride_") or n in ("M", "N", "K", "NUM_PROGRAMS") else "fp32"
                     for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        print(path, split, "ptx" in compiled.asm)
        if "--ptx" in sys.argv:
            print(compiled.asm["ptx"])
"""


def test_group_kernels_compile_for_sm90(test_kernels):
    """The interpreter runs group steps through numpy; compiled Triton takes another path (tl.reduce with a
    NaN-propagating max, reshapes of the accumulator's layout): compile the kernels that use them to PTX for
    sm_90, with 128- and 256-wide tiles (one and two heads of 128), in a subprocess, since the compiler needs
    Triton's interpreter off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    built = Path(test_kernels("t_group_reduce").__file__).resolve().parents[2]
    paths = [f"{test_kernels('t_group_reduce').__package__}.t_group_reduce", "generated.kernels.qkv_qk_norm_rope",
             "generated.kernels.qk_norm_rope_bwd"]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), str(built)])}
    run = subprocess.run([sys.executable, "-c", _COMPILE, *paths], capture_output=True, text=True, env=env, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split().count("True") == 2 * len(paths), run.stdout


# -- column_group N: one group, the whole row, which one tile spans ---------------------------------------------
ROW_NORM = """\
kernel: row_norm
doc: Projection with an RMSNorm of each whole row and the rows' maxima, for tiles that span N.
column_group: N
gemm: {a: a, b: b}
inputs: {a: [M, K], b: [N, K], w: [N], inv_n: scalar}
outputs: {y: [M, N], rstd: {shape: [M], dtype: float32}, top: [M], lse: {shape: [M], dtype: float32}}
epilogue:
  - group_reduce: {op: sumsq, x: acc, out: ss}    # a row vector: the whole row's sum
  - mul: {x: ss, y: inv_n, out: ms}
  - add: {x: ms, y: 1.0e-6, out: ms_eps}
  - rsqrt: {x: ms_eps, out: r}
  - store: {x: r, to: rstd}
  - scale: {x: acc, by: r, out: normed}
  - scale: {x: normed, by: w, out: yv}
  - store: {x: yv, to: y}
  - group_reduce: {op: max, x: acc, out: mx}
  - store: {x: mx, to: top}
  - group_reduce: {op: logsumexp, x: acc, out: lse_v}
  - store: {x: lse_v, to: lse}
"""


@pytest.fixture(scope="module")
def row_norm(tmp_path_factory):
    """The row_norm kernel built into a package of its own: (module, checked kernel)."""
    import importlib
    import sys

    root = tmp_path_factory.mktemp("row_norm")
    (root / "row_norm.yaml").write_text(ROW_NORM, encoding="utf-8")
    (checked,) = api.load([root / "row_norm.yaml"])
    api.build([root / "row_norm.yaml"], out=root / "cg_row_norm")
    sys.path.insert(0, str(root))
    yield importlib.import_module("cg_row_norm.kernels.row_norm"), checked
    sys.path.remove(str(root))


@pytest.mark.parametrize("n, config", [(50, Config(16, 64, 16, 2, 4, 1)), (100, None),
                                       (120, Config(16, 256, 16, 2, 4, 1, epilogue_split=2))],
                         ids=["ragged-64", "default-widened", "split"])
def test_whole_row_reductions_match_pytorch(row_norm, n, config):
    """Ragged M and N against PyTorch's RMSNorm, max and logsumexp over each whole row (float64), and the
    float64 reference interpreter."""
    from codagen import reference

    module, checked = row_norm
    g = torch.Generator().manual_seed(n)
    m, k = 37, 29
    a, b, w = (torch.randn(*s, generator=g).to(DEVICE) for s in ((m, k), (n, k), (n,)))
    y, rstd, top = torch.empty(m, n, device=DEVICE), torch.empty(m, device=DEVICE), torch.empty(m, device=DEVICE)
    lse = torch.empty(m, device=DEVICE)
    module.launch(a, b, w, 1.0 / n, y=y, rstd=rstd, top=top, lse=lse, config=config)
    z = a.double() @ b.double().T
    want = {"y": torch.nn.functional.rms_norm(z, (n,), w.double(), eps=1e-6),
            "rstd": torch.rsqrt(z.pow(2).mean(1) + 1e-6), "top": z.amax(1), "lse": torch.logsumexp(z, 1)}
    got = {"y": y, "rstd": rstd, "top": top, "lse": lse}
    ref = reference.run(checked.kernel, checked.types, {"a": a, "b": b, "w": w, "inv_n": 1.0 / n}, 16, 64)
    for name, value in got.items():
        assert ((value.double() - want[name]).norm() / want[name].norm()).item() < 1e-5, name
        torch.testing.assert_close(ref[name], want[name])


def test_whole_row_needs_one_tile_over_n(row_norm):
    module, _ = row_norm
    m, n, k = 20, 70, 12
    args = [torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE), 0.1]
    outs = dict(y=torch.empty(m, n, device=DEVICE), rstd=torch.empty(m, device=DEVICE),
                top=torch.empty(m, device=DEVICE), lse=torch.empty(m, device=DEVICE))
    with pytest.raises(ValueError, match=r"row_norm: the config's epilogue runs on 64 columns at a time \(block_n "
                                         r"64\), fewer than N = 70, and the spec's column_group N needs one tile "
                                         r"over the whole row; use a block_n of 128 or more"):
        module.launch(*args, **outs, config=Config(16, 64, 16, 2, 4, 1))
    n = 600
    args[1], outs["y"] = torch.randn(n, k, device=DEVICE), torch.empty(m, n, device=DEVICE)
    args[2] = torch.randn(n, device=DEVICE)
    with pytest.raises(ValueError, match=r"row_norm: N = 600 is wider than the widest tile \(512 columns\)"):
        module.launch(*args, **outs)
    assert configs.widened(configs.GPU_DEFAULT, "N", 300).block_n == 512
    assert configs.runtime_candidates(True, False, "N", 200) and all(
        c.epilogue_n >= 200 for c in configs.runtime_candidates(True, False, "N", 200))


def test_whole_row_tuning_filters_by_shape_and_points_at_column_group(row_norm):
    from codagen.tune import harness
    from codagen.tune.candidates import GEMM_CANDIDATES

    _, checked = row_norm
    kernel = checked.kernel
    assert all(c.epilogue_n >= 200 for c in harness.shape_candidates(kernel, GEMM_CANDIDATES, 200))
    with pytest.raises(ValidationFailed) as info:
        harness.shape_candidates(kernel, GEMM_CANDIDATES, 300)
    (error,) = info.value.errors
    assert (error.loc.line, error.loc.col) == (3, 15)
    assert error.message.startswith("column_group N: at N = 300, no tuning candidate of row_norm has one tile over "
                                    "the whole row (the widest spans 256 columns)")


def test_whole_row_group_value_declared_as_groups_is_refused(tmp_path):
    text = ROW_NORM.replace("lse: {shape: [M], dtype: float32}", "lse: {shape: [M, groups(N)], dtype: float32}")
    (tmp_path / "bad.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(ValidationFailed) as info:
        api.load([tmp_path / "bad.yaml"])
    messages = [e.message for e in info.value.errors]
    assert any("with column_group N the group is the whole row" in m for m in messages), messages
