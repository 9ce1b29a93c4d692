"""`codagen tune`: choose each generated kernel's tile configuration per shape on this GPU, and commit it.

For every selected kernel and shape, each candidate Config is first checked: it runs on NaN-prefilled outputs
over a ragged slice of the rows (all of N and K), and every output is compared with the float64 reference
(codagen.reference). A candidate that fails to compile, runs out of resources or is wrong is discarded and
reported, never chosen. The survivors are timed at the full shape on random bf16 data, and the fastest goes
into generated/tuning/<gpu>/<kernel>.json, keyed by runtime.configs.shape_bucket, which
runtime.pick_config reads. The run stops cleanly when its time budget is spent: every shape finished by
then is written (tables are written shape by shape), and `--missing-only` continues later.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import api, reference
from .api import Checked
from .model import BLayout, Kernel
from .runtime import configs
from .runtime.configs import Config, shape_bucket


class TuneError(Exception):
    """A request that cannot be tuned as given (unknown preset or kernel, stale generated code, no GPU)."""


# -- shapes: where each kernel runs in a Llama block ----------------------------------------------------------
@dataclass(frozen=True)
class Widths:
    dim: int  # D, the residual stream
    ffn: int  # the MLP's hidden width
    qkv: int  # q, k and v heads together
    vocab: int


PRESETS = {
    "llama3-1b": Widths(dim=2048, ffn=8192, qkv=3072, vocab=128256),
    "llama3-8b": Widths(dim=4096, ffn=14336, qkv=6144, vocab=128256),
}
TOKENS = (8192, 32768)
# The cross-entropy backward recomputes the logits on chunks of rows (specs/blocks/lm_head_loss.yaml,
# chunk_rows): its kernels see at most this many rows whatever the token count.
CE_CHUNK_ROWS = 2048


class Use(NamedTuple):
    n: str  # the kernel's N, in the preset's widths ("2*ffn": twice the MLP width)
    k: str  # its K; "-": the kernel has no GEMM
    rows: str  # "tokens", or "chunk": at most CE_CHUNK_ROWS
    where: str  # which step of which block spec (specs/blocks/) calls it so


LLAMA_USES: dict[str, tuple[Use, ...]] = {
    # kernel                     N        K        rows      called by
    "qkv_norm_rope":          (Use("qkv",   "dim",   "tokens", "pre_attention forward: QKV projection"),),
    "rope_bwd_rowdot":        (Use("qkv",   "-",     "tokens", "pre_attention backward: RoPE backward"),),
    "out_proj_residual_norm": (Use("dim",   "dim",   "tokens", "post_attention forward: out-projection"),
                               Use("dim",   "ffn",   "tokens", "post_attention forward: down projection")),
    "gate_up_swiglu":         (Use("2*ffn", "dim",   "tokens", "post_attention forward: gate/up projection"),),
    "swiglu_dgrad":           (Use("ffn",   "dim",   "tokens", "post_attention backward: through w_down"),),
    "norm_dgrad_residual":    (Use("dim",   "qkv",   "tokens", "pre_attention backward: through w_qkv"),
                               Use("dim",   "2*ffn", "tokens", "post_attention backward: through w_gate_up")),
    "rmsnorm_stats":          (Use("dim",   "-",     "tokens", "norm_stats: the first layer's RMSNorm"),),
    "lm_head_logsumexp":      (Use("vocab", "dim",   "tokens", "lm_head_loss forward"),),
    "lm_head_ce_grad":        (Use("vocab", "dim",   "chunk",  "lm_head_loss backward"),),
    "norm_dgrad":             (Use("dim",   "vocab", "chunk",  "lm_head_loss backward: through w_vocab"),),
    # The mainloop alone against cuBLAS, at the GEMM shape of every kernel above.
    "matmul":                 (Use("qkv",   "dim",   "tokens", "the GEMM of qkv_norm_rope"),
                               Use("dim",   "dim",   "tokens", "the GEMM of the out-projection"),
                               Use("2*ffn", "dim",   "tokens", "the GEMM of gate_up_swiglu"),
                               Use("dim",   "ffn",   "tokens", "the GEMM of the down projection"),
                               Use("vocab", "dim",   "tokens", "the GEMM of lm_head_logsumexp"),
                               Use("vocab", "dim",   "chunk",  "the GEMM of lm_head_ce_grad"),
                               Use("ffn",   "dim",   "tokens", "the GEMM of swiglu_dgrad"),
                               Use("dim",   "qkv",   "tokens", "the GEMM of norm_dgrad_residual (pre_attention)"),
                               Use("dim",   "2*ffn", "tokens", "the GEMM of norm_dgrad_residual (post_attention)"),
                               Use("dim",   "vocab", "chunk",  "the GEMM of norm_dgrad")),
}

_WIDTH = re.compile(r"(?:(\d+)\*)?(dim|ffn|qkv|vocab)")


def width(expr: str, widths: Widths) -> int:
    """'dim' -> widths.dim, '2*ffn' -> 2 * widths.ffn, '-' -> 0."""
    if expr == "-":
        return 0
    match = _WIDTH.fullmatch(expr)
    if match is None:
        raise ValueError(f"width {expr!r}: expected dim, ffn, qkv or vocab, optionally as '<integer>*name'")
    return int(match.group(1) or 1) * getattr(widths, match.group(2))


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int  # 0: no GEMM

    @property
    def bucket(self) -> str:
        return shape_bucket(self.m, self.n, self.k)

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}" if self.k else f"{self.m}x{self.n}"


def use_shapes(kernel: Kernel, widths: Widths, tokens=TOKENS) -> dict[Shape, Use]:
    """Each shape at which the Llama block runs `kernel` (LLAMA_USES at these widths and token counts), with
    the first use that gives it."""
    uses = LLAMA_USES.get(kernel.name)
    if uses is None:
        raise TuneError(f"kernel '{kernel.name}' ({kernel.source}) has no entry in codagen/tune.py LLAMA_USES, "
                        "so the presets do not know its shapes; add one, or pass --shapes MxNxK")
    shapes: dict[Shape, Use] = {}
    for use in uses:
        for t in tokens:
            m = min(t, CE_CHUNK_ROWS) if use.rows == "chunk" else t
            shapes.setdefault(Shape(m, width(use.n, widths), width(use.k, widths) if kernel.gemm else 0), use)
    return shapes


def preset_shapes(preset: str, kernel: Kernel, tokens=TOKENS) -> list[Shape]:
    return list(use_shapes(kernel, PRESETS[preset], tokens))


_LITERAL = re.compile(r"(\d+)x(\d+)(?:x(\d+))?")


def parse_shapes(text: str, kernel: Kernel, tokens=TOKENS) -> list[Shape]:
    """`--shapes`: comma-separated presets and literal MxNxK (MxN for kernels without a GEMM); a literal
    applies to every kernel (K is dropped for those without a GEMM). Shapes of one bucket count once."""
    shapes: dict[str, Shape] = {}
    for item in (s.strip() for s in text.split(",")):
        if item in PRESETS:
            found = preset_shapes(item, kernel, tokens)
        elif (match := _LITERAL.fullmatch(item)) is not None:
            m, n, k = (int(g or 0) for g in match.groups())
            if m < 1 or n < 1 or (kernel.gemm and k < 1):
                raise TuneError(f"shape {item!r}: M, N and K must be positive (kernel '{kernel.name}' has "
                                f"{'a' if kernel.gemm else 'no'} GEMM)")
            found = [Shape(m, n, k if kernel.gemm else 0)]
        else:
            raise TuneError(f"--shapes: {item!r} is neither a preset ({', '.join(PRESETS)}) nor MxNxK, "
                            "e.g. 8192x2048x2048")
        for s in found:
            shapes.setdefault(s.bucket, s)
    return list(shapes.values())


def parse_tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise TuneError(f"--tokens {text!r}: expected positive integers separated by commas, e.g. 8192,32768")
    return tokens


# -- candidates ------------------------------------------------------------------------------------------------
def _c(bm, bn, bk, warps, stages, persistent, tma) -> Config:
    return Config(bm, bn, bk, 8, warps, stages, persistent=persistent, tma=tma)


# For Hopper (H100/H200: 228 KB of shared memory per SM, wgmma on 64-row warpgroups) and bf16 operands.
# Centred on what DESIGN.md §7 measured: a persistent grid with TMA operands and 128x256x64 tiles matched
# cuBLAS's mainloop, but epilogues add registers and shared memory, so smaller N-tiles and fewer stages
# stay in. 128x256 tiles use 8 warps (two warpgroups); 64-wide tiles use 4. Shared memory per stage is
# (BM + BN) * BK * 2 bytes: 48 KB for 128x256x64, so 4 stages is the most that fits next to an epilogue.
# Pointer loads (tma=False) and one-program-per-tile grids stay in for layouts and shapes where TMA or
# persistence lose. Candidates that do not fit are discarded by the check, not chosen.
GEMM_CANDIDATES = (
    #   BM   BN   BK  warps stages persistent tma
    _c(128, 256, 64, 8, 3, True, True),  # DESIGN.md §7's fastest mainloop
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), flatten=True),  # won most GEMM shapes on the H200
    _c(128, 128, 64, 8, 4, True, True),  # runtime.configs.GPU_DEFAULT
    dataclasses.replace(_c(128, 128, 64, 8, 4, True, True), flatten=True),
    # warp-specialized: the loads in producer warps, the epilogue overlapping them (won 10 of the 36 matmul
    # shapes on the H200)
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True),
    dataclasses.replace(_c(128, 128, 64, 8, 4, True, True), warp_specialize=True),
    _c(128, 128, 64, 8, 4, False, True),  # one program per tile: the epilogue of one overlaps the next's loads
    _c(128, 64, 64, 4, 4, False, True),  # narrow tiles: heavy epilogues, few registers to spare
    _c(64, 128, 64, 4, 4, False, True),
    _c(64, 64, 64, 4, 4, False, True),  # wide inputs in the epilogue (2*N columns) need the smallest tiles
    # ... or the epilogue on a half or a quarter of the tile at a time, fewer registers live at once: on the
    # H200 (2026-12-02) these won 26 of the 36 shapes of the fused GEMM kernels, all of swiglu_dgrad's and
    # lm_head_logsumexp's
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), epilogue_split=2),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True, epilogue_split=2),
    dataclasses.replace(_c(128, 128, 64, 8, 4, False, True), epilogue_split=2),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), epilogue_split=4),
    dataclasses.replace(_c(128, 256, 64, 8, 3, True, True), warp_specialize=True, epilogue_split=4),
    dataclasses.replace(_c(128, 128, 64, 8, 4, False, True), epilogue_split=4),
)
# Pruned on the H200 (2026-12-02, graph-timed sweep of 8 configs over the Llama kernels, see
# benchmarks/results/h200-kernels.md): pointer loads, 4 warps on 128x128 and 256-row tiles never won.
# No GEMM, no K loop: only the tile shape and the warps matter; the rest is the default's.
ELEMENTWISE_CANDIDATES = tuple(
    dataclasses.replace(configs.GPU_DEFAULT, block_m=bm, block_n=bn, num_warps=w)
    for bm, bn, w in ((128, 128, 8), (64, 128, 4), (32, 256, 4))
)


def candidates(kernel: Kernel) -> tuple[Config, ...]:
    return GEMM_CANDIDATES if kernel.gemm else ELEMENTWISE_CANDIDATES


# -- arguments -------------------------------------------------------------------------------------------------
FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_ROWS = 1024 + 48  # ragged for every BM of 64, 128 and 256, yet a multiple of 16: Triton specializes
# integer arguments on divisibility by 16, so the check compiles the very kernel that the full shape times
TOLERANCE = 1e-2  # relative norm error vs float64: a few bf16 roundings (2**-8 each); wrong tiles give O(1)


def _sizes(shape: Shape) -> dict[str, int]:
    return {"M": shape.m, "N": shape.n, "K": shape.k}


def _dims(dims: tuple[str, ...], sizes: dict, config: Config) -> tuple[int, ...]:
    m, n = sizes["M"], sizes["N"]
    table = {"M": m, "N": n, "K": sizes["K"], "N/2": n // 2, "2*N": 2 * n,
             "tiles(M)": -(-m // config.block_m), "tiles(N)": -(-n // config.epilogue_n)}
    return tuple(table[d] for d in dims)


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
    vectors and scalars positive like rstd, index tensors within [0, N), host scalars in [0.5, 1.5), and the
    initial values of inplace outputs from randn."""
    g = torch.Generator(device=device).manual_seed(seed)
    sizes = _sizes(shape)
    inplace = inplace_names(kernel)
    b_name = kernel.gemm.b if kernel.gemm else None
    args: dict = {}
    for d in module.DECLS:
        if d.output and d.name not in inplace:
            continue
        dims = _dims(d.dims, sizes, configs.GPU_DEFAULT)
        if d.dtype == "index":
            args[d.name] = torch.randint(0, max(shape.n, 1), dims, generator=g, device=device)
            continue
        dt = dtype if d.dtype == "T" else FLOATS[d.dtype]
        if d.dtype != "T" and len(dims) <= 1:
            t = 0.5 + torch.rand(dims, generator=g, device=device)
        else:
            t = torch.randn(dims, generator=g, device=device)
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
        outs[d.name] = torch.full(_dims(d.dims, sizes, config), float("nan") if dt.is_floating_point else -1,
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
        e = {"config": self.best.as_dict(), "ms": _round(self.ms)}
        if self.cublas_ms is not None:
            e["cuBLAS_ms"] = _round(self.cublas_ms)
        return e


def _round(ms: float) -> float:
    return float(f"{ms:.4g}")


class Checker:
    """Runs candidates on the first rows and compares every output with the float64 reference, which is
    computed once per tile shape (partial reductions are per tile) and kept."""

    def __init__(self, checked: Checked, module, inputs: dict, rows: int, device, dtype=torch.bfloat16):
        self.kernel, self.module, self.device, self.dtype = checked.kernel, module, device, dtype
        self.inputs = _rows(module, inputs, rows)
        self.rows = rows
        self._truth: dict[tuple[int, int], dict] = {}

    def truth(self, config: Config) -> dict:
        key = (config.block_m, config.epilogue_n) if self.kernel.tile_dependent else (0, 0)
        if key not in self._truth:
            self._truth[key] = reference.run(self.kernel, self.inputs, config.block_m, config.epilogue_n)
        return self._truth[key]

    def __call__(self, config: Config, shape: Shape) -> str | None:
        """None when the candidate is right; else why not."""
        sub = Shape(self.rows, shape.n, shape.k)
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


def tune_shape(checked: Checked, module, shape: Shape, device: torch.device, *, pool=None,
               timer: Callable[[Callable[[], None]], float] = do_bench_timer, check_rows: int = CHECK_ROWS,
               deadline: float | None = None, dtype=torch.bfloat16, seed: int = 0) -> Outcome:
    """Check and time every candidate of `pool` (default: candidates(kernel)) at `shape`; stop early, with
    an incomplete outcome, once time.monotonic() passes `deadline`."""
    kernel = checked.kernel
    pool = candidates(kernel) if pool is None else pool
    outcome = Outcome(shape)
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
            outcome.cublas_ms = time_cublas(kernel, inputs, timer)
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
    inplace = inplace_names(checked.kernel)
    outs = new_outputs(checked.kernel, module, shape, config, device, dtype, {n: inputs[n] for n in inplace})
    launch_args = {n: v for n, v in inputs.items() if n not in inplace}

    def fn():
        module.launch(**launch_args, **outs, config=config)

    fn()
    _sync(device)
    unwritten = [n for n, t in outs.items() if n not in inplace and t.is_floating_point() and torch.isnan(t).any()]
    if unwritten:
        return f"{', '.join(unwritten)} left NaN at the full shape {shape}", None
    return None, timer(fn)


def time_cublas(kernel: Kernel, inputs: dict, timer) -> float | None:
    """The plain GEMM of the same shape through torch.matmul (cuBLAS on a GPU): the speed of light."""
    a, b = inputs[kernel.gemm.a], inputs[kernel.gemm.b]
    b = b.T if kernel.gemm.b_layout is BLayout.NK else b
    try:
        return timer(lambda: torch.matmul(a, b))
    except Exception:  # noqa: BLE001 - the yardstick is optional
        return None


# -- tables ----------------------------------------------------------------------------------------------------
def table_text(kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> str:
    data = {"kernel": kernel.name, "spec": kernel.source, "spec_sha256": kernel.sha256, "triton": triton_version,
            "gpu": gpu, "shapes": shapes}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def read_table(path: Path, kernel: Kernel, triton_version: str) -> dict:
    """The shapes of an existing table that is still valid: same kernel, spec hash and Triton version."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or (data.get("kernel"), data.get("spec_sha256"), data.get("triton")) != (
            kernel.name, kernel.sha256, triton_version):
        return {}
    shapes = data.get("shapes")
    return dict(shapes) if isinstance(shapes, dict) else {}


def write_table(path: Path, kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> bool:
    """Merge `shapes` (bucket -> entry) into the table at `path` (its entries are kept when it was made for
    this spec and Triton version, else replaced) and write it atomically if it changed. Touches no other
    file. Returns whether it wrote."""
    merged = {**read_table(path, kernel, triton_version), **shapes}
    text = table_text(kernel, gpu, triton_version, merged)
    if path.is_file() and path.read_bytes() == text.encode("utf-8"):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    configs.clear_caches()  # this process reads the new table from now on
    return True


# -- the command -----------------------------------------------------------------------------------------------
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


@dataclass
class Job:
    checked: Checked
    module: object
    shapes: list[Shape]
    table: Path


def plan(paths, shapes: str, out: str | Path = "generated", kernels: str | None = None, tokens: str | None = None,
         tuning_dir: str | Path | None = None, gpu: str = "gpu") -> list[Job]:
    """What a run would tune: the selected kernels of the specs under `paths`, their shapes and tables."""
    out = Path(out)
    tuning_dir = Path(tuning_dir) if tuning_dir is not None else out / "tuning"
    found = sorted((c for c in api.load(list(paths)) if isinstance(c, Checked)), key=lambda c: c.kernel.name)
    if kernels:
        wanted = [k.strip() for k in kernels.split(",") if k.strip()]
        names = {c.kernel.name for c in found}
        unknown = [k for k in wanted if k not in names]
        if unknown:
            raise TuneError(f"--kernels: no spec defines {', '.join(unknown)}; "
                            f"the specs given define {', '.join(sorted(names))}")
        found = [c for c in found if c.kernel.name in wanted]
    toks = parse_tokens(tokens) if tokens else TOKENS
    jobs = []
    for c in found:
        module = load_module(out, c.kernel.name)
        if module.SHA256 != c.kernel.sha256:
            raise TuneError(f"{out}/kernels/{c.kernel.name}.py was generated from another version of "
                            f"{c.kernel.source}; run codagen build first")
        jobs.append(Job(c, module, parse_shapes(shapes, c.kernel, toks),
                        configs.table_path(tuning_dir, gpu, c.kernel.name)))
    return jobs


def run(paths, shapes: str, *, out: str | Path = "generated", budget: float | None = None, kernels: str | None = None,
        tokens: str | None = None, missing_only: bool = False, tuning_dir: str | Path | None = None,
        device: torch.device | None = None, gpu: str | None = None,
        timer: Callable[[Callable[[], None]], float] = do_bench_timer, check_rows: int = CHECK_ROWS,
        pools: dict | None = None, log: Callable[[str], None] | None = None) -> list[Path]:
    """Tune and write tables; returns the tables written. `device`, `gpu`, `timer`, `check_rows` and
    `pools` (kernel name -> candidates) exist for tests on the CPU; the command runs on the current GPU."""
    import triton

    log = log or functools.partial(print, flush=True)  # progress shows as it happens, even through a pipe
    start = time.monotonic()
    deadline = start + budget if budget is not None else None
    if device is None:
        if not torch.cuda.is_available():
            raise TuneError("codagen tune times kernels on a CUDA GPU, and this machine has none")
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = gpu or configs.gpu_key(device)
    jobs = plan(paths, shapes, out, kernels, tokens, tuning_dir, gpu)
    runs = sum(len(j.shapes) * len((pools or {}).get(j.checked.kernel.name, candidates(j.checked.kernel)))
               for j in jobs)
    log(f"tuning {len(jobs)} kernel(s) at {sum(len(j.shapes) for j in jobs)} shape(s) on {gpu} "
        f"(triton {triton.__version__}): {runs} candidate runs"
        + (f", budget {budget:.0f} s" if budget is not None else ""))
    written: list[Path] = []
    stopped = None
    for job in jobs:
        kernel = job.checked.kernel
        have = read_table(job.table, kernel, triton.__version__) if missing_only else {}
        for shape in job.shapes:
            label = f"{kernel.name} {shape}"
            if shape.bucket in have:
                log(f"{label}: in the table already (bucket {shape.bucket}), skipped")
                continue
            if deadline is not None and time.monotonic() > deadline:
                stopped = label
                break
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                outcome = tune_shape(job.checked, job.module, shape, device, pool=(pools or {}).get(kernel.name),
                                     timer=timer, check_rows=check_rows, deadline=deadline)
            _report(label, outcome, log)
            if not outcome.complete:
                stopped = label
                break
            if outcome.best is not None:
                if write_table(job.table, kernel, gpu, triton.__version__, {shape.bucket: outcome.entry()}):
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
    for config, why in outcome.discarded:
        log(f"  discarded {config.label()}: {why}")

