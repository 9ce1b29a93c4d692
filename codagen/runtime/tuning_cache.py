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
import tempfile
from pathlib import Path

from .. import tablefile
from ..quoting import quoted
from .configs import TileConfig

log = logging.getLogger("codagen.tune")

# A kernel's file holds a few hundred bytes per bucket tuned: a larger one is not the cache's, and is not read.
MAX_BYTES = tablefile.MAX_BYTES


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
    """The JSON object in `path`; None when there is no such file, and None (logged) when it is no tuning table
    (tablefile.read_json: a FIFO or a link to /dev/zero, more than MAX_BYTES, not a JSON object)."""
    try:
        return tablefile.read_json(path)
    except FileNotFoundError:
        return None
    except tablefile.TableError as e:
        log.info("codagen: ignoring the tuning cache: %s", e)
        return None


def read(path: Path, fingerprint: str, triton_version: str) -> dict[str, TileConfig]:
    """The valid entries (bucket -> config) of the cache file at `path`, when it was written for this computation
    (`fingerprint`) with this Triton; otherwise none. Entries whose key or config is not valid are skipped."""
    data = _load(path)
    if data is None:
        return {}
    if data.get("fingerprint") != fingerprint or data.get("triton") != triton_version:
        log.info("codagen: the tuning cache %s was written for another computation or Triton; not used",
                 quoted(path))
        return {}
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        log.info("codagen: ignoring the tuning cache %s: its shapes are not a JSON object", quoted(path))
        return {}
    entries = {}
    for bucket, entry in shapes.items():
        try:
            entries[tablefile.shape_text(tablefile.shape_numbers(bucket))] = tablefile.entry_config(
                bucket, entry, gpu=tablefile.table_gpu(path, data))
        except ValueError as e:  # wrong types, unknown fields, no config, a key that is no shape
            log.info("codagen: ignoring the tuning cache %s entry %s: %s", quoted(path), ascii(bucket), e)
    return entries


def write(path: Path, kernel: str, gpu: str, fingerprint: str, triton_version: str, bucket: str,
          config: TileConfig) -> None:
    """Add `bucket`'s choice to the cache file at `path`, keeping its valid entries of this computation and Triton
    (stale ones are dropped). Written to a temporary file in the same folder and renamed over it, so that a
    reader, or a process writing at the same time, never sees half a file (one of two such writes may lose the
    other's new entry: that bucket is tuned again later)."""
    shapes = {b: tablefile.entry_of(c) for b, c in read(path, fingerprint, triton_version).items()}
    shapes[bucket] = tablefile.entry_of(config)
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
