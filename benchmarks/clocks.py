"""SM clock and board power while a generated kernel runs back to back, beside the cuBLAS GEMM of its shape.

An epilogue that overlaps the mainloop is free in time only while the GPU keeps its clock: where the GEMM
alone already draws the board's power limit, the epilogue's extra memory traffic lowers the clock and the
mainloop slows with it. This script shows which of the two a kernel's gap to cuBLAS is.

    python benchmarks/clocks.py --kernel swiglu_dgrad --shape 32768x8192x2048 --shape 32768x14336x4096

Each row: ms per call (CUDA events over the whole run), the host's time to enqueue a call, and nvidia-smi's
samples every 20 ms during the run (after a warm-up of the same length): SM clock (MHz) and power (W), mean
and range."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_kernel import prepare  # noqa: E402


def sampled(fn, seconds: float) -> tuple[float, float, list[float], list[float]]:
    """(GPU ms per call, host ms per call to enqueue it, SM clocks in MHz, power draws in W) over `seconds` of
    `fn` run back to back, synchronizing only every 200 ms or so of work: where the host takes longer to
    enqueue a call than the GPU to run it, the GPU idles, and the samples show that too."""
    import torch

    def spin(until: float, batch: int) -> tuple[int, float]:
        calls, enqueue = 0, 0.0
        while time.monotonic() < until:
            begin = time.perf_counter()
            for _ in range(batch):
                fn()
            enqueue += time.perf_counter() - begin
            calls += batch
            torch.cuda.synchronize()
        return calls, enqueue

    begin = time.perf_counter()
    calls, _ = spin(time.monotonic() + seconds, 10)  # warm-up: compiled, clocks and power settled
    batch = max(10, int(0.2 * calls / (time.perf_counter() - begin)))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-i", str(torch.cuda.current_device()), "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls, enqueue = spin(time.monotonic() + seconds, batch)
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    return (start.elapsed_time(end) / calls, 1e3 * enqueue / calls, [float(c) for c, _ in rows],
            [float(p) for _, p in rows])


def row(name: str, ms: float, host_ms: float, clocks: list[float], power: list[float]) -> str:
    return (f"| {name} | {ms:.4f} | {host_ms:.4f} | {statistics.mean(clocks):.0f} ({min(clocks):.0f}-"
            f"{max(clocks):.0f}) | {statistics.mean(power):.0f} ({min(power):.0f}-{max(power):.0f}) | {len(clocks)} |")


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--shape", action="append", required=True, help="MxNxK (repeatable)")
    ap.add_argument("--config", help="a tuning candidate's label (default: the tuning table's choice)")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| run | ms per call | host ms per call | SM clock, MHz: mean (range) | power, W: mean (range) | samples |")
    print("|---|---|---|---|---|---|")
    for shape in args.shape:
        m, n, k = (int(x) for x in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        print(row(f"cuBLAS {shape}", *sampled(lambda: torch.matmul(a, b), args.seconds)), flush=True)
        config, _, run = prepare(args.kernel, shape, args.config)
        print(row(f"{args.kernel} {shape}, {config.label()}", *sampled(run, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
