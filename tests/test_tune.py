"""`codagen tune` and run-time configuration choice, on the CPU: the preset table covers every kernel of specs/
(each at the presets of the model families whose blocks call it), candidates are checked against the float64
reference before they are timed (a wrong or failing one is discarded, never chosen), tables are deterministic
and merge, runtime.pick_config reads what the tuner wrote, tunes an untuned shape once per process where that
is safe, and CODAGEN_NO_TUNE=1 is honoured.
GPU-only pieces are replaced: the timer by a fake, gpu_key and the device check by monkeypatch."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import shutil
import types

import pytest
import torch
import triton
from click.testing import CliRunner

from codagen import api
from codagen.blockmodel import CheckedBlock
from codagen.cli import main
from codagen.emit import kernel as kernel_emit
from codagen.fingerprint import fingerprint
from codagen.presets import PRESETS
from codagen.tune import TuneError, command, harness, precompile, shapes, tables
from codagen.runtime import autotune, backends, configs
from codagen.runtime import tables as runtime_tables
from codagen.runtime.configs import GPU_DEFAULT, Config, HopperConfig
from codagen.tablefile import config_of_entry, entry_of
from conftest import REPO, draw_args

SPECS = REPO / "specs"
pytestmark = pytest.mark.usefixtures("fresh_caches")
CPU = torch.device("cpu")
# Small tiles keep the interpreter quick; the shapes below are ragged for all of them.
POOL = (Config(16, 16, 16, 8, 4, 1), Config(32, 16, 16, 8, 4, 1, persistent=True),
        Config(16, 32, 32, 8, 4, 1, tma=True))


@pytest.fixture
def as_gpu(monkeypatch):
    """pick_config as on a GPU called 'test-gpu', with a fake run-time timer: each trial launches once
    (to prove the hook runs the kernel) and reports a time from `times` (config -> ms; default 5)."""
    monkeypatch.setattr(autotune, "_on_gpu", lambda device: True)
    monkeypatch.setattr(runtime_tables, "gpu_key", lambda device: "test-gpu")
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)
    trials: list[Config] = []
    times: dict[Config, float] = {}

    def measure(run, config):
        run(config)
        trials.append(config)
        return times.get(config, 5.0)

    monkeypatch.setattr(autotune, "measure", measure)
    return types.SimpleNamespace(trials=trials, times=times)


@functools.lru_cache(maxsize=None)
def checked(name: str) -> api.Checked:
    (c,) = [c for c in api.load([SPECS]) if isinstance(c, api.Checked) and c.kernel.name == name]
    return c


def module(name: str):
    return importlib.import_module(f"generated.kernels.{name}")


class FakeTimer:
    """Stands for do_bench: runs fn once (so that a failure shows) and reports times[config] for the config
    of the kernel launch that fn made, 1 ms by default, and 0.5 ms when fn launched no kernel (the cuBLAS
    yardstick). `watch` makes a module's launch report its config here."""

    def __init__(self, times: dict[Config, float] | None = None):
        self.times = times or {}
        self.calls = 0
        self.last: Config | None = None

    def watch(self, monkeypatch, mod):
        real = mod.launch

        def launch(*args, config, **kwargs):
            self.last = config
            real(*args, config=config, **kwargs)

        monkeypatch.setattr(mod, "launch", launch)

    def __call__(self, fn) -> float:
        self.last = None
        fn()
        self.calls += 1
        return 0.5 if self.last is None else self.times.get(self.last, 1.0)


# -- shapes: presets through the block specs ----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def all_specs() -> tuple:
    return tuple(api.load([SPECS]))


def kernels_of_specs() -> list:
    return [c.kernel for c in all_specs() if isinstance(c, api.Checked)]


def test_presets_give_every_kernel_of_specs_its_shapes():
    """Each kernel gets shapes at every preset whose model family runs a block that calls it (every GEMM kernel
    no block calls, at every preset), and none at the others: Llama presets leave Gemma-2's kernels alone."""
    for k in kernels_of_specs():
        families = set()
        for preset, model in PRESETS.items():
            found = shapes.preset_shapes(all_specs(), preset, k)
            assert all(s.n > 0 and (s.k > 0) == (k.gemm is not None) for s in found), (preset, k.name)
            runs = any(model.runs_block(c.block.name) and any(k.name in call.kernels
                                                              for _, calls, _ in c.passes() for call in calls)
                       for c in all_specs() if isinstance(c, CheckedBlock))
            assert bool(found) == (runs or k.name == "matmul"), (preset, k.name)
            if found:
                families.add(model.family)
        assert families, k.name


def test_an_accumulating_gemm_is_tuned_as_its_block_calls_it():
    """lm_head_loss's weight gradient, dz^T @ normed summed over chunks by matmul_accumulate: (vocab, dim,
    chunk_rows), its a (dz^T) M-contiguous, in the tuning inputs as in the block."""
    uses = [u for u in shapes.block_uses(all_specs(), PRESETS["llama3-1b"], (32768,), family_only=True)
            if u.kernel == "matmul_accumulate"]
    assert [u.shape for u in uses] == [shapes.Shape(128256, 2048, 2048, a_km=True)]
    assert uses[0].where == "lm_head_loss forward with gradients: dz^T @ normed summed over chunks"
    module = importlib.import_module("generated.kernels.matmul_accumulate")
    for a_km, strides in ((True, (1, 45)), (False, (24, 1))):
        inputs = harness.make_inputs(checked("matmul_accumulate").kernel, module, shapes.Shape(45, 40, 24, a_km),
                                     torch.device("cpu"), torch.float32)
        assert inputs["a"].shape == (45, 24) and inputs["a"].stride() == strides


def test_family_presets_take_shapes_from_their_own_blocks():
    keys = lambda name, preset: [s.key for s in shapes.parse_shapes(  # noqa: E731
        preset, checked(name).kernel, all_specs())]
    # Gemma-2-2B: out-projection from the attention width (2048) to dim (2304), GeGLU over 2 x 9216 columns
    assert keys("gemma_proj_sumsq", "gemma2-2b") == ["8192x2304x2048", "32768x2304x2048", "8192x2304x9216",
                                                         "32768x2304x9216"]
    assert keys("gate_up_geglu", "gemma2-2b") == ["8192x18432x2304", "32768x18432x2304"]
    assert keys("lm_head_logits_softcap", "gemma2-2b") == ["2048x256000x2304"]
    assert keys("qkv_qk_norm_rope", "qwen3-1.7b") == ["8192x4096x2048", "32768x4096x2048"]
    assert keys("lm_head_logits", "qwen3-1.7b") == ["2048x151936x2048"]  # Llama's LM-head block
    assert keys("gate_up_swiglu", "qwen3-1.7b") == ["8192x12288x2048", "32768x12288x2048"]
    for kernel, preset in (("gate_up_geglu", "llama3-1b"), ("qkv_qk_norm_rope", "gemma2-2b"),
                           ("qkv_norm_rope", "qwen3-1.7b"), ("gate_up_swiglu", "gemma2-2b")):
        assert keys(kernel, preset) == [], (kernel, preset)
    assert keys("gate_up_geglu", "llama3-1b,gemma2-2b") == ["8192x18432x2304", "32768x18432x2304"]
    # without family_only, every block at a preset's dims: how the GPU tests run every kernel at Llama-1B's
    llama = PRESETS["llama3-1b"]
    own = {u.kernel for u in shapes.block_uses(all_specs(), llama, family_only=True)}
    every = {u.kernel for u in shapes.block_uses(all_specs(), llama)}
    assert "gate_up_geglu" not in own and every == {k.name for k in kernels_of_specs()} and own < every


def test_plain_matmul_is_tuned_at_every_gemm_shape_of_the_presets():
    # no block calls matmul; its ratio to cuBLAS is reported at every GEMM shape the blocks run
    matmul = checked("matmul").kernel
    for preset in PRESETS:
        have = {s.key for s in shapes.preset_shapes(all_specs(), preset, matmul)}
        for k in kernels_of_specs():
            if k.gemm and k.name != "matmul":
                assert {s.key for s in shapes.preset_shapes(all_specs(), preset, k)} <= have, (preset, k.name)


