"""Per-kernel sweep on a GPU: the host time of one op call, then every GEMM kernel where the block specs first
run it (the llama3-1b preset, 16k tokens) in a few configurations, each checked against the float64 reference
on NaN-prefilled outputs and timed by CUDA-graph replay (no host overhead) against the cuBLAS GEMM of the same
shape. Report: benchmarks/results/h200-kernels.md.

    python benchmarks/kernel_sweep.py
"""
import importlib
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from codagen import api, reference  # noqa: E402
from codagen.presets import PRESETS  # noqa: E402
from codagen.runtime import Config  # noqa: E402
from codagen.tune.shapes import block_uses  # noqa: E402

PRESET, TOKENS = "llama3-1b", 16384  # each GEMM kernel at its first place in the blocks, at 16k tokens
CONFIGS = {
    "p128x128": Config(128, 128, 64, 8, 8, 3),
    "t128x256p": Config(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    "t128x128": Config(128, 128, 64, 8, 8, 4, tma=True),
    "t128x128p": Config(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
    "t128x64": Config(128, 64, 64, 8, 4, 4, tma=True),
    "t64x128": Config(64, 128, 64, 8, 4, 4, tma=True),
    "t128x128w4": Config(128, 128, 64, 8, 4, 4, tma=True),
    "t64x64": Config(64, 64, 64, 8, 4, 4, tma=True),
}
CHECK_ROWS = 1061  # ragged for every tile height


def sizes(m, n, k, config):
    return {"M": m, "N": n, "K": k, "N/2": n // 2, "2*N": 2 * n,
            "tiles(N)": triton.cdiv(n, config.epilogue_n), "tiles(M)": triton.cdiv(m, config.block_m)}


def make_inputs(module, m, n, k):
    """Random inputs from the module's declarations: never zeros, positive per-row scales, indices in range."""
    s = sizes(m, n, k, Config())
    args = {}
    for d in module.DECLS:
        if d.output:
            continue
        shape = [s[x] for x in d.dims]
        if d.dtype == "index":
            args[d.name] = torch.randint(0, n, shape, device="cuda")
        elif d.dtype == "float32":
            args[d.name] = torch.rand(shape, device="cuda") + 0.5 if shape else torch.tensor(1.3, device="cuda")
        else:
            scale = k ** -0.25 if "K" in d.dims else 1.0
            args[d.name] = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * scale
    return args


def make_outputs(kernel, m, n, k, config, fill=float("nan")):
    s = sizes(m, n, k, config)
    return {o.name: torch.full([s[d.value] for d in o.dims], fill, device="cuda",
                               dtype=torch.float32 if o.dtype.value == "float32" else torch.bfloat16)
            for o in kernel.outputs}


def graph_ms(fn, reps=20):
    """GPU time per call from replays of a CUDA graph of `reps` calls."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") / reps


def host_us(fn, calls=100):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def sweep_shapes(specs) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of each GEMM kernel where the block specs first run it at the preset (the backward in row
    chunks on chunk_rows rows)."""
    first = {}
    for use in block_uses(specs, PRESETS[PRESET], (TOKENS,)):
        first.setdefault(use.kernel, use.shape)
    return {name: (s.m, s.n, s.k) for name, s in first.items() if s.k}


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    specs = api.load(["specs/"])
    checked = {c.kernel.name: c for c in specs if isinstance(c, api.Checked)}
    shapes = sweep_shapes(specs)

    module = importlib.import_module("generated.kernels.out_proj_residual_norm")
    args = make_inputs(module, *shapes["out_proj_residual_norm"])
    print(f"host: eager call {host_us(lambda: module.out_proj_residual_norm(*args.values())):.0f} us, "
          f"custom op {host_us(lambda: module.out_proj_residual_norm_op(*args.values())):.0f} us")

    for name, (m, n, k) in shapes.items():
        module = importlib.import_module(f"generated.kernels.{name}")
        kernel = checked[name].kernel
        args = make_inputs(module, m, n, k)
        a, b = args[kernel.gemm.a], args[kernel.gemm.b]
        b_op = b.T if kernel.gemm.b_layout.value == "nk" else b
        cublas = graph_ms(lambda: a @ b_op)
        line = f"{name:24s} {m}x{n}x{k} cuBLAS {cublas:.3f} ms |"
        rows = {d.name: args[d.name][:CHECK_ROWS] if d.dims and d.dims[0] == "M" else args[d.name]
                for d in module.DECLS if not d.output}
        for label, config in CONFIGS.items():
            try:
                outs = make_outputs(kernel, CHECK_ROWS, n, k, config)
                module.launch(*rows.values(), **outs, config=config)
                truth = reference.run(kernel, checked[name].types, rows, config.block_m, config.epilogue_n)
                err = max(((outs[o].double() - truth[o]).norm() / truth[o].norm()).item() for o in outs)
                full = make_outputs(kernel, m, n, k, config, 0.0)
                ms = graph_ms(lambda: module.launch(*args.values(), **full, config=config))
                line += f" {label} {ms / cublas:.2f}x" + ("" if err < 2e-2 else f" WRONG({err:.0e})") + " |"
            except Exception as e:  # noqa: BLE001 - a failing configuration is reported, not fatal
                line += f" {label} FAILED {type(e).__name__} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
