"""benchmarks/ on the CPU without timing anything: the benchmark's presets are the model presets, codagen's
variants name known patterns, and rows become the report's tables."""
from __future__ import annotations

import json
import sys
import types

import torch

from codagen.presets import PRESETS
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import cases  # noqa: E402
import codagen_variants  # noqa: E402
import kernels  # noqa: E402
import report  # noqa: E402
from harness import Row  # noqa: E402
from runners import CUBLAS  # noqa: E402


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
    assert variants and {v.pattern for v in variants} <= set(cases.PATTERN_BY_KEY)
    assert {v.name for v in variants} == {"codagen"}


def test_rows_become_the_report(tmp_path):
    title = cases.PATTERN_BY_KEY["block.fwd"].title
    rows = [Row("tiny", 128, "block.fwd", title, variant, ms=ms, ms_passes=[ms * 0.99, ms * 1.01])
            for variant, ms in ((CUBLAS, 1.0), ("eager", 2.0), ("codagen", 1.5))]
    kernel_rows = [kernels.KernelRow("tiny", 128, "matmul", "the GEMM of x", "128x64x64", "64x64x32", 2.0, 1.0)]
    args = types.SimpleNamespace(quick=True, tag="", warmup=5, rep=20, min_iters=3, max_sets=4, passes=2,
                                 device_obj=torch.device("cpu"), dtype_obj=torch.bfloat16)
    env = {"date": "today", "device": "cpu", "gpu": "none", "torch": "t", "triton": "t", "liger-kernel": "-",
           "python": "p", "dtype": "bfloat16"}
    md = report.write_report(rows, env, args, tmp_path, kernel_rows, chart=False)
    text = md.read_text()
    assert md.name == "cpu-quick.md" and "## tiny, 128 tokens" in text
    assert f"| {title} | 1.000 (1.00x) | 2.000 (2.00x) | 1.500 (1.50x) |" in text
    assert "| block.fwd | 1.500 | 1.50 | 0.75 |" in text  # codagen / cuBLAS, codagen / eager
    assert "| matmul | the GEMM of x | 128x64x64 | 64x64x32 | 2.0000 | 1.0000 | 2.00 |" in text
    data = json.loads((tmp_path / "cpu-quick.json").read_text())
    assert [r["variant"] for r in data["rows"]] == [CUBLAS, "eager", "codagen"] and data["kernels"][0]["ms"] == 2.0
    assert "codagen / cuBLAS GEMMs alone=1.50  eager=0.75" in report.summary(rows)
