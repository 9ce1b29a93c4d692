"""Tuning tables that are corrupt or hostile (codagen.tablefile, the one reader of `codagen build --check`,
`codagen tune` and the launcher): bad JSON, bytes that are not UTF-8, nesting 200,000 deep, entries that are no
configuration or that no launch of their kernel can use, keys that are no shape, links to /dev/zero, FIFOs. Each
gives a named, located error in `build --check` and one warning and the default configuration at a launch, never a
traceback or a hang; and nothing read from a table's name or content is printed raw (a key is no command to paste).
The GPU path of pick_config is faked as in test_tune.py."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import triton
from click.testing import CliRunner

from codagen import api, tablefile, tileconfig
from codagen.cli import main
from codagen.runtime import autotune, configs
from codagen.runtime import tables as runtime_tables
from codagen.runtime.configs import GPU_DEFAULT, Config, HopperConfig
from codagen.tune import tables
from conftest import ERROR_LINE, REPO, SCALED_SPEC, TEST_SPECS, within_seconds

pytestmark = pytest.mark.usefixtures("fresh_caches")
CPU = torch.device("cpu")

GOOD = Config(64, 64, 32, 8, 4, 2)
SPLIT_GROUPS = Config(64, 16, 32, 8, 4, 1, epilogue_split=4)  # 4 columns at a time: cuts t_group_reduce's groups of 8
TOO_BIG = Config(512, 512, 512, 8, 8, 2)  # one stage of its operand tiles: 1 MiB of shared memory


def entry(config: Config) -> dict:
    return {**tablefile.entry_of(config), "ms": 1.0}


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A working folder with specs/ (scaled, and t_group_reduce with its column groups of 8) built into generated/;
    returns name -> a function writing that kernel's table for 'test-gpu' with the given shapes."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "scaled.yaml").write_text(SCALED_SPEC)
    shutil.copy(TEST_SPECS / "t_group_reduce.yaml", tmp_path / "specs")
    monkeypatch.chdir(tmp_path)
    api.build(["specs"], "generated")
    kernels = {c.kernel.name: c.kernel for c in api.load(["specs"]) if isinstance(c, api.Checked)}

    def write(name: str, shapes: dict, key: str | None = None, folder: str = "test-gpu"):
        path = tmp_path / "generated" / "tuning" / folder / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(tables.table_text(kernels[name], folder, triton.__version__, {}))
        data["shapes"] = shapes
        if key is not None:
            data["fingerprint"] = key
        path.write_text(json.dumps(data, indent=1))
        return path

    return write


def check():
    """`codagen build specs/ --check`, its exit code and output (stdout and stderr), within 60 s."""
    result = within_seconds(lambda: CliRunner().invoke(main, ["build", "specs/", "--check"]), 60)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


# -- nothing printed raw --------------------------------------------------------------------------------------
def test_a_stale_tables_command_is_written_from_its_keys_numbers_only(ws):
    """Keys that are no shape (a shell command, a newline that forges a line, digits that are not ASCII) stay
    out of the `codagen tune` command that `build --check` suggests: written from parsed integers, in order."""
    ws("scaled", {"64x40x24": entry(GOOD), "1x1x1; touch pwned #": entry(GOOD),
                  "2x2x2\nFORGED: generated/ is up to date": entry(GOOD), "\u00b2x1x1": entry(GOOD),
                  "\u0663x1x1": entry(GOOD), "8x8x8": entry(GOOD)}, key="0" * 64)
    code, output = check()
    assert code == 1
    assert ("re-run on a test-gpu GPU: codagen tune specs/ --kernels scaled --shapes 8x8x8,64x40x24\n") in output
    assert "pwned" not in output and "FORGED" not in output and "\u00b2" not in output and "\u0663" not in output


def test_table_and_folder_names_are_quoted(ws):
    """A file or folder name with a newline or an escape code is shown escaped on its line, never as it is; the
    kernel a table names is quoted as Python writes a string."""
    ws("scaled", {"64x40x24": entry(GOOD)}, key="0" * 64, folder="gpu\x1b[2J")
    path = ws("scaled", {"64x40x24": entry(GOOD)})
    path.rename(path.parent / "gone\nFORGED: generated is up to date.json")
    code, output = check()
    assert code == 1
    assert "\x1b" not in output and not any(line.startswith("FORGED") for line in output.splitlines())
    assert "re-run on a 'gpu\\x1b[2J' GPU: codagen tune" in output
    assert ("stale tuning table 'generated/tuning/test-gpu/gone\\nFORGED: generated is up to date.json': no spec "
            "defines a kernel 'gone\\nFORGED: generated is up to date'; delete it") in output


def test_shape_keys_are_read_in_ascii_digits_only():
    assert tablefile.shape_numbers("8192x2048x0") == (8192, 2048, 0)
    for key in ("\u00b2x1x1", "\u0663x1x1", "1x1x1 ", "0x8x8", "8x8", "1x1x" + "9" * 5000, 12, None):
        assert tablefile.shape_numbers(key) is None, key
    assert sorted(["32768x8x8", "abc", "\u00b2x1x1", "8192x8x8"], key=tablefile.shape_order) == [
        "8192x8x8", "32768x8x8", "abc", "\u00b2x1x1"]


# -- the two forms of an entry ------------------------------------------------------------------------------------
def test_an_entry_names_its_backend_beside_its_configuration_and_the_flat_form_still_reads():
    """Tables are written {"backend": ..., "config": {...}}, the config's fields of its backend's type; the flat form
    of the tables written before, with the backend among the fields (or none: the tl kernel) and backend "mm" for
    the tl kernel over cuBLAS's product, reads as the same configuration."""
    hopper = HopperConfig(128, 128, 64, stages=5, epilogue_split=4)
    written = tablefile.entry_of(hopper)
    assert written == {"backend": "gluon", "config": hopper.as_dict()} and "backend" not in written["config"]
    assert tablefile.entry_fields(written) == ("gluon", hopper.as_dict())
    assert tablefile.config_of_entry(written) == hopper
    assert tablefile.config_of_entry({"config": {**hopper.as_dict(), "backend": "gluon"}}) == hopper
    flat = {k: v for k, v in GOOD.as_dict().items() if k != "mainloop"}
    assert tablefile.config_of_entry({"config": flat}) == GOOD
    cublas = tablefile.config_of_entry({"config": {**flat, "backend": "mm"}})
    assert (cublas.backend, cublas.mainloop) == ("tl", "cublas") and "cublas" in cublas.label()
    assert tablefile.entry_of(cublas) == {"backend": "tl", "config": {**flat, "mainloop": "cublas"}}


