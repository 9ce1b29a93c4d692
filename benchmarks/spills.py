"""Registers and spills of the generated kernels, compiled for an NVIDIA architecture on a machine without a
GPU: each kernel of `generated/` in each tuning candidate of `codagen.tune`, through Triton's compiler and
its bundled ptxas, read back with the bundled `cuobjdump -res-usage`. A candidate that spills heavily is
unlikely to win; what wins is only known from `codagen tune` on the GPU. The register allocation comes
from this machine's Triton, which can differ from the GPU machine's.

    TRITON_INTERPRET=0 python benchmarks/spills.py [--kernels a,b] [--arch 90] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
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
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated to silence its warning
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from codagen import api  # noqa: E402
from codagen.runtime.configs import Config, fits_group  # noqa: E402
from codagen.tune.candidates import tl_candidates  # noqa: E402
from codagen.tune.command import load_module  # noqa: E402
from codagen.tune.harness import scalar_names  # noqa: E402

# Triton's names of the tensors' element types ("T": the launch's type, bf16 here)
ELEMENT = {"T": "bf16", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "index": "i64",
           "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def jit_specialization(module, params: list[str], sig: dict) -> tuple[dict, dict]:
    """What Triton's JIT makes of a launch on contiguous tensors at a model's shapes, where every size, row
    stride and base address is a multiple of 16: each tensor's last stride is 1, which the JIT turns into a
    constexpr (so the compiler knows rows are contiguous), and pointers and the other ints are marked
    divisible by 16 (so loads and stores can be vectorized). Without this, a compile sees strides it knows
    nothing about, and its registers, spills and instructions are not those of the GPU's compile.
    Returns (constexprs, attrs) keyed as ASTSource takes them; `sig` gets the unit strides as constexprs."""
    strides: dict[str, list[str]] = {}
    for p in params:
        stride = p.removeprefix("_")  # the tl kernels' parameters start with '_', the Hopper modules' do not
        if stride.startswith("stride_"):
            tensor = max((name for name in [*(d.name for d in module.DECLS), "acc"]  # acc: the cuBLAS mainloop's product
                          if stride.startswith(f"stride_{name}_")), key=len)
            strides.setdefault(tensor, []).append(p)
    unit = {names[-1] for names in strides.values()}
    constexprs, attrs = {}, {}
    for p in params:
        if p in unit:
            sig[p] = "constexpr"
            constexprs[(params.index(p),)] = 1
        elif sig[p].startswith("*") or (sig[p] == "i32" and p != "NUM_PROGRAMS"):
            attrs[(params.index(p),)] = [["tt.divisibility", 16]]
    return constexprs, attrs


def signature(module, config: Config) -> tuple[dict, dict]:
    """Triton types of the kernel's parameters for bf16 tensors (`T`; others in their own types), and its
    constexprs for `config`. The generated parameters are the spec's names with `_` before them."""
    kernel = getattr(module, f"{module.NAME}_kernel")
    params = list(inspect.signature(kernel.fn).parameters)
    decls = {d.name: d for d in module.DECLS}
    scalars = set(scalar_names(module))
    descs = [p for p in params if p.endswith("_desc")]
    sig = {}
    for p in params:
        if p == "_acc_ptr":  # the fp32 product of mainloop "cublas"; None (a constexpr) for the others
            sig[p] = "*fp32" if config.mainloop == "cublas" else "constexpr"
        elif p.endswith("_ptr"):
            sig[p] = "*" + ELEMENT[decls[p[1:-4]].dtype]
        elif p in descs:  # the GEMM's a, then b, as the launcher builds them
            decl = decls[p[1:-5]]
            if p == descs[0]:
                block = [config.block_m, config.block_k]
            elif decl.dims == ("N", "K"):
                block = [config.block_n, config.block_k]
            else:
                block = [config.block_k, config.block_n]
            sig[p] = f"tensordesc<{ELEMENT[decl.dtype]}{block}>"
        elif p in scalars:
            sig[p] = "fp32"
        elif p.isupper() and p not in ("M", "N", "K", "NUM_PROGRAMS"):
            sig[p] = "constexpr"
        else:
            sig[p] = "i32"
    consts = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
              "GROUP_M": config.group_m, "EVEN_K": True, "UPCAST_DOT": False, "DOT_PRECISION": "ieee",
              "TMA": config.tma, "FLATTEN": config.flatten, "WARP_SPECIALIZE": config.warp_specialize,
              "EPILOGUE_SPLIT": config.epilogue_split, "INT64": False, "ACC_IN": config.mainloop == "cublas"}
    if config.mainloop != "cublas":
        consts["_acc_ptr"] = None
    return sig, {k: v for k, v in consts.items() if k in params}


def usage(module, config: Config, arch: int) -> dict | str:
    """{'REG': n, 'STACK': bytes, ...} of the compiled kernel, or why it did not compile."""
    kernel = getattr(module, f"{module.NAME}_kernel")
    sig, consts = signature(module, config)
    params = list(sig)
    unit_strides, attrs = jit_specialization(module, params, sig)
    src = ASTSource(kernel, sig, {**{(params.index(k),): v for k, v in consts.items()}, **unit_strides}, attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    except Exception as e:  # noqa: BLE001 - reported per candidate, as tuning does
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", help="comma-separated kernel names (default: every kernel of specs/)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    ap.add_argument("--out", type=Path, help="write the report here (markdown)")
    args = ap.parse_args()
    names = args.kernels.split(",") if args.kernels else sorted(
        p.stem for p in (ROOT / "generated" / "kernels").glob("*.py") if p.stem != "__init__")
    lines = [f"# Registers and spills for sm_{args.arch}, compiled without a GPU", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; triton "
             f"{triton.__version__}; bf16 tensors (FP8 operands as the specs declare them); command: "
             "`python benchmarks/spills.py`",
             "- REG: registers per thread (255 is the most there are); STACK: bytes of stack per thread, mostly "
             "spilled registers (0: no spill). Each kernel in each candidate of `codagen tune`, compiled as the JIT "
             "compiles a launch on contiguous tensors at a model's shapes (jit_specialization).",
             "- `ws` rows: whether this compile warp-specializes for sm_90 is not established (in the first "
             "run, on triton 3.9, every `ws` row equalled its twin without `ws`).", ""]
    kernels = {c.kernel.name: c.kernel for c in api.load([ROOT / "specs"]) if isinstance(c, api.Checked)}
    for name in names:
        module = load_module(ROOT / "generated", name)
        lines += [f"## {name}", "", "| configuration | REG | STACK |", "|---|---|---|"]
        kernel = kernels[name]
        for config in (c for c in tl_candidates(kernel) if fits_group(c, kernel.column_group)):
            u = usage(module, config, args.arch)
            row = f"| {config.label()} | " + (f"{u['REG']} | {u['STACK']} |" if isinstance(u, dict) else f"{u} | |")
            print(f"{name}: {row}", flush=True)
            lines.append(row)
        lines.append("")
    if args.out:
        args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
