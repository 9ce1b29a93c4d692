"""The one reader of tuning tables (generated/tuning/<gpu>/<kernel>.json, and run-time tuning's cache files in the
same format), shared by `codagen build --check`, `codagen tune` and the launcher (runtime.tables).

A committed table is reviewed in pull requests as a spec is, and a cache file is whatever is on the disk: neither is
trusted. Only a regular file is read (a FIFO would block for ever, /dev/zero never ends), not through a link out of
its folder, and at most MAX_BYTES of it; a file that does not decode as a JSON object with shapes is "not a tuning
table"; each entry is checked (its key a shape, its configuration one that constructs and that the kernel can
launch) so that a bad one is reported or skipped by name, never handed to a launch. Standard library only: `build
--check` reads tables without importing torch."""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .quoting import quoted
from .tileconfig import TileConfig, config_of, fits_group, fits_shared, shared_bytes

# A table holds a few hundred bytes per shape tuned (the largest committed one, 12 KB): a larger file is no table.
MAX_BYTES = 1 << 20
# ASCII digits only: \d and int() also take '²' or Arabic-Indic digits, which no shape key holds. Ten digits at most:
# int() refuses a few thousand, and no dimension has more than ten.
_SHAPE = re.compile(r"([0-9]{1,10})x([0-9]{1,10})x([0-9]{1,10})")
_SHOWN = 200  # characters of a value from a file that a message shows at most


class TableError(ValueError):
    """A file that is no tuning table, or an entry of one that no launch can use, at its line and column."""

    def __init__(self, path: str | Path, message: str, line: int = 1, col: int = 1, entry: bool = False):
        super().__init__(message)
        self.path, self.line, self.col = Path(path), line, col
        self.entry = entry  # about one entry of the table, not the whole file

    def located(self) -> str:
        """file:line:col: message, as spec errors are shown."""
        return f"{quoted(self.path)}:{self.line}:{self.col}: {self}"


def shape_numbers(key) -> tuple[int, int, int] | None:
    """(M, N, K) of a table's key 'MxNxK' (K 0 for a kernel without a GEMM), or None when it is no such key."""
    match = _SHAPE.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        return None
    m, n, k = (int(g) for g in match.groups())
    return (m, n, k) if m >= 1 and n >= 1 else None


def shape_text(numbers: tuple[int, int, int]) -> str:
    """The key of (M, N, K), written from the numbers (never from a file's text)."""
    return "x".join(str(int(d)) for d in numbers)


def shape_order(key: str) -> tuple:
    """'8192x2048x2048' before '32768x2048x2048': by the numbers, not the text; a key that is no shape last."""
    numbers = shape_numbers(key)
    return (0, numbers) if numbers is not None else (1, (), str(key))


def read_json(path: str | Path) -> dict:
    """The JSON object in the file at `path`. Raises FileNotFoundError when there is none, and TableError ("not a
    tuning table: <path>") for anything else that is not a regular file in its folder holding at most MAX_BYTES of
    UTF-8 JSON, an object."""
    return _read(Path(path))[1]


@dataclass
class Table:
    path: Path
    data: dict  # the file's JSON object: fingerprint, triton, kernel, gpu, shapes
    entries: dict[str, TileConfig]  # shape key (as shape_text writes it) -> the entry's configuration: the valid ones
    shapes: dict[str, dict]  # the same keys -> the entries as the file holds them (config, ms, cuBLAS_ms)
    bad: list[TableError]  # the entries skipped, each at its line


def read_table(path: str | Path, group: int | str | None = None, gemm: bool | None = None,
               cublas: bool = True, k_group: int | None = None) -> Table:
    """The table at `path`, its entries checked (entry_config) for a kernel of column_group `group` that has a GEMM
    or not (`gemm`; None: as each key's K says), whose GEMM torch.mm can make (`cublas`: not FP8 operands), and
    whose K-group scales have `k_group` columns of K each (None: none).
    Raises as read_json does, and TableError when the object has no shapes."""
    path = Path(path)
    text, data = _read(path)
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        raise TableError(path, f"not a tuning table: {quoted(path)} (no JSON object of shapes)")
    table = Table(path, data, {}, {}, [])
    gpu = table_gpu(path, data)
    for key, entry in shapes.items():
        try:
            config = entry_config(key, entry, group, gemm, gpu, cublas, k_group)
        except ValueError as e:
            table.bad.append(TableError(path, f"tuning table {quoted(path)}: entry {_shown(key)}: {e}",
                                        *_where(text, key), entry=True))
            continue
        canonical = shape_text(shape_numbers(key))
        table.entries[canonical], table.shapes[canonical] = config, entry
    return table


def table_gpu(path: Path, data: dict) -> str | None:
    """The GPU a table is for, as its shared memory is checked: the name its "gpu" field gives or its folder's
    (tables live in <tuning>/<gpu>/), of the two the one with less shared memory (tileconfig.shared_bytes), so
    that a field naming a larger GPU than the folder does not let through tiles the folder's GPU cannot run."""
    names = [name for name in (data.get("gpu"), Path(path).parent.name) if isinstance(name, str) and name]
    return min(names, key=shared_bytes, default=None)


