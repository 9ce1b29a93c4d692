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
    pool = candidates(_kernel(tmp_path, 256), hopper=True)
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

POINTER = {"T": "*bf16", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "index": "*i64"}
for path in sys.argv[1:]:
    module = importlib.import_module(path)
    fn, decls = getattr(module, module.NAME + "_kernel"), {d.name: d for d in module.DECLS}
    for split in (1, 2):
        consts = dict(BLOCK_M=128, BLOCK_N=128 * split, BLOCK_K=64, GROUP_M=8, EVEN_K=False, UPCAST_DOT=False,
                      DOT_PRECISION="tf32", TMA=False, FLATTEN=False, WARP_SPECIALIZE=False, EPILOGUE_SPLIT=split,
                      INT64=False)
        consts = {n: v for n, v in consts.items() if n in fn.arg_names}  # a kernel without a GEMM has no BLOCK_K
        consts.update({n: None for n in fn.arg_names if n.endswith("_desc")})
        signature = {n: "constexpr" if n in consts else POINTER[decls[n[:-4]].dtype] if n.endswith("_ptr")
                     else "i32" if n.startswith("stride_") or n in ("M", "N", "K", "NUM_PROGRAMS") else "fp32"
                     for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        print(path, split, "ptx" in compiled.asm)
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
