"""The Hopper (Gluon) kernels on an H200: correctness against float64, then time against cuBLAS and the tl kernels.

1. Correctness: each kernel of generated/kernels/gluon/ named by --kernels, in bf16 and fp16, at ragged shapes
   (M, N and K multiples of no tile) and at a Llama-3-1B shape, on NaN-prefilled outputs: the relative error of
   every output against codagen's float64 reference, next to the tl kernel's error on the same inputs. A
   kernel passes when no output holds NaN and each error is within 2x the tl kernel's and under 1e-2.
2. Time (triton.testing.do_bench, median, L2 flushed): at 32768 tokens, each kernel at the out-projection and
   down-projection shapes of Llama-3-1B and -8B, in bf16: the Gluon kernel in a few configurations (each first
   checked on its first 1072 rows against float64 and at the full shape for NaN, as `codagen tune` does), the
   tl kernel with the configuration its launcher picks (this GPU's committed tuning table), and the cuBLAS GEMM
   of the same shape.

    python benchmarks/gluon_bench.py --out DIR [--phase check|time|all] [--kernels matmul,out_proj_residual_norm]

Writes DIR/h200-gluon.md and DIR/h200-gluon.json."""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from codagen import api, reference, runtime  # noqa: E402
from codagen.runtime import gluon_hopper as hopper  # noqa: E402
from codagen.tune import harness  # noqa: E402
from codagen.tune.shapes import Shape  # noqa: E402

RAGGED = (Shape(1037, 1000, 872), Shape(333, 2056, 200))  # no dimension a multiple of 64 but N, K of 8 (TMA)
LLAMA_1B = Shape(8192, 2048, 2048)
TIMED = {"1B out-proj": Shape(32768, 2048, 2048), "1B down": Shape(32768, 2048, 8192),
         "8B out-proj": Shape(32768, 4096, 4096), "8B down": Shape(32768, 4096, 14336)}
