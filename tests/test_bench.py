"""benchmarks/ on the CPU without timing anything: the benchmark's presets are the model presets, codagen's
variants name known patterns, and rows become the report's tables."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from codagen.presets import PRESETS
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench  # noqa: E402
import cases  # noqa: E402
import codagen_variants  # noqa: E402
import fused_kernels  # noqa: E402
import report  # noqa: E402
import runners  # noqa: E402
import tuning_report  # noqa: E402
from harness import Row, run_case  # noqa: E402
from runners import CUBLAS, MAX_AUTOTUNE  # noqa: E402


def test_every_model_preset_runs_as_batches_of_sequences():
    assert set(cases.PRESETS) == set(PRESETS)
    for name, model in PRESETS.items():
        for tokens in (100, 4096, 12288):
            dm = cases.PRESETS[name].dims(tokens)
            assert dm.batch * dm.seq == tokens and dm.seq <= max(cases.SEQ, tokens)
            assert (dm.d, dm.ffn, dm.qkv_width, dm.vocab, dm.eps) == (model.dim, model.ffn_dim, model.qkv_dim,
                                                                      model.vocab, model.eps)


def test_codagen_variants_run_known_patterns():
    variants = codagen_variants.codagen_variants(cases.PRESETS["tiny"], 128, torch.bfloat16)
    assert {v.pattern for v in variants if v.name == "codagen"} == set(cases.PATTERN_BY_KEY)  # every pattern
    assert {(v.pattern, v.name) for v in variants if v.name != "codagen"} == {
        ("lm_ce.fwdbwd", codagen_variants.FP32_SUM), ("lm_ce.fwdbwd", codagen_variants.HALF_CHUNKS),
        ("lm_ce.fwdbwd", codagen_variants.FIVE_EIGHTHS_CHUNKS)}


def test_torch_compile_runs_in_both_modes_on_every_pattern():
    args = bench.parse_args(["--device", "cpu", "--compile"])
    variants = runners.builtin_variants(args)
    for mode in ("torch.compile", MAX_AUTOTUNE):
        assert {v.pattern for v in variants if v.name == mode} == set(cases.PATTERN_BY_KEY), mode
    default_only = runners.builtin_variants(bench.parse_args(["--device", "cpu", "--compile", "--no-max-autotune"]))
    assert {v.name for v in default_only} >= {"torch.compile"} and MAX_AUTOTUNE not in {v.name for v in default_only}


def test_new_codagen_rows_check_against_the_reference_on_the_cpu():
    """oproj_swiglu.fwdbwd and the LM head's rows (both weight-gradient sums) built, run and checked against
    eager and the float64 reference as bench.py does, in fp32 on the tiny preset: codagen matches to ~1e-6."""
    args = bench.parse_args(["--device", "cpu", "--quick", "--dtype", "float32", "--variants", "codagen",
                             "--patterns", "oproj_swiglu.fwdbwd", "lm_ce", "--passes", "1", "--rep", "1",
                             "--warmup", "1", "--min-iters", "1"])
    preset = cases.PRESETS["tiny"]
    variants = runners.builtin_variants(args) + codagen_variants.codagen_variants(preset, 64, torch.float32)
    rows = run_case(preset, 64, args, variants, [])
    checked = {(r.pattern, r.variant): r for r in rows if r.variant.startswith("codagen")}
    assert set(checked) == {("oproj_swiglu.fwdbwd", "codagen"), ("lm_ce.fwd", "codagen"),
                            ("lm_ce.fwdbwd", "codagen"), ("lm_ce.fwdbwd", codagen_variants.FP32_SUM),
                            ("lm_ce.fwdbwd", codagen_variants.HALF_CHUNKS),
                            ("lm_ce.fwdbwd", codagen_variants.FIVE_EIGHTHS_CHUNKS)}
    for key, row in checked.items():
        assert not row.error and row.ms is not None, (key, row.error)
        assert row.err_ref < 1e-5 and row.err_eager < 1e-5, (key, row.errs)
    assert {n for n in checked["oproj_swiglu.fwdbwd", "codagen"].errs if "@" not in n} == {
        "x1", "y1", "dx0", "dy0", "dwo", "dwn1", "dwg", "dwu"}


def test_kernel_profile_of_each_row_on_the_cpu():
    """--kernel-profile: after the timing, each row's call profiled (on the CPU its operators' own time), most
    expensive first: the cuBLAS row runs the pattern's three matrix products, codagen's none (its GEMMs are
    generated kernels); the report lists each row's."""
    args = bench.parse_args(["--device", "cpu", "--quick", "--dtype", "float32", "--variants", "codagen",
                             "--patterns", "oproj_swiglu.fwd", "--passes", "1", "--rep", "1", "--warmup", "1",
                             "--min-iters", "1", "--no-ref", "--kernel-profile"])
    preset = cases.PRESETS["tiny"]
    variants = runners.builtin_variants(args) + codagen_variants.codagen_variants(preset, 128, torch.float32)
    rows = {r.variant: r for r in run_case(preset, 128, args, variants, []) if r.pattern == "oproj_swiglu.fwd"}
    assert set(rows) == {CUBLAS, "eager", "codagen"}
    for row in rows.values():
        assert row.kernels and all(ms > 0 and n > 0 for _, ms, n in row.kernels), row.variant
        assert [ms for _, ms, _ in row.kernels] == sorted((ms for _, ms, _ in row.kernels), reverse=True)
    launches = {name: n for name, _, n in rows[CUBLAS].kernels}
    assert launches["aten::mm"] == 3, launches
    assert not any("mm" in name for name, _, _ in rows["codagen"].kernels)
    lines = report.kernel_profile_lines(list(rows.values()), ["oproj_swiglu.fwd"], [CUBLAS, "eager", "codagen"])
    assert lines[0].startswith("<details><summary>kernels per call") and lines[-2] == "</details>"
    assert any(line.startswith("**oproj_swiglu.fwd, codagen**:") for line in lines)


