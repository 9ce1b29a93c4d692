"""Tile configurations: the committed tuning table of this GPU when it has the shape and was tuned for what the
kernel computes (its fingerprint) with this Triton (`codagen tune` writes generated/tuning/<gpu>/<kernel>.json);
otherwise, once per shape bucket, the fastest of a few built-in candidates, timed on the launch itself, in this
process or an earlier one (tuning_cache keeps the choices in the user's cache folder); otherwise the default.

CODAGEN_NO_TUNE=1 always gives the default: no table, no tuning at run time (reproducible baselines)."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import os
import re
import threading
from pathlib import Path
from typing import Callable

import torch

from .. import tablefile
from ..tileconfig import BACKENDS, MAX_BLOCK, MIN_BLOCK, Config, epilogue_label, fits_group  # noqa: F401 (re-exported)

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


def _row_width(n: int) -> int:
    """The narrowest tile width that spans n columns."""
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


def widened(config: Config, group: int | str | None, n: int | None = None) -> Config:
    """A default config made wide enough for column groups: block_n the smallest multiple of the group width
    per epilogue slice that is at least its own; for group "N", the narrowest that spans the row (unchanged
    when none does: the launch then says so)."""
    if fits_group(config, group, n):
        return config
    if group == "N":
        block_n = _row_width(n) * config.epilogue_split
        return dataclasses.replace(config, block_n=block_n) if block_n <= MAX_BLOCK else config
    block_n = max(config.block_n, group * config.epilogue_split)
    if block_n > MAX_BLOCK:  # slices of whole groups would be too wide a tile: the epilogue on the whole tile
        return dataclasses.replace(config, block_n=max(config.block_n, group), epilogue_split=1)
    return dataclasses.replace(config, block_n=block_n)


def check_group(kernel: str, config: Config, group: int | str, n: int) -> None:
    """Refuse a config whose epilogue slices would cut a column group in two (or, for group "N", the row)."""
    if fits_group(config, group, n):
        return
    split = f" / epilogue_split {config.epilogue_split}" if config.epilogue_split > 1 else ""
    at_a_time = (f"{kernel}: the config's epilogue runs on {config.epilogue_n} columns at a time (block_n "
                 f"{config.block_n}{split})")
    if group != "N":
        raise ValueError(f"{at_a_time}, which is not a multiple of the spec's column_group {group}; use a block_n "
                         f"of {group * config.epilogue_split} or more")
    if _row_width(n) > MAX_BLOCK:
        raise ValueError(f"{kernel}: N = {n} is wider than the widest tile ({MAX_BLOCK} columns), and the spec's "
                         "column_group N needs one tile over the whole row")
    raise ValueError(f"{at_a_time}, fewer than N = {n}, and the spec's column_group N needs one tile over the "
                     f"whole row; use a block_n of {_row_width(n) * config.epilogue_split} or more")


def check_tl_only(kernel: str, config: Config, gemm: bool = True) -> None:
    """Refuse, for a kernel that the Hopper backend does not lower, a config that asks for its kernel; and for a
    kernel without a GEMM, one that asks for torch.mm's."""
    if config.backend == "gluon":
        raise ValueError(f"{kernel}: Config(backend='gluon'), but the Hopper backend does not lower this kernel "
                         "(generated/kernels/gluon/__init__.py says why); use backend='tl'")
    if config.backend == "mm" and not gemm:
        raise ValueError(f"{kernel}: Config(backend='mm') makes a GEMM's product with torch.mm, but this kernel has "
                         "no GEMM; use backend='tl'")


def mm_pays(m: int, n: int, k: int) -> bool:
    """Whether backend "mm" is worth timing at an [m, n] x k GEMM: K at least 8 times M and N, as the LM head's
    input gradient over a chunk of rows (1280 x 2048 x 128256), where the fp32 product's extra write and read are
    a few percent of the GEMM's time and memory, and cuBLAS's split-K fills SMs that one program per output tile
    leaves idle (norm_dgrad at 1280 x 2048: 80 tiles of 128x256 for the H200's 132 SMs)."""
    return k >= 8 * max(m, n)