CONFIGS = {  # None: the launcher's default, 128x128x64 with as many stages as fit (5 for one epilogue buffer)
    "default": None, "s4": hopper.HopperConfig(stages=4), "g16": hopper.HopperConfig(stages=5, group_m=16),
    "wide": hopper.HopperConfig(block_m=64, block_n=256, stages=4),
    "r240": hopper.HopperConfig(stages=5, consumer_regs=240),
    "k32": hopper.HopperConfig(block_k=32, stages=10),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def versions() -> dict:
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    return {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__}


def errors(checked, module, shape: Shape, config, inputs: dict, device, dtype) -> dict:
    """{output: relative error vs float64} of one launch on NaN-prefilled outputs, or {'error': why}."""
    outs = harness.new_outputs(checked.kernel, module, shape, config, device, dtype)
    try:
        module.launch(**inputs, **outs, config=config)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": harness._short(e)}
    truth = reference.run(checked.kernel, checked.types, inputs, config.block_m, config.epilogue_n)
    found = {}
    for name, got in outs.items():
        found[name] = float("nan") if torch.isnan(got).any() else harness.relative_error(got, truth[name])
    return found


def correctness(checked, tl_module, gl_module, shapes, device, log) -> list[dict]:
    rows = []
    gl_config = hopper.default_config(gl_module.EPILOGUE)
    for dtype_name, dtype in DTYPES.items():
        for shape in shapes:
            inputs = harness.make_inputs(checked.kernel, gl_module, shape, device, dtype, seed=len(rows) + 1)
            tl_config = runtime.pick_config(tl_module.NAME, tl_module.FINGERPRINT, tl_module.TUNING,
                                            shape.m, shape.n, shape.k, device, split=tl_module.DEFAULT_SPLIT)
            got = errors(checked, gl_module, shape, gl_config, inputs, device, dtype)
            tl = errors(checked, tl_module, shape, tl_config, inputs, device, dtype)
            ok = "error" not in got and all(
                v == v and v <= harness.TOLERANCE and v <= 2 * max(tl.get(k, 0.0), 1e-6) for k, v in got.items())
            rows.append({"kernel": checked.kernel.name, "dtype": dtype_name, "shape": str(shape), "gluon": got,
                         "tl": tl, "pass": ok})
            log(f"  {checked.kernel.name:<24} {dtype_name} {str(shape):<18} {'PASS' if ok else 'FAIL'} "
                f"gluon {_fmt(got)}  tl {_fmt(tl)}")
    return rows


def _fmt(errs: dict) -> str:
    return errs["error"] if "error" in errs else " ".join(f"{k}={v:.1e}" for k, v in errs.items())


def timing(checked, tl_module, gl_module, device, configs, shapes: dict, rows: list, save, log) -> None:
    """Appends a row per shape to `rows`, and saves after each."""
    for where, shape in shapes.items():
        tl_config = runtime.pick_config(tl_module.NAME, tl_module.FINGERPRINT, tl_module.TUNING,
                                        shape.m, shape.n, shape.k, device, split=tl_module.DEFAULT_SPLIT)
        outcome = harness.tune_shape(checked, tl_module, shape, device, pool=[tl_config])
        row = {"kernel": checked.kernel.name, "where": where, "shape": str(shape), "cublas_ms": outcome.cublas_ms,
               "tl": {"config": tl_config.label(), "ms": outcome.ms,
                      "error": "; ".join(why for _, why in outcome.discarded)}, "gluon": []}
        pool = [c or hopper.default_config(gl_module.EPILOGUE) for c in configs]
        pool = list(dict.fromkeys(pool))
        started = time.monotonic()
        outcome = harness.tune_shape(checked, gl_module, shape, device, pool=pool)
        for config, ms in outcome.timed:
            row["gluon"].append({"config": config.label(), "ms": ms})
        for config, why in outcome.discarded:
            row["gluon"].append({"config": config.label(), "ms": None, "error": why})
        best = min((g["ms"] for g in row["gluon"] if g["ms"]), default=None)
        log(f"  {checked.kernel.name:<24} {where:<12} cuBLAS {row['cublas_ms'] or float('nan'):.4f}  "
            f"tl {row['tl']['ms'] or float('nan'):.4f}  gluon best {best or float('nan'):.4f} "
            f"({time.monotonic() - started:.0f} s)")
        for g in row["gluon"]:
            log(f"      {g['config']:<32} " + (f"{g['ms']:.4f}" if g["ms"] else g["error"]))
        rows.append(row)
        save()


def report(info: dict, checks: list[dict], times: list[dict]) -> str:
    lines = ["# Hopper (Gluon) kernels on the H200: correctness and time", "",
             f"- {info['date']}; {info['gpu']} ({info['sms']} SMs), driver {info['driver']}, CUDA {info['cuda']}, "
             f"torch {info['torch']}, triton {info['triton']}; command: `python benchmarks/gluon_bench.py`",
             "- Correctness: relative error ‖out − ref‖ / ‖ref‖ of each output against codagen's float64 "
             "reference, outputs NaN-prefilled; the tl kernel's error on the same inputs beside it. PASS: no NaN, "
             "each error ≤ 2× the tl kernel's and ≤ 1e-2.",
             "- Time: `triton.testing.do_bench` median in ms, bf16, L2 flushed; the tl kernel in the configuration "
             "its launcher picks (the committed tuning table), the cuBLAS GEMM (`torch.matmul`) of the same shape; "
             "ratio = time / cuBLAS.", "", "## Correctness", "",
             "| kernel | dtype | M×N×K | result | Gluon errors | tl errors |", "|---|---|---|---|---|---|"]
    for r in checks:
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['shape']} | {'PASS' if r['pass'] else 'FAIL'} | "
                     f"{_fmt(r['gluon'])} | {_fmt(r['tl'])} |")
    lines += ["", "## Time at 32768 tokens (bf16)", "",
              "| kernel | where | M×N×K | cuBLAS ms | tl ms (ratio) | best Gluon ms (ratio) | best Gluon config |",
              "|---|---|---|---|---|---|---|"]
    for r in times:
        cublas = r["cublas_ms"]
        tl_ms = r["tl"]["ms"]
        timed = [g for g in r["gluon"] if g["ms"]]
        best = min(timed, key=lambda g: g["ms"]) if timed else None
        ratio = (lambda ms: f"{ms:.4f} ({ms / cublas:.2f})" if ms and cublas else (f"{ms:.4f}" if ms else "–"))
        lines.append(f"| {r['kernel']} | {r['where']} | {r['shape']} | {cublas or float('nan'):.4f} | "
                     f"{ratio(tl_ms)} | {ratio(best['ms'] if best else None)} | {best['config'] if best else '–'} |")
    lines += ["", "Every Gluon configuration timed:", "", "| kernel | where | configuration | ms | × cuBLAS |",
              "|---|---|---|---|---|"]
    for r in times:
        for g in r["gluon"]:
            cell = f"{g['ms']:.4f} | {g['ms'] / r['cublas_ms']:.2f}" if g["ms"] and r["cublas_ms"] else \
                f"{g.get('error', '')} | "
            lines.append(f"| {r['kernel']} | {r['where']} | {g['config']} | {cell} |")
    tl_line = [f"{r['kernel']} {r['where']}: {r['tl']['config']}" for r in times]
    lines += ["", "tl configurations (from the tuning table): " + "; ".join(tl_line), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", choices=("check", "time", "all"), default="all",
                    help="check: correctness only; time: timing only, added to the report a check phase wrote")
    ap.add_argument("--check-kernels", help="kernels to check (default: every module of generated/kernels/gluon)")
    ap.add_argument("--kernels", default="matmul,out_proj_residual_norm", help="kernels to time")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"Gluon configurations to time, of {list(CONFIGS)}")
    ap.add_argument("--shapes", help="MxNxK,... to time at instead of the Llama projections' shapes (for kernels "
                                     "of other places, e.g. swiglu_dgrad's 32768x8192x2048)")
    args = ap.parse_args()
    shapes = TIMED if not args.shapes else {s: Shape(*map(int, s.split("x"))) for s in args.shapes.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    saved = args.out / "h200-gluon.json"
    previous = json.loads(saved.read_text()) if args.phase == "time" and saved.exists() else {}
    info = versions()
    print(json.dumps(info), flush=True)
    checked = {c.kernel.name: c for c in api.load([ROOT / "specs"]) if isinstance(c, api.Checked)}
    checks, times = previous.get("correctness", []), []

    def save() -> None:
        saved.write_text(json.dumps({"info": info, "correctness": checks, "time": times}, indent=1))
        (args.out / "h200-gluon.md").write_text(report(info, checks, times))

    timed = args.kernels.split(",")
    check_names = args.check_kernels.split(",") if args.check_kernels else timed + sorted(
        p.stem for p in (ROOT / "generated" / "kernels" / "gluon").glob("*.py") if p.stem not in ("__init__", *timed))
    for name in check_names if args.phase != "time" else ():
        tl_module = importlib.import_module(f"generated.kernels.{name}")
        gl_module = importlib.import_module(f"generated.kernels.gluon.{name}")
        print(f"correctness: {name}", flush=True)
        checks += correctness(checked[name], tl_module, gl_module, (*RAGGED, LLAMA_1B), device, print)
        save()
    for name in timed if args.phase != "check" else ():
        tl_module = importlib.import_module(f"generated.kernels.{name}")
        gl_module = importlib.import_module(f"generated.kernels.gluon.{name}")
        print(f"time: {name}", flush=True)
        timing(checked[name], tl_module, gl_module, device, [CONFIGS[c] for c in args.configs.split(",")], shapes,
               times, save, print)
    save()
    print(report(info, checks, times))


if __name__ == "__main__":
    main()
