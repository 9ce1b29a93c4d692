"""The `codagen tune` run: select kernels and shapes, tune each shape within the budget, write the tables."""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import api
from ..api import Checked
from ..fingerprint import fingerprint
from ..tablefile import config_of_entry
from ..runtime import autotune
from ..runtime import tables as runtime_tables
from ..runtime.configs import fits_k_group
from ..tileconfig import TileConfig, fits_shared, shared_bytes
from . import TuneError
from .candidates import candidates
from .harness import CHECK_ROWS, Outcome, do_bench_timer, load_module, other_backends, tune_shape
from .precompile import precompile
from .shapes import TOKENS, Shape, parse_attrs, parse_shapes, parse_tokens
from .tables import read_table, write_table


@dataclass
class Job:
    checked: Checked
    module: object
    shapes: list[Shape]
    table: Path


def jobs(paths, shapes: str, out: str | Path = "generated", kernels: str | None = None, tokens: str | None = None,
         tuning_dir: str | Path | None = None, gpu: str = "gpu", attrs: str | None = None,
         memory: int | None = None) -> list[Job]:
    """What a run would tune: the selected kernels of the specs under `paths`, their shapes (none whose operands
    exceed `memory` bytes, the GPU's, where given) and tables."""
    out = Path(out)
    tuning_dir = Path(tuning_dir) if tuning_dir is not None else out / "tuning"
    specs = api.load(list(paths))
    found = sorted((c for c in specs if isinstance(c, Checked)), key=lambda c: c.kernel.name)
    if kernels is not None:
        wanted = [k.strip() for k in kernels.split(",") if k.strip()]
        names = {c.kernel.name for c in found}
        if not wanted:  # tuning nothing and saying ok would hide the mistake
            raise TuneError(f"--kernels {kernels!r} names no kernel; give kernel names separated by commas, e.g. "
                            "matmul,rmsnorm_stats")
        unknown = [k for k in wanted if k not in names]
        if unknown:
            raise TuneError(f"--kernels: no spec defines {', '.join(unknown)}; "
                            f"the specs given define {', '.join(sorted(names))}")
        found = [c for c in found if c.kernel.name in wanted]
    toks = parse_tokens(tokens) if tokens else TOKENS
    given = parse_attrs(attrs, specs) if attrs else {}
    selected = []
    for c in found:
        module = load_module(out, c.kernel.name)
        if getattr(module, "FINGERPRINT", None) != fingerprint(c.kernel):
            raise TuneError(f"{out}/kernels/{c.kernel.name}.py does not compute what {c.kernel.source} describes "
                            "now; run codagen build first")
        selected.append(Job(c, module, parse_shapes(shapes, c.kernel, specs, toks, given, memory),
                            runtime_tables.table_path(tuning_dir, gpu, c.kernel.name)))
    idle = [j.checked.kernel.name for j in selected if not j.shapes]
    if kernels is not None and idle:  # asked for by name: a kernel that would be skipped is an error, not a no-op
        raise TuneError(f"--kernels: no block of the presets in --shapes ({shapes}) runs {', '.join(idle)}; give "
                        "a preset of the model family whose blocks call it, or MxNxK shapes")
    return selected


