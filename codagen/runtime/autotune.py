"""Which configuration a launch runs (pick_config): the committed tuning table of this GPU when it has the shape and
was tuned for what the kernel computes (its fingerprint) with this Triton (`codagen tune` writes
generated/tuning/<gpu>/<kernel>.json; tables reads them); otherwise, once per shape bucket, the fastest of a few
built-in candidates (configs.runtime_candidates, and each backend's: backends), timed on the launch itself, in this
process or an earlier one (tuning_cache keeps the choices in the user's cache folder); otherwise the default.

CODAGEN_NO_TUNE=1 always gives the default: no table, no tuning at run time (reproducible baselines)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from .. import dims
from . import backends, tables, tuning_cache
from .configs import (INTERPRETER_DEFAULT, TileConfig, fits_k_group, gpu_default, gpu_k_group_default,
                      runtime_candidates, widened, with_k_group)

log = logging.getLogger("codagen.tune")


@functools.lru_cache(maxsize=None)
def _saved(path: str, fingerprint: str, triton_version: str) -> dict:
    """What earlier processes' run-time tuning chose (bucket -> config), read once per process."""
    return tuning_cache.read(Path(path), fingerprint, triton_version)


_tuned: dict[tuple, TileConfig] = {}  # (kernel, fingerprint, gpu, bucket) -> what run-time tuning chose
_picked: dict[tuple, TileConfig] = {}  # pick_config's arguments -> its final answer for them
_tuning = threading.Lock()


def clear_caches() -> None:
    """Forget the tables and tuning cache files read and the configurations tuned in this process (after
    `codagen tune` wrote tables, and in tests); the files themselves stay."""
    tables.clear_caches()
    _saved.cache_clear()
    _tuned.clear()
    _picked.clear()


def _on_gpu(device: torch.device) -> bool:
    """Whether tables and tuning apply: a real CUDA device, not the interpreter."""
    from . import INTERPRETED

    return not INTERPRETED and device.type == "cuda"


