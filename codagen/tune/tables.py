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

from ..fingerprint import fingerprint
from ..model import Kernel


def table_text(kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> str:
    data = {"kernel": kernel.name, "spec": kernel.source, "fingerprint": fingerprint(kernel),
            "triton": triton_version, "gpu": gpu, "shapes": shapes}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("shapes"), dict) else None


def read_table(path: Path, kernel: Kernel, triton_version: str) -> dict:
    """The shapes of an existing table that is still valid: same kernel, fingerprint and Triton version."""
    data = _read(path)
    if data is None or (data.get("kernel"), data.get("fingerprint"), data.get("triton")) != (
            kernel.name, fingerprint(kernel), triton_version):
        return {}
    return dict(data["shapes"])


def write_table(path: Path, kernel: Kernel, gpu: str, triton_version: str, shapes: dict) -> bool:
    """Merge `shapes` (shape -> entry) into the table at `path` (its entries are kept when it was made for
    this computation and Triton version, else replaced) and write it atomically if it changed. Touches no
    other file. Returns whether it wrote."""
    merged = {**read_table(path, kernel, triton_version), **shapes}
    text = table_text(kernel, gpu, triton_version, merged)
    if path.is_file() and path.read_bytes() == text.encode("utf-8"):
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


@dataclass(frozen=True)
class StaleTable:
    """A table that no kernel of the specs can use."""

    path: Path
    gpu: str
    kernel: Kernel | None  # the kernel of the table's name; None when no spec defines it
    problem: str  # why no kernel uses it
    shapes: tuple[str, ...]  # the shapes it holds


def stale_tables(tuning_dir: Path, kernels) -> list[StaleTable]:
    """The tables under tuning_dir/<gpu>/ whose key matches none of `kernels`: tuned for a computation that
    the kernel of that name no longer performs (a comment or doc edit keeps the fingerprint; a change to
    what the kernel computes does not), for a kernel no spec defines, or unreadable. The Triton version is
    not checked: a table of another Triton is stale only on a machine that runs that other version."""
    by_name = {k.name: k for k in kernels}
    stale = []
    for path in sorted(Path(tuning_dir).glob("*/*.json")):
        data = _read(path)
        kernel = by_name.get(path.stem)
        gpu = path.parent.name
        if data is None:
            stale.append(StaleTable(path, gpu, kernel, "not a tuning table (no JSON object with shapes)", ()))
            continue
        shapes = tuple(sorted(data["shapes"], key=_shape_order))
        if kernel is None:
            stale.append(StaleTable(path, gpu, None, f"no spec defines a kernel '{path.stem}'", shapes))
        elif data.get("kernel") != kernel.name or data.get("fingerprint") != fingerprint(kernel):
            stale.append(StaleTable(path, gpu, kernel, f"tuned for a different computation than {kernel.source} "
                                                       "now describes", shapes))
    return stale


def _shape_order(shape: str) -> tuple:
    """'8192x2048x2048' before '32768x2048x2048': by the numbers, not the text."""
    return tuple(int(p) if p.isdigit() else 0 for p in shape.split("x"))