def test_each_family_runs_its_own_patterns_and_variants():
    """Qwen3 and Gemma-2 presets run the block and LM-head patterns only, with their own inputs (QK-norm weights;
    Gemma-2's post-norms), and Liger's fused add + RMSNorm (no part of their Liger patches) stays Llama's."""
    assert [p.key for p in cases.PRESETS["qwen3-1.7b"].patterns] == ["block.fwd", "block.fwdbwd", "lm_ce.fwd",
                                                                     "lm_ce.fwdbwd"]
    assert [p.key for p in cases.PRESETS["gemma2-2b"].patterns] == ["block.fwd", "block.fwdbwd", "lm_ce.fwd",
                                                                    "lm_ce.fwdbwd"]
    assert {"wqn", "wkn"} <= set(cases.PRESETS["qwen3-tiny"].patterns[1].leaves)
    assert {"wna", "wnm"} <= set(cases.PRESETS["gemma2-tiny"].patterns[1].leaves)
    gemma = cases.PRESETS["gemma2-2b"].dims(32768)
    assert (gemma.family, gemma.softcap, gemma.q_width, gemma.d) == ("gemma2", 30.0, 2048, 2304)
    args = bench.parse_args(["--device", "cpu", "--compile"])
    args.liger = True   # registered as on a GPU (not run here)
    variants = runners.builtin_variants(args)
    assert {v.families for v in variants if v.name == "liger+addnorm"} == {("llama",)}
    assert all(not v.families for v in variants if v.name in ("liger", "torch.compile", MAX_AUTOTUNE))
    for family, preset in (("qwen3", "qwen3-tiny"), ("gemma2", "gemma2-tiny")):
        keys = {(v.pattern, v.name) for v in codagen_variants.codagen_variants(cases.PRESETS[preset], 128,
                                                                                torch.bfloat16)}
        assert keys == {(p.key, "codagen") for p in cases.PRESETS[preset].patterns} | {
            ("lm_ce.fwdbwd", codagen_variants.FP32_SUM)}, family


@pytest.mark.parametrize("preset", ["qwen3-tiny", "gemma2-tiny"])
def test_family_rows_check_against_the_reference_on_the_cpu(preset):
    """Qwen3's and Gemma-2's block and LM-head rows, forward+backward, built, run and checked as bench.py does, in
    fp32 against eager and the float64 reference: every output and gradient (the QK-norm and post-norm weights'
    included) matches to ~1e-6. Timing is left out here (passes 0): the Llama rows above time theirs."""
    args = bench.parse_args(["--device", "cpu", "--quick", "--dtype", "float32", "--variants", "codagen",
                             "--patterns", "block.fwdbwd", "lm_ce.fwdbwd", "--passes", "0"])
    bp = cases.PRESETS[preset]
    variants = runners.builtin_variants(args) + codagen_variants.codagen_variants(bp, 128, torch.float32)
    rows = run_case(bp, 128, args, variants, [])
    assert {(r.pattern, r.variant) for r in rows} == {
        (p, v) for p in ("block.fwdbwd", "lm_ce.fwdbwd") for v in ("eager", CUBLAS, "codagen")} | {
        ("lm_ce.fwdbwd", codagen_variants.FP32_SUM)}
    checked = {(r.pattern, r.variant): r for r in rows if r.variant.startswith("codagen")}
    for key, row in checked.items():
        assert not row.error, (key, row.error)
        assert row.err_ref < 1e-5 and row.err_eager < 1e-5, (key, row.errs)
    eager_leaves = {"d" + n for n in cases.PRESETS[preset].patterns[1].leaves}
    assert {n for n in checked["block.fwdbwd", "codagen"].errs if "@" not in n} == {"x2", "q", "k", "v"} | eager_leaves
    assert {n for n in checked["lm_ce.fwdbwd", "codagen"].errs if "@" not in n} == {"loss", "dxf", "dwnf", "dwv"}


