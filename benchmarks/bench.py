"""codagen benchmark: times the Llama-block patterns (out-projection to SwiGLU, the post-attention rest, down
projection to RoPE, the whole non-attention block, LM head + cross-entropy) in every variant.

    python benchmarks/bench.py --preset llama3-1b --preset llama3-8b --tokens 16384 --out OUTDIR
    python benchmarks/bench.py --quick                      # tokens 2048, short timing: a smoke test
    python benchmarks/bench.py --device cpu --quick         # tiny shapes on the CPU (no Liger, no compile)
    python benchmarks/bench.py --variants codagen           # only cuBLAS, eager and codagen: no compile time

A row of the results is (pattern, variant). Patterns are the fixed list cases.PATTERNS (forward, or
forward+backward with random upstream gradients) at a model preset (codagen/presets.py). Variants come from a
registry: the built-in baselines (runners.py: cuBLAS GEMMs alone, eager, torch.compile, Liger-Kernel; see
baselines.py) plus codagen's (codagen_variants.py).

Method (harness.py): every variant's outputs (and gradients) are compared once with the eager ones and with a
higher-precision reference (the eager function on fp32 inputs with TF32 off on the GPU, fp64 on the CPU)
before timing; each row is timed with ``triton.testing.do_bench`` (median; L2 flushed before each call;
inputs rotated among a few sets when they would fit in L2) in two passes over all variants, and the report
gives the mean of the two medians and their spread; peak memory above the inputs is read with
``torch.cuda.max_memory_allocated`` after a reset. Results (report.py): ``<gpu>.md``, ``<gpu>.json`` and a
bar chart ``<gpu>.png`` in --out. The report ends with each fused kernel against the cuBLAS GEMM of its shape
(fused_kernels.py; ``--no-kernels`` skips it, ``--patterns kernels`` runs it alone).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402  (does not import triton)


def _cpu_run(argv) -> bool:
    """Whether this run is on the CPU (--device cpu, or no CUDA device): read before argparse, since Triton's
    interpreter must be switched on before triton is first imported."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1].startswith("cpu")
        if a.startswith("--device="):
            return a.split("=", 1)[1].startswith("cpu")
    return not torch.cuda.is_available()


# On the CPU, Triton kernels (codagen's generated ones; Liger's with --liger-interpret) run only under
# Triton's interpreter, which must be set before triton is imported anywhere (environment() imports it).
if "--liger-interpret" in sys.argv or (_cpu_run(sys.argv[1:]) and "TRITON_INTERPRET" not in os.environ):
    os.environ["TRITON_INTERPRET"] = "1"

