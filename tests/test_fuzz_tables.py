"""A property-based fuzzer of tuning tables (Hypothesis), beside the spec fuzzer (test_fuzz.py): a valid table of a
kernel (the plain GEMM, or one with column groups of 8), spoiled by random bytes, a truncation, a value of the wrong
type or a deeply nested one in place of any part of it, a key that is no shape, or replaced by a special file (a
FIFO, a link to /dev/zero, a folder). For each: the reader (codagen.tablefile) returns a table or raises TableError,
nothing else; `build --check`'s table check (tables.check_tables) reports one printable line per problem; and a
launch (pick_config on the CPU, as on a GPU) returns, within seconds, the table's valid entry or the default, never
a configuration that the table did not validly hold or that cuts the kernel's column groups.

The default run is bounded and deterministic (derandomized: the same examples each time, a few seconds; CI runs
it). `make fuzz` runs CODAGEN_FUZZ_EXAMPLES (20) times as many, random ones (new each run)."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from codagen import api, tablefile
from codagen.quoting import showable
from codagen.fingerprint import fingerprint
from codagen.runtime import autotune, configs
from codagen.runtime import tables as runtime_tables
from codagen.runtime.configs import Config
from codagen.tune import tables
from conftest import REPO, TEST_SPECS, within_seconds

SCALE = int(os.environ.get("CODAGEN_FUZZ_EXAMPLES", "1"))
FUZZ = settings(deadline=None, database=None, derandomize=SCALE == 1, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
CPU = torch.device("cpu")
GPU = "test-gpu"
CONFIGS = (Config(64, 64, 32, 8, 4, 2), Config(128, 128, 64, 8, 8, 3, persistent=True, tma=True),
           Config(64, 16, 32, 8, 4, 1, epilogue_split=4), Config(512, 512, 512, 8, 8, 2))
SHAPES = ("32x40x24", "64x48x24", "1024x64x32")


def _kernel(path: Path, name: str):
    return next(c.kernel for c in api.load([path]) if isinstance(c, api.Checked) and c.kernel.name == name)


KERNELS = {"matmul": _kernel(REPO / "specs" / "matmul.yaml", "matmul"),
           "t_group_reduce": _kernel(TEST_SPECS / "t_group_reduce.yaml", "t_group_reduce")}


def json_values(depth: int = 3):
    """Any JSON value: the wrong types a table's parts could hold, numbers past int()'s digits included."""
    leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10 ** 30)
              | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(SHAPES))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                              max_size=3),
                        max_leaves=depth * 3)


def shape_keys():
    """Keys a table might hold: shapes, and text that is not one (other scripts' digits, shell, newlines)."""
    return st.sampled_from(SHAPES) | st.sampled_from(
        ["abc", "\u00b2x40x24", "\u0663x40x24", "1x1x1; touch pwned #", "2x2x2\nFORGED", "0x8x8", "64x40x0", "64x40",
         "1x1x" + "9" * 50, " 64x40x24"]) | st.text(max_size=12)


@st.composite
def tables_text(draw, kernel) -> bytes | str:
    """The bytes of a spoiled table of `kernel`, or the name of a special file to put in its place."""
    shapes = {key: {"config": draw(st.sampled_from(CONFIGS)).as_dict(), "ms": 1.0}
              for key in draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=3, unique=True))}
    data = {"kernel": kernel.name, "fingerprint": fingerprint(kernel), "triton": triton.__version__, "gpu": GPU,
            "shapes": shapes}
    how = draw(st.sampled_from(["valid", "value", "key", "field", "deep", "truncated", "bytes", "special"]))
    event(how)
    if how == "value":  # a part of the table replaced by any JSON value
        key = draw(st.sampled_from(sorted(shapes)))
        where = draw(st.sampled_from(["table", "shapes", "entry", "config", "field"]))
        value = draw(json_values())
        if where == "table":
            data = value
        elif where == "shapes":
            data["shapes"] = value
        elif where == "entry":
            shapes[key] = value
        elif where == "config":
            shapes[key]["config"] = value
        else:
            shapes[key]["config"][draw(st.sampled_from(sorted(shapes[key]["config"])))] = value
    elif how == "key":
        shapes[draw(shape_keys())] = {"config": draw(st.sampled_from(CONFIGS)).as_dict()}
    elif how == "field":
        shapes[draw(st.sampled_from(sorted(shapes)))]["config"][draw(st.text(max_size=10))] = draw(json_values(1))
    text = json.dumps(data, indent=1, ensure_ascii=draw(st.booleans()))
    if how == "deep":  # nesting far past the recursion limit, in place of a value
        depth = draw(st.integers(min_value=1_000, max_value=200_000))
        text = text.replace('"ms": 1.0', '"ms": ' + "[" * depth + "]" * depth, 1)
    if how == "truncated":
        text = text[:draw(st.integers(min_value=0, max_value=len(text)))]
    if how == "bytes":
        raw = bytearray(text.encode())
        for _ in range(draw(st.integers(min_value=1, max_value=8))):
            raw[draw(st.integers(min_value=0, max_value=len(raw) - 1))] = draw(st.integers(min_value=0, max_value=255))
        return bytes(raw)
    if how == "special":
        return draw(st.sampled_from(["fifo", "dev-zero", "folder", "outside"]))
    return text.encode("utf-8", "surrogatepass")


