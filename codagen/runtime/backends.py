"""The backends a tl kernel's launcher dispatches to by its config's `backend`, as launches and tuning see them: a
`Backend` record each in BACKENDS, with its config type (codagen.tileconfig.CONFIGS). "tl", the kernel itself
(TlConfig: with its own mainloop, or over cuBLAS's product, mainloop "cublas", cublas_product); "gluon", the Hopper
backend's kernel of the same spec (HopperConfig; generated/kernels/gluon/<name>.py, for kernels it lowers). What
generated launchers call to launch (`launch`),
check (`check_tl_only`) and fall back between them (`or_tl`), and what run-time tuning and `codagen tune` ask of
each: whether it lowers a kernel and runs on this device (`running`), its run-time candidate (`candidates`)."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from ..tileconfig import cublas_pays  # noqa: F401 (re-exported: what tuning asks of mainloop "cublas")
from .configs import CONFIGS, TileConfig, TlConfig, fits_group

log = logging.getLogger("codagen.tune")


@dataclass(frozen=True)
class Backend:
    """A backend at run time; its generator side is the record of the same name in codagen/emit/backends.py."""

    name: str  # as its config type's `backend` names it (codagen.tileconfig.CONFIGS)
    # the subpackage of a generated kernels package that holds its modules, <package>.<folder>.<kernel>, each with
    # `launch` (the tl launcher's arguments) and `check_launch(tensors, config)`; None: the tl modules themselves
    folder: str | None
    runs: Callable[[torch.device], bool]  # whether this device runs its kernels
    # its kernel's default for one of its modules, a config of its type: its run-time candidate
    default: Callable[[ModuleType], TileConfig] | None = None

    @property
    def config(self) -> type:
        """Its config type (codagen.tileconfig.CONFIGS), which checks its own fields and says what its kernel
        needs of a GPU (operand_bytes), whether it pays at a shape (pays), and the tl kernel's config of the same
        tile (as_tl)."""
        return CONFIGS[self.name]

    def module(self, package: str, kernel: str) -> ModuleType:
        """A kernel's module of this backend, imported at its first use (a backend's modules may import what only
        its devices have, as the Hopper modules import Triton's Gluon)."""
        return importlib.import_module(f"{package}.{self.folder}.{kernel}")

    def lowers(self, package: str, kernel: str) -> bool:
        """Whether the generator wrote a module of this kernel for this backend (it lowers the kernel)."""
        return self.folder is None or importlib.util.find_spec(f"{package}.{self.folder}.{kernel}") is not None


def _hopper_runs(device: torch.device) -> bool:
    """Whether the Hopper kernels can run here: an sm_90 GPU, not the interpreter, and a Triton with Gluon."""
    from . import INTERPRETED

    return (not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and importlib.util.find_spec("triton.experimental.gluon") is not None)


def _hopper_default(module: ModuleType) -> TileConfig:
    """The Hopper kernel's own default configuration (gluon_hopper.default_config of its epilogue: 128x128 tiles,
    as many operand stages as fit)."""
    from . import gluon_hopper

    return gluon_hopper.default_config(module.EPILOGUE)


TL = Backend("tl", folder=None, runs=lambda device: True)
GLUON = Backend("gluon", folder="gluon", runs=_hopper_runs, default=_hopper_default)
BACKENDS: tuple[Backend, ...] = (TL, GLUON)


def backend(name: str) -> Backend:
    return next(b for b in BACKENDS if b.name == name)


def launch(package: str, kernel: str, /, **arguments) -> None:
    """Launch a kernel's module of the backend its config names (a config of a backend other than tl), with the
    tl launcher's arguments."""
    backend(arguments["config"].backend).module(package, kernel).launch(**arguments)


def or_tl(package: str, kernel: str, config: TileConfig, tensors) -> TileConfig:
    """A tuning table's choice of another backend's kernel, or the tl kernel with the same tile shape (the config's
    as_tl) where that kernel refuses these tensors (a dtype, or strides TMA cannot address, that the table was not
    tuned on)."""
    chosen = backend(config.backend)
    try:
        chosen.module(package, kernel).check_launch(tensors, config)
    except ValueError as e:
        log.info("codagen: %s: the tuning table chose the %s kernel, which refuses these arguments (%s); "
                 "running the tl kernel", kernel, chosen.name, e)
        return config.as_tl()
    return config