def test_preset_shapes_follow_the_block_specs():
    keys = lambda name, preset="llama3-1b": [s.key for s in shapes.parse_shapes(  # noqa: E731
        preset, checked(name).kernel, all_specs())]
    assert keys("out_proj_residual_norm") == ["8192x2048x2048", "32768x2048x2048", "8192x2048x8192",
                                                 "32768x2048x8192"]  # out-projection, then down projection
    assert keys("gate_up_swiglu", "llama3-8b") == ["8192x28672x4096", "32768x28672x4096"]
    assert keys("norm_dgrad_residual") == ["8192x2048x16384", "32768x2048x16384", "8192x2048x3072",
                                              "32768x2048x3072"]  # post_attention's, then pre_attention's
    assert keys("lm_head_logits") == ["2048x128256x2048"]  # row chunks of 2048, whatever the tokens
    assert keys("lm_head_logsumexp") == ["8192x128256x2048", "32768x128256x2048"]  # the forward is not chunked
    assert keys("norm_dgrad", "llama3-8b") == ["2048x4096x128256"]
    # the norm's statistics of every row (norm_stats, an LM head's forward), and of a chunk of rows (its forward
    # with gradients)
    assert keys("rmsnorm_stats") == ["8192x2048x0", "32768x2048x0", "2048x2048x0"]
    assert keys("rope_bwd_rowdot", "llama3-8b") == ["8192x6144x0", "32768x6144x0"]
    where = {(u.kernel, u.shape.key): u.where for u in shapes.block_uses(all_specs(), PRESETS["llama3-1b"])}
    assert where["out_proj_residual_norm", "8192x2048x8192"] == "post_attention forward: y1 @ w_down^T"
    assert where["rmsnorm_stats", "2048x2048x0"] == "lm_head_loss forward with gradients: rmsnorm_stats(x, wn)"
    # the first of the LM-head blocks (by name) whose forward with gradients runs this GEMM
    assert where["matmul", "2048x2048x128256"].endswith("_loss forward with gradients: dz @ w_vocab")


def test_shapes_follow_edits_to_the_block_specs(tmp_path):
    """Chunk sizes and widths come from the specs: edit them, and the tuning shapes follow."""
    specs = tmp_path / "specs"
    shutil.copytree(SPECS, specs)
    for block in specs.rglob("*.yaml"):  # every block that calls lm_head_logits in row chunks
        block.write_text(block.read_text().replace("chunk_rows: 2048", "chunk_rows: 1024"))
    loaded = api.load([specs])
    logits = next(c.kernel for c in loaded if isinstance(c, api.Checked) and c.kernel.name == "lm_head_logits")
    assert [s.key for s in shapes.preset_shapes(loaded, "tiny", logits, (100, 3000))] == ["100x1000x64",
                                                                                           "1024x1000x64"]
    assert [str(s) for s in shapes.preset_shapes(loaded, "tiny", logits, (100,))] == ["100x1000x64"]


def test_attrs_set_the_block_attrs_of_the_preset_shapes():
    """--attrs chunk_rows=1024: the LM heads' chunked kernels at 1024 rows, the rest as the preset gives them."""
    keys = lambda name, attrs: [s.key for s in shapes.parse_shapes(  # noqa: E731
        "llama3-1b", checked(name).kernel, all_specs(), attrs=shapes.parse_attrs(attrs, all_specs()))]
    assert keys("lm_head_logits", "chunk_rows=1024") == ["1024x128256x2048"]
    assert keys("norm_dgrad", "chunk_rows=1024,dim=4096") == ["1024x4096x128256"]
    assert keys("gate_up_swiglu", "chunk_rows=1024") == ["8192x16384x2048", "32768x16384x2048"]
    job, = command.jobs([REPO / "specs"], "llama3-8b", REPO / "generated", kernels="lm_head_logits",
                        attrs="chunk_rows=512")
    assert [s.key for s in job.shapes] == ["512x128256x4096"]


@pytest.mark.parametrize("text, words", [
    ("chunk_row=1024", "'chunk_row' is no int attr of the block specs given (attn_dim, chunk_rows, dim"),
    ("eps=1", "'eps' is no int attr"),  # a float attr
    ("chunk_rows=0", "'chunk_rows=0': expected chunk_rows=N with N a positive integer"),
    ("chunk_rows=1e3", "expected chunk_rows=N"),
    ("chunk_rows", "expected chunk_rows=N"),
    ("chunk_rows=\u00b2", "'chunk_rows=\u00b2': expected chunk_rows=N"),  # a digit to str.isdigit, not to int()
    ("chunk_rows=\u0661\u0660\u0662\u0664", "expected chunk_rows=N"),  # Arabic-Indic 1024: no ASCII digits
    ("chunk_rows=1" + "0" * 5000, "expected chunk_rows=N"),  # more digits than int() takes
])
def test_attrs_mistakes_are_named(text, words):
    with pytest.raises(TuneError) as e:
        shapes.parse_attrs(text, all_specs())
    assert words in str(e.value)


def test_presets_need_the_block_specs():
    kernel = checked("gate_up_swiglu").kernel
    only_kernels = [c for c in all_specs() if isinstance(c, api.Checked)]
    with pytest.raises(TuneError, match="hold no block spec"):
        shapes.parse_shapes("llama3-1b", kernel, only_kernels)
    rms = checked("rmsnorm_stats").kernel  # no GEMM: norm_stats and the LM heads call it
    no_callers = [c for c in all_specs() if not (isinstance(c, CheckedBlock) and any(
        call.op == "rmsnorm_stats" for _, calls, _ in c.passes() for call in calls))]
    with pytest.raises(TuneError, match="no block among the specs given"):
        shapes.parse_shapes("llama3-1b", rms, no_callers)


def test_a_kernel_named_at_presets_that_never_run_it_is_refused(tmp_path):
    """gate_up_geglu runs in Gemma-2's blocks only: named with --kernels at a Llama preset, it would tune nothing."""
    with pytest.raises(TuneError, match="no block of the presets in --shapes .llama3-1b. runs gate_up_geglu"):
        command.jobs([REPO / "specs"], "llama3-1b", REPO / "generated", kernels="gate_up_geglu,matmul")
    assert [j.checked.kernel.name for j in command.jobs([REPO / "specs"], "llama3-1b", REPO / "generated",
                                                        kernels="matmul")] == ["matmul"]


def test_literal_shapes_apply_to_every_kernel():
    assert [s.key for s in shapes.parse_shapes("100x64x32,128x64x32,8x8x8", checked("matmul").kernel)] == [
        "100x64x32", "128x64x32", "8x8x8"]  # each shape its own entry
    assert [str(s) for s in shapes.parse_shapes("100x64x32", checked("rmsnorm_stats").kernel)] == ["100x64"]
    for bad in ("llama3-70b", "12x34", "0x8x8", "\u00b2x8x8", "\u0668x8x8", "8x8x" + "9" * 5000):
        with pytest.raises(TuneError):
            shapes.parse_shapes(bad, checked("matmul").kernel, all_specs())
    for bad in ("8k", "\u00b2", "1" + "0" * 5000, ","):
        with pytest.raises(TuneError):
            shapes.parse_tokens(bad)


@pytest.mark.parametrize("kernel, text, words", [
    ("qkv_qk_norm_rope", "64x1000x64", "--shapes '64x1000x64': N = 1000 (shape 64x1000x64) is no multiple of kernel "
                                       "'qkv_qk_norm_rope''s column_group 128 (specs/qwen3/qkv_qk_norm_rope.yaml"),
    ("qk_norm_rope_bwd", "64x1000", "--shapes '64x1000': N = 1000 (shape 64x1000) is no multiple of kernel "
                                    "'qk_norm_rope_bwd''s column_group 128"),
    ("qkv_qk_norm_rope", "64x1024x64,64x1088x64", "--shapes '64x1088x64': N = 1088"),  # the second one
    ("matmul", "0x64x64", "--shapes '0x64x64': M, N and K must be positive (kernel 'matmul' has a GEMM)"),
    ("matmul", "64x0x64", "--shapes '64x0x64': M, N and K must be positive"),
    ("matmul", "64x64x0", "--shapes '64x64x0': M, N and K must be positive"),
    ("rmsnorm_stats", "0x64", "--shapes '0x64': M, N and K must be positive (kernel 'rmsnorm_stats' has no GEMM)"),
    # 2**37 bytes of operands at most: matmul's out_tile [M, N] in bf16 alone 2**39 bytes here
    ("matmul", "524288x524288x64", "--shapes '524288x524288x64': shape 524288x524288x64 makes kernel 'matmul''s "
                                   "operands 512.1 GiB in bf16 ('out_tile' alone 274877906944 elements), over 128 GiB"),
    ("matmul", "9999999999x8x8", "operands 298.0 GiB in bf16 ('a' alone 79999999992 elements), over 128 GiB"),
    ("rmsnorm_stats", "9999999999x8", "kernel 'rmsnorm_stats''s operands"),  # no GEMM: every operand counts
    ("lm_head_logits", "600000x128256x2048", "kernel 'lm_head_logits''s operands"),
])
def test_shapes_a_kernel_cannot_run_are_refused_by_name(kernel, text, words):
    """An N that breaks a kernel's column_group, a zero size and operands no GPU's memory holds are refused as
    --shapes enters, by argument, kernel and value; never a failure in the middle of a run."""
    with pytest.raises(TuneError) as e:
        shapes.parse_shapes(text, checked(kernel).kernel, all_specs())
    assert words in str(e.value)