def place(path: Path, content: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "fifo":
        os.mkfifo(path)
    elif content == "dev-zero":
        path.symlink_to("/dev/zero")
    elif content == "folder":
        path.mkdir()
    elif content == "outside":  # a valid table, but through a link out of the folder
        outside = path.parent.parent / "elsewhere.json"
        outside.write_text(json.dumps({"fingerprint": "f", "shapes": {}}))
        path.symlink_to(outside)
    else:
        path.write_bytes(content)


@pytest.fixture
def as_gpu(monkeypatch):
    monkeypatch.setattr(autotune, "_on_gpu", lambda device: True)
    monkeypatch.setattr(runtime_tables, "gpu_key", lambda device: GPU)
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)


@settings(FUZZ, max_examples=150 * SCALE)
@given(data=st.data())
def test_corrupt_tables_give_a_named_error_or_a_skip(as_gpu, tmp_path_factory, caplog, data):
    name = data.draw(st.sampled_from(sorted(KERNELS)))
    kernel = KERNELS[name]
    content = data.draw(tables_text(kernel))
    tuning = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    path = tuning / GPU / f"{name}.json"
    place(path, content)
    note(f"{name}: {content[:300]!r}")
    group, gemm = kernel.column_group, kernel.gemm is not None

    # the reader: a table of valid entries, or TableError
    try:
        table = within_seconds(lambda: tablefile.read_table(path, group, gemm))
    except tablefile.TableError as e:
        assert str(e).startswith("not a tuning table: ") and _one_line(e.located())
        table = None
    ours = table is not None and (table.data.get("fingerprint"), table.data.get("triton")) == (
        fingerprint(kernel), triton.__version__)
    valid = table.entries if ours else {}  # what a launch may take: a table of another computation is not used
    for key, config in (table.entries if table else {}).items():
        numbers = tablefile.shape_numbers(key)
        assert numbers is not None and tablefile.shape_text(numbers) == key
        assert configs.fits_group(config, group, numbers[1]) and tablefile.fits_shared(config, gemm)
    assert all(_one_line(bad.located()) for bad in (table.bad if table else ()))

    # build --check's check: one printable line per problem, never an exception
    stale, errors = within_seconds(lambda: tables.check_tables(tuning, list(KERNELS.values())))
    assert all(_one_line(e.located()) for e in errors) and all(_one_line(t.problem) for t in stale)
    assert all(tablefile.shape_text(tablefile.shape_numbers(key)) == key for t in stale for key in t.shapes)

    # a launch: the table's valid entry or the default, with at most one warning
    autotune.clear_caches()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="codagen.tune"):
        for key in SHAPES:
            m, n, k = tablefile.shape_numbers(key)
            picked = within_seconds(lambda: autotune.pick_config(name, fingerprint(kernel), tuning, m, n, k, CPU,
                                                                 group))
            assert picked in (*valid.values(), configs.gpu_default(group, n))
            assert picked == valid.get(key, picked) and configs.fits_group(picked, group, n)
    assert len(caplog.records) <= 1 and all(_one_line(r.getMessage()) for r in caplog.records)
    autotune.clear_caches()


def _one_line(text: str) -> bool:
    return "\n" not in text and showable(text)