def test_rows_become_the_report(tmp_path):
    title = cases.PATTERN_BY_KEY["block.fwd"].title
    rows = [Row("tiny", 128, "block.fwd", title, variant, ms=ms, ms_passes=[ms * 0.99, ms * 1.01], host_ms=ms / 4)
            for variant, ms in ((CUBLAS, 1.0), ("eager", 2.0), ("codagen", 1.5))]
    lm_title = cases.PATTERN_BY_KEY["lm_ce.fwdbwd"].title
    rows += [Row("tiny", 128, "lm_ce.fwdbwd", lm_title, variant, ms=1.0, ms_passes=[1.0], peak_mib=peak)
             for variant, peak in (("liger", 1008.0), ("codagen", 900.4))]
    kernel_rows = [fused_kernels.KernelRow("tiny", 128, "matmul", "the GEMM of x", "128x64x64", "64x64x32", 2.0, 1.0)]
    args = types.SimpleNamespace(quick=True, tag="", warmup=5, rep=20, min_iters=3, max_sets=4, passes=2,
                                 device_obj=torch.device("cpu"), dtype_obj=torch.bfloat16)
    env = {"date": "today", "device": "cpu", "gpu": "none", "torch": "t", "triton": "t", "liger-kernel": "-",
           "python": "p", "dtype": "bfloat16"}
    md = report.write_report(rows, env, args, tmp_path, kernel_rows, chart=False)
    text = md.read_text()
    assert md.name == "cpu-quick.md" and "## tiny, 128 tokens" in text
    assert f"| {title} | 1.000 (1.00x) | 2.000 (2.00x) | - | 1.500 (1.50x) |" in text  # no liger row there
    assert "| block.fwd | 1.500 | 1.50 | 0.75 |" in text  # codagen / cuBLAS, codagen / eager
    assert "| block.fwd | codagen | 1.500 | 1.50 | 0.75 | 2.0% | 0.375 |" in text  # ... spread, host ms
    assert "| matmul | the GEMM of x | 128x64x64 | 64x64x32 | 2.0000 | 1.0000 | 2.00 |" in text
    data = json.loads((tmp_path / "cpu-quick.json").read_text())
    assert [r["variant"] for r in data["rows"]] == [CUBLAS, "eager", "codagen", "liger", "codagen"]
    assert data["rows"][-1]["peak_mib"] == 900.4 and data["kernels"][0]["ms"] == 2.0
    assert "| pattern | liger | codagen |\n|---|---|---|\n| lm_ce.fwdbwd | 1,008 | 900 |" in text  # peak memory
    assert "codagen / cuBLAS GEMMs alone=1.50  eager=0.75" in report.summary(rows)
    assert "peak MiB: liger=1,008  codagen=900" in report.summary(rows)