def test_shapes_a_kernel_can_run_pass_the_checks():
    assert [s.key for s in shapes.parse_shapes("64x1024x64", checked("qkv_qk_norm_rope").kernel)] == ["64x1024x64"]
    # the LM head's logits of 32768 rows at once (4.2e9 elements, past 2**31: the tl kernels' offsets are 64-bit)
    assert shapes.parse_shapes("32768x128256x4096", checked("matmul").kernel)
    with pytest.raises(TuneError, match="over the GPU.s 8.0 GiB"):  # the GPU's memory, where the run gives it
        shapes.parse_shapes("32768x128256x4096", checked("lm_head_logits").kernel, memory=8 * 2**30)
    with pytest.raises(TuneError, match="K = 200 .* is no multiple of kernel 'down_residual_norm_fp8''s K group 128"):
        shapes.parse_shapes("64x256x200", checked("down_residual_norm_fp8").kernel)
    for preset in PRESETS:  # every preset's shapes at the default token counts pass
        for k in kernels_of_specs():
            try:
                shapes.parse_shapes(preset, k, all_specs())
            except TuneError as e:
                # or the FP8 kernels at a preset whose dim or ffn_dim is no multiple of their 128 (tiny's 64, 160)
                fp8 = k.source.startswith("specs/fp8/") and (PRESETS[preset].dim % 128 or PRESETS[preset].ffn_dim % 128)
                assert "has no shapes at preset" in str(e) or (fp8 and "is no multiple of" in str(e)), e


def test_preset_shapes_past_the_bound_name_the_preset_and_tokens():
    with pytest.raises(TuneError) as e:
        shapes.parse_shapes("llama3-1b", checked("rmsnorm_stats").kernel, all_specs(), tokens=(2**35,))
    assert "--shapes 'llama3-1b' (at --tokens 34359738368): shape 34359738368x2048 makes kernel 'rmsnorm_stats''s " \
           "operands" in str(e.value)


def test_cli_refuses_shapes_a_kernel_cannot_run(tune_on_cpu):
    result = CliRunner().invoke(main, ["tune", str(SPECS), "--shapes", "64x1000x64", "--kernels", "qkv_qk_norm_rope"])
    assert result.exit_code == 1 and "error: --shapes '64x1000x64': N = 1000" in result.output
    assert "Traceback" not in result.output and "wrote" not in result.output


def test_inputs_look_like_a_models():
    args = harness.make_inputs(checked("lm_head_logits").kernel, module("lm_head_logits"), shapes.Shape(40, 64, 32),
                               CPU)
    assert set(args) == {"h", "w_vocab", "rstd", "target"}
    assert args["h"].dtype == torch.bfloat16 and (args["h"] != 0).float().mean() > 0.9
    assert args["w_vocab"].float().std() < 0.5  # a weight: scaled by K**-0.5
    args = harness.make_inputs(checked("lm_head_ce_dz").kernel, module("lm_head_ce_dz"), shapes.Shape(40, 64, 0), CPU)
    assert set(args) == {"logits", "lse", "target", "weights"}
    assert all((args[n] > 0).all() and args[n].dtype == torch.float32 for n in ("lse", "weights"))
    assert ((args["target"] >= 0) & (args["target"] < 64)).all()


# -- checking and timing candidates -----------------------------------------------------------------------
def sabotaged(real, wrong: Config, fails: Config, unwritten: Config):
    """A kernel module whose launch is wrong for one config (one output element off), raises for another
    (as an out-of-resources compile would), and leaves a row unwritten for a third."""
    def launch(*args, config, **kwargs):
        if config == fails:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448\nmore")
        real.launch(*args, config=config, **kwargs)
        first = next(d.name for d in real.DECLS if d.output)
        if config == wrong:
            kwargs[first].view(-1)[0] += 1000.0
        if config == unwritten:
            kwargs[first][-1].fill_(float("nan"))
    return types.SimpleNamespace(NAME=real.NAME, SHA256=real.FINGERPRINT, DECLS=real.DECLS, launch=launch)


def test_wrong_and_failing_candidates_are_discarded_never_chosen(monkeypatch):
    right, wrong, fails, unwritten = POOL[0], POOL[1], POOL[2], dataclasses.replace(POOL[0], num_warps=8)
    fake = sabotaged(module("out_proj_residual_norm"), wrong, fails, unwritten)
    timer = FakeTimer({wrong: 0.1, fails: 0.1, unwritten: 0.1, right: 2.0})  # the saboteurs look fastest
    timer.watch(monkeypatch, fake)
    outcome = harness.tune_shape(checked("out_proj_residual_norm"), fake, shapes.Shape(45, 40, 24), CPU,
                              pool=(right, wrong, fails, unwritten), timer=timer, check_rows=37)
    assert outcome.best == right and outcome.ms == 2.0 and outcome.complete
    why = dict(outcome.discarded)
    assert set(why) == {wrong, fails, unwritten}
    assert "x_out" in why[wrong] and "relative error" in why[wrong]
    assert why[fails].startswith("RuntimeError: out of resource") and "more" not in why[fails]
    assert "NaN" in why[unwritten]
    assert outcome.cublas_ms is not None  # the plain GEMM of the shape, timed by the same timer


def test_kernel_and_cublas_timed_in_turn():
    """The chosen configuration and its plain GEMM are timed alternately, and each gets the median of its
    rounds: a GPU whose clocks drift moves both alike."""
    c = checked("out_proj_residual_norm")
    mod = module("out_proj_residual_norm")
    inputs = harness.make_inputs(c.kernel, mod, shapes.Shape(45, 40, 24), CPU, torch.float32)
    order, times = [], iter([5.0, 1.0, 3.0, 2.0, 4.0, 9.0])

    def timer(fn):
        order.append("kernel" if fn is kernel else "cuBLAS")
        return next(times)

    def kernel():
        pass

    assert harness.time_against_cublas(c.kernel, kernel, inputs, timer) == (4.0, 2.0)
    assert order == ["kernel", "cuBLAS"] * harness.CUBLAS_ROUNDS


