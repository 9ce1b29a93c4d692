"""What generated modules import at run time: argument checks, tile configurations, device helpers.

On a machine with no GPU, importing this switches on Triton's interpreter (unless TRITON_INTERPRET is already
set either way), so that generated kernels run there whatever was imported first: generated modules import this
before they decorate a kernel, and triton.language's own helpers are made interpreted if triton came first."""
from __future__ import annotations

import os
import sys

import torch


def _interpret_triton_language() -> None:
    """Turn the @triton.jit helpers of triton.language (tl.max, tl.sigmoid, tl.cdiv, their tensor methods),
    made compiled-mode when triton was imported before the interpreter was switched on, into interpreted ones:
    an interpreted kernel cannot call a compiled-mode function. Kernels decorated later are interpreted anyway
    (triton.jit reads TRITON_INTERPRET when it decorates)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, InterpretedFunction] = {}
    holders = [m for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    holders.append(sys.modules["triton.language"].tensor)
    for holder in holders:
        for key, value in list(vars(holder).items()):
            if isinstance(value, JITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = InterpretedFunction(value.fn, debug=value.debug,
                                                                 noinline=value.noinline)
                setattr(holder, key, interpreted[id(value)])


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:  # imported first, by the user or a library (torch._inductor)
        _interpret_triton_language()

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import contextlib  # noqa: E402
import functools  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from .checks import Aliasing, Decl, bind, check_choice, check_tiles, host_scalar  # noqa: E402
from . import backends  # noqa: E402,F401 (generated launchers call runtime.backends)
from .autotune import pick_config  # noqa: E402
from .configs import CONFIGS, Config, HopperConfig, TlConfig  # noqa: E402
from .launcher import Launcher  # noqa: E402
from .ops import kernel_op, no_backward  # noqa: E402

__all__ = ["INTERPRETED", "Config", "TlConfig", "HopperConfig", "Decl", "bind", "check_choice", "check_tiles",
           "host_scalar", "Aliasing", "pick_config",
           "dot_settings", "needs_int64", "on_device", "reset_parameters", "sm_count", "tma_layout", "aligned",
           "descriptor", "signature", "check_storage", "LaunchPlan", "wants_grad", "kernel_op", "no_backward",
           "row_chunks", "ChunkSum", "Launcher"]


def dot_settings(dtype: torch.dtype) -> dict:
    """Mainloop constexprs for operand dtype: fp32 operands multiply in full fp32 (as torch does by default,
    not tf32); under the CPU interpreter every dot runs on fp32 operands, since its bf16 dot is wrong."""
    return {
        "UPCAST_DOT": INTERPRETED,
        "DOT_PRECISION": "ieee" if (dtype == torch.float32 or INTERPRETED) else "tf32",
    }


def needs_int64(tensors) -> bool:
    """Whether some element's offset reaches 2**31, so that 32-bit index arithmetic would overflow."""
    return any(
        sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1 >= 2**31
        for t in tensors if isinstance(t, torch.Tensor) and t.numel()
    )


def row_chunks(rows: int, size: int):
    """Slices of at most `size` rows covering `rows` (chunked backward passes); for no rows, one empty slice,
    so that the gradients still come out, empty or zero."""
    for start in range(0, max(rows, 1), size):
        yield slice(start, min(rows, start + size))


