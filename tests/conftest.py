"""Shared test setup: Triton's CPU interpreter, the test kernels built from tests/specs/, and random
arguments for any generated kernel module.

Arguments are drawn from a module's DECLS (and the host scalars of its `launch`), so the same helpers serve
the test kernels and the kernels of specs/ in generated/, whatever their specs hold."""
from __future__ import annotations

import os

import torch

# Before anything imports triton: without a GPU, kernels run on the CPU through Triton's interpreter.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from interpreter import quicken  # noqa: E402

quicken()

import importlib  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import dataclasses  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402

from codagen import api  # noqa: E402
from codagen.runtime import Config  # noqa: E402
from codagen.runtime.backends import FP8_MIN_BLOCK_K  # noqa: E402
from codagen.runtime.checks import FLOATS  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TEST_SPECS = TESTS / "specs"


def quickened(env: dict) -> dict:
    """The environment of a Python process the tests launch, with tests/site first on PYTHONPATH: its
    sitecustomize makes the interpreter quicker there as in the tests' own processes (tests/interpreter.py)."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS / "site"), env.get("PYTHONPATH")]))}

# a one-line error of the CLI: file:line:col: message
ERROR_LINE = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): (?P<message>\S.*)$")
# a valid kernel spec, for tests that need one on disk
SCALED_SPEC = """\
kernel: scaled
doc: Scales the GEMM result by a column vector.
gemm: {a: a, b: b}
inputs: {a: [M, K], b: [N, K], v: [N]}
outputs: {o: [M, N]}
epilogue:
  - scale: {x: acc, by: v, out: s}
  - store: {x: s, to: o}
"""
PACKAGE = "cg_test_generated"
# Where the kernels run: the GPU when there is one (compiled Triton), else the CPU (the interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fp8_mma_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The part of the error bound of the FP8 GEMM a @ b^T beyond fp32 accumulation's, per element (float64, on the
    CPU; a and b as the MMAs read them, or dequantized by scales constant over each K group of 128). On a GPU,
    Hopper's FP8 MMAs (wgmma) add each K step of 32 products to the running sum with about 14 bits (DeepSeek-V3's
    report, arXiv 2412.19437, section 3.3.2): aligned to the largest of those 33 terms and truncated, each term loses
    less than 2^-13 of that largest one, which is at most the step's largest |a_ik b_jk| or the |a||b| sum before
    the step. The interpreter adds in fp32: 0 (docs/fp8.md, "Accumulation on Hopper")."""
    a, b = a.detach().cpu().double().abs(), b.detach().cpu().double().abs()
    bound = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    if DEVICE.type != "cuda":
        return bound
    before = torch.zeros_like(bound)
    for k0 in range(0, a.shape[1], 32):
        products = a[:, None, k0:k0 + 32] * b[None, :, k0:k0 + 32]
        bound += (products.shape[-1] + 1) * 2.0**-13 * torch.maximum(products.amax(-1), before)
        before += products.sum(-1)
    return bound


@pytest.fixture
def fresh_caches():
    """No tuning table read nor configuration tuned or picked before the test, nor kept after it (modules that
    fake the GPU path of pick_config use it for every test)."""
    from codagen.runtime import autotune

    autotune.clear_caches()
    yield
    autotune.clear_caches()


@pytest.fixture(autouse=True)
def tuning_cache_dir(tmp_path_factory, monkeypatch):
    """A fresh, empty cache folder per test (CODAGEN_CACHE_DIR, inherited by subprocesses): run-time tuning
    neither reads choices another test kept nor writes into the user's ~/.cache."""
    path = tmp_path_factory.mktemp("codagen-cache")
    monkeypatch.setenv("CODAGEN_CACHE_DIR", str(path))
    return path


