"""Compile a tuning run's candidates before it times them, in parallel worker processes.

Triton compiles a kernel on one CPU core, and a Hopper kernel takes seconds (a minute or more for a sweep of
one kernel's candidates), while timing it takes a fraction of a second: compiling dominates a sweep. Each
worker launches one candidate once on the first rows of a shape, as the run's own check will, so that the
compiled kernel lands in Triton's on-disk cache under the same key; the run's launches then load it. A
candidate that fails here is simply compiled (and fails, and is reported) in the run itself."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from pathlib import Path
from typing import Callable

import torch

from ..tablefile import config_of_entry, entry_of
from ..tileconfig import TileConfig
from .shapes import Shape

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def precompile(work: list[tuple[str, str, Shape, TileConfig]], out: str | Path, device: torch.device, processes: int,
               log: Callable[[str], None], dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile each (spec file, kernel, shape, config) of `work` on `processes` worker processes."""
    if device.type != "cuda" or processes < 2 or not work:
        return
    start = time.monotonic()
    dtype_name = next(name for name, dt in DTYPES.items() if dt is dtype)
    failed = []
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=processes,
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(compile_candidate, source, str(out), name, shape, entry_of(config), dtype_name,
                                   device.index or 0): (name, config)
                       for source, name, shape, config in work}
            for future in concurrent.futures.as_completed(futures):
                why = future.result()
                if why is not None:
                    failed.append(f"{futures[future][0]} {futures[future][1].label()}: {why}")
    except concurrent.futures.process.BrokenProcessPool as e:  # a worker died: the run compiles the rest itself
        log(f"compiling in parallel stopped: {e}")
    log(f"compiled {len(work) - len(failed)} of {len(work)} candidate(s) on {processes} processes in "
        f"{time.monotonic() - start:.0f} s" + ("; the others are compiled as the run times them:" if failed else ""))
    for line in failed:
        log(f"  {line}")


def compile_candidate(source: str, out: str, name: str, shape: Shape, config: dict, dtype: str,
                      device_index: int) -> str | None:
    """In a worker: launch kernel `name` of spec file `source` once with `config` (as a table's entry holds it:
    tablefile.entry_of) on random inputs of `shape` (so that Triton compiles it); None, or why it failed."""
    try:
        from .. import api
        from .harness import launcher, load_module, make_inputs

        checked = next(c for c in api.load([Path(source)]) if isinstance(c, api.Checked) and c.kernel.name == name)
        module = load_module(Path(out), name)
        device = torch.device("cuda", device_index) if torch.cuda.is_available() else torch.device("cpu")
        dt = DTYPES[dtype]
        inputs = make_inputs(checked.kernel, module, shape, device, dt)
        launch, _ = launcher(checked, module, config_of_entry(config), shape, inputs, device, dt)
        launch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return None
    except Exception as e:  # noqa: BLE001 - reported; the run compiles and reports the candidate again
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