FP8_MIN_BLOCK_K = 32  # the K of one FP8 MMA (wgmma and mma on sm_89+): Triton's tl.dot takes no less


def check_tl_only(kernel: str, config: TileConfig, gemm: bool = True, fp8_gemm: str | None = None) -> None:
    """Refuse, for a kernel that no other backend lowers, a config that asks for another backend's kernel; and
    for a kernel without a GEMM, or whose GEMM has FP8 operands (`fp8_gemm`: where the spec declares that GEMM,
    file:line:col), one that asks for cuBLAS's product."""
    if config.backend != "tl":
        raise ValueError(f"{kernel}: {type(config).__name__}, the {config.backend} backend's config, but that backend "
                         f"does not lower this kernel (generated/kernels/{backend(config.backend).folder}/__init__.py "
                         "says why); use a Config (TlConfig)")
    if config.mainloop == "cublas" and not gemm:
        raise ValueError(f"{kernel}: Config(mainloop='cublas') makes a GEMM's product with torch.mm, but this kernel "
                         "has no GEMM; use mainloop='triton'")
    if config.mainloop == "cublas" and fp8_gemm:
        raise ValueError(f"{kernel}: Config(mainloop='cublas') makes the GEMM's product with torch.mm, which takes no "
                         f"FP8 operands, and the GEMM at {fp8_gemm} has FP8 operands (torch._scaled_mm is not "
                         "used yet); use mainloop='triton'")
    if fp8_gemm and config.block_k < FP8_MIN_BLOCK_K:
        raise ValueError(f"{kernel}: Config(block_k={config.block_k}), but the GEMM at {fp8_gemm} has FP8 operands, "
                         f"whose MMAs take K steps of {FP8_MIN_BLOCK_K} or more (Triton refuses a smaller tl.dot on "
                         f"GPUs); use block_k={FP8_MIN_BLOCK_K} or more")


def running(package: str, kernel: str, device: torch.device) -> tuple[Backend, ...]:
    """The backends besides tl that lower this kernel (of the generated `package`) and that this device runs:
    whose kernels run-time tuning and `codagen tune` time beside the tl kernel's."""
    return tuple(b for b in BACKENDS if b is not TL and b.runs(device) and b.lowers(package, kernel))


def candidates(package: str, kernel: str, device: torch.device, default: TlConfig, tile_dependent: bool, group,
               n) -> list[TileConfig]:
    """The run-time candidates of the other backends that run this kernel here (`running`): each one's default
    (none where its slices would split column groups); for a kernel whose outputs depend on the tile shape, with
    the tl default's tile and epilogue split, as the tl candidates (configs.runtime_candidates)."""
    return [c for b in running(package, kernel, device)
            for c in [_candidate(b, package, kernel, default, tile_dependent, group, n)] if c is not None]


def _candidate(b: Backend, package: str, kernel: str, default: TlConfig, tile_dependent: bool, group,
               n) -> TileConfig | None:
    try:
        config = b.default(b.module(package, kernel))
    except Exception as e:  # noqa: BLE001 - as a candidate that fails to compile: the tl candidates remain
        log.info("codagen: %s: the %s kernel is not a run-time candidate: %s", kernel, b.name, e)
        return None
    if tile_dependent:
        config = dataclasses.replace(config, block_m=default.block_m, block_n=default.block_n,
                                     epilogue_split=default.epilogue_split)
    return config if fits_group(config, group, n) else None


def hopper_default(package: str, kernel: str) -> TileConfig:
    """The Hopper kernel's default of a kernel (a HopperConfig)."""
    return GLUON.default(GLUON.module(package, kernel))


def cublas_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for mainloop "cublas": bf16 and fp16 operands through cuBLAS with an fp32 output (no rounding
    of the product to their dtype before the epilogue, as in the fused kernel); elsewhere in fp32."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())