def test_fp8_kernels_are_timed_against_a_plain_fp8_gemm(monkeypatch):
    """An FP8 kernel's yardstick is torch._scaled_mm on its own FP8 operands with one scale per tensor (torch.matmul
    takes no FP8), its product of the shape as the kernel's GEMM computes it."""
    c = checked("gate_up_swiglu_fp8")
    mod = module("gate_up_swiglu_fp8")
    inputs = harness.make_inputs(c.kernel, mod, shapes.Shape(48, 256, 256), CPU, torch.float32)
    a, b = inputs[c.kernel.gemm.a], inputs[c.kernel.gemm.b]
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    products, scaled_mm = [], torch._scaled_mm

    def recorded(*args, **kwargs):
        products.append(scaled_mm(*args, **kwargs))
        return products[-1]

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    timed = harness.time_against_cublas(c.kernel, lambda: None, inputs, lambda fn: fn() or 1.0)
    assert timed == (1.0, 1.0) and len(products) == harness.CUBLAS_ROUNDS
    want = a.double() @ b.double().T
    assert products[0].dtype == torch.bfloat16
    torch.testing.assert_close(products[0].double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def _k(kernel) -> int:
    """A K for the kernel: 24, ragged against the tiles; two K groups for K-group scales (whole groups of K)."""
    return 2 * kernel.k_group if kernel.k_group else 24 if kernel.gemm else 0


def test_every_generated_kernel_passes_its_check():
    """The check itself is right: the real kernels of specs/ pass it with a ragged slice of rows (bf16)."""
    for c in (c for c in api.load([SPECS]) if isinstance(c, api.Checked)):
        mod = module(c.kernel.name)
        group = c.kernel.column_group
        # whole column groups, ragged against the tiles; tiles that hold whole groups; K whole K groups, FP8's block_k
        shape = shapes.Shape(45, 3 * group if group else 40, _k(c.kernel))
        config = dataclasses.replace(POOL[1], block_n=2 * group) if group else POOL[1]
        config = dataclasses.replace(config, block_k=32) if c.kernel.fp8_gemm else config
        inputs = harness.make_inputs(c.kernel, mod, shape, CPU)
        check = harness.Checker(c, mod, inputs, 37, CPU)
        assert check(config, shape) is None, c.kernel.name


def test_cublas_mainloop_passes_the_check_of_every_gemm_kernel():
    """Mainloop "cublas" (torch.mm's product, then the tl kernel's epilogue over it in place of its mainloop) gives
    every GEMM kernel of specs/ what the float64 reference gives, with tiles ragged against the shape; a kernel
    without a GEMM refuses it, naming why."""
    # FP8 operands refuse it (torch.mm takes none: tests/test_fp8_gemm.py)
    for c in (c for c in api.load([SPECS]) if isinstance(c, api.Checked) and c.kernel.gemm and not c.kernel.fp8_gemm):
        mod = module(c.kernel.name)
        group = c.kernel.column_group
        shape = shapes.Shape(45, 3 * group if group else 40, 24)
        config = Config(16, 2 * group if group else 32, 16, 8, 4, 1, mainloop="cublas")
        inputs = harness.make_inputs(c.kernel, mod, shape, CPU)
        assert harness.Checker(c, mod, inputs, 37, CPU)(config, shape) is None, c.kernel.name
    stats = module("rmsnorm_stats")
    x, wn = torch.randn(5, 8), torch.randn(8)
    with pytest.raises(ValueError, match="rmsnorm_stats: Config.mainloop='cublas'. makes a GEMM's product with "
                                         "torch.mm, but this kernel has no GEMM"):
        stats.launch(x, wn, h=torch.empty(5, 8), ss=torch.empty(5, 1), config=Config(mainloop="cublas"))
    with pytest.raises(ValueError, match="mainloop 'cublas' is the tl kernel's"):
        Config(mainloop="cublas", tma=True)
    with pytest.raises(TypeError, match="mainloop"):
        HopperConfig(mainloop="cublas")  # the Hopper kernel has its own mainloop only
    with pytest.raises(ValueError, match="Config.mainloop='cublas'."):
        config_of_entry({"backend": "mm", "config": {}})


def test_cublas_mainloop_is_timed_only_where_k_is_long(as_gpu, tmp_path):
    """The tuner times mainloop "cublas" where backends.cublas_pays (K at least 8 times M and N: the LM head's input
    gradient over a chunk of rows), and leaves it out elsewhere; run-time tuning tries it there too, with the
    default's tile."""
    mm = Config(16, 16, 16, 8, 4, 1, mainloop="cublas")
    norm = checked("norm_dgrad")
    mod = module("norm_dgrad")
    for shape, timed in ((shapes.Shape(45, 40, 24), False), (shapes.Shape(20, 24, 200), True)):
        outcome = harness.tune_shape(norm, mod, shape, CPU, pool=(POOL[0], mm), timer=FakeTimer(), check_rows=20)
        assert (mm in [c for c, _ in outcome.timed]) == timed and not outcome.discarded
    for m, k, tried in ((45, 24, False), (20, 400, True)):
        as_gpu.trials.clear()
        autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, m, 40, k, CPU, decls=mod.DECLS, run=lambda c: None,
                             split=mod.DEFAULT_SPLIT)
        ran = [c for c in as_gpu.trials if c.mainloop == "cublas"]
        assert len(ran) == tried
        default = configs.gpu_default(split=mod.DEFAULT_SPLIT)
        assert all((c.block_m, c.block_n, c.persistent, c.tma) == (default.block_m, default.block_n, False, False)
                   for c in ran)


def test_budget_stops_cleanly():
    outcome = harness.tune_shape(checked("rmsnorm_stats"), module("rmsnorm_stats"), shapes.Shape(40, 32, 0), CPU,
                              pool=POOL, timer=FakeTimer(), deadline=0.0)
    assert not outcome.complete and outcome.best is None and not outcome.timed


# -- tables -----------------------------------------------------------------------------------------------
def entry(config: Config, ms: float) -> dict:
    return {**entry_of(config), "ms": ms}


def test_table_is_deterministic_merges_and_touches_nothing_else(tmp_path):
    k = checked("matmul").kernel
    path = tmp_path / "test-gpu" / "matmul.json"
    (tmp_path / "test-gpu").mkdir()
    other = tmp_path / "test-gpu" / "other.json"
    other.write_text("{}\n")
    assert tables.write_table(path, k, "test-gpu", "3.9.0", {"64x64x32": entry(POOL[0], 1.5)})
    first = path.read_text()
    assert first.endswith("}\n") and first == json.dumps(json.loads(first), indent=1, sort_keys=True) + "\n"
    assert not tables.write_table(path, k, "test-gpu", "3.9.0", {"64x64x32": entry(POOL[0], 1.5)})  # unchanged
    assert path.read_text() == first
    tables.write_table(path, k, "test-gpu", "3.9.0", {"128x64x32": entry(POOL[1], 2.5)})
    data = json.loads(path.read_text())
    assert set(data["shapes"]) == {"64x64x32", "128x64x32"}
    assert (data["kernel"], data["spec"], data["fingerprint"], data["triton"], data["gpu"]) == (
        "matmul", k.source, fingerprint(k), "3.9.0", "test-gpu")
    tables.write_table(path, k, "test-gpu", "3.9.1", {"8x64x32": entry(POOL[2], 0.5)})  # another Triton
    assert set(json.loads(path.read_text())["shapes"]) == {"8x64x32"}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["matmul.json", "other.json", "test-gpu"]
    assert other.read_text() == "{}\n"


def test_a_comment_edit_keeps_the_table_in_use_and_a_semantic_edit_makes_it_stale(tmp_path, monkeypatch, as_gpu):
    """Tables are keyed by what the kernel computes (codagen.fingerprint), not by the spec file's bytes: a
    comment, doc or layout edit keeps the table in use; a change to the computation makes `build --check`
    report it, with the command that re-tunes it, and pick_config no longer reads it."""
    shutil.copytree(SPECS, tmp_path / "specs")
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "specs" / "out_proj_residual_norm.yaml"
    table = tmp_path / "generated" / "tuning" / "test-gpu" / "out_proj_residual_norm.json"
    tuning = tmp_path / "generated" / "tuning"

    def rebuild() -> tuple[api.Checked, str]:
        api.build(["specs"], "generated")
        (c,) = [c for c in api.load([spec]) if isinstance(c, api.Checked)]
        module = (tmp_path / "generated" / "kernels" / "out_proj_residual_norm.py").read_text()
        (key,) = re.findall(r'^FINGERPRINT = "([0-9a-f]{64})"', module, re.M)
        return c, key

    def check():
        return CliRunner().invoke(main, ["build", "specs/", "--check"])

    before, key = rebuild()
    tables.write_table(table, before.kernel, "test-gpu", triton.__version__, {"64x40x24": entry(POOL[1], 1.0)})
    assert check().exit_code == 0 and key == fingerprint(before.kernel)
    assert autotune.pick_config("out_proj_residual_norm", key, tuning, 45, 40, 24, CPU) == POOL[1]

    text = spec.read_text()
    edited = ("# a comment\n" + text.replace("doc: Attention", "doc: The attention")
              .replace("{x: acc, y: x, out: x_new}", "{y: x, x: acc, out: x_new}"))  # same step, keys reordered
    assert edited != text
    spec.write_text(edited)
    after, key_after = rebuild()
    assert after.kernel.sha256 != before.kernel.sha256 and key_after == key
    result = check()
    assert result.exit_code == 0, result.output
    autotune.clear_caches()
    assert autotune.pick_config("out_proj_residual_norm", key_after, tuning, 45, 40, 24, CPU) == POOL[1]

    spec.write_text(edited.replace("add: {y: x, x: acc, out: x_new}", "sub: {y: x, x: acc, out: x_new}"))
    semantic, key_semantic = rebuild()
    assert key_semantic != key
    result = check()
    assert result.exit_code == 1
    assert ("stale tuning table generated/tuning/test-gpu/out_proj_residual_norm.json: tuned for a different "
            "computation than specs/out_proj_residual_norm.yaml now describes; re-run on a test-gpu GPU: "
            "codagen tune specs/ --kernels out_proj_residual_norm --shapes 64x40x24") in result.output
    assert "is out of date" not in result.output  # generated/ itself is up to date
    autotune.clear_caches()
    assert autotune.pick_config("out_proj_residual_norm", key_semantic, tuning, 45, 40, 24, CPU) == GPU_DEFAULT