def test_tuning_report_sorts_shapes_by_number_and_lists_what_the_reader_refused(tmp_path):
    """Shape keys sorted by their numbers as the table reader parses them (8192 before 32768, 16 before 128), keys
    that are no shape (which int() failed on) and files that are no table listed as refused, quoted on one line,
    never a traceback or a raw key."""
    folder = tmp_path / "test-gpu"
    folder.mkdir()
    config = {"block_m": 64, "block_n": 64, "block_k": 32, "group_m": 8, "num_warps": 4, "num_stages": 2}
    good = lambda ms: {"config": config, "ms": ms, "cuBLAS_ms": 1.0}  # noqa: E731
    shapes = {"32768x11x7": good(2.0), "8192x11x7": good(1.0), "abc": good(9.0), "1x1x1; touch pwned #": good(9.0),
              "16x11x7": good(0.5), "\u00b2x1x1": good(9.0), "128x11x7": {"config": config, "ms": "fast"},
              "64x11x7": {"config": {"bogus_field": 1}}}
    (folder / "zz_made_up.json").write_text(json.dumps({"triton": "3.x", "shapes": shapes}))
    (folder / "broken.json").write_text('{"shapes": {')
    presets, others = tuning_report.rows("test-gpu", tmp_path)
    assert presets == {}
    assert [key for _, key, _ in others] == ["16x11x7", "128x11x7", "8192x11x7", "32768x11x7"]
    text = tuning_report.markdown("test-gpu", tmp_path)
    assert "| zz_made_up | 16x11x7 | 64x64x32 g8 w4 s2 | 0.5 | 1.0 | 0.50 * |" in text
    assert "| zz_made_up | 128x11x7 | 64x64x32 g8 w4 s2 | - | - | - |" in text  # no time: no number made up
    refused = text.split("## Skipped")[1]
    assert "broken.json (invalid JSON" in refused
    for key in ("'abc'", "'1x1x1; touch pwned #'", "'\\xb2x1x1'", "'64x11x7'"):
        assert f"entry {key}: " in refused, key
    assert "touch pwned" not in text.split("## Skipped")[0] and "\u00b2" not in text  # no key raw in a row


def test_launch_kernel_writes_every_output():
    """benchmarks/launch_kernel.py, as a profiler runs it: under the interpreter at a small ragged shape, with
    the config for the CPU and with a tl tuning candidate named by its label, every output is written."""
    import launch_kernel

    for label in (None, "64x64x64 g8 w4 s4 tma"):
        config, outs = launch_kernel.launch("swiglu_dgrad", "37x48x40", label, launches=1, device="cpu")
        assert label is None or config.label() == label
        for name, t in outs.items():
            assert not torch.isnan(t).any(), (label, name)
    with pytest.raises(SystemExit, match="no candidate labelled 'nothing'"):
        launch_kernel.launch("swiglu_dgrad", "37x48x40", "nothing", device="cpu")


@pytest.mark.parametrize("kernel", ["swiglu_dgrad", "norm_dgrad_residual"])
def test_epilogue_parts_keep_what_they_do_not_leave_out(kernel, tmp_path):
    """benchmarks/epilogue_parts.py's variants of a kernel: one per output left out and the GEMM alone, each a
    valid spec that the Hopper backend lowers; under the interpreter, on fresh random data at a ragged shape,
    each writes the outputs it keeps exactly as the kernel does, and the GEMM alone writes the accumulator."""
    import epilogue_parts
    from codagen.runtime import Config
    from codagen.tune.command import load_module
    from codagen.tune.harness import make_inputs, new_outputs
    from codagen.tune.shapes import Shape

    found = epilogue_parts.variants(epilogue_parts.spec_of(kernel, REPO / "specs"))
    spec = found[kernel]
    assert set(found) == {kernel, f"{kernel}_gemm_alone"} | {f"{kernel}_without_{o}" for o in spec["outputs"]}
    out = epilogue_parts.build(found, tmp_path)
    assert {p.stem for p in (out / "kernels" / "gluon").glob("*.py")} >= set(found)
    shape, config = Shape(37, 48, 40), Config(16, 32, 16, 8, 4, 1)
    checked = {c.kernel.name: c.kernel for c in epilogue_parts.api.load([tmp_path / "specs"])}
    full = load_module(out, kernel)
    seed = int(torch.randint(0, 2**31, ()))  # fresh data each run
    inputs = make_inputs(checked[kernel], full, shape, torch.device("cpu"), torch.float32, seed=seed)
    results = {}
    for name in found:
        module = load_module(out, name)
        args = {d.name: inputs[d.name] for d in module.DECLS if not d.output}
        outs = new_outputs(checked[name], module, shape, config, torch.device("cpu"), torch.float32)
        module.launch(**args, **outs, config=config)
        results[name] = outs
    for name, outs in results.items():
        if name == f"{kernel}_gemm_alone":
            a, b = inputs[spec["gemm"]["a"]].double(), inputs[spec["gemm"]["b"]].double()
            want = a @ (b if spec["gemm"].get("b_layout") == "kn" else b.T)
            torch.testing.assert_close(outs["product"].double(), want, rtol=1e-5, atol=1e-5)
            continue
        if name != kernel:
            assert outs and set(outs) < set(results[kernel]), name
        for o, t in outs.items():
            assert not torch.isnan(t).any() and torch.equal(t, results[kernel][o]), (name, o)