def _may_tune() -> bool:
    """Trial launches would be recorded into a CUDA graph being captured, and torch.compile must not see
    them (nor time anything while it traces): then the default is used, and not remembered."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def measure(run: Callable[[TileConfig], None], config: TileConfig) -> float:
    """Milliseconds per launch of `run(config)` on the current stream: one launch to compile and warm up,
    one to size the loop, then about 10 ms of launches. Replaced by a fake timer in tests."""
    run(config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(config)
    end.record()
    end.synchronize()
    reps = max(1, min(20, int(10.0 / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(reps):
        run(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _tune(kernel: str, bucket: str, candidates: list[TileConfig],
          run: Callable[[TileConfig], None]) -> TileConfig | None:
    """The fastest candidate, timed by `measure` on the caller's own arguments; a candidate that fails
    (does not compile, needs more shared memory than there is) is skipped. None if all fail."""
    timings = []
    for config in candidates:
        try:
            timings.append((measure(run, config), config))
        except Exception as e:  # noqa: BLE001 - any failure rules the candidate out; the launch reports its own
            log.info("codagen: %s %s: candidate %s failed: %s", kernel, bucket, config.label(), e)
    if not timings:
        return None
    ms, best = min(timings, key=lambda t: t[0])  # min keeps the first of equal times: the default's
    log.info("codagen: %s %s is not in the tuning table; tuned in this process: %s (%.3f ms); "
             "`codagen tune` commits a table, CODAGEN_NO_TUNE=1 skips this", kernel, bucket, best.label(), ms)
    return best


def _aliased(decls, values: dict) -> bool:
    """Whether an output shares memory with an input (a launch that updates x in place through x_out=x):
    then a second launch would read its own results."""
    inputs = {t.untyped_storage().data_ptr() for d in decls if not d.output
              for t in [values.get(d.name)] if isinstance(t, torch.Tensor)}
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs
               for d in decls if d.output for t in [values.get(d.name)])


def pick_config(kernel: str, fingerprint: str, tuning_dir: Path, m, n, k, device: torch.device, group=None, *,
                run: Callable[[TileConfig], None] | None = None, decls=None, values: dict | None = None,
                split: int = 1, package: str | None = None, cublas: bool = True, k_group: int | None = None
                ) -> TileConfig:
    """The configuration of a launch of `kernel` on an [m, n] (x k) problem. `fingerprint` (the generated
    module's FINGERPRINT) says what the kernel computes: a table tuned for another computation is not used.

    A token count the table lacks takes the table's entry at the nearest one of the same N and K
    (nearest_tuned); widths it lacks, for a kernel whose outputs depend on the tile shape (or without
    `decls`), the nearest entry of other widths. `run(config)` launches the kernel on the caller's arguments
    with `config`; given, another shape is tuned on those arguments once per process, unless an earlier process
    tuned its bucket (tuning_cache keeps the choice). Pass it only when every output is overwritten by a launch
    (no `inplace` outputs: an accumulation would be applied once per trial).
    `decls` (the module's DECLS) says whether outputs depend on the tile shape (without it, tuning keeps the
    default tile shape) and, with `values` (name -> tensor), whether an output aliases an input (then there is
    no tuning). `group`: the kernel's column_group, which every epilogue slice must hold whole (defaults are
    widened to it); "N": one slice must span the n columns. `split`: the epilogue split of the kernel's default
    and of its run-time candidates on a GPU (codagen.emit.kernel.gpu_default_split: 4 where the whole tile's
    epilogue would spill). `package`: the generated package of a kernel that other backends lower; run-time
    tuning tries the default of each that runs here too (backends.candidates). `cublas`: whether mainloop
    "cublas" is a candidate where it may pay (not for FP8 operands, which torch.mm does not take). `k_group`: the
    GEMM's K-group scales have this many columns of K per scale (gemm.scales): every K step must lie within one
    group, so the defaults take a block_k of at most k_group, a candidate or a table's entry with a larger one is
    left out."""
    if not _on_gpu(device):
        return with_k_group(widened(INTERPRETER_DEFAULT, group, n), k_group)
    if os.environ.get("CODAGEN_NO_TUNE") == "1":
        return gpu_k_group_default(gpu_default(group, n, split), k_group)
    # a launch's arguments decide its configuration once the table or tuning has it: the look-ups below cost
    # hundreds of microseconds of host time, on every launch of a training step
    launch = (kernel, fingerprint, tuning_dir, int(m), int(n), int(k), device, group, split, decls is None, k_group)
    picked = _picked.get(launch)
    if picked is not None:
        return picked
    import triton

    gpu = tables.gpu_key(device)
    tile_dependent = decls is None or _tile_dependent(decls)
    hit = tables.lookup(kernel, fingerprint, tuning_dir, gpu, int(m), int(n), int(k), group, tile_dependent,
                        triton.__version__, cublas, k_group)
    if hit is not None:
        _picked[launch] = hit
        return hit
    default = gpu_k_group_default(gpu_default(group, n, split), k_group)
    bucket = tables.shape_bucket(m, n, k)
    key = (kernel, fingerprint, gpu, bucket)
    pool = functools.partial(_candidates, kernel, m, n, k, device, default, tile_dependent, group, split, package,
                             cublas, k_group)
    saved = tuning_cache.cache_file(gpu, kernel)
    hit = _tuned.get(key)
    if hit is None and saved is not None:
        earlier = _saved(str(saved), fingerprint, triton.__version__).get(bucket)
        # one outside this launch's candidates was chosen by another codagen version, and may not suit its launch
        if earlier is not None and earlier in pool():
            hit = _tuned[key] = earlier
    if hit is not None:
        _picked[launch] = hit
        return hit
    if run is None or not _may_tune():
        return default  # for now: tuning may choose another later
    if values is not None and _aliased(decls or (), values):
        return default  # trial launches would read what the previous ones wrote
    with _tuning:
        if key not in _tuned:
            best = _tune(kernel, bucket, pool(), run)
            _tuned[key] = best or default  # all failed: the default, whose launch raises the error for the caller
            if best is not None and saved is not None:
                tuning_cache.write(saved, kernel, gpu, fingerprint, triton.__version__, bucket, best)
    _picked[launch] = _tuned[key]
    return _tuned[key]


@functools.lru_cache(maxsize=None)
def _tile_dependent(decls) -> bool:
    return any(dims.is_tiles(d) for decl in decls for d in decl.dims)


def _candidates(kernel: str, m: int, n: int, k: int, device: torch.device, default: TileConfig,
                tile_dependent: bool, group, split: int, package: str | None, cublas: bool = True,
                k_group: int | None = None) -> list[TileConfig]:
    """What run-time tuning times at this launch (see pick_config for the arguments)."""
    pool = runtime_candidates(bool(k), tile_dependent, group, n, split, default)
    if k and not cublas:  # FP8 operands, a byte an element: BK 128 fills a stage as bf16's BK 64 does
        pool = [dataclasses.replace(c, block_k=2 * c.block_k) for c in pool] + pool
    pool = [c for c in pool if fits_k_group(c, k_group)] or [default]
    if k_group:  # the K-group default (gpu_k_group_default) first, so that ties keep it
        pool = list(dict.fromkeys([default, *pool]))
    if k and cublas and backends.cublas_pays(m, n, k):  # the default's tile, its epilogue after cuBLAS's product
        pool.append(dataclasses.replace(default, mainloop="cublas", persistent=False, tma=False, flatten=False,
                                        warp_specialize=False))
    if package is not None:
        pool += backends.candidates(package, kernel, device, default, tile_dependent, group, n)
    return pool