# what the one Config of before each backend had a config type wrote for each (the committed tables' entries)
OLD_HOPPER_OF_TL = {"epilogue_stages": None, "direct_stores": False, "slice_loop": False, "slice_unroll": 1,
                    "consumers": 2}
OLD_TL_OF_HOPPER = {"num_warps": 4, "persistent": False, "tma": False, "flatten": False, "warp_specialize": False}


@pytest.mark.parametrize("form", ["flat", "backend beside"])
def test_entries_of_the_one_config_of_before_read_as_their_backends_config(form):
    """Entries written while one Config held every backend's fields (the committed tables, flat, and those written
    {"backend": ..., "config": {...}} before each backend had its type) read as the config of their backend: the
    other backend's fields are dropped where that Config took them, the Hopper kernel's num_stages are its stages;
    where that Config refused them, so does the reader, naming why."""
    def read(backend, fields):
        e = {"config": {**fields, "backend": backend}} if form == "flat" else {"backend": backend, "config": fields}
        return tablefile.config_of_entry(e)

    tl = {**GOOD.as_dict(), **OLD_HOPPER_OF_TL}
    assert read("tl", tl) == GOOD
    hopper = {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_stages": 7, "epilogue_split": 4,
              "epilogue_stages": None, "direct_stores": False, "slice_loop": True, "slice_unroll": 1, "consumers": 3,
              "mainloop": "triton", **OLD_TL_OF_HOPPER}
    three = read("gluon", hopper)
    assert three == HopperConfig(64, 128, 64, stages=7, epilogue_split=4, slice_loop=True, consumers=3)
    assert three.consumer_regs == tileconfig.CONSUMER_REGS[3]
    for name, value, words in (("direct_stores", True, "direct_stores is the Hopper .gluon. kernel's"),
                               ("consumers", 3, "consumers is the Hopper .gluon. kernel's"),
                               ("slice_unroll", True, "slice_unroll is the Hopper .gluon. kernel's"),
                               ("epilogue_stages", 2, "epilogue_stages is the Hopper .gluon. kernel's")):
        with pytest.raises(ValueError, match=words):
            read("tl", {**tl, name: value})
    with pytest.raises(ValueError, match="mainloop 'cublas' is the tl kernel's"):
        read("gluon", {**hopper, "mainloop": "cublas"})
    with pytest.raises(ValueError, match="Config: num_warps must be a power of two"):
        read("gluon", {**hopper, "num_warps": 3})
    with pytest.raises(ValueError, match="stages are named twice"):
        read("gluon", {**hopper, "stages": 7})
    with pytest.raises(ValueError, match="the configuration has no field 'stages'"):
        read("tl", {**tl, "stages": 7})
    with pytest.raises(ValueError, match="backend must be one of tl, gluon, got 'cuda'"):
        read("cuda", tl)