def test_check_reports_tables_of_kernels_no_spec_defines(tmp_path):
    tuning = tmp_path / "tuning" / "test-gpu"
    tables.write_table(tuning / "matmul.json", checked("matmul").kernel, "test-gpu", "3.9.0",
                       {"64x64x32": entry(POOL[0], 1.5)})
    (tuning / "gone.json").write_text((tuning / "matmul.json").read_text())
    (tuning / "broken.json").write_text("{")
    (tmp_path / "tuning" / "notes.txt").write_text("not a table\n")
    stale, errors = tables.check_tables(tmp_path / "tuning", kernels_of_specs())
    assert [(t.path.name, t.problem) for t in stale] == [("gone.json", "no spec defines a kernel 'gone'")]
    assert [(e.path.name, e.line, e.col, str(e)) for e in errors] == [
        ("broken.json", 1, 2, f"not a tuning table: {tuning / 'broken.json'} (invalid JSON: Expecting property name "
                              "enclosed in double quotes)")]
    assert tables.stale_tables(tmp_path / "tuning", kernels_of_specs()) == stale


def test_pick_config_reads_what_the_tuner_wrote(tmp_path, as_gpu, monkeypatch):
    best = POOL[1]
    timer = FakeTimer({POOL[0]: 3.0, best: 1.0, POOL[2]: 2.0})
    timer.watch(monkeypatch, module("matmul"))
    timer.watch(monkeypatch, module("rmsnorm_stats"))
    log: list[str] = []
    written = command.run([SPECS / "matmul.yaml", SPECS / "rmsnorm_stats.yaml"], "45x40x24", device=CPU,
                       gpu="test-gpu", tuning_dir=tmp_path, timer=timer, check_rows=37,
                       pools={"matmul": POOL, "rmsnorm_stats": POOL}, log=log.append)
    assert written == [tmp_path / "test-gpu" / "matmul.json", tmp_path / "test-gpu" / "rmsnorm_stats.json"]
    assert any(line.startswith("matmul 45x40x24: 1.0000 ms") for line in log), log
    assert json.loads(written[0].read_text())["shapes"]["45x40x24"]["cuBLAS_ms"] == 0.5
    mm = module("matmul")
    assert triton.__version__ == json.loads(written[0].read_text())["triton"]
    for m in (33, 45, 64):  # the shape tuned, and token counts nearest to it
        assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, m, 40, 24, CPU) == best
    rs = module("rmsnorm_stats")
    assert autotune.pick_config(rs.NAME, rs.FINGERPRINT, tmp_path, 45, 40, 0, CPU) == best
    # another token count: the nearest tuned one of the same widths; other widths or another fingerprint: not
    # in the table, and without `run` the default, untuned
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 1000, 40, 24, CPU) == best
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 45, 48, 24, CPU, decls=mm.DECLS) == GPU_DEFAULT
    assert autotune.pick_config(mm.NAME, "0" * 64, tmp_path, 45, 40, 24, CPU) == GPU_DEFAULT
    assert not as_gpu.trials
    # --missing-only: the shape is in the table now, so nothing is timed again
    timer.calls = 0
    assert command.run([SPECS / "matmul.yaml"], "45x40x24", device=CPU, gpu="test-gpu", tuning_dir=tmp_path,
                    timer=timer, missing_only=True, log=log.append) == []
    assert timer.calls == 0 and "matmul 45x40x24: in the table already, skipped" in log


def test_an_untuned_token_count_takes_the_nearest_tuned_one():
    table = {"8192x64x32": POOL[0], "32768x64x32": POOL[1], "2048x64x32": POOL[2], "4096x96x32": GPU_DEFAULT}
    near = lambda m: runtime_tables.nearest_tuned(table, runtime_tables.shape_key(m, 64, 32))  # noqa: E731
    assert (near(5000), near(16384), near(100_000), near(4096), near(1)) == (POOL[0], POOL[1], POOL[1], POOL[0],
                                                                             POOL[2])
    assert runtime_tables.nearest_tuned(table, runtime_tables.shape_key(4096, 64, 16)) is None
    # other widths: nearest in M, N and K together; only configurations that fit
    assert runtime_tables.nearest_tuned(table, runtime_tables.shape_key(4096, 80, 32), other_widths=True) == GPU_DEFAULT
    assert runtime_tables.nearest_tuned(table, runtime_tables.shape_key(4096, 64, 16), other_widths=True) == GPU_DEFAULT
    assert runtime_tables.nearest_tuned(table, runtime_tables.shape_key(4096, 80, 32), other_widths=True,
                                        fits=lambda c: c != GPU_DEFAULT) == POOL[0]


def test_each_tuned_row_count_keeps_its_own_entry(tmp_path, as_gpu):
    """The LM head's kernels tuned at 1280- and 2048-row chunks: each chunk size reads its own entry, neither
    overwrites the other, and a row count between them takes the nearer."""
    mm = module("matmul")
    k = checked("matmul").kernel
    path = tmp_path / "test-gpu" / "matmul.json"
    tables.write_table(path, k, "test-gpu", triton.__version__, {"2048x40x24": entry(POOL[0], 1.0)})
    tables.write_table(path, k, "test-gpu", triton.__version__, {"1280x40x24": entry(POOL[1], 1.0)})
    autotune.clear_caches()
    pick = lambda m: autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, m, 40, 24, CPU)  # noqa: E731
    assert (pick(2048), pick(1280), pick(1400), pick(1900), pick(1024)) == (POOL[0], POOL[1], POOL[1], POOL[0],
                                                                            POOL[1])


def test_tile_dependent_kernels_take_a_tuned_tile_of_other_widths(tmp_path, as_gpu):
    """A kernel whose outputs have the tile count in their shape cannot change its tile at run time: where the
    table has no entry of its widths, it takes the nearest entry of other widths, in its op's allocation and in
    its launch alike; other kernels tune at run time."""
    tuned = dataclasses.replace(GPU_DEFAULT, block_n=64, epilogue_split=2)
    for name in ("out_proj_residual_norm", "matmul"):
        k = checked(name).kernel
        tables.write_table(tmp_path / "test-gpu" / f"{name}.json", k, "test-gpu", triton.__version__,
                           {"64x40x24": entry(tuned, 1.0)})
    mod = module("out_proj_residual_norm")
    for decls in (None, mod.DECLS):
        assert autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 45, 96, 24, CPU, decls=decls,
                                    run=lambda c: pytest.fail("no run-time tuning")) == tuned
    mm = module("matmul")
    autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 45, 96, 24, CPU, decls=mm.DECLS, run=lambda c: None)
    assert as_gpu.trials  # tuned at run time: matmul's outputs do not depend on its tile


def test_codagen_no_tune_uses_the_default(tmp_path, as_gpu, monkeypatch):
    mm = module("matmul")
    k = checked("matmul").kernel
    tables.write_table(tmp_path / "test-gpu" / "matmul.json", k, "test-gpu", triton.__version__,
                     {"64x40x24": entry(POOL[1], 1.0)})
    monkeypatch.setenv("CODAGEN_NO_TUNE", "1")
    run = lambda c: pytest.fail("CODAGEN_NO_TUNE=1 must not tune")  # noqa: E731
    for m in (45, 999):  # in the table, and not
        assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, m, 40, 24, CPU, decls=mm.DECLS,
                                    run=run) == GPU_DEFAULT
    monkeypatch.delenv("CODAGEN_NO_TUNE")
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 45, 40, 24, CPU) == POOL[1]


