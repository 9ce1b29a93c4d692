"""One preset and token count: every (pattern, variant) built, checked against eager and a higher-precision
reference, then timed in interleaved passes."""
from __future__ import annotations

import fnmatch
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

import baselines as B
from cases import PATTERN_BY_KEY, Case, Preset, make_input_set, upcast
from measure import bench_ms, compare, detach_named, free, host_ms, kernel_times, l2_bytes, one_call, sync
from report import fmt_err, fmt_mib, ratio, spread
from runners import CUBLAS, AutogradRunner


@dataclass
class Row:
    preset: str
    tokens: int
    pattern: str
    title: str
    variant: str
    ms: Optional[float] = None
    ms_passes: list = field(default_factory=list)
    peak_mib: Optional[float] = None
    host_ms: Optional[float] = None  # host time per call to enqueue its work (measure.host_ms)
    err_eager: Optional[float] = None
    err_ref: Optional[float] = None
    worst: str = ""
    errs: dict = field(default_factory=dict)
    gemm_tflop: float = 0.0
    note: str = ""
    error: str = ""
    kernels: list = field(default_factory=list)  # (name, ms, launches) per call, with --kernel-profile
    timeline: Optional[dict] = None  # measure.gpu_idle of the profiled calls, with --kernel-profile on a GPU


def log(msg):
    print(msg, flush=True)