def test_every_committed_table_reads_and_writes_in_the_new_form_to_the_same_configurations(tmp_path):
    """Each committed table (generated/tuning/, written in the flat form) has no entry a launch would skip, and its
    entries rewritten as `codagen tune` writes them now read back as the same configurations."""
    committed = sorted((REPO / "generated" / "tuning").glob("*/*.json"))
    assert committed
    for path in committed:
        table = tablefile.read_table(path)
        assert not table.bad, table.bad[0].located()
        rewritten = tmp_path / path.parent.name / path.name
        rewritten.parent.mkdir(exist_ok=True)
        shapes = {key: {**entry, **tablefile.entry_of(table.entries[key])} for key, entry in table.shapes.items()}
        assert all("backend" not in e["config"] for e in shapes.values())
        rewritten.write_text(json.dumps({**table.data, "shapes": shapes}, indent=1, sort_keys=True))
        again = tablefile.read_table(rewritten)
        assert again.entries == table.entries and not again.bad, path


# -- corrupt tables: build --check and the launcher -------------------------------------------------------------
def huge(path):
    path.write_bytes(b'{"shapes": {}}' + b" " * tablefile.MAX_BYTES)


def fifo(path):
    path.unlink()
    os.mkfifo(path)


def dev_zero(path):
    path.unlink()
    path.symlink_to("/dev/zero")


def folder(path):
    path.unlink()
    path.mkdir()


# (name, how the table is spoiled, words of build --check's error, whether it is one entry's)
CORRUPT = [
    ("bad-json", lambda p: p.write_text('{"shapes": {'), "(invalid JSON: ", False),
    ("not-utf-8", lambda p: p.write_bytes(b'{"shapes": {"\xff\xfe": 1}}'), "(not UTF-8: byte 13)", False),
    ("deep-array", lambda p: p.write_text("[" * 200_000), "(JSON nested too deep)", False),
    ("deep-object", lambda p: p.write_text('{"shapes": ' + '{"a":' * 200_000), "(JSON nested too deep)", False),
    ("long-number", lambda p: p.write_text('{"shapes": {}, "n": 1' + "0" * 5000 + "}"), "(invalid JSON: ", False),
    ("not-an-object", lambda p: p.write_text("[1, 2]"), "(not a JSON object)", False),
    ("shapes-not-an-object", lambda p: p.write_text('{"shapes": [1]}'), "(no JSON object of shapes)", False),
    ("too-large", huge, f"(larger than {tablefile.MAX_BYTES} bytes)", False),
    ("fifo", fifo, "(not a regular file)", False),
    ("dev-zero", dev_zero, "(a link to a file outside its folder)", False),
    ("folder", folder, "(not a regular file)", False),
    ("bogus-entry", {"64x40x24": {"bogus_field": 1}}, "entry '64x40x24': expected {\"backend\": ..., \"config\"",
     True),
    ("backend-twice", {"64x40x24": {"backend": "tl", "config": {**GOOD.as_dict(), "backend": "tl"}}},
     "entry '64x40x24': the backend is named twice", True),
    ("bogus-field", {"64x40x24": {"config": {**GOOD.as_dict(), "bogus_field": 1}}},
     "entry '64x40x24': the configuration has no field 'bogus_field'", True),
    ("wrong-type", {"64x40x24": {"config": {**GOOD.as_dict(), "block_m": "64"}}},
     "entry '64x40x24': Config: block_m must be an int, got '64'", True),
    ("key-abc", {"abc": entry(GOOD)}, "entry 'abc': the key is not a shape", True),
    ("key-superscript", {"\u00b2x40x24": entry(GOOD)}, "entry '\\xb2x40x24': the key is not a shape", True),
    ("no-k", {"64x40x0": entry(GOOD)}, "entry '64x40x0': K must be positive", True),
    ("shared-memory", {"64x40x24": entry(TOO_BIG)}, "1048576 bytes of shared memory", True),
]


def spoil(path, how) -> None:
    if callable(how):
        how(path)
    else:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "shapes": {**data["shapes"], **how}}, indent=1))


