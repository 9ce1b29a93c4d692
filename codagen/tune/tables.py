"""Tuning tables: generated/tuning/<gpu>/<kernel>.json, one per kernel and GPU, holding the chosen config of
each shape tuned. A table is keyed by the kernel's fingerprint (what it computes) and the Triton version:
runtime.pick_config uses it only when both match. Standard library only, so that `codagen build --check`
can find stale tables without importing torch."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import tablefile
from ..quoting import quoted
from ..fingerprint import fingerprint
from ..model import Kernel
from ..tablefile import TableError, shape_numbers, shape_order, shape_text
from . import TuneError


def table_text(kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> str:
    data = {"kernel": kernel.name, "spec": kernel.source, "fingerprint": fingerprint(kernel),
            "triton": triton_version, "gpu": gpu, "shapes": shapes}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def read_table(path: Path, kernel: Kernel, triton_version: str, log=None) -> dict:
    """The valid entries (shape -> entry) of an existing table that is still valid: same kernel, fingerprint and
    Triton version; none when there is no table. Each entry's configuration is given as a table is written now
    (tablefile.entry_of), whichever form the file holds, so that a write after it holds one form throughout. Entries that no launch of the kernel can use are left out (each
    reported to `log` when given: the next write drops them); a file that is no tuning table raises TuneError,
    so that tuning never overwrites what it cannot read without saying so."""
    try:
        table = tablefile.read_table(path, kernel.column_group, kernel.gemm is not None, not kernel.fp8_gemm,
                                     kernel.k_group)
    except FileNotFoundError:
        return {}
    except TableError as e:
        raise TuneError(f"{e}; delete it, or move it away, and run again") from None
    data = table.data
    if (data.get("kernel"), data.get("fingerprint"), data.get("triton")) != (
            kernel.name, fingerprint(kernel), triton_version):
        return {}
    for bad in table.bad if log is not None else ():
        log(f"{bad.located()}; dropped at the next write")
    return {key: {**{k: v for k, v in entry.items() if k not in ("backend", "config")},
                  **tablefile.entry_of(table.entries[key])} for key, entry in table.shapes.items()}


def write_table(path: Path, kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> bool:
    """Merge `shapes` (shape -> entry) into the table at `path` (its entries are kept when it was made for
    this computation and Triton version, else replaced) and write it atomically if it changed. Touches no
    other file. Returns whether it wrote."""
    merged = {**read_table(path, kernel, triton_version), **shapes}
    text = table_text(kernel, gpu, triton_version, merged)
    if _holds(path, text):
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
    return True


def _holds(path: Path, text: str) -> bool:
    """Whether the table at `path` is `text` already (read as tables are: not a FIFO's, nor past the size cap)."""
    try:
        return tablefile.read_bytes(path) == text.encode("utf-8")
    except (FileNotFoundError, TableError):
        return False


@dataclass(frozen=True)
class StaleTable:
    """A table that no kernel of the specs can use."""

    path: Path
    gpu: str
    kernel: Kernel | None  # the kernel of the table's name; None when no spec defines it
    problem: str  # why no kernel uses it
    shapes: tuple[str, ...]  # the shapes it holds, written from their numbers (keys that are no shape left out)


def check_tables(tuning_dir: Path, kernels) -> tuple[list[StaleTable], list[TableError]]:
    """The tables under tuning_dir/<gpu>/ that no kernel of `kernels` uses (stale_tables), and the errors of the
    others: a file that is no tuning table, entries of a table in use that no launch of its kernel can use."""
    by_name = {k.name: k for k in kernels}
    stale, errors = [], []
    for path in sorted(Path(tuning_dir).glob("*/*.json")):
        kernel = by_name.get(path.stem)
        try:
            table = tablefile.read_table(path, *((kernel.column_group, kernel.gemm is not None, not kernel.fp8_gemm,
                                                  kernel.k_group) if kernel else ()))
        except (OSError, TableError) as e:  # OSError: gone since the listing
            errors.append(e if isinstance(e, TableError) else TableError(path, f"not a tuning table: "
                                                                               f"{quoted(path)} ({e.strerror})"))
            continue
        data, gpu = table.data, path.parent.name
        # from the numbers of the keys, never their text: a key is shown in a command to paste
        shapes = tuple(sorted(dict.fromkeys(shape_text(n) for n in map(shape_numbers, data["shapes"]) if n),
                              key=shape_order))
        if kernel is None:
            stale.append(StaleTable(path, gpu, None, f"no spec defines a kernel {ascii(path.stem)}", shapes))
        elif data.get("kernel") != kernel.name or data.get("fingerprint") != fingerprint(kernel):
            stale.append(StaleTable(path, gpu, kernel, f"tuned for a different computation than {kernel.source} "
                                                       "now describes", shapes))
        else:
            errors += table.bad
    return stale, errors


def stale_tables(tuning_dir: Path, kernels) -> list[StaleTable]:
    """The tables under tuning_dir/<gpu>/ whose key matches none of `kernels`: tuned for a computation that
    the kernel of that name no longer performs (a comment or doc edit keeps the fingerprint; a change to
    what the kernel computes does not), or for a kernel no spec defines. The Triton version is not checked: a
    table of another Triton is stale only on a machine that runs that other version. Files that are no tuning
    table are check_tables' errors."""
    return check_tables(tuning_dir, kernels)[0]