# -- tuning at run time -----------------------------------------------------------------------------------
def launch_with_hook(mod, args, tuning_dir):
    """What a generated launcher does: it passes `decls`, `values` and `run` for kernels without inplace
    outputs (codagen/templates/kernel.py.j2)."""
    values = args.kwargs
    sizes = {"M": 45, "N": 40, "K": 24}
    k = sizes["K"] if any("K" in d.dims for d in mod.DECLS) else 0
    config = autotune.pick_config(mod.NAME, mod.FINGERPRINT, tuning_dir, sizes["M"], sizes["N"], k, CPU,
                                  decls=mod.DECLS, values=values, run=lambda c: mod.launch(**values, config=c))
    mod.launch(**values, config=config)
    return config


def test_untuned_shape_is_tuned_once_per_process(tmp_path, as_gpu):
    mod = module("matmul")
    faster = configs.RUNTIME_GEMM_CANDIDATES[2]
    as_gpu.times[faster] = 1.0
    args = draw_args(mod, {"M": 45, "N": 40, "K": 24}, torch.float32, GPU_DEFAULT,
                     generator=torch.Generator().manual_seed(0))
    assert launch_with_hook(mod, args, tmp_path) == faster
    assert as_gpu.trials == list(configs.RUNTIME_GEMM_CANDIDATES)  # each candidate launched on these arguments
    want = args.inputs["a"].double() @ args.inputs["b"].double().T
    assert harness.relative_error(args.outputs["out_tile"], want) < 1e-5
    as_gpu.trials.clear()
    assert launch_with_hook(mod, args, tmp_path) == faster and not as_gpu.trials  # once per process
    assert autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 60, 40, 24, CPU) == faster  # same bucket


def test_tile_dependent_kernels_keep_the_default_tile_shape(tmp_path, as_gpu, monkeypatch):
    """out_proj_residual_norm writes ss[M, tiles(N)], allocated by its op for the default tile shape
    before the launch: run-time candidates differ in everything but block_m x block_n and the epilogue
    split."""
    split = dataclasses.replace(GPU_DEFAULT, epilogue_split=2)  # would halve the columns of a partial
    monkeypatch.setattr(configs, "RUNTIME_GEMM_CANDIDATES", (*configs.RUNTIME_GEMM_CANDIDATES, split))
    mod = module("out_proj_residual_norm")
    args = draw_args(mod, {"M": 45, "N": 40, "K": 24}, torch.float32, GPU_DEFAULT,
                     generator=torch.Generator().manual_seed(1))
    for c in configs.RUNTIME_GEMM_CANDIDATES:
        as_gpu.times[c] = 1.0 if c.block_n != GPU_DEFAULT.block_n else 5.0  # a wider tile would "win"
    chosen = launch_with_hook(mod, args, tmp_path)
    assert as_gpu.trials and all((c.block_m, c.epilogue_n) == (GPU_DEFAULT.block_m, GPU_DEFAULT.block_n)
                                 for c in as_gpu.trials)
    assert (chosen.block_m, chosen.epilogue_n) == (GPU_DEFAULT.block_m, GPU_DEFAULT.block_n)
    assert len(set(as_gpu.trials)) == len(as_gpu.trials)
    # without decls, pick_config cannot tell, so it keeps the default tile shape too
    autotune.clear_caches()
    monkeypatch.setenv("CODAGEN_TUNING_CACHE", "0")  # tuned again, not read from what the launch above kept
    as_gpu.trials.clear()
    autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 45, 40, 24, CPU, run=lambda c: None)
    assert as_gpu.trials and all((c.block_m, c.epilogue_n) == (GPU_DEFAULT.block_m, GPU_DEFAULT.block_n)
                                 for c in as_gpu.trials)


def test_kernels_of_pairs_default_to_quarter_slices(tmp_path, as_gpu, monkeypatch):
    """Without a tuning table, a kernel whose epilogue loads a tile of pairs runs its epilogue on quarters of
    the default tile (on the whole tile it spills, compiled for sm_90): its module's DEFAULT_SPLIT is 4, which
    its launcher passes to pick_config, and the default and every run-time candidate take. Launched so (untuned, on a GPU as faked
    here, under the interpreter), swiglu_dgrad allocates its row partials by quarter and matches float64."""
    assert kernel_emit.gpu_default_split(checked("swiglu_dgrad").kernel) == 4
    assert kernel_emit.gpu_default_split(checked("out_proj_residual_norm").kernel) == 1
    mod = module("swiglu_dgrad")
    assert mod.DEFAULT_SPLIT == 4 and module("out_proj_residual_norm").DEFAULT_SPLIT == 1
    autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 45, 40, 24, CPU, decls=mod.DECLS, run=lambda c: None,
                         split=mod.DEFAULT_SPLIT)
    assert as_gpu.trials and all(c.epilogue_split == 4 for c in as_gpu.trials)
    monkeypatch.setenv("CODAGEN_NO_TUNE", "1")
    monkeypatch.setattr(mod, "TUNING", tmp_path)
    g = torch.Generator().manual_seed(5)
    grad_y, w_down = torch.randn(45, 24, generator=g), torch.randn(24, 40, generator=g)
    z = torch.randn(45, 80, generator=g)
    dz, zdz_part, y = mod.swiglu_dgrad(grad_y, w_down, z)
    assert zdz_part.shape == (45, 2)  # 40 columns in slices of 128 / 4
    gate, up = z.double()[:, 0::2], z.double()[:, 1::2]
    dy = grad_y.double() @ w_down.double()
    sig = torch.sigmoid(gate)
    want = torch.stack([dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig], dim=-1).reshape(45, 80)
    assert harness.relative_error(dz, want) < 1e-5
    assert harness.relative_error(y, gate * sig * up) < 1e-5
    assert harness.relative_error(zdz_part.sum(1), (z.double() * dz.double()).sum(1)) < 1e-5


def test_untuned_shapes_try_the_hopper_kernel_on_sm90(tmp_path, as_gpu, monkeypatch):
    """On an sm_90 GPU, run-time tuning of a kernel the Hopper backend lowers tries the Hopper kernel's own
    default too, and keeps it where it is the fastest; a kernel whose outputs depend on the tile tries it with
    the default's tile, as its tl candidates. Elsewhere, and for kernels the backend does not lower, the tl
    candidates alone."""
    hopper_gpu = {"yes": False}
    gluon = dataclasses.replace(backends.GLUON, runs=lambda device: hopper_gpu["yes"])
    monkeypatch.setattr(backends, "BACKENDS", tuple(gluon if b is backends.GLUON else b for b in backends.BACKENDS))
    swiglu, norm = module("gate_up_swiglu"), module("out_proj_residual_norm")
    own = backends.hopper_default(swiglu.__package__, swiglu.NAME)
    assert (type(own), own.backend, own.block_m, own.block_n) == (HopperConfig, "gluon", 128, 128)

    def pick(mod, m, package):
        return autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, m, 40, 24, CPU, decls=mod.DECLS,
                                    run=lambda c: None, split=mod.DEFAULT_SPLIT, package=package)

    assert pick(swiglu, 45, swiglu.__package__).backend == "tl" and as_gpu.trials  # not an sm_90 GPU
    assert all(c.backend == "tl" for c in as_gpu.trials)
    hopper_gpu["yes"] = True
    as_gpu.trials.clear()
    as_gpu.times[own] = 1.0
    assert pick(swiglu, 1000, None).backend == "tl"  # no Hopper module named: a kernel it does not lower
    assert pick(swiglu, 3000, swiglu.__package__) == own and as_gpu.trials[-1] == own
    as_gpu.trials.clear()
    pick(norm, 45, norm.__package__)
    (hopper,) = [c for c in as_gpu.trials if c.backend == "gluon"]
    default = configs.gpu_default(split=norm.DEFAULT_SPLIT)
    assert (hopper.block_m, hopper.block_n, hopper.epilogue_split) == (
        default.block_m, default.block_n, default.epilogue_split)
    assert hopper.stages == backends.hopper_default(norm.__package__, norm.NAME).stages


def test_epilogue_split_halves_what_tiles_n_counts_in():
    assert Config(64, 128, epilogue_split=2).epilogue_n == 64 and Config(64, 128).epilogue_n == 128
    assert "epilogue/2" in Config(64, 128, epilogue_split=2).label()
    for bad in ({"epilogue_split": 3}, {"epilogue_split": 16}, {"epilogue_split": 8, "block_n": 8}):
        with pytest.raises(ValueError, match="epilogue_split must be 1, 2, 4 or 8"):
            Config(**bad)


