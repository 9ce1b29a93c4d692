"""Tile configurations: the committed tuning table for this GPU when it has the shape, else a default.
Nothing is tuned at run time unless a table lacks the shape (see codagen.tune)."""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Config:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # a grid of one program per SM, each walking over tiles
    tma: bool = False  # GEMM operands through TMA tensor descriptors (Hopper), where their layout allows

    def meta(self) -> dict:
        """Keyword arguments of a kernel launch."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def as_dict(self) -> dict:
        return asdict(self)


# Under the interpreter each program is a numpy step: larger tiles mean fewer steps.
INTERPRETER_DEFAULT = Config(64, 64, 32, 8, 4, 1)
GPU_DEFAULT = Config(128, 128, 64, 8, 8, 3, persistent=True, tma=True)


@functools.lru_cache(maxsize=None)
def gpu_key(device: torch.device) -> str:
    """Folder name of a GPU's tuning tables: its marketing name in lowercase, e.g. 'nvidia-h200'."""
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_bucket(m: int, n: int, k: int) -> str:
    """Tables are keyed by M rounded up to a power of two (token counts vary) and the exact N and K
    (model widths do not)."""
    return f"{1 << max(int(m) - 1, 0).bit_length()}x{int(n)}x{int(k)}"


@functools.lru_cache(maxsize=None)
def _table(path: str, sha256: str, triton_version: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if data.get("spec_sha256") != sha256 or data.get("triton") != triton_version:
        return {}  # tuned for another version of the spec or of Triton: use the defaults
    return {key: Config(**value["config"]) for key, value in data["shapes"].items()}


def pick_config(kernel: str, sha256: str, tuning_dir: Path, m, n, k, device: torch.device) -> Config:
    from . import INTERPRETED

    if INTERPRETED or device.type != "cuda":
        return INTERPRETER_DEFAULT
    if os.environ.get("CODAGEN_NO_TUNE") != "1":
        import triton

        table = _table(str(tuning_dir / gpu_key(device) / f"{kernel}.json"), sha256, triton.__version__)
        hit = table.get(shape_bucket(m, n, k))
        if hit is not None:
            return hit
    return GPU_DEFAULT
