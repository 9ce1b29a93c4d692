"""One kernel at one shape: arguments that look like a model's, the float64 check of a candidate, and the
timing of those that pass."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import dims, reference, tablefile
from ..api import Checked
from ..errors import SpecError, ValidationFailed
from ..model import BLayout, Kernel
from ..runtime import backends, configs
from ..runtime.autotune import pick_config
from ..runtime.checks import FLOATS
from ..runtime.configs import Config, fits_k_group, k_group_problem
from . import TuneError
from .candidates import candidates
from .shapes import Shape

CHECK_ROWS = 1024 + 48  # ragged for every BM of 64, 128 and 256, yet a multiple of 16: Triton specializes
# integer arguments on divisibility by 16, so the check compiles the very kernel that the full shape times
TOLERANCE = 1e-2  # relative norm error vs float64: a few bf16 roundings (2**-8 each); wrong tiles give O(1)


def _sizes(shape: Shape) -> dict[str, int]:
    return {"M": shape.m, "N": shape.n, "K": shape.k}


def _dims(names: tuple[str, ...], sizes: dict, config: Config, module) -> tuple[int, ...]:
    tile, group = (config.block_m, config.epilogue_n), getattr(module, "COLUMN_GROUP", None)
    return tuple(dims.size(d, sizes, tile, group, getattr(module, "K_GROUP", None)) for d in names)


def scalar_names(module) -> list[str]:
    """Host-scalar parameters of `launch`: neither a declared tensor nor config."""
    decls = {d.name for d in module.DECLS}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, p in inspect.signature(module.launch).parameters.items()
            if p.kind in named and name not in decls and name != "config"]


def inplace_names(kernel: Kernel) -> set[str]:
    return {o.name for o in kernel.outputs if o.inplace}


def make_inputs(kernel: Kernel, module, shape: Shape, device: torch.device, dtype=torch.bfloat16,
                seed: int = 0) -> dict:
    """Random arguments that look like a model's, never zeros: T tensors from randn (the GEMM's B operand
    scaled by K**-0.5, like a weight, so that the accumulator is O(1) and exp() stays finite), float32
    vectors and scalars positive like rstd (and K-group scales), index tensors within [0, N), host scalars in
    [0.5, 1.5), and the initial values of inplace outputs from randn. The GEMM's a is M-contiguous where the shape says so."""
    g = torch.Generator(device=device).manual_seed(seed)
    sizes = _sizes(shape)
    inplace = inplace_names(kernel)
    b_name = kernel.gemm.b if kernel.gemm else None
    args: dict = {}
    for d in module.DECLS:
        if d.output and d.name not in inplace:
            continue
        extent = _dims(d.dims, sizes, configs.GPU_DEFAULT, module)
        if d.dtype == "index":
            args[d.name] = torch.randint(0, max(shape.n, 1), extent, generator=g, device=device)
            continue
        dt = dtype if d.dtype == "T" else FLOATS[d.dtype]
        if d.dtype != "T" and (len(extent) <= 1 or dims.GROUPS_K in d.dims):  # K-group scales too
            t = 0.5 + torch.rand(extent, generator=g, device=device)
        elif shape.a_km and d.name == kernel.gemm.a:
            t = torch.randn(extent[::-1], generator=g, device=device).T
        else:
            t = torch.randn(extent, generator=g, device=device)
            if d.name == b_name:
                t *= shape.k ** -0.5
        args[d.name] = t.to(dt)
    for s in scalar_names(module):
        args[s] = 0.5 + torch.rand((), generator=g, device=device).item()
    return args


def new_outputs(kernel: Kernel, module, shape: Shape, config: Config, device, dtype=torch.bfloat16,
                initial: dict | None = None) -> dict:
    """Outputs for one launch: NaN-prefilled, so that an element the kernel does not write shows; inplace
    outputs as copies of their initial values."""
    sizes = _sizes(shape)
    outs = {}
    for d in module.DECLS:
        if not d.output:
            continue
        if initial is not None and d.name in initial:
            outs[d.name] = initial[d.name].clone()
            continue
        dt = dtype if d.dtype == "T" else FLOATS.get(d.dtype, torch.int64)
        outs[d.name] = torch.full(_dims(d.dims, sizes, config, module), float("nan") if dt.is_floating_point else -1,
                                  dtype=dt, device=device)
    return outs


def _rows(module, args: dict, rows: int) -> dict:
    """The first `rows` rows of every argument that has an M dimension (views: the base stays aligned)."""
    sliced = dict(args)
    for d in module.DECLS:
        if d.name in args and "M" in d.dims:
            index = tuple(slice(0, rows) if x == "M" else slice(None) for x in d.dims)
            sliced[d.name] = args[d.name][index]
    return sliced


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = next((t.strip() for t in text if t.strip()), "")
    return f"{type(e).__name__}: {line[:200]}" if line else type(e).__name__


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale > 0 else 1.0)


