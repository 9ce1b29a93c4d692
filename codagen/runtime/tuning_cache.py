"""Run-time tuning's choices kept on disk for the next process: <cache>/tuning/<gpu>/<kernel>.json, in the format of
the committed tuning tables (fingerprint, Triton version, shapes: {bucket: {"config": ...}}), keyed by the shape
bucket run-time tuning uses. <cache> is $CODAGEN_CACHE_DIR, else $XDG_CACHE_HOME/codagen, else ~/.cache/codagen;
CODAGEN_TUNING_CACHE=0 turns the cache off. A cache only saves time: a file that cannot be read as such a table is
ignored (and replaced at the next write), and a failed write is logged, never raised."""
from __future__ import annotations

import functools
import json
import logging
import os
import stat
import tempfile
from dataclasses import asdict
from pathlib import Path

from .configs import Config

log = logging.getLogger("codagen.tune")

# A kernel's file holds a few hundred bytes per bucket tuned: a larger one is not the cache's, and is not read.
MAX_BYTES = 1 << 20


def cache_file(gpu: str, kernel: str) -> Path | None:
    """Where run-time tuning's choices for `kernel` on `gpu` are kept; None when the cache is off, or when there is
    no folder for it (no CODAGEN_CACHE_DIR and no home directory)."""
    env = os.environ
    return _cache_file(gpu, kernel, env.get("CODAGEN_TUNING_CACHE"), env.get("CODAGEN_CACHE_DIR"),
                       env.get("XDG_CACHE_HOME", ""), env.get("HOME"))


@functools.lru_cache(maxsize=None)
def _cache_file(gpu: str, kernel: str, switch: str | None, root: str | None, xdg: str, home: str | None
                ) -> Path | None:
    # kept by the environment's values: a launch that has not been tuned yet asks at every call
    if switch == "0":
        return None
    if not root:
        try:  # a relative XDG_CACHE_HOME is ignored, as the XDG spec says
            base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
        except RuntimeError:  # no home directory to find
            return None
        root = base / "codagen"
    return Path(root) / "tuning" / gpu / f"{kernel}.json"


def _load(path: Path) -> dict | None:
    """The JSON object in `path`; None when there is no such file, and None (logged) when it is not a regular file
    (a FIFO or a link to /dev/zero: reading it may wait or never end) of at most MAX_BYTES holding a JSON object.
    Opened without blocking, since opening a FIFO waits for a writer; never read past MAX_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        log.info("codagen: ignoring the tuning cache %s: %s", path, e)
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep to parse
        log.info("codagen: ignoring the tuning cache %s: %s", path, e)
        return None
    return data


def read(path: Path, fingerprint: str, triton_version: str) -> dict[str, Config]:
    """The valid entries (bucket -> Config) of the cache file at `path`, when it was written for this computation
    (`fingerprint`) with this Triton; otherwise none. Entries whose config is not a valid Config are skipped."""
    data = _load(path)
    if data is None:
        return {}
    if data.get("fingerprint") != fingerprint or data.get("triton") != triton_version:
        log.info("codagen: the tuning cache %s was written for another computation or Triton; not used", path)
        return {}
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        log.info("codagen: ignoring the tuning cache %s: its shapes are not a JSON object", path)
        return {}
    entries = {}
    for bucket, entry in shapes.items():
        try:
            entries[bucket] = Config(**entry["config"])
        except (TypeError, ValueError, KeyError) as e:  # wrong types, unknown fields, no config
            log.info("codagen: ignoring the tuning cache %s entry %r: %s", path, bucket, e)
    return entries


def write(path: Path, kernel: str, gpu: str, fingerprint: str, triton_version: str, bucket: str,
          config: Config) -> None:
    """Add `bucket`'s choice to the cache file at `path`, keeping its valid entries of this computation and Triton
    (stale ones are dropped). Written to a temporary file in the same folder and renamed over it, so that a
    reader, or a process writing at the same time, never sees half a file (one of two such writes may lose the
    other's new entry: that bucket is tuned again later)."""
    shapes = {b: {"config": asdict(c)} for b, c in read(path, fingerprint, triton_version).items()}
    shapes[bucket] = {"config": asdict(config)}
    text = json.dumps({"kernel": kernel, "gpu": gpu, "fingerprint": fingerprint, "triton": triton_version,
                       "shapes": shapes}, indent=1, sort_keys=True) + "\n"
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        log.info("codagen: could not write the tuning cache %s: %s", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
