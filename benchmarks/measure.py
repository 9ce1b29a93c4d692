"""Measurement: errors against a reference, times (do_bench on a GPU, the host clock on the CPU), peak memory."""
from __future__ import annotations

import gc
import math
import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (fp32 on the GPU, in chunks, to bound memory)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
    acc = torch.float64 if a.device.type == "cpu" else torch.float32
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    num = den = 0.0
    chunk = 1 << 26
    for i in range(0, max(a.numel(), 1), chunk):
        aa, bb = a[i:i + chunk].to(acc), b[i:i + chunk].to(acc)
        num += float(torch.sum((aa - bb) ** 2))
        den += float(torch.sum(bb * bb))
        if not math.isfinite(num):
            return float("nan")
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return math.sqrt(num / den)


def compare(named: dict, ref: dict) -> tuple:
    """(max relative error, name of the worst tensor, {name: err})."""
    errs = {}
    for k, r in ref.items():
        if k not in named:
            raise KeyError(f"variant output lacks {k!r} (has {sorted(named)})")
        errs[k] = rel_err(named[k], r)
    worst = max(errs, key=lambda k: (math.isnan(errs[k]), errs[k]))
    return errs[worst], worst, errs


def detach_named(named: dict) -> dict:
    return {k: v.detach() for k, v in named.items()}


def bench_ms(fn, device, warmup_ms, rep_ms) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    # CPU: host clock around synchronous calls, median
    t_end = time.perf_counter() + warmup_ms / 1e3
    for i in range(1000):
        fn()
        if i >= 1 and time.perf_counter() > t_end:
            break
    times, t_end = [], time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def one_call(fn, device) -> tuple:
    """Run once; return (ms, peak bytes allocated above what was allocated before)."""
    sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize(device)
        return e0.elapsed_time(e1), torch.cuda.max_memory_allocated(device) - base
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, None


def host_ms(fn, device, calls: int = 10) -> float:
    """Milliseconds of host time per call to enqueue `calls` calls back to back (the GPU's work runs on
    asynchronously): at or above the GPU time of a call, the GPU waits for the host, and the timed figure is
    the host's."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync(device)
    return elapsed * 1e3 / calls


def kernel_times(fn, device, calls: int = 3) -> tuple[list, dict | None]:
    """Where a call's time goes, from torch.profiler over `calls` calls after one more: on a GPU its kernels,
    on the CPU its operators' own time, as (name, ms per call, launches per call), the most expensive first;
    and on a GPU the timeline of those calls (gpu_idle)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    found = []
    for e in prof.key_averages():
        us = e.self_device_time_total if gpu else e.self_cpu_time_total
        if us > 0:
            found.append((e.key, us / 1e3 / calls, e.count / calls))
    timeline = None
    if gpu:
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
        timeline = gpu_idle(spans, calls)
    return sorted(found, key=lambda t: -t[1]), timeline


def gpu_idle(spans: list, calls: int, gap_us: float = 5.0, top: int = 5) -> dict:
    """From the GPU's activities (start us, end us, name) over `calls` calls back to back: per call, the span
    from the first start to the last end, the time within it when no kernel ran, and how many idle gaps were
    longer than gap_us; and the longest gaps (ms, the kernel before, the kernel after). Idle time within a
    sustained run is the GPU waiting for the host or for a launch, which per-kernel sums do not show."""
    spans = sorted(spans)
    idle, gaps, end, before = 0.0, [], None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            idle += start - end
            if start - end > gap_us:
                gaps.append(((start - end) / 1e3, before, name))
        if end is None or stop > end:
            end, before = stop, name
    span = (end - spans[0][0]) if spans else 0.0
    return {"span_ms": span / 1e3 / calls, "idle_ms": idle / 1e3 / calls, "gaps_per_call": len(gaps) / calls,
            "longest": sorted(gaps, key=lambda g: -g[0])[:top]}


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def l2_bytes(device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) or (60 << 20))
    return 32 << 20