def within_seconds(fn, seconds: float = 10.0):
    """fn(), failing the test if it has not returned in `seconds` (a read that blocks on a FIFO or never ends)."""
    result = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the test's own thread
            result["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


# -- the test kernels -------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def test_kernels(tmp_path_factory) -> Callable[[str], object]:
    """Build tests/specs/ into <tmp>/cg_test_generated once per session; returns name -> kernel module."""
    root = tmp_path_factory.mktemp("codagen")
    api.build([TEST_SPECS], out=root / PACKAGE)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()

    def import_kernel(name: str):
        return importlib.import_module(f"{PACKAGE}.kernels.{name}")

    yield import_kernel
    sys.path.remove(str(root))


_CHECKED: dict[str, api.Checked] = {}


def _checked() -> dict[str, api.Checked]:
    if not _CHECKED:
        _CHECKED.update({c.kernel.name: c for c in api.load([TEST_SPECS])})
    return _CHECKED


def kernel_model(name: str):
    """The checked kernel model (codagen.model.Kernel) of a test kernel, loaded with codagen.api.load."""
    return _checked()[name].kernel


def kernel_types(name: str) -> dict:
    """The value types of a test kernel's values, as the validator found them."""
    return _checked()[name].types


def all_test_kernels() -> list[str]:
    """Names of the test kernels (the specs of tests/specs/), sorted."""
    return sorted(_checked())


@pytest.fixture(scope="session")
def model() -> Callable[[str], object]:
    return kernel_model


# -- random arguments -------------------------------------------------------------------------------------
@dataclass
class Args:
    """Keyword arguments of a module's `launch`, plus what a test needs to check the outputs."""

    kwargs: dict  # name -> tensor or float, for launch (without config)
    inputs: dict  # the inputs (and the inplace outputs' values before the launch) for the reference
    outputs: dict  # output name -> the view the kernel writes
    bases: dict = field(default_factory=dict)  # output name -> (base tensor, its copy before the launch, mask)


def scalar_names(module) -> list[str]:
    """Host-scalar parameters of a module's launch: parameters that are neither tensors nor config."""
    decls = {d.name for d in module.DECLS}
    return [p for p in inspect.signature(module.launch).parameters if p not in decls and p != "config"]


def dim_size(dim: str, sizes: dict, config: Config, group: int | None = None, k_group: int | None = None) -> int:
    m, n = sizes["M"], sizes["N"]
    if dim == "groups(N)":
        return n // group
    if dim == "groups(K)":
        return sizes["K"] // k_group
    if dim == "blocks(N)":
        return -(-n // k_group)
    return {"M": m, "K": sizes["K"], "N": n, "N/2": n // 2, "2*N": 2 * n,
            "tiles(M)": -(-m // config.block_m), "tiles(N)": -(-n // config.epilogue_n)}[dim]


def _embed(values: torch.Tensor, how: int, base_fill: Callable[[tuple[int, ...]], torch.Tensor]):
    """`values` (drawn on the CPU) on DEVICE, as a contiguous tensor (how 0) or as a non-contiguous view of a
    larger base made by `base_fill`: transposed (how 1) or a column slice (how 2); 1-d: every other element.
    Returns (view, base, view_of), where view_of maps a tensor shaped like the base to the same view of it."""
    shape = tuple(values.shape)
    if how == 0 or len(shape) == 0:
        values = values.to(DEVICE)
        return values, values, lambda t: t
    if len(shape) == 1:
        base_shape, view_of = (2 * shape[0] + 1,), lambda t: t[1::2]
    elif how == 1:
        base_shape, view_of = (shape[1], shape[0]), lambda t: t.t()
    else:
        base_shape, view_of = (shape[0], shape[1] + 5), lambda t: t[:, 3:3 + shape[1]]
    base = base_fill(base_shape).to(values.dtype)
    view_of(base).copy_(values)
    base = base.to(DEVICE)
    return view_of(base), base, view_of


def fitting(module, config: Config) -> Config:
    """The test's config for this kernel: for FP8 operands (FP8 inputs are only ever a GEMM's), block_k at least one
    FP8 MMA's K, which the launch requires on every device; for column groups, epilogue slices of whole groups
    (fewer slices where the config's are narrower than a group)."""
    if any(d.dtype.startswith("float8") for d in module.DECLS if not d.output):
        config = dataclasses.replace(config, block_k=max(config.block_k, FP8_MIN_BLOCK_K))
    group = getattr(module, "COLUMN_GROUP", None)
    if group and (config.block_n // config.epilogue_split) % group:
        block_n = max(config.block_n, group)
        config = dataclasses.replace(config, block_n=block_n, epilogue_split=max(1, min(config.epilogue_split,
                                                                                          block_n // group)))
    return config


def draw_args(module, sizes: dict, dtype: torch.dtype, config: Config, *, strided: bool = False,
              generator: torch.Generator | None = None, index_dtype: torch.dtype = torch.int64,
              special: dict | None = None) -> Args:
    """Fresh random arguments for `module.launch`: floating inputs from randn (never zeros), index inputs in
    [0, N) with every fifth row out of range (-100, or past any width), outputs pre-filled with NaN (inplace
    outputs with random data). With `strided`, every tensor is a non-contiguous view (transposed, a column
    slice or every other element), outputs included, and each output's base is kept to check that nothing
    outside the view is written. `special` maps an input name to a function (shape, generator) -> tensor.
    For a kernel with K-group scales (its module's K_GROUP), K is rounded up to whole groups."""
    special = special or {}
    g = generator
    k_group = getattr(module, "K_GROUP", None)
    if k_group:  # K-group scales (gemm.scales) take whole groups of K: K rounded up to one
        sizes = {**sizes, "K": -(-sizes["K"] // k_group) * k_group}
    n = sizes["N"]
    inplace = set(inplace_names(module))
    kwargs, inputs, outputs, bases = {}, {}, {}, {}
    nan = lambda s: torch.full(s, float("nan"))  # noqa: E731
    rand = lambda s: torch.randn(s, generator=g)  # noqa: E731
    for i, d in enumerate(module.DECLS):
        shape = tuple(dim_size(x, sizes, config, getattr(module, "COLUMN_GROUP", None), k_group) for x in d.dims)
        dt = dtype if d.dtype == "T" else FLOATS.get(d.dtype, index_dtype)
        if d.name in special:
            values = special[d.name](shape, g)
        elif d.output and d.name not in inplace:
            values = nan(shape)
        elif d.dtype == "index":
            values = torch.randint(0, n, shape, generator=g)
            values[0::10] = -100  # rows 0, 5, 10, ...: outside [0, N/2), [0, N) and [0, 2*N)
            values[5::10] = 2 * n + 7
        else:
            values = rand(shape)
        how = (1 + i % 2) if strided else 0
        view, base, view_of = _embed(values.to(dt), how, nan if d.output and d.name not in inplace else rand)
        kwargs[d.name] = view
        if d.output:
            outputs[d.name] = view
            mask = torch.zeros(base.shape, dtype=torch.bool, device=DEVICE)
            view_of(mask).fill_(True)
            bases[d.name] = (base, base.clone(), mask)
            if d.name in inplace:
                inputs[d.name] = view.clone()
        else:
            inputs[d.name] = view
    for s in scalar_names(module):
        value = float(special[s]((), g)) if s in special else 0.5 + torch.rand((), generator=g).item()
        kwargs[s] = inputs[s] = value
    return Args(kwargs, inputs, outputs, bases)


def inplace_names(module) -> list[str]:
    params = inspect.signature(module.launch).parameters
    return [d.name for d in module.DECLS if d.output and params[d.name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