def test_no_tuning_without_run_under_compile_or_capture(tmp_path, as_gpu, monkeypatch):
    mm = module("matmul")
    run = lambda c: as_gpu.trials.append(c)  # noqa: E731 - would record a trial
    pick = lambda m: autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, m, 40, 24, CPU,  # noqa: E731
                                          decls=mm.DECLS, run=run)
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 45, 40, 24, CPU) == GPU_DEFAULT  # no run: inplace
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert pick(45) == GPU_DEFAULT
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert pick(45) == GPU_DEFAULT
    assert not as_gpu.trials and not autotune._tuned  # and nothing remembered: tuned later, outside
    as_gpu.times[configs.RUNTIME_GEMM_CANDIDATES[1]] = 1.0
    assert pick(45) == configs.RUNTIME_GEMM_CANDIDATES[1]


def test_no_tuning_when_an_output_aliases_an_input(tmp_path, as_gpu):
    """x_out=x updates the residual stream in place: one launch is right, a second would add acc twice."""
    mod = module("out_proj_residual_norm")
    args = draw_args(mod, {"M": 45, "N": 40, "K": 24}, torch.float32, GPU_DEFAULT,
                     generator=torch.Generator().manual_seed(2))
    values = {**args.kwargs, "x_out": args.kwargs["x"]}
    want = args.inputs["x"].double() + args.inputs["y"].double() @ args.inputs["w_o"].double().T
    config = autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 45, 40, 24, CPU, decls=mod.DECLS, values=values,
                                  run=lambda c: mod.launch(**values, config=c))
    assert config == GPU_DEFAULT and not as_gpu.trials and not autotune._tuned
    mod.launch(**values, config=config)
    assert harness.relative_error(values["x"], want) < 1e-5


def test_failing_runtime_candidates_are_skipped(tmp_path, as_gpu, monkeypatch):
    mm = module("matmul")

    def measure(run, config):
        if config != configs.RUNTIME_GEMM_CANDIDATES[3]:
            raise RuntimeError("out of resource")
        return 1.0

    monkeypatch.setattr(autotune, "measure", measure)
    pick = lambda m: autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, m, 40, 24, CPU,  # noqa: E731
                                          decls=mm.DECLS, run=lambda c: None)
    assert pick(45) == configs.RUNTIME_GEMM_CANDIDATES[3]
    monkeypatch.setattr(autotune, "measure", lambda run, config: (_ for _ in ()).throw(RuntimeError("no")))
    assert pick(1000) == GPU_DEFAULT  # all failed: the default, whose launch reports the error


def test_interpreter_ignores_tables(tmp_path):
    mm = module("matmul")
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 45, 40, 24, CPU, run=pytest.fail) == (
        configs.INTERPRETER_DEFAULT)


# -- the command ------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_needs_a_gpu():
    result = CliRunner().invoke(main, ["tune", str(SPECS), "--shapes", "llama3-1b"])
    assert result.exit_code == 1 and "CUDA GPU" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the order of the messages on a machine without CUDA")
@pytest.mark.parametrize("args, words", [(["--shapes", "big"], "neither a preset"),
                                         (["--shapes", "llama3-1b", "--kernels", "nope"], "no spec defines nope"),
                                         (["--shapes", "llama3-1b", "--tokens", "x"], "expected positive integers")])
def test_cli_checks_its_arguments_before_looking_for_a_gpu(args, words):
    result = CliRunner().invoke(main, ["tune", str(SPECS), *args])
    assert result.exit_code == 1 and words in result.output and "CUDA GPU" not in result.output, result.output


@pytest.fixture
def tune_on_cpu(monkeypatch, tmp_path):
    """The command's command.run, on the CPU with a fake timer, writing under tmp_path."""
    real = command.run

    def run(paths, shapes, **kw):
        return real(paths, shapes, device=CPU, gpu="test-gpu", tuning_dir=tmp_path, timer=FakeTimer(),
                    check_rows=37, **kw)

    monkeypatch.setattr(command, "run", run)
    return tmp_path


def test_cli_reports_bad_requests(tune_on_cpu):
    result = CliRunner().invoke(main, ["tune", str(SPECS), "--shapes", "llama3-1b", "--kernels", "nope"])
    assert result.exit_code == 1 and "no spec defines nope" in result.output
    result = CliRunner().invoke(main, ["tune", str(SPECS), "--shapes", "big", "--kernels", "matmul"])
    assert result.exit_code == 1 and "neither a preset" in result.output


@pytest.mark.parametrize("args, words", [
    (["--attrs", "chunk_rows=\u00b2"], "error: --attrs: 'chunk_rows=\u00b2': expected chunk_rows=N with N a positive"),
    (["--kernels", ","], "error: --kernels ',' names no kernel"),
    (["--kernels", " , "], "error: --kernels ' , ' names no kernel"),
    (["--kernels", ""], "error: --kernels '' names no kernel"),
    (["--shapes", "8x8x" + "9" * 5000], "error: --shapes: '8x8x999"),
    (["--tokens", "\u00b2"], "error: --tokens '\u00b2': expected positive integers"),
])
def test_cli_names_bad_arguments_instead_of_a_traceback_or_tuning_nothing(tune_on_cpu, args, words):
    options = {"--shapes": "45x40x24", "--kernels": "matmul", **dict(zip(args[::2], args[1::2]))}
    argv = ["tune", str(SPECS)] + [x for option, value in options.items() for x in (option, value)]
    result = CliRunner().invoke(main, argv)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.exception
    assert words in result.output and "wrote" not in result.output


def test_candidates_beyond_the_gpus_shared_memory_are_not_timed(tmp_path, monkeypatch):
    """Each candidate's resource model (its config type's operand_bytes) against the GPU's shared memory: one that
    its table would refuse (tileconfig.fits_shared) is left out before any launch, and the run says so; a kernel
    left with none is skipped."""
    timer = FakeTimer()
    timer.watch(monkeypatch, module("matmul"))
    big = Config(256, 256, 128, 8, 4, 1)  # one stage: 128 KiB, more than a T4's 64 KiB
    log = []
    command.run([SPECS / "matmul.yaml"], "45x40x24", device=CPU, gpu="nvidia-tesla-t4", tuning_dir=tmp_path,
                timer=timer, check_rows=37, pools={"matmul": (POOL[0], big)}, log=log.append)
    text = "\n".join(log)
    assert ("matmul: 1 candidate(s) need more shared memory than a program has on nvidia-tesla-t4 (65536 bytes); "
            "not timed") in text and "(1 timed, 0 discarded" in text
    log.clear()
    assert command.run([SPECS / "matmul.yaml"], "45x40x24", device=CPU, gpu="nvidia-tesla-t4", tuning_dir=tmp_path,
                       timer=timer, check_rows=37, pools={"matmul": (big,)}, log=log.append) == []
    assert "none left: skipped" in log[0] and "tuning 0 kernel(s)" in log[1]


def test_only_some_candidates_against_the_present_choice(tmp_path, monkeypatch):
    """--only: the candidates whose label contains the text are timed against the table's present choice,
    re-timed; the table keeps that choice where it is faster, takes a challenger where one is; a kernel with
    no such candidate is skipped."""
    present, slow, fast = POOL[0], POOL[1], POOL[2]  # labels: '16x16x16 g8 w4 s1', '... persistent', '... tma'
    mod = module("matmul")
    timer = FakeTimer({present: 1.0, slow: 2.0, fast: 0.5})
    timer.watch(monkeypatch, mod)
    table = tmp_path / "test-gpu" / "matmul.json"

    def run(only, times):
        timer.times.update(times)
        log = []
        command.run([SPECS / "matmul.yaml", SPECS / "rmsnorm_stats.yaml"], "45x40x24", device=CPU, gpu="test-gpu",
                    tuning_dir=tmp_path, timer=timer, check_rows=37, only=only,
                    pools={"matmul": POOL, "rmsnorm_stats": POOL[:1]}, log=log.append)
        return json.loads(table.read_text())["shapes"]["45x40x24"], "\n".join(log)

    command.run([SPECS / "matmul.yaml"], "45x40x24", device=CPU, gpu="test-gpu", tuning_dir=tmp_path, timer=timer,
                check_rows=37, pools={"matmul": POOL[:1]}, log=lambda _: None)
    entry, log = run("persistent", {})
    assert config_of_entry(entry) == present and entry["ms"] == 1.0  # the challenger is slower
    assert "rmsnorm_stats: no candidate's label contains 'persistent'; skipped" in log
    assert "(2 timed, 0 discarded" in log
    assert f"\n  2.0000 ms  {slow.label()}" in log  # the runner-up, with its time
    entry, _ = run("tma", {})
    assert config_of_entry(entry) == fast and entry["ms"] == 0.5
    entry, _ = run("persistent", {fast: 3.0})  # the present choice, re-timed, now slower than the challenger
    assert config_of_entry(entry) == slow and entry["ms"] == 2.0