def load_module(out: Path, name: str):
    """generated/kernels/<name>.py, imported as part of its package (importing a second copy would register
    its torch.library op twice)."""
    pkg = Path(out).resolve()
    if not (pkg / "kernels" / f"{name}.py").is_file():
        raise TuneError(f"{out}/kernels/{name}.py does not exist; run codagen build first")
    loaded = sys.modules.get(pkg.name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().parent != pkg:
        raise TuneError(f"another package named '{pkg.name}' is already imported ({loaded.__file__})")
    if str(pkg.parent) not in sys.path:
        sys.path.insert(0, str(pkg.parent))
    return importlib.import_module(f"{pkg.name}.kernels.{name}")


def other_backends(module, device: torch.device) -> tuple[str, ...]:
    """The backends besides tl whose kernels are candidates: they lower this kernel (its module of theirs exists)
    and this GPU runs them (runtime.backends.running)."""
    return tuple(b.name for b in backends.running(module.__package__, module.NAME, device))


# -- one kernel at one shape -----------------------------------------------------------------------------------
def do_bench_timer(fn: Callable[[], None]) -> float:
    """Median milliseconds of fn through triton.testing.do_bench (which flushes L2 between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


@dataclass
class Outcome:
    shape: Shape
    best: Config | None = None
    ms: float | None = None
    cublas_ms: float | None = None
    timed: list[tuple[Config, float]] = field(default_factory=list)
    discarded: list[tuple[Config, str]] = field(default_factory=list)
    complete: bool = True  # False: the budget ran out before every candidate was tried

    def entry(self) -> dict:
        e = {**tablefile.entry_of(self.best), "ms": _round(self.ms)}
        if self.cublas_ms is not None:
            e["cuBLAS_ms"] = _round(self.cublas_ms)
            e["rounds"] = CUBLAS_ROUNDS  # ms and cuBLAS_ms: medians of that many timings of each, in turn
        return e


def _round(ms: float) -> float:
    return float(f"{ms:.4g}")


class Checker:
    """Runs candidates on the first rows and compares every output with the float64 reference, which is
    computed once per tile shape (partial reductions are per tile) and kept."""

    def __init__(self, checked: Checked, module, inputs: dict, rows: int, device, dtype=torch.bfloat16):
        self.kernel, self.module, self.device, self.dtype = checked.kernel, module, device, dtype
        self.types = checked.types
        self.inputs = _rows(module, inputs, rows)
        self.rows = rows
        self._truth: dict[tuple[int, int], dict] = {}

    def truth(self, config: Config) -> dict:
        key = (config.block_m, config.epilogue_n) if self.kernel.tile_dependent else (0, 0)
        if key not in self._truth:
            self._truth[key] = reference.run(self.kernel, self.types, self.inputs, config.block_m, config.epilogue_n)
        return self._truth[key]

    def __call__(self, config: Config, shape: Shape) -> str | None:
        """None when the candidate is right; else why not."""
        sub = Shape(self.rows, shape.n, shape.k, shape.a_km)
        initial = {n: self.inputs[n] for n in inplace_names(self.kernel)}
        outs = new_outputs(self.kernel, self.module, sub, config, self.device, self.dtype, initial)
        launch_args = {n: v for n, v in self.inputs.items() if n not in initial}
        self.module.launch(**launch_args, **outs, config=config)
        _sync(self.device)
        truth = self.truth(config)
        for name, got in outs.items():
            want = truth[name]
            if tuple(got.shape) != tuple(want.shape):
                return f"'{name}' has shape {tuple(got.shape)}, the reference {tuple(want.shape)}"
            if got.is_floating_point() and torch.isnan(got).any():
                return f"'{name}' holds NaN on {self.rows} rows (elements left unwritten, or computed wrong)"
            err = relative_error(got, want)
            if not err <= TOLERANCE:
                return f"'{name}' is wrong on {self.rows} rows: relative error {err:.1e} > {TOLERANCE:.0e}"
        return None


def shape_candidates(kernel: Kernel, pool, n: int) -> list[Config]:
    """The configs of `pool` whose epilogue slices span the n columns of a kernel with column_group N; none is
    an error located at the spec's column_group."""
    fitting = [c for c in pool if configs.fits_group(c, kernel.column_group, n)]
    if not fitting:
        widest = max(c.epilogue_n for c in pool)
        raise ValidationFailed([SpecError(
            kernel.column_group_loc or kernel.loc,
            f"column_group N: at N = {n}, no tuning candidate of {kernel.name} has one tile over the whole row "
            f"(the widest spans {widest} columns); reduce the row in partials (reduce, axis cols) instead")])
    return fitting


def tune_shape(checked: Checked, module, shape: Shape, device: torch.device, *, pool=None,
               timer: Callable[[Callable[[], None]], float] = do_bench_timer, check_rows: int = CHECK_ROWS,
               deadline: float | None = None, dtype=torch.bfloat16, seed: int = 0) -> Outcome:
    """Check and time every candidate of `pool` (default: candidates(kernel), with those of the other backends
    that lower it and run here) at `shape`; stop early, with an incomplete outcome, once time.monotonic() passes `deadline`."""
    kernel = checked.kernel
    pool = candidates(kernel, other_backends(module, device)) if pool is None else pool
    if kernel.whole_rows:  # one tile over the whole row: which tiles do depends on the shape
        pool = shape_candidates(kernel, pool, shape.n)
    # each config says where it is worth timing; no cuBLAS product for FP8 operands, which torch.mm does not take
    pool = [c for c in pool if c.pays(shape.m, shape.n, shape.k)
            and not (kernel.fp8_gemm and getattr(c, "mainloop", "triton") == "cublas")]
    outcome = Outcome(shape)
    if kernel.k_group:  # K-group scales: a candidate whose K steps cross a group is discarded, with the reason
        outcome.discarded += [(c, k_group_problem(c, kernel.k_group)) for c in pool
                              if not fits_k_group(c, kernel.k_group)]
        pool = [c for c in pool if fits_k_group(c, kernel.k_group)]
    inputs = make_inputs(kernel, module, shape, device, dtype, seed)
    check = Checker(checked, module, inputs, min(check_rows, shape.m), device, dtype)
    for config in pool:
        if deadline is not None and time.monotonic() > deadline:
            outcome.complete = False
            break
        try:
            why, ms = _try(checked, module, config, shape, inputs, check, timer, device, dtype)
        except Exception as e:  # noqa: BLE001 - a candidate that fails in any way is out, and reported
            why, ms = _short(e), None
        if why is None:
            outcome.timed.append((config, ms))
        else:
            outcome.discarded.append((config, why))
    if outcome.timed:
        outcome.best, outcome.ms = min(outcome.timed, key=lambda t: t[1])  # ties: the earlier candidate
        if kernel.gemm and outcome.complete:
            fn, _ = launcher(checked, module, outcome.best, shape, inputs, device, dtype)
            timed = time_against_cublas(kernel, fn, inputs, timer)
            if timed is not None:
                outcome.ms, outcome.cublas_ms = timed
    del inputs, check
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return outcome


def _try(checked: Checked, module, config: Config, shape: Shape, inputs: dict, check: Checker, timer, device,
         dtype) -> tuple[str | None, float | None]:
    """(why the candidate is out, None), or (None, its time at the full shape). The first full-shape launch
    writes NaN-prefilled outputs, which must hold no NaN afterwards (every tile of the grid was written)."""
    why = check(config, shape)
    if why is not None:
        return why, None
    fn, outs = launcher(checked, module, config, shape, inputs, device, dtype)
    fn()
    _sync(device)
    inplace = inplace_names(checked.kernel)
    unwritten = [n for n, t in outs.items() if n not in inplace and t.is_floating_point() and torch.isnan(t).any()]
    if unwritten:
        return f"{', '.join(unwritten)} left NaN at the full shape {shape}", None
    return None, timer(fn)


def launch_choice(kernel: Kernel, module, shape: Shape, device: torch.device):
    """The config the kernel's launch takes at `shape` when given none and not tuning at run time: its table's entry,
    else the GPU's default, looked up with the kernel's column and K groups as its launcher looks it up (a lookup
    without them finds no entry of a kernel with column groups, and misses the K-group default)."""
    return pick_config(module.NAME, module.FINGERPRINT, module.TUNING, shape.m, shape.n, shape.k, device,
                       kernel.column_group, decls=module.DECLS, split=module.DEFAULT_SPLIT,
                       cublas=not kernel.fp8_gemm, k_group=kernel.k_group)


def launcher(checked: Checked, module, config: Config, shape: Shape, inputs: dict, device, dtype):
    """(fn, outputs): fn launches the kernel with `config` on the inputs, into NaN-prefilled outputs."""
    inplace = inplace_names(checked.kernel)
    outs = new_outputs(checked.kernel, module, shape, config, device, dtype, {n: inputs[n] for n in inplace})
    launch_args = {n: v for n, v in inputs.items() if n not in inplace}

    def fn():
        module.launch(**launch_args, **outs, config=config)
    return fn, outs


CUBLAS_ROUNDS = 3


def time_against_cublas(kernel: Kernel, fn: Callable[[], None], inputs: dict, timer) -> tuple[float, float] | None:
    """(the kernel's ms, the ms of its plain GEMM through cuBLAS: the speed of light), each the median of
    CUBLAS_ROUNDS timings taken in turn, the kernel's then cuBLAS's: a GPU's clocks move with its power and
    temperature, and two yardsticks timed minutes apart differed by 4-6% (an H200, the same GEMM in two tuning
    runs). The plain GEMM is torch.matmul, or for FP8 operands torch._scaled_mm with one scale per tensor (cuBLAS's
    FP8 GEMM without K-group scales: the cheapest FP8 product of that shape). None where it fails."""
    a, b = inputs[kernel.gemm.a], inputs[kernel.gemm.b]
    b = b.T if kernel.gemm.b_layout is BLayout.NK else b
    if a.dtype.is_floating_point and a.dtype.itemsize == 1:
        one = torch.ones((), device=a.device)

        def plain():
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        def plain():
            torch.matmul(a, b)
    ours, theirs = [], []
    try:
        for _ in range(CUBLAS_ROUNDS):
            ours.append(timer(fn))
            theirs.append(timer(plain))
    except Exception:  # noqa: BLE001 - the yardstick is optional
        return None
    return statistics.median(ours), statistics.median(theirs)