def mm_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for backend "mm": bf16 and fp16 operands through cuBLAS with an fp32 output (no rounding
    of the product to their dtype before the epilogue, as in the fused kernel); elsewhere in fp32."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def hopper_runs(device: torch.device) -> bool:
    """Whether the Hopper kernels can run here: an sm_90 GPU, not the interpreter, and a Triton with Gluon."""
    from . import INTERPRETED

    return (not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and importlib.util.find_spec("triton.experimental.gluon") is not None)


# Under the interpreter each program is a numpy step: larger tiles mean fewer steps.
INTERPRETER_DEFAULT = Config(64, 64, 32, 8, 4, 1)
GPU_DEFAULT = Config(128, 128, 64, 8, 8, 3, persistent=True, tma=True)

# What an untuned shape tries at run time: few, since each costs a compile on the first call. GPU_DEFAULT
# comes first, so that ties keep it. A kernel whose outputs depend on the tile shape keeps GPU_DEFAULT's
# block_m x block_n and epilogue split (its op allocated the partial-reduction buffers for them before the
# launch), which leaves block_k, warps, stages and the grid to choose.
RUNTIME_GEMM_CANDIDATES = (
    GPU_DEFAULT,
    Config(128, 256, 64, 8, 8, 3, persistent=True, tma=True),  # the fastest plain mainloop measured
    Config(128, 128, 64, 8, 4, 4, persistent=True, tma=True),
    Config(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
    Config(128, 128, 64, 8, 8, 4, persistent=False, tma=True),  # fastest for heavy epilogues on the H200
)
RUNTIME_ELEMENTWISE_CANDIDATES = (  # no GEMM: only the tile shape and the warps matter
    GPU_DEFAULT,
    dataclasses.replace(GPU_DEFAULT, block_m=64, block_n=128, num_warps=4),
    dataclasses.replace(GPU_DEFAULT, block_m=64, block_n=256, num_warps=8),
    dataclasses.replace(GPU_DEFAULT, num_warps=4),
)


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


def nearest_tuned(table: dict, key: str, other_widths: bool = False, fits=lambda config: True) -> Config | None:
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
def _table(path: str, fingerprint: str, triton_version: str, group=None, gemm: bool | None = None) -> dict:
    """The committed table's entries (shape -> Config) when it was tuned for this computation and Triton, else none.
    A file that is no tuning table, and entries that no launch of a kernel of column_group `group` (with a GEMM or
    not) can use, are skipped with one warning naming the file (read once per process): the launch runs as
    without them."""
    try:
        table = tablefile.read_table(Path(path), group, gemm)
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
def _saved(path: str, fingerprint: str, triton_version: str) -> dict:
    """What earlier processes' run-time tuning chose (bucket -> Config), read once per process."""
    from . import tuning_cache  # it imports Config from here

    return tuning_cache.read(Path(path), fingerprint, triton_version)


_tuned: dict[tuple, Config] = {}  # (kernel, fingerprint, gpu, bucket) -> what run-time tuning chose
_picked: dict[tuple, Config] = {}  # pick_config's arguments -> its final answer for them
_tuning = threading.Lock()


def clear_caches() -> None:
    """Forget the tables and tuning cache files read and the configurations tuned in this process (after
    `codagen tune` wrote tables, and in tests); the files themselves stay."""
    _table.cache_clear()
    _saved.cache_clear()
    _from_table.cache_clear()
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


def measure(run: Callable[[Config], None], config: Config) -> float:
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


def runtime_candidates(has_gemm: bool, tile_dependent: bool, group: int | str | None = None,
                       n: int | None = None, split: int = 1) -> list[Config]:
    pool = RUNTIME_GEMM_CANDIDATES if has_gemm else RUNTIME_ELEMENTWISE_CANDIDATES
    default = gpu_default(group, n, split)
    if split != 1:
        pool = [dataclasses.replace(c, epilogue_split=split) for c in pool]
    if tile_dependent:
        pool = [dataclasses.replace(c, block_m=default.block_m, block_n=default.block_n,
                                    epilogue_split=default.epilogue_split) for c in pool]
    pool = [c for c in pool if fits_group(c, group, n)] or [default]
    return list(dict.fromkeys(pool))  # in order, without duplicates


def _tune(kernel: str, bucket: str, candidates: list[Config], run: Callable[[Config], None]) -> Config | None:
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


@functools.lru_cache(maxsize=None)
def gpu_default(group: int | str | None = None, n: int | None = None, split: int = 1) -> Config:
    """GPU_DEFAULT with a kernel's default epilogue split (its generated module's DEFAULT_SPLIT), widened to its
    column groups."""
    return widened(dataclasses.replace(GPU_DEFAULT, epilogue_split=split), group, n)


def pick_config(kernel: str, fingerprint: str, tuning_dir: Path, m, n, k, device: torch.device, group=None, *,
                run: Callable[[Config], None] | None = None, decls=None, values: dict | None = None,
                split: int = 1, package: str | None = None) -> Config:
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
    epilogue would spill). `package`: the generated package of a kernel the Hopper backend lowers; on an sm_90
    GPU, run-time tuning tries its Hopper kernel's default too (hopper_default)."""
    if not _on_gpu(device):
        return widened(INTERPRETER_DEFAULT, group, n)
    if os.environ.get("CODAGEN_NO_TUNE") == "1":
        return gpu_default(group, n, split)
    # a launch's arguments decide its configuration once the table or tuning has it: the look-ups below cost
    # hundreds of microseconds of host time, on every launch of a training step
    launch = (kernel, fingerprint, tuning_dir, int(m), int(n), int(k), device, group, split, decls is None)
    picked = _picked.get(launch)
    if picked is not None:
        return picked
    import triton

    gpu = gpu_key(device)
    tile_dependent = decls is None or _tile_dependent(decls)
    hit = _from_table(kernel, fingerprint, tuning_dir, gpu, int(m), int(n), int(k), group, tile_dependent,
                      triton.__version__)
    if hit is not None:
        _picked[launch] = hit
        return hit
    default = gpu_default(group, n, split)
    from . import tuning_cache  # it imports Config from here

    bucket = shape_bucket(m, n, k)
    key = (kernel, fingerprint, gpu, bucket)
    pool = functools.partial(_candidates, kernel, m, n, k, device, default, tile_dependent, group, split, package)
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
    return any(d.startswith("tiles(") for decl in decls for d in decl.dims)