def test_compile_work_is_each_kernels_candidates_and_present_choices_once(tmp_path):
    """What --compile-jobs compiles: per kernel, the present choices (with --only) and the candidates, each
    once, at the first shape the run tunes with as many rows as its check launches."""
    (job,) = command.jobs([SPECS / "matmul.yaml"], "45x40x24,2000x40x24", kernels="matmul", tuning_dir=tmp_path,
                          gpu="test-gpu")
    tables.write_table(job.table, job.checked.kernel, "test-gpu", triton.__version__, {"45x40x24": entry(POOL[1], 1.0)})
    pool_of = {"matmul": POOL[:2]}
    work = command._compile_work([job], pool_of, "s1", False, 1072, triton.__version__)
    assert [(name, shape, c) for _, name, shape, c in work] == [
        ("matmul", shapes.Shape(45, 40, 24), POOL[1]), ("matmul", shapes.Shape(45, 40, 24), POOL[0])]
    assert work[0][0] == job.checked.kernel.source
    work = command._compile_work([job], pool_of, None, True, 1072, triton.__version__)  # --missing-only
    assert {shape for _, _, shape, _ in work} == {shapes.Shape(1072, 40, 24)} and len(work) == 2
    mm = Config(16, 16, 16, 8, 4, 1, mainloop="cublas")  # compiled only for a run with a shape that times it
    work = command._compile_work([job], {"matmul": (POOL[0], mm)}, None, False, 1072, triton.__version__)
    assert [c for _, _, _, c in work] == [POOL[0]]
    (long_k,) = command.jobs([SPECS / "matmul.yaml"], "45x40x24,20x40x400", kernels="matmul", tuning_dir=tmp_path,
                             gpu="test-gpu")
    work = command._compile_work([long_k], {"matmul": (POOL[0], mm)}, None, False, 1072, triton.__version__)
    assert [c for _, _, _, c in work] == [POOL[0], mm]


def test_precompile_launches_each_candidate_once_in_workers():
    """Worker processes launch each candidate once (here under the interpreter, as this machine has no GPU);
    one that fails is reported and left to the run, which compiles and reports it again."""
    source = str(SPECS / "matmul.yaml")
    for shape in (shapes.Shape(45, 40, 24), shapes.Shape(45, 40, 24, a_km=True)):
        assert precompile.compile_candidate(source, str(REPO / "generated"), "matmul", shape, entry_of(POOL[0]),
                                            "float32", 0) is None
    gluon = HopperConfig(POOL[0].block_m, POOL[0].block_n, POOL[0].block_k, stages=POOL[0].num_stages)
    assert "Hopper" in precompile.compile_candidate(source, str(REPO / "generated"), "matmul",
                                                    shapes.Shape(45, 40, 24), entry_of(gluon), "float32", 0)
    log = []
    precompile.precompile([(source, "matmul", shapes.Shape(45, 40, 24), c) for c in (POOL[0], gluon)],
                          REPO / "generated", torch.device("cuda", 0), 2, log.append, torch.float32)
    assert log[0].startswith("compiled 1 of 2 candidate(s) on 2 processes in ")
    assert log[1].startswith(f"  matmul {gluon.label()}: ") and len(log) == 2
    precompile.precompile([(source, "matmul", shapes.Shape(45, 40, 24), POOL[0])], REPO / "generated", CPU, 2,
                          log.append)
    assert len(log) == 2  # on the CPU nothing compiles ahead: the interpreter compiles nothing


def test_cli_tunes_and_writes(tune_on_cpu):
    result = CliRunner().invoke(main, ["tune", str(SPECS), "--shapes", "45x40x24", "--kernels", "matmul"])
    assert result.exit_code == 0, result.output
    assert f"wrote {tune_on_cpu / 'test-gpu' / 'matmul.json'}" in result.output
    assert result.output.splitlines()[1].startswith("matmul 45x40x24: ")


# -- on the GPU (marker `gpu`; about 30 s on an H200, nearly all of it compiling) -------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the device machine")
def test_gpu_tune_writes_what_pick_config_uses(tmp_path, monkeypatch):
    """The real thing at a small shape: do_bench, the float64 check on CUDA, the table, pick_config on this
    GPU, and run-time tuning of an untuned bucket timed with CUDA events on the caller's arguments."""
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)
    dev = torch.device("cuda")
    pool = (GPU_DEFAULT, Config(128, 256, 64, 8, 8, 3, persistent=True, tma=True), Config(64, 128, 64, 8, 4, 4))
    log: list[str] = []
    written = command.run([SPECS / "matmul.yaml", SPECS / "out_proj_residual_norm.yaml"], "2048x1024x512",
                       tuning_dir=tmp_path, pools={"matmul": pool, "out_proj_residual_norm": pool}, budget=300,
                       log=log.append)
    print("\n".join(log))
    gpu = runtime_tables.gpu_key(dev)
    assert written == [tmp_path / gpu / "matmul.json", tmp_path / gpu / "out_proj_residual_norm.json"]
    entry = json.loads(written[0].read_text())["shapes"]["2048x1024x512"]
    assert entry["ms"] > 0 and entry["cuBLAS_ms"] > 0
    mm = module("matmul")
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 2000, 1024, 512, dev) == config_of_entry(entry)
    # another token count of the same widths: the tuned entry, no run-time tuning
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 3000, 1024, 512, dev, decls=mm.DECLS,
                                run=lambda c: pytest.fail("tuned at run time")) == config_of_entry(entry)

    # widths the table lacks: tuned at run time on the caller's arguments
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(3000, 768, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(1024, 768, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.full((3000, 1024), float("nan"), device=dev, dtype=torch.bfloat16)
    config = autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 3000, 1024, 768, dev, decls=mm.DECLS,
                                  run=lambda c: mm.launch(a, b, out_tile=out, config=c))
    assert config in configs.RUNTIME_GEMM_CANDIDATES
    assert autotune.pick_config(mm.NAME, mm.FINGERPRINT, tmp_path, 4000, 1024, 768, dev,
                                decls=mm.DECLS) == config  # remembered
    mm.launch(a, b, out_tile=out, config=config)
    assert harness.relative_error(out, a.double() @ b.double().T) < 1e-2


def test_a_launch_looks_its_configuration_up_once(tmp_path, as_gpu, monkeypatch):
    """The table look-up (hundreds of microseconds of host time) runs once per launch arguments, also where the
    table has nothing: later launches take the answer as it was, until clear_caches; a default given while tuning
    could not run yet is not kept, so that the tuned choice replaces it."""
    mod = module("matmul")
    faster = configs.RUNTIME_GEMM_CANDIDATES[2]
    as_gpu.times[faster] = 1.0
    reads, table = [], runtime_tables.entries

    def counted(*args):
        reads.append(args)
        return table(*args)
    counted.cache_clear = table.cache_clear
    monkeypatch.setattr(runtime_tables, "entries", counted)
    pick = lambda: autotune.pick_config(mod.NAME, mod.FINGERPRINT, tmp_path, 45, 40, 24, CPU)  # noqa: E731
    assert pick() == GPU_DEFAULT and pick() == GPU_DEFAULT and len(reads) == 1  # untuned, no run: the default
    args = draw_args(mod, {"M": 45, "N": 40, "K": 24}, torch.float32, GPU_DEFAULT,
                     generator=torch.Generator().manual_seed(0))
    assert launch_with_hook(mod, args, tmp_path) == faster
    trials, looked_up = len(as_gpu.trials), len(reads)
    assert pick() == faster and pick() == faster and len(reads) == looked_up and len(as_gpu.trials) == trials
    autotune.clear_caches()
    assert pick() == faster and len(reads) == looked_up + 1  # looked up again (the choice now from the disk cache)
