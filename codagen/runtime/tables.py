"""The committed tuning tables at run time: generated/tuning/<gpu>/<kernel>.json (`codagen tune` writes them), read
once per process, and the entry a launch takes: its own shape's, else the nearest tuned one."""
from __future__ import annotations

import functools
import logging
import math
import re
from pathlib import Path

import torch

from .. import tablefile
from ..tileconfig import TileConfig, fits_group

log = logging.getLogger("codagen.tune")


@functools.lru_cache(maxsize=None)
def gpu_key(device: torch.device) -> str:
    """Folder name of a GPU's tuning tables: its marketing name in lowercase, e.g. 'nvidia-h200'."""
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(m: int, n: int, k: int) -> str:
    """A tuning table's key: the tuned shape itself, 'MxNxK' (K is 0 for kernels without a GEMM). Tables hold
    the few token counts and row chunks that were tuned, each its own entry (1280- and 2048-row chunks of the
    LM head alike); a launch at another M takes the nearest (nearest_tuned)."""
    return f"{int(m)}x{int(n)}x{int(k)}"


def shape_bucket(m: int, n: int, k: int) -> str:
    """Run-time tuning tunes once per bucket: M rounded up to a power of two (token counts vary from batch to
    batch), the exact N and K (model widths do not)."""
    return f"{1 << max(int(m) - 1, 0).bit_length()}x{int(n)}x{int(k)}"


def nearest_tuned(table: dict, key: str, other_widths: bool = False,
                  fits=lambda config: True) -> TileConfig | None:
    """For a shape that was not tuned: the entry of the same N and K whose M is nearest (by ratio; between two
    as near, the larger), or with `other_widths`, the entry nearest in M, N and K together; only entries
    for which fits(config) holds. Tables hold a few token counts per model width, and a configuration tuned
    at 8k tokens serves 4k far better than the untuned default (which spills in the kernels with heavy
    epilogues, and which kernels with tile-shaped partial sums cannot leave at run time)."""
    want = [math.log2(max(int(d), 1)) for d in key.split("x")]
    near = []
    for tuned, config in table.items():
        have = [math.log2(max(int(d), 1)) for d in tuned.split("x")]
        if (other_widths or have[1:] == want[1:]) and fits(config):
            near.append((sum(abs(h - w) for h, w in zip(have, want)), -have[0], tuned))
    return table[min(near)[2]] if near else None


def table_path(tuning_dir: Path, gpu: str, kernel: str) -> Path:
    return Path(tuning_dir) / gpu / f"{kernel}.json"


@functools.lru_cache(maxsize=None)
def entries(path: str, fingerprint: str, triton_version: str, group=None, gemm: bool | None = None,
            cublas: bool = True, k_group: int | None = None) -> dict:
    """The committed table's entries (shape -> config) when it was tuned for this computation and Triton, else none.
    A file that is no tuning table, and entries that no launch of a kernel of column_group `group` (with a GEMM or
    not; `cublas`: whose GEMM torch.mm can make; `k_group`: the K group of its K-group scales) can use, are skipped
    with one warning naming the file (read once per process): the launch runs as without them."""
    try:
        table = tablefile.read_table(Path(path), group, gemm, cublas, k_group)
    except FileNotFoundError:
        return {}
    except tablefile.TableError as e:
        log.warning("codagen: %s; not used, as if there were no table", e)
        return {}
    if table.data.get("fingerprint") != fingerprint or table.data.get("triton") != triton_version:
        return {}  # tuned for another computation or another Triton: use the defaults
    if table.bad:
        more = f" (and {len(table.bad) - 1} more entries of it)" if len(table.bad) > 1 else ""
        log.warning("codagen: %s%s; skipped, as if the table did not hold them", table.bad[0], more)
    return table.entries


@functools.lru_cache(maxsize=None)
def lookup(kernel: str, fingerprint: str, tuning_dir: Path, gpu: str, m: int, n: int, k: int, group,
           tile_dependent: bool, triton_version: str, cublas: bool = True, k_group: int | None = None
           ) -> TileConfig | None:
    """The committed table's configuration for this launch (pick_config), or None: looked up once per launch shape,
    also where the answer is none (a shape run-time tuning has not chosen for yet asks again at every launch)."""
    table = entries(str(table_path(tuning_dir, gpu, kernel)), fingerprint, triton_version, group, k > 0, cublas,
                    k_group)
    shape = shape_key(m, n, k)
    fits = lambda config: fits_group(config, group, n)  # noqa: E731
    hit = table.get(shape) or nearest_tuned(table, shape, fits=fits)
    if hit is None and tile_dependent:  # run-time tuning could not change the tile: a tuned one of other widths
        hit = nearest_tuned(table, shape, other_widths=True, fits=fits)
    return hit


def clear_caches() -> None:
    """Forget the tables read and the entries looked up in this process; the files themselves stay."""
    entries.cache_clear()
    lookup.cache_clear()
