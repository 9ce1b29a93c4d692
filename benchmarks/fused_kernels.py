"""Each generated kernel at its places in a preset's blocks (codagen.tune.shapes.block_uses: where the block
specs run it), against the cuBLAS GEMM of the same shape and operands: the "fused kernels" section of
bench.py's report.

A kernel runs with the configuration its launcher would pick (the committed tuning table of this GPU, else
the default; no tuning at run time, so that the row says what the table gives). Where it runs the default on
an sm_90 GPU, a second row times the Hopper kernel's own default there (what run-time tuning would try beside
it): whether an untuned shape should default to the Hopper kernel. Before it is timed, its
outputs on the first rows are compared with the float64 reference on NaN-prefilled outputs, as
`codagen tune` does; a wrong or failing kernel is reported, not timed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from codagen import api, runtime
from codagen.presets import PRESETS
from codagen.tune import harness
from codagen.tune.command import load_module
from codagen.tune.shapes import Shape, block_uses

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class KernelRow:
    preset: str
    tokens: int
    kernel: str
    where: str
    shape: str
    config: str = ""
    ms: float | None = None
    cublas_ms: float | None = None  # None: the kernel has no GEMM
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def run(preset: str, tokens: int, device: torch.device, dtype: torch.dtype,
        timer: Callable[[Callable[[], None]], float], log=print) -> list[KernelRow]:
    specs = api.load([ROOT / "specs"])
    checked = {c.kernel.name: c for c in specs if isinstance(c, api.Checked)}
    rows = []
    for use in block_uses(specs, PRESETS[preset], (tokens,), family_only=True):
        c = checked[use.kernel]
        module = load_module(ROOT / "generated", use.kernel)
        row = KernelRow(preset, tokens, use.kernel, use.where, str(use.shape))
        rows.append(row)
        default = _measured(row, c, module, use.shape, device, dtype, timer, None, log)
        hopper = _hopper_default(c, module, use.shape, device) if default else None
        if hopper is not None:
            extra = KernelRow(preset, tokens, use.kernel, use.where + " (the Hopper kernel's default)", str(use.shape))
            rows.append(extra)
            _measured(extra, c, module, use.shape, device, dtype, timer, hopper, log)
    return rows


def _measured(row: KernelRow, c: api.Checked, module, shape: Shape, device, dtype, timer, config, log) -> bool:
    """Time the row (its launcher's choice where config is None); whether that choice is the default."""
    default = False
    try:
        default = _measure(row, c, module, shape, device, dtype, timer, config)
    except Exception as e:  # noqa: BLE001 - a failing kernel is a row of the report
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        row.error = f"{type(e).__name__}: {first[:200]}"
    log(f"   {row.kernel:<24} {row.shape:<22} {row.config:<44} "
        + (row.error or f"{row.ms:.4f} ms" + (f"  cuBLAS {row.cublas_ms:.4f} ms  x{row.ms / row.cublas_ms:.2f}"
                                              if row.cublas_ms else "")))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return default


def _hopper_default(c: api.Checked, module, shape: Shape, device) -> runtime.Config | None:
    """The Hopper kernel's default at this shape, as run-time tuning tries it; None where there is none."""
    if device.type != "cuda" or "gluon" not in harness.other_backends(module, device):
        return None
    kernel = c.kernel
    default = runtime.configs.gpu_default(kernel.column_group, shape.n, module.DEFAULT_SPLIT)
    found = runtime.backends.candidates(module.__package__, module.NAME, device, default, kernel.tile_dependent,
                                        kernel.column_group, shape.n)
    return found[0] if found else None


def _measure(row: KernelRow, c: api.Checked, module, shape: Shape, device, dtype, timer, config=None) -> bool:
    """Check and time the kernel with `config`, else its launcher's choice; whether that was the default."""
    kernel = c.kernel
    picked = config is None
    config = config or harness.launch_choice(kernel, module, shape, device)
    default = picked and config == runtime.configs.gpu_k_group_default(
        runtime.configs.gpu_default(kernel.column_group, shape.n, module.DEFAULT_SPLIT), kernel.k_group)
    row.config = config.label()
    inputs = harness.make_inputs(kernel, module, shape, device, dtype)
    why = harness.Checker(c, module, inputs, min(harness.CHECK_ROWS, shape.m), device, dtype)(config, shape)
    if why is not None:
        row.error = f"wrong: {why}"
        return default
    inplace = harness.inplace_names(kernel)
    outs = harness.new_outputs(kernel, module, shape, config, device, dtype, {n: inputs[n] for n in inplace})
    launch_args = {n: v for n, v in inputs.items() if n not in inplace}

    def fn():
        module.launch(**launch_args, **outs, config=config)

    timed = harness.time_against_cublas(kernel, fn, inputs, timer) if kernel.gemm else None
    row.ms, row.cublas_ms = timed or (timer(fn), None)
    return default


def report_lines(rows: list[KernelRow]) -> list[str]:
    if not rows:
        return []
    lines = ["## Fused kernels vs the cuBLAS GEMM of the same shape", "",
             "Each kernel where the block specs run it (codagen.tune.shapes.block_uses), with the configuration its "
             "launcher picks (this GPU's tuning table, else the default), checked against float64 on the first "
             "rows before timing; cuBLAS = torch.matmul of the same operands; ratio = time / cuBLAS time "
             "(1.00: the epilogue is free; for `matmul`, which has none, the mainloop against cuBLAS).", ""]
    groups = list(dict.fromkeys((r.preset, r.tokens) for r in rows))
    for preset, tokens in groups:
        lines += [f"### {preset}, {tokens} tokens", "",
                  "| kernel | where | shape | configuration | ms | cuBLAS ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if (r.preset, r.tokens) == (preset, tokens)):
            if r.ms is None:
                lines.append(f"| {r.kernel} | {r.where} | {r.shape} | {r.config} | failed: {r.error} | - | - |")
                continue
            cublas = f"{r.cublas_ms:.4f}" if r.cublas_ms else "-"
            ratio = f"{r.ms / r.cublas_ms:.2f}" if r.cublas_ms else "-"
            lines.append(f"| {r.kernel} | {r.where} | {r.shape} | {r.config} | {r.ms:.4f} | {cublas} | {ratio} |")
        lines.append("")
    return lines
