"""Run-time tuning's choices kept on disk (codagen.runtime.tuning_cache), on the CPU: written once after a tune,
read by the next process instead of tuning, ignored when stale, corrupt or hostile (never crashing or hanging a
launch), off with CODAGEN_TUNING_CACHE=0, and never written when nothing was tuned. The GPU path of pick_config
is faked as in test_tune.py; the cache folder is a per-test tmp_path (conftest's CODAGEN_CACHE_DIR)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from codagen import tablefile
from codagen.runtime import autotune, configs, tables, tuning_cache
from codagen.runtime.configs import GPU_DEFAULT, Config
from conftest import REPO, within_seconds

pytestmark = pytest.mark.usefixtures("fresh_caches")
CPU = torch.device("cpu")
KERNEL, FINGERPRINT, GPU = "matmul", "f" * 64, "test-gpu"
M, N, K, BUCKET = 45, 40, 24, "64x40x24"
FASTER = configs.RUNTIME_GEMM_CANDIDATES[2]  # what the fake timer makes run-time tuning choose
OTHER = configs.RUNTIME_GEMM_CANDIDATES[1]  # another candidate, for entries tuning would not choose here


@pytest.fixture
def as_gpu(monkeypatch):
    """pick_config as on a GPU called 'test-gpu', whose fake timer makes FASTER the fastest candidate; returns
    the list of configs timed."""
    monkeypatch.setattr(autotune, "_on_gpu", lambda device: True)
    monkeypatch.setattr(tables, "gpu_key", lambda device: GPU)
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)
    monkeypatch.delenv("CODAGEN_TUNING_CACHE", raising=False)
    trials: list[Config] = []

    def measure(run, config):
        trials.append(config)
        return 1.0 if config == FASTER else 5.0

    monkeypatch.setattr(autotune, "measure", measure)
    return trials


def pick(m: int = M, run=lambda config: None) -> Config:
    """A launch's choice, as a generated launcher of a kernel whose outputs do not depend on the tile asks it, where
    there is no committed tuning table."""
    no_tables = Path(os.environ["CODAGEN_CACHE_DIR"]) / "no-tables"
    return autotune.pick_config(KERNEL, FINGERPRINT, no_tables, m, N, K, CPU, decls=(), run=run)


def cache_path() -> Path:
    return Path(os.environ["CODAGEN_CACHE_DIR"]) / "tuning" / GPU / f"{KERNEL}.json"


def table(shapes: dict, fingerprint: str = FINGERPRINT, triton_version: str = triton.__version__) -> str:
    return json.dumps({"kernel": KERNEL, "gpu": GPU, "fingerprint": fingerprint, "triton": triton_version,
                       "shapes": shapes})


def entry(config: Config) -> dict:
    return tablefile.entry_of(config)


CHILD = """
import json, sys
import torch
from codagen.runtime import autotune, tables
autotune._on_gpu = lambda device: True
tables.gpu_key = lambda device: "test-gpu"
timed = []
autotune.measure = lambda run, config: timed.append(config) or 5.0
config = autotune.pick_config("matmul", sys.argv[1], sys.argv[2], 50, 40, 24, torch.device("cpu"), decls=(),
                              run=lambda c: None)