from cases import PRESETS  # noqa: E402
from codagen_variants import codagen_variants  # noqa: E402
from harness import log, run_case, selected  # noqa: E402
from measure import bench_ms  # noqa: E402
from report import environment, summary, write_report  # noqa: E402
from runners import builtin_variants  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS),
                    help="model shapes (repeatable; default llama3-1b and llama3-8b on CUDA, tiny on the CPU)")
    ap.add_argument("--tokens", type=int, nargs="+", help="token counts (default 16384; --quick: 2048; CPU: 128)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for <gpu>.md/.json/.png")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tokens 2048 (CPU: 128), short timing, first preset only")
    ap.add_argument("--patterns", nargs="+", help="only patterns matching these (substring or glob), e.g. block "
                                                  "lm_ce.fwd; 'kernels' selects the fused-kernel section")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="skip the section of fused kernels vs the cuBLAS GEMM of the same shape")
    ap.add_argument("--variants", nargs="+",
                    help="only these variants (substring or glob; cuBLAS and eager, the check's reference, always "
                         "run), e.g. --variants codagen, or --variants codagen torch.compile liger")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help="include torch.compile rows")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-max-autotune", dest="max_autotune", action="store_false",
                    help="torch.compile's default mode only (max-autotune's compile takes minutes per pattern)")
    ap.add_argument("--no-liger", dest="liger", action="store_false", default=None)
    ap.add_argument("--liger-interpret", action="store_true",
                    help="CPU only: run the Liger rows under TRITON_INTERPRET=1 (slow; to check the calls)")
    ap.add_argument("--no-ref", dest="ref", action="store_false", help="skip the fp32/fp64 reference")
    ap.add_argument("--warmup", type=int, default=None, help="do_bench warmup, ms (default 25; quick 5)")
    ap.add_argument("--rep", type=int, default=None, help="do_bench rep, ms (default 100; quick 20)")
    ap.add_argument("--min-iters", type=int, default=None, help="timed calls at least (rep is raised to fit)")
    ap.add_argument("--passes", type=int, default=2, help="timing passes over all variants")
    ap.add_argument("--max-sets", type=int, default=4, help="input sets to rotate among when one set fits in L2")
    ap.add_argument("--tol", type=float, default=5e-2,
                    help="flag rows whose relative error vs eager or vs the reference exceeds this (or is NaN)")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="after timing, profile one call of each row (torch.profiler): its kernels in the report")
    ap.add_argument("--tag", default="", help="suffix for the output file names (<gpu>[-quick][-TAG].md)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failed rows")
    args = ap.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device_obj = torch.device(args.device)
    if args.device_obj.type == "cuda" and args.device_obj.index is None:
        args.device_obj = torch.device("cuda", torch.cuda.current_device())
    cpu = args.device_obj.type == "cpu"
    args.dtype_obj = getattr(torch, args.dtype)
    if args.preset is None:
        args.preset = ["tiny"] if cpu else ["llama3-1b", "llama3-8b"]
    if args.quick and len(args.preset) > 1:
        args.preset = args.preset[:1]
    if args.tokens is None:
        args.tokens = [128] if cpu else ([2048] if args.quick else [16384])
    if args.compile is None:
        args.compile = not cpu
    if args.liger is None:
        args.liger = (not cpu) or args.liger_interpret
    if args.warmup is None:
        args.warmup = 5 if args.quick else 25
    if args.rep is None:
        args.rep = 20 if args.quick else 100
    if args.min_iters is None:
        args.min_iters = 3 if args.quick else 7
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    # one compiled graph per (pattern, preset, tokens, grad mode): room for all of them
    import torch._dynamo
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(256, torch._dynamo.config.accumulated_cache_size_limit)
    # the reference runs fp32 GEMMs: keep them true fp32 (TF32 off; it is off by default too)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    env = environment(args)
    log(f"codagen bench: {env['gpu']}; torch {env['torch']}, triton {env['triton']}, "
        f"liger-kernel {env['liger-kernel']}")
    rows, kernel_rows = [], []
    out = Path(args.out)
    for pname in args.preset:
        preset = PRESETS[pname]
        for tokens in args.tokens:
            variants = builtin_variants(args) + list(codagen_variants(preset, tokens, args.dtype_obj))
            run_case(preset, tokens, args, variants, rows,
                     checkpoint=lambda: write_report(rows, env, args, out, kernel_rows, chart=False))
            if args.kernels and selected("kernels", args.patterns):
                import fused_kernels

                log(f"\n== {pname} T={tokens}  fused kernels vs the cuBLAS GEMM of the same shape")
                kernel_rows += fused_kernels.run(pname, tokens, args.device_obj, args.dtype_obj,
                                           lambda fn: bench_ms(fn, args.device_obj, args.warmup, args.rep), log)
                write_report(rows, env, args, out, kernel_rows, chart=False)
            log(f"[{time.time() - t_start:.0f}s elapsed]")
    md = write_report(rows, env, args, out, kernel_rows)
    failed = [r for r in rows if r.error] + [r for r in kernel_rows if r.error]
    log(f"\nwrote {md} (+ .json, .png) in {time.time() - t_start:.0f}s; {len(rows)} rows, {len(failed)} failed")
    # last: the short table (a remote run may return only the tail of the output)
    log(summary(rows))
    return 1 if failed and not any(r.ms for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