@pytest.mark.parametrize("name, how, words, one_entry", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_check_names_a_corrupt_table_at_its_place(ws, name, how, words, one_entry):
    spoil(ws("scaled", {"32x40x24": entry(GOOD)}), how)
    code, output = check()
    assert code == 1, output
    (line,) = [line for line in output.splitlines() if "tuning table" in line]
    located = ERROR_LINE.match(line)
    assert located and located["file"] == "generated/tuning/test-gpu/scaled.json", line
    if one_entry:
        assert "tuning table generated/tuning/test-gpu/scaled.json: " in line and "; delete the entry" in line
        assert int(located["line"]) > 1  # the line of the entry's key
    else:
        assert located["message"].startswith("not a tuning table: generated/tuning/test-gpu/scaled.json (")
    assert words in line, line


# one stage of 16-bit operand tiles takes (block_m + block_n) x block_k x 2 bytes
FITS_99K = Config(128, 256, 128, 8, 4, 1)  # 96 KiB: every GPU of the table but the 64 KiB ones
NEEDS_160K = Config(256, 256, 128, 8, 4, 1)  # 128 KiB: sm_80 (163 KiB), sm_90 and sm_100, not sm_86 or sm_89
NEEDS_200K = Config(256, 128, 256, 8, 4, 1)  # 192 KiB: sm_90 and sm_100 only


@pytest.mark.parametrize("gpu, limit", [
    ("nvidia-h100-80gb-hbm3", 232448), ("nvidia-h200", 232448), ("nvidia-gh200-480gb", 232448),
    ("nvidia-b200", 232448), ("nvidia-a100-sxm4-80gb", 166912), ("nvidia-a100-pcie-40gb", 166912),
    ("nvidia-a10g", 101376), ("nvidia-rtx-a6000", 101376), ("nvidia-geforce-rtx-3090", 101376),
    ("nvidia-l4", 101376), ("nvidia-l40s", 101376), ("nvidia-geforce-rtx-4090", 101376),
    ("nvidia-rtx-6000-ada-generation", 101376), ("tesla-v100-sxm2-16gb", 98304), ("tesla-t4", 65536),
    ("test-gpu", 232448), ("nvidia-h1000", 232448), ("a-l4x", 232448), ("", 232448), (None, 232448),
])
def test_shared_memory_by_gpu_name(gpu, limit):
    """One row per GPU family in tileconfig.SHARED_BYTES_BY_GPU, matched on whole words of the table's GPU name;
    227 KiB only for names it lacks (not 'h1000' for h100, nor 'l4x' for l4)."""
    assert tileconfig.shared_bytes(gpu) == limit
    assert tileconfig.fits_shared(FITS_99K, True, gpu) is (limit >= 98304)
    assert tileconfig.fits_shared(NEEDS_160K, True, gpu) is (limit >= 131072)
    assert tileconfig.fits_shared(NEEDS_200K, True, gpu) is (limit >= 196608)
    assert tileconfig.fits_shared(NEEDS_200K, False, gpu)  # no GEMM: no operand tiles


@pytest.mark.parametrize("folder, field, bad", [
    ("nvidia-a100-sxm4-80gb", "nvidia-a100-sxm4-80gb", ["64x40x48"]),  # 163 KiB: the 200 KiB tile only
    ("nvidia-l4", "nvidia-l4", ["64x40x40", "64x40x48"]),  # 99 KiB: both
    ("nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3", []),
    ("nvidia-l4", "nvidia-h100-80gb-hbm3", ["64x40x40", "64x40x48"]),  # a field naming a larger GPU: the folder's
    ("nvidia-h100-80gb-hbm3", "nvidia-l4", ["64x40x40", "64x40x48"]),  # and the reverse: the smaller of the two
    ("test-gpu", "test-gpu", []),  # a name the table lacks: 227 KiB
])
def test_check_takes_the_shared_memory_of_the_tables_gpu(ws, folder, field, bad):
    path = ws("scaled", {"64x40x24": entry(FITS_99K), "64x40x40": entry(NEEDS_160K), "64x40x48": entry(NEEDS_200K)},
              folder=folder)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "gpu": field}, indent=1))
    table = tablefile.read_table(path, None, True)
    assert sorted(table.entries) == sorted({"64x40x24", "64x40x40", "64x40x48"} - set(bad))
    code, output = check()
    assert code == (1 if bad else 0), output
    for key in bad:
        limit = min(tileconfig.shared_bytes(folder), tileconfig.shared_bytes(field))
        name = folder if tileconfig.shared_bytes(folder) <= tileconfig.shared_bytes(field) else field
        assert f"entry '{key}': one stage of its " in output
        assert f"more than a program may use on '{name}' ({limit} bytes)" in output, output
    assert "64x40x24" not in output


