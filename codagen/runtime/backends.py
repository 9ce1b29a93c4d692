"""The backends a tl kernel's launcher dispatches to by its config's `backend` (codagen.tileconfig.BACKENDS): "tl",
the kernel itself (with its own mainloop, or over torch.mm's product: Config.mainloop "cublas"); "gluon", the Hopper
backend's kernel of the same spec (generated/kernels/gluon/<name>.py, for kernels it lowers). What generated
launchers call to launch, check and fall back between them, and the candidates each adds to run-time tuning."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging

import torch

from .configs import Config, fits_group

log = logging.getLogger("codagen.tune")


def launch_hopper(package: str, kernel: str, /, **arguments) -> None:
    """Launch a kernel's Hopper module, <package>.gluon.<kernel>, for a config whose backend is "gluon". The
    module is imported at the first such launch only: it imports Triton's Gluon (and refuses all but sm_90)."""
    importlib.import_module(f"{package}.gluon.{kernel}").launch(**arguments)


def hopper_default(package: str, kernel: str) -> Config:
    """The Hopper kernel's own default configuration (gluon_hopper.default_config of its epilogue: 128x128 tiles,
    as many operand stages as fit), as a tl launcher's Config whose backend is "gluon"."""
    from . import gluon_hopper

    h = gluon_hopper.default_config(importlib.import_module(f"{package}.gluon.{kernel}").EPILOGUE)
    return Config(h.block_m, h.block_n, h.block_k, h.group_m, num_warps=4, num_stages=h.stages,
                  epilogue_split=h.epilogue_split, backend="gluon")


def hopper_or_tl(package: str, kernel: str, config: Config, tensors) -> Config:
    """A tuning table's choice of the Hopper kernel, or the tl kernel with the same tile shape where the Hopper
    kernel refuses these tensors (a dtype, or strides TMA cannot address, that the table was not tuned on)."""
    try:
        importlib.import_module(f"{package}.gluon.{kernel}").check_launch(tensors, config)
    except ValueError as e:
        log.info("codagen: %s: the tuning table chose the Hopper kernel, which refuses these arguments (%s); "
                 "running the tl kernel", kernel, e)
        return dataclasses.replace(config, backend="tl", epilogue_stages=None, direct_stores=False,
                                   slice_loop=False, slice_unroll=1, consumers=2)
    return config


def check_tl_only(kernel: str, config: Config, gemm: bool = True) -> None:
    """Refuse, for a kernel that the Hopper backend does not lower, a config that asks for its kernel; and for a
    kernel without a GEMM, one that asks for cuBLAS's product."""
    if config.backend == "gluon":
        raise ValueError(f"{kernel}: Config(backend='gluon'), but the Hopper backend does not lower this kernel "
                         "(generated/kernels/gluon/__init__.py says why); use backend='tl'")
    if config.mainloop == "cublas" and not gemm:
        raise ValueError(f"{kernel}: Config(mainloop='cublas') makes a GEMM's product with torch.mm, but this kernel "
                         "has no GEMM; use mainloop='triton'")


def cublas_pays(m: int, n: int, k: int) -> bool:
    """Whether mainloop "cublas" is worth timing at an [m, n] x k GEMM: K at least 8 times M and N, as the LM head's
    input gradient over a chunk of rows (1280 x 2048 x 128256), where the fp32 product's extra write and read are
    a few percent of the GEMM's time and memory, and cuBLAS's split-K fills SMs that one program per output tile
    leaves idle (norm_dgrad at 1280 x 2048: 80 tiles of 128x256 for the H200's 132 SMs)."""
    return k >= 8 * max(m, n)


def cublas_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for mainloop "cublas": bf16 and fp16 operands through cuBLAS with an fp32 output (no rounding
    of the product to their dtype before the epilogue, as in the fused kernel); elsewhere in fp32."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def hopper_runs(device: torch.device) -> bool:
    """Whether the Hopper kernels can run here: an sm_90 GPU, not the interpreter, and a Triton with Gluon."""
    from . import INTERPRETED

    return (not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and importlib.util.find_spec("triton.experimental.gluon") is not None)


def hopper_candidates(package: str, kernel: str, default: Config, tile_dependent: bool, group, n) -> list[Config]:
    """The Hopper kernel's default as a run-time candidate (none where its slices would split column groups);
    for a kernel whose outputs depend on the tile shape, with the default's tile and epilogue split, as the tl
    candidates (runtime_candidates)."""
    try:
        config = hopper_default(package, kernel)
    except Exception as e:  # noqa: BLE001 - as a candidate that fails to compile: the tl candidates remain
        log.info("codagen: %s: the Hopper kernel is not a run-time candidate: %s", kernel, e)
        return []
    if tile_dependent:
        config = dataclasses.replace(config, block_m=default.block_m, block_n=default.block_n,
                                     epilogue_split=default.epilogue_split)
    return [config] if fits_group(config, group, n) else []