def run(paths, shapes: str, *, out: str | Path = "generated", budget: float | None = None, kernels: str | None = None,
        tokens: str | None = None, attrs: str | None = None, missing_only: bool = False, only: str | None = None,
        tuning_dir: str | Path | None = None, device: torch.device | None = None, gpu: str | None = None,
        timer: Callable[[Callable[[], None]], float] = do_bench_timer, check_rows: int = CHECK_ROWS,
        pools: dict | None = None, log: Callable[[str], None] | None = None, compile_jobs: int = 0) -> list[Path]:
    """Tune and write tables; returns the tables written. `only`: time just the candidates whose label
    contains it, each shape's against the table's present choice, re-timed in the same run, so that a table
    changes only where one of them is faster (a kernel none of whose candidates match is skipped).
    `compile_jobs`: compile every candidate first, on that many worker processes (codagen.tune.precompile;
    0 or 1: as the run launches them). `device`,
    `gpu`, `timer`, `check_rows` and `pools` (kernel name -> candidates) exist for tests on the CPU; the
    command runs on the current GPU."""
    import triton

    log = log or functools.partial(print, flush=True)  # progress shows as it happens, even through a pipe
    start = time.monotonic()
    deadline = start + budget if budget is not None else None
    if device is None:
        if not torch.cuda.is_available():
            jobs(paths, shapes, out, kernels, tokens, tuning_dir, "gpu", attrs)  # a mistaken argument is named first
            raise TuneError("codagen tune times kernels on a CUDA GPU, and this machine has none")
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = gpu or runtime_tables.gpu_key(device)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    selected = jobs(paths, shapes, out, kernels, tokens, tuning_dir, gpu, attrs, memory)
    pool_of = {j.checked.kernel.name: tuple((pools or {}).get(j.checked.kernel.name) or candidates(
        j.checked.kernel, other_backends(j.module, device))) for j in selected}
    for j in list(selected):  # each candidate's resource model (its config type's): what this GPU's table would refuse
        name, pool = j.checked.kernel.name, pool_of[j.checked.kernel.name]
        pool_of[name] = tuple(c for c in pool if fits_shared(c, j.checked.kernel.gemm is not None, gpu))
        if len(pool_of[name]) < len(pool):
            log(f"{name}: {len(pool) - len(pool_of[name])} candidate(s) need more shared memory than a program has "
                f"on {gpu} ({shared_bytes(gpu)} bytes); not timed" + ("" if pool_of[name] else ", none left: skipped"))
        if not pool_of[name]:
            selected.remove(j)
    if only is not None:
        pool_of = {name: tuple(c for c in pool if only in c.label()) for name, pool in pool_of.items()}
        for j in [j for j in selected if not pool_of[j.checked.kernel.name]]:
            log(f"{j.checked.kernel.name}: no candidate's label contains {only!r}; skipped")
            selected.remove(j)
    runs = sum(len(j.shapes) * len(pool_of[j.checked.kernel.name]) for j in selected)
    log(f"tuning {len(selected)} kernel(s) at {sum(len(j.shapes) for j in selected)} shape(s) on {gpu} "
        f"(triton {triton.__version__}): {runs} candidate runs"
        + (f", budget {budget:.0f} s" if budget is not None else ""))
    if compile_jobs > 1:
        precompile(_compile_work(selected, pool_of, only, missing_only, check_rows, triton.__version__), out,
                   device, compile_jobs, log)
    written: list[Path] = []
    stopped = None
    for job in selected:
        kernel = job.checked.kernel
        table = read_table(job.table, kernel, triton.__version__, log)
        have = table if missing_only else {}
        for shape in job.shapes:
            label = f"{kernel.name} {shape}"
            if shape.key in have:
                log(f"{label}: in the table already, skipped")
                continue
            if deadline is not None and time.monotonic() > deadline:
                stopped = label
                break
            pool = pool_of[kernel.name]
            if only is not None and shape.key in table:  # the present choice, to beat
                present = config_of_entry(table[shape.key])
                pool = pool if present in pool else (present, *pool)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                outcome = tune_shape(job.checked, job.module, shape, device, pool=pool, timer=timer,
                                     check_rows=check_rows, deadline=deadline)
            _report(label, outcome, log)
            if not outcome.complete:
                stopped = label
                break
            if outcome.best is not None:
                if write_table(job.table, kernel, gpu, triton.__version__, {shape.key: outcome.entry()}):
                    autotune.clear_caches()  # this process reads the new table from now on
                    if job.table not in written:
                        written.append(job.table)
        if stopped:
            break
    elapsed = time.monotonic() - start
    if stopped:
        log(f"budget of {budget:.0f} s spent at {stopped} after {elapsed:.0f} s: that shape and the rest are not "
            "tuned; run the same command with --missing-only to continue")
    for path in written:
        log(f"wrote {path}")
    log(f"{len(written)} table(s) written in {elapsed:.0f} s")
    return written


def _compile_work(selected: list[Job], pool_of: dict, only: str | None, missing_only: bool, check_rows: int,
                  triton_version: str) -> list[tuple[str, str, Shape, TileConfig]]:
    """What a run compiles: each kernel's candidates (and, with `only`, the table's present choices), at the
    first shape it tunes, as many rows as its check launches: Triton specializes a kernel on its integer
    arguments' divisibility by 16, which the presets' shapes share, so one compile serves them all."""
    work = []
    for job in selected:
        kernel = job.checked.kernel
        table = read_table(job.table, kernel, triton_version)
        shapes = [s for s in job.shapes if not (missing_only and s.key in table)]
        if not shapes:
            continue
        present = [config_of_entry(table[s.key]) for s in shapes if only is not None and s.key in table]
        first = Shape(min(check_rows, shapes[0].m), shapes[0].n, shapes[0].k, shapes[0].a_km)
        # what tune_shape times at one shape or more (each config says where it pays; no cuBLAS product for FP8
        # operands, which torch.mm does not take; no K step across a group of K-group scales)
        pool = [c for c in pool_of[kernel.name] if any(c.pays(s.m, s.n, s.k) for s in shapes)
                and not (kernel.fp8_gemm and getattr(c, "mainloop", "triton") == "cublas")
                and fits_k_group(c, kernel.k_group)]
        work += [(kernel.source, kernel.name, first, c) for c in dict.fromkeys((*present, *pool))]
    return work


def _report(label: str, outcome: Outcome, log) -> None:
    if not outcome.complete:
        log(f"{label}: stopped by the budget after {len(outcome.timed) + len(outcome.discarded)} candidate(s); "
            "not written")
    elif outcome.best is None:
        log(f"{label}: every candidate was discarded; nothing written")
    else:
        vs = ""
        if outcome.cublas_ms:
            vs = f", cuBLAS {outcome.cublas_ms:.4f} ms ({outcome.ms / outcome.cublas_ms:.2f}x)"
        log(f"{label}: {outcome.ms:.4f} ms  {outcome.best.label()}  "
            f"({len(outcome.timed)} timed, {len(outcome.discarded)} discarded{vs})")
        for config, ms in sorted(outcome.timed, key=lambda timed: timed[1])[1:]:  # the runners-up
            log(f"  {ms:.4f} ms  {config.label()}")
    for config, why in outcome.discarded:
        log(f"  discarded {config.label()}: {why}")