print(json.dumps({"config": config.as_dict(), "timed": len(timed)}))
"""


def next_process(cache_dir: Path) -> dict:
    """pick_config in a fresh Python, as on the fake GPU (every candidate takes 5 ms there, so that tuning would
    choose GPU_DEFAULT): its choice and how many candidates it timed."""
    env = {k: v for k, v in os.environ.items() if k not in ("CODAGEN_NO_TUNE", "CODAGEN_TUNING_CACHE")}
    env["CODAGEN_CACHE_DIR"] = str(cache_dir)
    result = subprocess.run([sys.executable, "-c", CHILD, FINGERPRINT, str(cache_dir / "no-tables")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    return {"config": Config(**out["config"]), "timed": out["timed"]}


def test_the_cache_folder(monkeypatch):
    where = lambda: tuning_cache.cache_file(GPU, KERNEL)  # noqa: E731
    for name in ("CODAGEN_CACHE_DIR", "XDG_CACHE_HOME", "CODAGEN_TUNING_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    assert where() == Path("/home/u/.cache/codagen/tuning/test-gpu/matmul.json")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG spec says
    assert where() == Path("/home/u/.cache/codagen/tuning/test-gpu/matmul.json")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert where() == Path("/xdg/codagen/tuning/test-gpu/matmul.json")
    monkeypatch.setenv("CODAGEN_CACHE_DIR", "/mine")
    assert where() == Path("/mine/tuning/test-gpu/matmul.json")
    monkeypatch.setenv("CODAGEN_TUNING_CACHE", "0")
    assert where() is None


def test_a_tuned_choice_is_written_once_and_read_by_the_next_process(as_gpu, monkeypatch, tmp_path):
    writes = []
    real_write = tuning_cache.write
    monkeypatch.setattr(tuning_cache, "write", lambda *a: writes.append(a[-2:]) or real_write(*a))
    assert pick() == FASTER and as_gpu
    assert writes == [(BUCKET, FASTER)]
    data = json.loads(cache_path().read_text())
    assert (data["fingerprint"], data["triton"], data["shapes"]) == (FINGERPRINT, triton.__version__,
                                                                     {BUCKET: entry(FASTER)})
    as_gpu.clear()
    assert pick(60) == FASTER and not as_gpu and len(writes) == 1  # the same bucket: remembered, not written again
    autotune.clear_caches()  # this process forgets; the file stays and answers
    assert pick(60) == FASTER and not as_gpu and len(writes) == 1
    assert next_process(cache_path().parents[2]) == {"config": FASTER, "timed": 0}
    # the next process tunes where there is no cache (what makes the line above mean something)
    assert next_process(tmp_path / "empty") == {"config": GPU_DEFAULT, "timed": len(configs.RUNTIME_GEMM_CANDIDATES)}


@pytest.mark.parametrize("stale", [{"fingerprint": "0" * 64}, {"triton_version": "0.0.0"}],
                         ids=["other-fingerprint", "other-triton"])
def test_stale_entries_are_ignored_and_replaced(as_gpu, stale):
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(table({BUCKET: entry(OTHER), "128x40x24": entry(OTHER)}, **stale))
    assert pick() == FASTER and as_gpu
    data = json.loads(cache_path().read_text())
    assert (data["fingerprint"], data["triton"], data["shapes"]) == (FINGERPRINT, triton.__version__,
                                                                     {BUCKET: entry(FASTER)})


def test_entries_of_other_candidates_are_ignored(as_gpu):
    """An entry that is none of this launch's candidates (chosen by another codagen version, among other
    candidates or around another default) might not suit this launch: its bucket is tuned again."""
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(table({BUCKET: entry(Config(64, 64, 32, 8, 4, 2))}))
    assert pick() == FASTER and as_gpu


def test_valid_entries_of_a_file_are_kept_and_invalid_ones_skipped(as_gpu, caplog):
    wrong_types = {"128x40x24": {"config": OTHER.as_dict() | {"block_m": "128"}},
                   "256x40x24": {"config": OTHER.as_dict() | {"no_such_field": 1}},
                   "512x40x24": {"config": [1, 2]}, "1024x40x24": "not an entry"}
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(table({BUCKET: entry(OTHER), **wrong_types}))
    with caplog.at_level(logging.INFO, logger="codagen.tune"):
        assert pick() == OTHER and not as_gpu  # the valid entry is used
        for m in (100, 200, 400, 1000):
            assert pick(m) == FASTER
    assert len(as_gpu) == 4 * len(configs.RUNTIME_GEMM_CANDIDATES)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"entry '{bucket}'" in logged for bucket in wrong_types), logged
    assert json.loads(cache_path().read_text())["shapes"] == {
        BUCKET: entry(OTHER), **{b: entry(FASTER) for b in wrong_types}}


def huge_but_valid() -> bytes:
    return table({BUCKET: entry(OTHER)}).encode() + b" " * tuning_cache.MAX_BYTES


@pytest.mark.parametrize("make", [
    lambda p: p.write_bytes(b"\xff\xfe\x00garbage{"),
    lambda p: p.write_text("[1, 2, 3]"),
    lambda p: p.write_text(json.dumps({"fingerprint": FINGERPRINT, "triton": triton.__version__, "shapes": [1]})),
    lambda p: p.write_text("[" * 100_000),
    lambda p: p.write_bytes(huge_but_valid()),
    lambda p: os.mkfifo(p),
    lambda p: p.symlink_to("/dev/zero"),
    lambda p: p.mkdir(),
], ids=["garbage", "not-an-object", "shapes-not-a-dict", "too-deep", "too-large", "fifo", "dev-zero", "folder"])
def test_corrupt_or_hostile_files_are_ignored(as_gpu, caplog, make):
    cache_path().parent.mkdir(parents=True)
    make(cache_path())
    with caplog.at_level(logging.INFO, logger="codagen.tune"):
        assert within_seconds(pick) == FASTER and as_gpu
    assert any("tuning cache" in r.getMessage() for r in caplog.records)
    if not cache_path().is_dir():  # replaced by a valid file; a folder in the way stays, and nothing is kept
        assert cache_path().is_file()  # (not read otherwise: a FIFO would wait for a writer)
        assert json.loads(cache_path().read_text())["shapes"] == {BUCKET: entry(FASTER)}
    assert not list(cache_path().parent.glob(".*.tmp"))


def test_only_a_regular_file_is_read(as_gpu):
    """A FIFO that holds a valid table (its writer still has it open) is not read either."""
    cache_path().parent.mkdir(parents=True)
    os.mkfifo(cache_path())
    writer = os.open(cache_path(), os.O_RDWR)  # Linux opens a FIFO so without waiting for a reader
    try:
        os.write(writer, table({BUCKET: entry(OTHER)}).encode())
        assert within_seconds(pick) == FASTER and as_gpu
    finally:
        os.close(writer)


def test_off_with_codagen_tuning_cache_0(as_gpu, monkeypatch):
    cache_path().parent.mkdir(parents=True)
    kept = table({BUCKET: entry(OTHER)})
    cache_path().write_text(kept)
    monkeypatch.setenv("CODAGEN_TUNING_CACHE", "0")
    assert pick() == FASTER and as_gpu  # not read
    assert pick(1000) == FASTER
    assert cache_path().read_text() == kept  # not written
    assert [p.name for p in cache_path().parent.iterdir()] == ["matmul.json"]


def test_nothing_is_written_where_nothing_was_tuned(as_gpu, monkeypatch):
    assert pick(run=None) == GPU_DEFAULT  # no run hook: a kernel with inplace outputs
    with monkeypatch.context() as mp:
        mp.setenv("CODAGEN_NO_TUNE", "1")
        assert pick() == GPU_DEFAULT
    with monkeypatch.context() as mp:
        mp.setattr(torch.compiler, "is_compiling", lambda: True)
        assert pick() == GPU_DEFAULT
    with monkeypatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert pick() == GPU_DEFAULT
    with monkeypatch.context() as mp:
        mp.setattr(autotune, "measure", lambda run, config: (_ for _ in ()).throw(RuntimeError("out of resource")))
        assert pick() == GPU_DEFAULT  # every candidate failed: nothing chosen to keep
    with monkeypatch.context() as mp:
        mp.setattr(autotune, "_on_gpu", lambda device: False)  # the interpreter
        assert pick() == configs.INTERPRETER_DEFAULT
    assert not as_gpu and not any(Path(os.environ["CODAGEN_CACHE_DIR"]).iterdir())
    autotune.clear_caches()
    assert pick() == FASTER and cache_path().is_file()  # what the checks above would have written


WRITER = """
import sys
from pathlib import Path
from codagen.runtime import configs, tuning_cache
for i in range(40):
    tuning_cache.write(Path(sys.argv[1]), "matmul", "test-gpu", "f" * 64, sys.argv[2], f"{i}x{sys.argv[3]}x24",
                       configs.GPU_DEFAULT)
"""


def test_processes_writing_at_once_leave_a_valid_file():
    """Two processes add entries to one file while this one reads it: every read finds a whole table."""
    path = cache_path()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), triton.__version__, str(n)], cwd=REPO,
                                stderr=subprocess.PIPE, text=True) for n in (1, 2)]
    reads = 0
    while any(w.poll() is None for w in writers):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        assert json.loads(text)["fingerprint"] == FINGERPRINT
        reads += 1
    assert [w.wait(timeout=300) for w in writers] == [0, 0], [w.stderr.read() for w in writers]
    entries = tuning_cache.read(path, FINGERPRINT, triton.__version__)
    assert reads and entries and set(entries.values()) == {GPU_DEFAULT}
    assert {"39x1x24", "39x2x24"} & set(entries)  # the last write of one of them at least
    assert not list(path.parent.glob(".*.tmp"))