class ChunkSum:
    """A gradient summed over row chunks as they come, so that one total is alive at a time rather than every
    chunk's part. `sums` says in what: 'float32' (default), a running fp32 total, so that chunking costs no
    precision; 'same', a total in the parts' own dtype (bf16 or fp16: half the memory of an fp32 total, one
    rounding per chunk)."""

    def __init__(self, sums: str = "float32") -> None:
        if sums not in ("float32", "same"):
            raise ValueError(f"ChunkSum sums in 'float32' or 'same', got {sums!r}")
        self._fp32 = sums == "float32"
        self._dtype: torch.dtype | None = None  # the parts' dtype; None until the first part
        self._first: torch.Tensor | None = None  # the only part so far, not ours to update
        self._total: torch.Tensor | None = None  # ours, updated in place

    def add(self, part: torch.Tensor) -> None:
        if self._dtype is None:
            self._dtype, self._first = part.dtype, part
            return
        self._start_total()
        self._total.add_(part)

    def add_matmul(self, a: torch.Tensor, b: torch.Tensor, transpose: str = "none", accumulate=None) -> None:
        """add(finish.matmul(a, b, transpose)). On a GPU the GEMM writes the total and then accumulates into it
        (cuBLAS: bf16/fp16 operands, C = A @ B + C computed in fp32, C in fp32 as Megatron's gradient
        accumulation fusion does, or in the operands' dtype), so that no chunk's product is written out and
        added in another pass. `accumulate(a, b, total)`, where given, returns total + a @ b for a total in the
        operands' dtype, written over it where it can (a generated kernel, which overlaps the total's read and
        write with its GEMM where cuBLAS does not; under torch.compile or autograd, its op makes a new tensor):
        every part after the first goes through it, on any device, when the sum is 'same'."""
        a = a.T if transpose == "a" else a
        b = b.T if transpose == "b" else b
        if accumulate is not None and not self._fp32 and self._dtype is not None:
            self._start_total()
            self._total = accumulate(a, b, self._total)
        elif not (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)):
            self.add(torch.matmul(a, b))
        elif self._dtype is None:  # the first part is the total, made here: ours to update in place
            self._dtype = a.dtype
            self._total = torch.mm(a, b, out_dtype=torch.float32) if self._fp32 else torch.mm(a, b)
        elif self._fp32:
            self._start_total()
            torch.addmm(self._total, a, b, out_dtype=torch.float32, out=self._total)
        else:
            self._start_total()
            self._total.addmm_(a, b)

    def _start_total(self) -> None:
        if self._total is None:
            self._total = self._first.float() if self._fp32 else self._first.clone()
            self._first = None

    def result(self) -> torch.Tensor:
        """The sum, in the parts' dtype; a single part as it is."""
        return self._first if self._total is None else self._total.to(self._dtype)