def run_case(preset: Preset, tokens: int, args, variants: list, rows: list, checkpoint=None) -> list:
    """Build, check and time every (pattern, variant) of one preset and token count; appends to rows and
    calls checkpoint() after each pattern (the report is rewritten then, so a killed run leaves results)."""
    device, dtype = args.device_obj, args.dtype_obj
    patterns = [p for p in preset.patterns if selected(p.key, args.patterns)]
    by_pattern = {}
    for v in variants:
        if v.families and preset.model.family not in v.families:
            continue
        if v.name in (CUBLAS, "eager") or selected(v.name, args.variants):
            by_pattern.setdefault(v.pattern, []).append(v)
    unknown = sorted(set(by_pattern) - set(PATTERN_BY_KEY))
    if unknown:
        log(f"WARNING: variants registered for unknown patterns {unknown}; known: {sorted(PATTERN_BY_KEY)}")
    l2 = l2_bytes(device)
    for pat in patterns:
        case = Case(preset, tokens, dtype, device, pat)
        dm = case.dims
        vlist = by_pattern.get(pat.key, [])
        # eager first (the check's reference), then the rest in registry order
        vlist = sorted(vlist, key=lambda v: (v.name != "eager", v.name != CUBLAS))
        log(f"\n== {preset.name} T={tokens} (batch {dm.batch} x seq {dm.seq})  {pat.key}: {pat.title}")
        t0 = time.time()
        sets = [make_input_set(case, seed=1000 + i) for i in range(1)]
        nbytes = sets[0].nbytes()
        n_sets = 1 if nbytes >= 3 * l2 else min(args.max_sets, max(2, math.ceil(3 * l2 / max(nbytes, 1))))
        sets += [make_input_set(case, seed=1000 + i) for i in range(1, n_sets)]
        flops = B.gemm_flops(pat.base, dm, pat.backward)

        # higher-precision reference on set 0
        ref = None
        if args.ref:
            try:
                ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
                hi = upcast(sets[0], ref_dtype)
                r = AutogradRunner(pat, B.eager_fns(dm, "eager")[pat.base])
                ref = detach_named(r.named(hi, r.run(hi)))
                del hi, r
            except Exception as e:  # noqa: BLE001
                log(f"   reference failed: {type(e).__name__}: {e}")
                ref = None
            free(device)

        eager_named = None
        # build + check every variant
        built = []
        for v in vlist:
            row = Row(preset.name, tokens, pat.key, pat.title, v.name, gemm_tflop=flops / 1e12, note=v.note)
            rows.append(row)
            try:
                tb = time.time()
                runner = v.factory(case)
                states = [runner.prepare(s) for s in sets]
                result = runner.run(states[0])               # first call: compiles / JITs
                sync(device)
                named = runner.named(states[0], result)
                if named is not None:
                    named = detach_named(named)
                    if v.name == "eager":
                        eager_named = named
                    elif eager_named is not None:
                        row.err_eager, row.worst, row.errs = compare(named, eager_named)
                    if ref is not None:
                        row.err_ref, worst_ref, errs_ref = compare(named, ref)
                        row.errs.update({k + "@ref": e for k, e in errs_ref.items()})
                        if not row.worst:
                            row.worst = worst_ref
                del result, named
                sync(device)
                bad = [e for e in (row.err_eager, row.err_ref) if e is not None and not (e <= args.tol)]
                if bad:   # NaN or over tolerance: keep timing it, but say so loudly
                    row.note = (row.note + "; " if row.note else "") + f"CHECK: error {max(bad):.2e} > tol {args.tol:g}"
                    log(f"   !! {v.name}: {row.note}")
                built.append((row, runner, states))
                log(f"   {v.name:22s} built+checked in {time.time() - tb:6.1f}s   "
                    f"err vs eager {fmt_err(row.err_eager)}  vs ref {fmt_err(row.err_ref)}"
                    f"{'  (worst: ' + row.worst + ')' if row.worst else ''}")
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log(f"   {v.name:22s} FAILED: {row.error}")
                if args.verbose:
                    traceback.print_exc()
                free(device)
        eager_named = None

        # peak memory and a first time estimate, one call each; the host's time per call
        for row, runner, states in built:
            try:
                est, peak = one_call(lambda: runner.run(states[0]), device)
                row.peak_mib = None if peak is None else peak / 2**20
                row._est = est
                if device.type == "cuda":  # on the CPU every call is synchronous: host time is the time
                    row.host_ms = host_ms(lambda: runner.run(states[0]), device)
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {e}"[:300]
        # timing: passes over all variants, interleaved
        for _ in range(args.passes):
            for row, runner, states in built:
                if row.error:
                    continue
                idx = [0]

                def step(runner=runner, states=states, idx=idx):
                    s = states[idx[0] % len(states)]
                    idx[0] += 1
                    runner.run(s)
                rep = max(args.rep, args.min_iters * getattr(row, "_est", 0.0))
                try:
                    row.ms_passes.append(bench_ms(step, device, args.warmup, rep))
                except Exception as e:  # noqa: BLE001
                    row.error = f"{type(e).__name__}: {e}"[:300]
        if args.kernel_profile:  # after the timing, so that the profiler's overhead is in no timed call
            for row, runner, states in built:
                if not row.error:
                    try:
                        row.kernels, row.timeline = kernel_times(lambda: runner.run(states[0]), device)
                    except Exception as e:  # noqa: BLE001
                        log(f"   {row.variant}: no kernel profile: {type(e).__name__}: {e}")
        cub = next((r.ms_passes for r, _, _ in built if r.variant == CUBLAS and r.ms_passes), None)
        eag = next((r.ms_passes for r, _, _ in built if r.variant == "eager" and r.ms_passes), None)
        for row, _, _ in built:
            if row.ms_passes and not row.error:
                row.ms = statistics.fmean(row.ms_passes)
        for row, _, _ in built:
            if row.ms is None:
                continue
            log(f"   {row.variant:22s} {row.ms:9.3f} ms  x{ratio(row.ms, cub):>6s} cuBLAS  "
                f"x{ratio(row.ms, eag):>6s} eager"
                f"  spread {spread(row.ms_passes)}  peak+ {fmt_mib(row.peak_mib)}"
                + (f"  host {row.host_ms:.3f} ms" if row.host_ms is not None else "")
                + f"  ({sets[0].nbytes() / 2**20:.0f} MiB inputs, {len(sets)} set{'s' if len(sets) > 1 else ''})")
        log(f"   [{pat.key} done in {time.time() - t0:.1f}s]")
        del built, sets, ref
        free(device)
        if checkpoint:
            checkpoint()
    return rows


def selected(name, patterns):
    if not patterns:
        return True
    return any(fnmatch.fnmatch(name, p) or p in name for p in patterns)