def entry_config(key, entry, group: int | str | None = None, gemm: bool | None = None,
                 gpu: str | None = None, cublas: bool = True, k_group: int | None = None) -> TileConfig:
    """The configuration of a table's entry at shape `key` (entry_fields: either form); ValueError, saying why, when the key
    is no shape, the configuration does not construct, or its tiles do not fit the kernel: epilogue slices that
    would cut its column groups (`group`), operand tiles larger than the shared memory of a program on `gpu`
    (tileconfig.SHARED_BYTES_BY_GPU; any GPU's for None or a name it lacks), mainloop "cublas" for a kernel whose
    GEMM torch.mm cannot make (`cublas` False: FP8 operands), a block_k that does not divide the K group of the
    GEMM's K-group scales (`k_group`)."""
    numbers = shape_numbers(key)
    if numbers is None:
        raise ValueError("the key is not a shape MxNxK of positive numbers in ASCII digits (K 0 without a GEMM), "
                         "e.g. 8192x2048x2048")
    m, n, k = numbers
    has_gemm = k > 0 if gemm is None else gemm
    if gemm is not None and (k > 0) != gemm:
        raise ValueError(f"K must be {'positive: the kernel has a GEMM' if gemm else '0: the kernel has no GEMM'}")
    config = config_of_entry(entry)
    if getattr(config, "mainloop", "triton") == "cublas" and not cublas:
        raise ValueError("mainloop 'cublas' makes the GEMM's product with torch.mm, which takes no FP8 operands, and "
                         "the kernel's GEMM has them; use mainloop 'triton'")
    if k_group and k_group % config.block_k:
        raise ValueError(f"block_k {config.block_k} does not divide the K group {k_group} of the gemm's scales "
                         "(gemm.scales: each K step must lie within one group); use a block_k of "
                         f"{k_group} or less")
    if not fits_group(config, group, n):
        raise ValueError(f"its epilogue runs on {config.epilogue_n} columns at a time, which cuts the kernel's "
                         f"column groups ({group}) at N = {n}")
    if not fits_shared(config, has_gemm, gpu):
        raise ValueError(f"one stage of its {config.block_m}x{config.block_n}x{config.block_k} operand tiles takes "
                         f"{config.operand_bytes()} bytes of shared memory, more than a program may use on "
                         f"{_shown(gpu) if gpu else 'any GPU'} ({shared_bytes(gpu)} bytes)")
    return config


def entry_of(config: TileConfig) -> dict:
    """A configuration as a table's entry holds it: {"backend": <name>, "config": {<its fields>}}, so that an entry
    says first which backend's kernel runs, and of which config type its fields are (config_of_entry reads it, and
    the flat form of older tables)."""
    return {"backend": config.backend, "config": config.as_dict()}


def entry_fields(entry) -> tuple[str, dict]:
    """The backend and the configuration's fields of a table's entry: {"backend": ..., "config": {...}} as entry_of
    writes it, or the flat form of the tables written before it, {"config": {..., "backend": ...}} (backend "tl"
    where it names none), where backend "mm" (the tl kernel over torch.mm's product) reads as mainloop "cublas".
    ValueError, saying why, for anything else."""
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        raise ValueError('expected {"backend": ..., "config": {...}}, the backend and its configuration\'s fields')
    given = dict(entry["config"])
    if "backend" in entry:
        if "backend" in given:
            raise ValueError("the backend is named twice, beside the configuration and in it")
        backend = entry["backend"]
    else:
        backend = given.pop("backend", "tl")
        if backend == "mm":  # the flat form's cuBLAS mainloop
            backend, given["mainloop"] = "tl", "cublas"
    return backend, given


def config_of_entry(entry) -> TileConfig:
    """The configuration of a table's entry (entry_fields: either form), of its backend's config type
    (tileconfig.config_of); ValueError, saying why, where it does not construct."""
    backend, given = entry_fields(entry)
    try:
        return config_of(backend, given)
    except (TypeError, ValueError, RecursionError) as e:  # RecursionError: showing a deeply nested value
        raise ValueError(_shorter(str(e) if not isinstance(e, RecursionError) else "a field is nested too deep"))


def read_bytes(path: str | Path) -> bytes:
    """The bytes of the file at `path`, when it is a regular file in its folder of at most MAX_BYTES; raises
    FileNotFoundError when there is none, TableError otherwise."""
    path = Path(path)
    folder = os.path.realpath(path.parent)
    if os.path.commonpath([os.path.realpath(path), folder]) != folder:
        _fail(path, "a link to a file outside its folder")
    try:  # without blocking: opening a FIFO waits for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        _fail(path, f"cannot be opened: {e.strerror}")
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked on what was opened, not on the name
        os.close(fd)
        _fail(path, "not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(MAX_BYTES + 1)
        except OSError as e:
            _fail(path, f"cannot be read: {e.strerror}")
    if len(raw) > MAX_BYTES:
        _fail(path, f"larger than {MAX_BYTES} bytes")
    return raw


def _read(path: Path) -> tuple[str, dict]:
    raw = read_bytes(path)
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        _fail(path, f"not UTF-8: byte {e.start}")
    except json.JSONDecodeError as e:
        _fail(path, f"invalid JSON: {e.msg}", e.lineno, e.colno)
    except ValueError as e:  # a number of more digits than int() takes
        _fail(path, _shorter(f"invalid JSON: {e}"))
    except RecursionError:
        _fail(path, "JSON nested too deep")
    if not isinstance(data, dict):
        _fail(path, "not a JSON object")
    return text, data


def _fail(path: Path, why: str, line: int = 1, col: int = 1):
    raise TableError(path, f"not a tuning table: {quoted(path)} ({why})", line, col)


def _where(text: str, key: str) -> tuple[int, int]:
    """Line and column of `key` as a key of the file's text (the first place it is one), else 1, 1."""
    for written in (json.dumps(key), json.dumps(key, ensure_ascii=False)):
        match = re.search(re.escape(written) + r"\s*:", text)
        if match:
            start = match.start()
            return text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start)
    return 1, 1


def _shown(value) -> str:
    """A value from a file, quoted on one line as ascii() writes it, and shortened."""
    return _shorter(ascii(value))


def _shorter(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