def reset_parameters(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 3  # the interpreter: few programs, so that persistent grids walk over several tiles in tests
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _tma_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_layout(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these tensors, alignment of their base aside: a Hopper GPU (or
    the interpreter), a contiguous last dimension and 16-byte aligned rows."""
    if not (INTERPRETED or _tma_device(tensors[0].device)):
        return False
    return all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.numel() > 0 for t in tensors)


def aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


_CONFIG_TYPES = tuple(CONFIGS.values())  # TlConfig first


def signature(tensors, config) -> tuple | None:
    """What a launch plan depends on: types, shapes, strides, dtypes and devices of the arguments, whether their
    addresses are all 16-byte aligned (a tuning table's Hopper kernel reads through TMA, which needs it: a view at
    an odd offset gets a plan of its own, with the tl kernel), and the config. None when an argument is not a
    tensor: no plan has that key, and making one says which."""
    if config is not None and type(config) not in _CONFIG_TYPES:
        raise TypeError(f"config must be a codagen.runtime.Config (TlConfig), a config of another backend "
                        f"({', '.join(t.__name__ for t in _CONFIG_TYPES[1:])}) or None, got {type(config).__name__}")
    try:
        return (config, _all_aligned(tensors), *[(type(t), t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    except AttributeError:
        return None


def _all_aligned(tensors) -> bool | None:
    try:
        return aligned(*tensors)
    except RuntimeError:  # no storage to point to (torch.compile's fake tensors): their plans are not launched
        return None


def bind_once(bound: dict, kernel: str, decls, values: dict, **options) -> tuple[dict, torch.dtype, torch.device]:
    """bind(kernel, decls, values, **options), checked once per signature of the values and kept in `bound` (a
    generated module's own dict): its result follows from the signature alone, and an allocation before each
    launch would otherwise check the same tensors again at every call."""
    key = signature(tuple(values.values()), None)
    try:
        found = bound.get(key) if key is not None else None
    except TypeError:  # symbolic sizes (torch.compile's dynamic shapes) have no hash: check them each time
        key = found = None
    if found is None:
        found = bind(kernel, decls, values, **options)
        if key is not None:
            bound[key] = found
    return found


def check_storage(kernel: str, values: dict) -> None:
    """Kernels read and write memory directly: refuse tensors without storage of their own, such as the
    sharded DTensor parameters of FSDP2 outside the module that gathers them (their data pointer is 0)."""
    for name, t in values.items():
        try:
            ptr = t.data_ptr()
        except RuntimeError:
            ptr = 0
        if t.numel() and ptr == 0:
            raise ValueError(f"{kernel}: '{name}' has no storage of its own ({type(t).__name__}); pass a plain "
                             "tensor, e.g. a parameter inside the FSDP2 module that all-gathers it")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a launch that follows from the arguments' signature."""

    config: object  # the launch's config, of any backend (codagen.tileconfig.CONFIGS)
    device: torch.device
    m: int
    n: int
    k: int
    programs: int
    tma: bool
    even_k: bool
    upcast_dot: bool
    dot_precision: str
    int64: bool
    meta: dict
    aliasing: Aliasing  # the per-call check that outputs share no memory with other arguments

    @property
    def empty(self) -> bool:
        return self.m == 0 or self.n == 0

    @classmethod
    def make(cls, config, device: torch.device, t_dtype: torch.dtype, m: int, n: int, k: int, tensors,
             aliasing: Aliasing, gemm: tuple[int, int] | None = None) -> "LaunchPlan":
        if config.backend != "tl":  # the tl launcher hands the launch to that backend's module (backends.launch)
            return cls(config, device, m, n, k, programs=0, tma=False, even_k=False, upcast_dot=False,
                       dot_precision="", int64=False, meta={}, aliasing=aliasing)
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        operands = t_dtype if gemm is None else tensors[gemm[0]].dtype  # T, or FP8 (a kernel without T)
        dot = dot_settings(operands)
        if gemm is None:  # no K loop and no operand to share: no BLOCK_K, FLATTEN or GROUP_M
            meta = {k: v for k, v in config.meta().items() if k not in ("BLOCK_K", "FLATTEN", "GROUP_M")}
        else:
            meta = {**config.meta(), "num_stages": fitting_stages(config, operands, device)}
        return cls(
            config, device, m, n, k,
            programs=min(tiles, sm_count(device)) if config.persistent else tiles,
            tma=config.tma and gemm is not None and tma_layout(tensors[gemm[0]], tensors[gemm[1]]),
            even_k=k % config.block_k == 0,
            upcast_dot=dot["UPCAST_DOT"],
            dot_precision=dot["DOT_PRECISION"],
            int64=needs_int64(tensors),
            meta=meta,
            aliasing=aliasing,
        )


def fitting_stages(config: Config, t_dtype: torch.dtype, device: torch.device) -> int:
    """config.num_stages, or fewer where the tl kernel's pipelined operand tiles (num_stages - 1 of them) would not
    fit a program's shared memory in t_dtype: tables are tuned in bf16, and an fp32 launch that takes their entry
    (the nearest tuned shape, or the tl kernel in place of a Hopper one that refuses fp32) needs twice the bytes."""
    if device.type != "cuda":
        return config.num_stages
    per_stage = (config.block_m + config.block_n) * config.block_k * t_dtype.itemsize
    return max(2, min(config.num_stages, _shared_bytes(device) // per_stage + 1))


@functools.lru_cache(maxsize=None)
def _shared_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a call on these tensors: then a kernel's call goes to its op, which refuses it
    (kernels are not differentiable; eager calls otherwise skip the dispatcher)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))


def descriptor(t: torch.Tensor, rows: int, cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, cols])


_SAME_DEVICE = contextlib.nullcontext()
# Triton's interpreter patches triton.language process-wide while it runs a kernel: one launch at a time
_INTERPRETER = threading.RLock()


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device. Under the interpreter,
    launches from several threads take turns."""
    if INTERPRETED:
        return _INTERPRETER
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)
