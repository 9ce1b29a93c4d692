"""Host time of one launch: a codagen kernel through its public function, its tl and Hopper launchers, against
torch.mm and a one-line Triton kernel (as it is, and through codagen's Launcher), each called back to back on
shapes small enough that the GPU waits for the host (the time per call is then the host's).

    PYTHONPATH=. python3 benchmarks/launch_overhead.py --out $OUT      # writes launch-overhead.md
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from codagen.runtime import Config, Launcher


@triton.jit
def _copy_kernel(x, y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n), mask=offsets < n)


def per_call_us(call, calls: int) -> tuple[float, float]:
    """Host µs per call (until the last call returned) and the GPU's µs per call (the host's waits included)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t) / calls * 1e6
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from generated.kernels import gate_up_swiglu as g

    torch.manual_seed(0)
    m, n, k = 128, 256, 256
    h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    rstd = torch.rand(m, device="cuda")
    z, y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, n // 2, device="cuda",
                                                                                dtype=torch.bfloat16)
    x1, y1 = torch.randn(1024, device="cuda"), torch.empty(1024, device="cuda")
    copy = Launcher(_copy_kernel)
    tl_config = Config(64, 64, 64, 8, num_warps=4, num_stages=3)
    cases = {
        "torch.mm": lambda: torch.mm(h, w.T),
        "one-line Triton kernel": lambda: _copy_kernel[(1,)](x1, y1, 1024, BLOCK=1024),
        "one-line Triton kernel, through codagen's Launcher": lambda: copy[(1,)](x1, y1, 1024, BLOCK=1024),
        "gate_up_swiglu(h, w, rstd) (allocates)": lambda: g.gate_up_swiglu(h, w, rstd),
        "gate_up_swiglu launch, its default config": lambda: g.launch(h, w, rstd, z=z, y=y),
        "gate_up_swiglu launch, a tl config": lambda: g.launch(h, w, rstd, z=z, y=y, config=tl_config),
    }
    if torch.cuda.get_device_capability() == (9, 0):
        from codagen.runtime import backends

        hopper = backends.hopper_default("generated.kernels", "gate_up_swiglu")
        cases["gate_up_swiglu launch, the Hopper kernel"] = lambda: g.launch(h, w, rstd, z=z, y=y, config=hopper)
    lines = [f"# Host time per launch, {torch.cuda.get_device_name()}", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
             f"triton {triton.__version__}; {args.calls} calls back to back, "
             f"M x N x K = {m} x {n} x {k} bf16", "", "| call | host µs/call | GPU µs/call |", "|---|---:|---:|"]
    for name, call in cases.items():
        host, gpu = per_call_us(call, args.calls)
        lines.append(f"| {name} | {host:.1f} | {gpu:.1f} |")
    for name in [n for n in cases if n.startswith("gate_up_swiglu")]:  # where a launch's host time goes
        profile, text = cProfile.Profile(), io.StringIO()
        profile.runcall(lambda: [cases[name]() for _ in range(args.calls)])
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        lines += ["", f"## cProfile: {name}, {args.calls} calls", "", "```", text.getvalue().strip(), "```"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch-overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
