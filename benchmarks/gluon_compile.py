"""The Hopper (Gluon) kernels of generated/kernels/gluon/, compiled for sm_90 on a machine without a GPU:
registers, spill stack and shared memory of each kernel in each configuration, read back with the `cuobjdump`
that Triton bundles, how many HGMMA (Hopper's warpgroup MMA) instructions its SASS holds, and its code size.

    python benchmarks/gluon_compile.py [--kernels a,b] [--dtype bf16|fp16] [--out FILE]

Gluon's API moves between Triton releases: run it with the Triton the GPU machine has (3.6.0 there)."""
from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "0")  # compile for real even where codagen would interpret
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from codagen.runtime.gluon_hopper import CONSUMER_REGS, HopperConfig, default_config  # noqa: E402
from spills import ELEMENT, jit_specialization  # noqa: E402

# after each kernel's default (default_config)
CONFIGS = (HopperConfig(stages=4), HopperConfig(stages=2), HopperConfig(block_m=64, block_n=256, stages=4),
           HopperConfig(block_k=32, stages=10), HopperConfig(stages=3, epilogue_split=4),
           HopperConfig(stages=3, epilogue_split=8), HopperConfig(stages=6, direct_stores=True),
           HopperConfig(stages=6, epilogue_split=4, direct_stores=True),
           HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, direct_stores=True),
           HopperConfig(stages=5, epilogue_split=8, epilogue_stages=4, direct_stores=True),
           HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True),
           HopperConfig(stages=5, epilogue_split=4, slice_loop=True),
           HopperConfig(stages=5, epilogue_split=4, direct_stores=True, slice_loop=True),
           HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True, slice_unroll=2),
           HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True, slice_unroll=4),
           HopperConfig(stages=5, epilogue_split=4, slice_loop=True, slice_unroll=2),
           HopperConfig(block_m=64, stages=8, epilogue_split=8, epilogue_stages=2, slice_loop=True, consumers=3,
                        consumer_regs=CONSUMER_REGS[3]),
           HopperConfig(block_m=64, stages=7, epilogue_split=4, slice_loop=True, consumers=3,
                        consumer_regs=CONSUMER_REGS[3]))


def names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "generated" / "kernels" / "gluon").glob("*.py") if p.stem != "__init__")


