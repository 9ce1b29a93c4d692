"""SM clock and board power while a generated kernel runs back to back, beside the cuBLAS GEMM of its shape.

An epilogue that overlaps the mainloop is free in time only while the GPU keeps its clock: where the GEMM
alone already draws the board's power limit, the epilogue's extra memory traffic lowers the clock and the
mainloop slows with it. This script shows which of the two a kernel's gap to cuBLAS is.

    python benchmarks/clocks.py --kernel swiglu_dgrad --shape 32768x8192x2048 --shape 32768x14336x4096

Each row: ms per call (CUDA events over the whole run); each call's own time, between events recorded around
it (median, 90th percentile, longest: calls that take far longer than the median, which do_bench's median
hides); the GPU's time between calls (where the host or a synchronization keeps it waiting); the host's time
to enqueue a call; and nvidia-smi's samples every 20 ms during the run (after a warm-up of the same length):
SM clock (MHz), power (W), mean and range, and how many samples had each clock event reason active (power cap,
hardware slowdown, power brake, thermal; an idle GPU)."""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_kernel import prepare  # noqa: E402

# nvidia-smi's clocks_event_reasons.active bits (nvml's nvmlClocksEventReason*), those that slow a loaded GPU
EVENT_REASONS = {0x1: "idle", 0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
                 0x80: "power brake"}


@dataclass
class Sampled:
    ms: float  # GPU time of the whole run per call
    calls: list[float]  # each call's own GPU time, ms
    waits: float  # GPU time between calls, ms per call
    host_ms: float  # host time to enqueue a call
    clocks: list[float]  # MHz
    power: list[float]  # W
    reasons: list[int]  # clocks_event_reasons.active

    def row(self, name: str) -> str:
        calls = sorted(self.calls)
        p90 = calls[math.ceil(0.9 * len(calls)) - 1]  # nearest rank
        counts = ", ".join(f"{label} {sum(1 for r in self.reasons if r & bit)}"
                           for bit, label in EVENT_REASONS.items() if any(r & bit for r in self.reasons))
        clock, power = (f"{statistics.mean(v):.0f} ({min(v):.0f}-{max(v):.0f})" if v else "-"
                        for v in (self.clocks, self.power))
        return (f"| {name} | {self.ms:.4f} | {statistics.median(calls):.4f} / {p90:.4f} / {calls[-1]:.4f} | "
                f"{self.waits:.4f} | {self.host_ms:.4f} | {clock} | {power} | {counts or '-'} | {len(self.clocks)} |")


def sampled(fn, seconds: float) -> Sampled:
    """`fn` run back to back for `seconds`, synchronizing only every 200 ms or so of work (where the host takes
    longer to enqueue a call than the GPU to run it, the GPU idles, and the samples show that too), with CUDA
    events around every call."""
    import torch

    def spin(until: float, batch: int, events: list | None = None) -> tuple[int, float]:
        calls, enqueue = 0, 0.0
        while time.monotonic() < until:
            begin = time.perf_counter()
            for _ in range(batch):
                if events is not None:
                    events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                    events[-1][0].record()
                fn()
                if events is not None:
                    events[-1][1].record()
            enqueue += time.perf_counter() - begin
            calls += batch
            torch.cuda.synchronize()
        return calls, enqueue

    begin = time.perf_counter()
    calls, _ = spin(time.monotonic() + seconds, 10)  # warm-up: compiled, clocks and power settled
    batch = max(10, int(0.2 * calls / (time.perf_counter() - begin)))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-i", str(torch.cuda.current_device()), "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    events = []
    calls, enqueue = spin(time.monotonic() + seconds, batch, events)
    smi.terminate()
    rows = [_sample(line) for line in smi.communicate()[0].splitlines()]
    rows = [r for r in rows if r is not None]
    own = [start.elapsed_time(end) for start, end in events]
    whole = events[0][0].elapsed_time(events[-1][1])
    return Sampled(whole / calls, own, (whole - sum(own)) / calls, 1e3 * enqueue / calls,
                   [c for c, _, _ in rows], [p for _, p, _ in rows], [r for _, _, r in rows])


def _sample(line: str) -> tuple[float, float, int] | None:
    """(MHz, W, clock event reasons) of one nvidia-smi line; None for a line that is not a sample. Reasons a
    driver does not report ([N/A]) count as none."""
    fields = [f.strip() for f in line.split(",")]
    try:
        clock, power = float(fields[0]), float(fields[1])
    except (IndexError, ValueError):
        return None
    try:
        reasons = int(fields[2], 16)
    except (IndexError, ValueError):
        reasons = 0
    return clock, power, reasons


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--shape", action="append", required=True, help="MxNxK (repeatable)")
    ap.add_argument("--config", help="a tuning candidate's label (default: the tuning table's choice)")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| run | ms per call | one call, ms: median / p90 / longest | GPU waits, ms per call | host ms per call "
          "| SM clock, MHz: mean (range) | power, W: mean (range) | samples with a clock event reason | samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shape:
        m, n, k = (int(x) for x in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        print(sampled(lambda: torch.matmul(a, b), args.seconds).row(f"cuBLAS {shape}"), flush=True)
        config, _, run = prepare(args.kernel, shape, args.config)
        print(sampled(run, args.seconds).row(f"{args.kernel} {shape}, {config.label()}"), flush=True)


if __name__ == "__main__":
    main()