def test_a_launch_on_a_gpu_skips_entries_its_shared_memory_cannot_hold(tmp_path, monkeypatch, caplog):
    """On an A100 (by its tuning folder), an entry tuned for 200 KiB of operand tiles is skipped with a warning and
    the launch takes the default; on an H100 the same entry is used."""
    monkeypatch.setattr(autotune, "_on_gpu", lambda device: True)
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)  # pick_config without a run: no run-time tuning
    for gpu, used in (("nvidia-a100-sxm4-80gb", False), ("nvidia-h100-80gb-hbm3", True)):
        monkeypatch.setattr(runtime_tables, "gpu_key", lambda device, gpu=gpu: gpu)
        path = tmp_path / gpu / "matmul.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"fingerprint": "f" * 64, "triton": triton.__version__, "gpu": gpu,
                                    "shapes": {"32x40x24": entry(NEEDS_200K)}}))
        with caplog.at_level(logging.WARNING, logger="codagen.tune"):
            config = autotune.pick_config("matmul", "f" * 64, tmp_path, 32, 40, 24, CPU)
        assert (config == NEEDS_200K) is used, gpu
        assert ("166912 bytes" in caplog.text) is not used, caplog.text
        caplog.clear()


def test_check_names_tiles_that_cut_a_kernels_column_groups(ws):
    ws("t_group_reduce", {"64x40x24": entry(SPLIT_GROUPS), "64x48x24": entry(GOOD)})
    code, output = check()
    assert code == 1
    assert ("entry '64x40x24': its epilogue runs on 4 columns at a time, which cuts the kernel's column groups "
            "(8) at N = 40") in output and "64x48x24" not in output


@pytest.fixture
def as_gpu(monkeypatch):
    """pick_config as on a GPU called 'test-gpu', with no run-time tuning (launches without `run`)."""
    monkeypatch.setattr(autotune, "_on_gpu", lambda device: True)
    monkeypatch.setattr(runtime_tables, "gpu_key", lambda device: "test-gpu")
    monkeypatch.delenv("CODAGEN_NO_TUNE", raising=False)


@pytest.mark.parametrize("name, how, words, one_entry", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_a_launch_skips_a_corrupt_table_with_one_warning(tmp_path, as_gpu, caplog, name, how, words, one_entry):
    """The table's good entry (32x40x24) is still used where only another entry is bad; otherwise the launch takes
    the default, with one warning that names the file, however many launches ask."""
    path = tmp_path / "test-gpu" / "matmul.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"fingerprint": "f" * 64, "triton": triton.__version__,
                                "shapes": {"32x40x24": entry(GOOD)}}))
    spoil(path, how)
    pick = lambda m: autotune.pick_config("matmul", "f" * 64, tmp_path, m, 40, 24, CPU)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="codagen.tune"):
        for m in (32, 64, 1000):  # the good entry's shape, and others that take the nearest tuned one
            assert within_seconds(lambda: pick(m)) == (GOOD if one_entry else GPU_DEFAULT)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(path) in warning and ("entry" if one_entry else "not a tuning table: ") in warning, warning


def test_a_launch_never_takes_an_entry_that_cuts_its_column_groups(tmp_path, as_gpu, caplog):
    """Such an entry would fail the launch with an error blaming the caller: it is skipped, with a warning, and the
    default is widened to the groups as without a table."""
    path = tmp_path / "test-gpu" / "t_group_reduce.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"fingerprint": "f" * 64, "triton": triton.__version__,
                                "shapes": {"64x40x24": entry(SPLIT_GROUPS)}}))
    with caplog.at_level(logging.WARNING, logger="codagen.tune"):
        config = autotune.pick_config("t_group_reduce", "f" * 64, tmp_path, 64, 40, 24, CPU, 8)
    assert config == configs.gpu_default(8, 40) and configs.fits_group(config, 8, 40)
    assert "cuts the kernel's column groups (8)" in caplog.text


@pytest.mark.parametrize("name, how, words, one_entry", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_tune_names_a_corrupt_table_or_drops_its_bad_entries(ws, name, how, words, one_entry):
    path = ws("scaled", {"32x40x24": entry(GOOD)})
    spoil(path, how)
    kernel = next(c.kernel for c in api.load(["specs"]) if isinstance(c, api.Checked) and c.kernel.name == "scaled")
    logged = []
    if one_entry:
        assert within_seconds(lambda: tables.read_table(path, kernel, triton.__version__, logged.append)) == {
            "32x40x24": entry(GOOD)}
        assert len(logged) == 1 and words in logged[0] and logged[0].endswith("dropped at the next write")
    else:
        with pytest.raises(Exception) as e:
            within_seconds(lambda: tables.read_table(path, kernel, triton.__version__))
        assert type(e.value).__name__ == "TuneError" and words in str(e.value)