def source(module, config: HopperConfig, t: str = "bf16", a_km: bool = False) -> GluonASTSource:
    """The kernel with tensors of type T = `t` (bf16 or fp16) and `config`, as its launcher would call it;
    `a_km`: with the GEMM's a M-contiguous (gluon_hopper.mn_major)."""
    kernel = getattr(module, f"{module.NAME}_gluon_kernel")
    decls = {d.name: d for d in module.DECLS}
    params = list(inspect.signature(kernel.fn).parameters)
    descs = [p for p in params if p.endswith("_desc")]
    meta = {**config.meta(), "A_KM": a_km}
    sig, absent = {}, {}
    for p in params:
        if p in descs and config.direct_stores and decls[p[:-5]].output:
            sig[p], absent[(params.index(p),)] = "constexpr", None  # the launcher passes None: no TMA store
        elif p in descs:
            if p == descs[0]:
                block = [config.block_k, config.block_m] if a_km else [config.block_m, config.block_k]
            elif p == descs[1]:
                block = [config.block_n, config.block_k] if decls[p[:-5]].dims == ("N", "K") else \
                    [config.block_k, config.block_n]
            else:  # a tile input or output, in epilogue slices: N wide, N/2 (a gated activation's) or 2*N (pairs)
                slice_n = config.block_n // config.epilogue_split
                width = {"N/2": slice_n // 2, "2*N": 2 * slice_n}
                block = [config.block_m, width.get(decls[p[:-5]].dims[-1], slice_n)]
            layout = gl.NVMMASharedLayout.get_default_for(block, {"bf16": gl.bfloat16, "fp16": gl.float16}[t])
            sig[p] = f"tensordesc<{t}{block},{layout!r}>"
        elif p.endswith("_ptr"):
            dtype = decls[p[:-4]].dtype
            sig[p] = f"*{t}" if dtype == "T" else "*" + ELEMENT[dtype]
        elif p in meta:
            sig[p] = "constexpr"
        elif p in decls or p in ("M", "N", "K", "NUM_PROGRAMS") or p.startswith("stride_"):
            sig[p] = "i32"
        else:
            sig[p] = "fp32"  # host scalars
    unit_strides, attrs = jit_specialization(module, params, sig)
    return GluonASTSource(kernel, sig, {**{(params.index(k),): v for k, v in meta.items()}, **unit_strides, **absent},
                          attrs)


def compile_kernel(module, config: HopperConfig, t: str = "bf16", a_km: bool = False):
    return triton.compile(source(module, config, t, a_km), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


def usage(compiled) -> dict:
    """REG, STACK, SHARED (cuobjdump's, static only) and the kernel's dynamic shared memory, HGMMA count, and
    CODE: bytes of SASS (16 per instruction)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", res)}
    found["SMEM"] = compiled.metadata.shared
    found["HGMMA"] = len(re.findall(r"\bHGMMA\.", sass))
    found["CODE"] = 16 * len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
    counts = re.findall(r"SETMAXREG\.\w+\.CTAPOOL (?:UP0, )?0x([0-9a-f]+)", sass)
    found["SETMAXREG"] = sorted({int(v, 16) for v in counts})
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", help="comma-separated names (default: every module of generated/kernels/gluon)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="T, the type of the tensors")
    ap.add_argument("--out", type=Path, help="write the report here (markdown)")
    args = ap.parse_args()
    lines = ["# Hopper (Gluon) kernels compiled for sm_90 without a GPU", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; triton "
             f"{triton.__version__}; {args.dtype} tensors; command: "
             f"`python benchmarks/gluon_compile.py --dtype {args.dtype}`",
             "- REG: registers per thread at the kernel's entry (warp-specialized kernels re-divide them per "
             "partition with setmaxnreg: SETMAXREG lists the counts its SASS sets); STACK: bytes of stack per "
             "thread, mostly spilled registers (0: no spill); SMEM: bytes of shared memory a program uses; "
             "HGMMA: warpgroup MMA instructions in the SASS; CODE: kilobytes of SASS (the epilogue is there once per "
             "slice and consumer unrolled, once per consumer with the slice loop). The first row of a kernel is its "
             "launcher's default (as many operand stages as fit beside its epilogue). Compiled as the JIT compiles a "
             "launch on contiguous tensors at a model's shapes (spills.jit_specialization).", ""]
    for name in (args.kernels.split(",") if args.kernels else names()):
        module = importlib.import_module(f"generated.kernels.gluon.{name}")
        lines += [f"## {name}", "", "| configuration | REG | STACK | SMEM | HGMMA | CODE | SETMAXREG |",
                  "|---|---|---|---|---|---|---|"]
        for config in dict.fromkeys((default_config(module.EPILOGUE), *CONFIGS)):
            try:
                u = usage(compile_kernel(module, config, args.dtype))
                row = (f"| {config.label()} | {u['REG']} | {u['STACK']} | {u['SMEM']} | {u['HGMMA']} | "
                       f"{u['CODE'] / 1000:.0f} | {', '.join(map(str, u['SETMAXREG']))} |")
            except Exception as e:  # noqa: BLE001 - reported per configuration
                row = f"| {config.label()} | {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | | | |"
            print(f"{name}: {row}", flush=True)
            lines.append(row)
        lines.append("")
    if args.out:
        args.out.write_text("\n".join(lines))



def ttgir(module, config: HopperConfig, arch: int = 90, a_km: bool = False) -> str:
    """The kernel lowered as far as TTGIR for sm_`arch` (Gluon's own stage), without LLVM and ptxas: what the
    CPU tests check, since it is quick."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    src = source(module, config, a_km=a_km)
    options = backend.parse_options({"num_warps": 4})
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    return str(stages["ttgir"](mod, {}))


if __name__ == "__main__":
    main()