@functools.lru_cache(maxsize=None)
def _from_table(kernel: str, fingerprint: str, tuning_dir: Path, gpu: str, m: int, n: int, k: int, group,
                tile_dependent: bool, triton_version: str) -> Config | None:
    """The committed table's configuration for this launch (pick_config), or None: looked up once per launch shape,
    also where the answer is none (a shape run-time tuning has not chosen for yet asks again at every launch)."""
    table = _table(str(table_path(tuning_dir, gpu, kernel)), fingerprint, triton_version, group, k > 0)
    shape = shape_key(m, n, k)
    fits = lambda config: fits_group(config, group, n)  # noqa: E731
    hit = table.get(shape) or nearest_tuned(table, shape, fits=fits)
    if hit is None and tile_dependent:  # run-time tuning could not change the tile: a tuned one of other widths
        hit = nearest_tuned(table, shape, other_widths=True, fits=fits)
    return hit


def _candidates(kernel: str, m: int, n: int, k: int, device: torch.device, default: Config, tile_dependent: bool,
                group, split: int, package: str | None) -> list[Config]:
    """What run-time tuning times at this launch (see pick_config for the arguments)."""
    pool = runtime_candidates(bool(k), tile_dependent, group, n, split)
    if k and mm_pays(m, n, k):  # the default's tile, its epilogue after torch.mm's product
        pool.append(dataclasses.replace(default, backend="mm", persistent=False, tma=False, flatten=False,
                                        warp_specialize=False))
    if package is not None and hopper_runs(device):
        pool += hopper_candidates(package, kernel, default, tile_dependent, group, n)
    return pool


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
