"""`codagen build` as users and CI run it: byte-for-byte deterministic output, `--check` that names every
stale, missing and extra file, failed builds that change nothing, files codagen did not write left alone,
builds that write only what changed, and removed specs whose modules go away.

Each test writes a few small specs (one in a subfolder) into a fresh workspace and runs `python -m codagen`
there, in a subprocess, so that paths in generated headers are the workspace-relative ones a user would see.
Determinism and the CI check also run on the repository's own specs/."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codagen.writer import MARKER

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"

WORKSPACE_SPECS = {
    "residual_norm.yaml": """\
# The out-projection's epilogue: residual add, RMSNorm statistics, norm-weight scale.
kernel: residual_norm
doc: Residual add with RMSNorm sums of squares and the norm-weight scale.
gemm: {a: y, b: w, b_layout: nk}
inputs: {y: [M, K], w: [N, K], x: [M, N], wn: [N]}
outputs: {x_out: [M, N], h: [M, N], ss: [M, tiles(N)]}
epilogue:
  - add: {x: acc, y: x, out: x_new}
  - store: {x: x_new, to: x_out}
  - reduce: {op: sumsq, x: x_new, axis: cols, to: ss}
  - scale: {x: x_new, by: wn, out: hv}
  - store: {x: hv, to: h}
""",
    "swiglu.yaml": """\
kernel: gate_up
doc: Gate/up projection with a row scale and SwiGLU on interleaved pairs.
gemm: {a: h, b: w, b_layout: kn}
inputs: {h: [M, K], w: [K, N], rstd: {shape: [M], dtype: float32}}
outputs: {z: [M, N], y: [M, N/2]}
epilogue:
  - scale: {x: acc, by: rstd, out: zv}
  - store: {x: zv, to: z}
  - swiglu: {x: zv, out: yv}
  - store: {x: yv, to: y}
""",
    "backward/ce_head.yaml": """\
kernel: ce_head
doc: "LM head with log-sum-exp partials and the target logit, in 'quotes' and with unicode: α."
gemm: {a: h, b: w}
inputs: {h: [M, K], w: [N, K], target: {shape: [M], dtype: index}, scale: scalar}
outputs: {lse_part: [M, tiles(N)], target_logit: {shape: [M], dtype: float32}}
epilogue:
  - scale: {x: acc, by: scale, out: logits}
  - reduce: {op: logsumexp, x: logits, axis: cols, to: lse_part}
  - select: {x: logits, index: target, to: target_logit}
""",
}
MODULES = ["ce_head", "gate_up", "residual_norm"]  # kernel names, sorted

BAD_SPEC = """\
kernel: broken
doc: A spec with one mistake.
gemm: {a: a, b: b}
inputs: {a: [M, K], b: [N, K]}
outputs: {o: [M, N]}
epilogue:
  - store: {x: acc, to: oo}
"""  # 7:25 'oo' is not among the outputs (did you mean 'o'?), and so 5:11 output 'o' is never written


def codagen(*args: str, cwd: Path, seed: str = "0") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "codagen", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (but byte-code caches): relative path -> content."""
    if not folder.exists():
        return {}
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def write_specs(root: Path) -> Path:
    for rel, text in WORKSPACE_SPECS.items():
        (root / "specs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "specs" / rel).write_text(text)
    return root


@pytest.fixture
def ws(tmp_path) -> Path:
    """A workspace holding specs/ with the WORKSPACE_SPECS."""
    return write_specs(tmp_path / "ws")


@pytest.fixture
def built(ws) -> Path:
    """The workspace after one successful `codagen build specs/`."""
    ok(codagen("build", "specs/", cwd=ws))
    return ws


@pytest.mark.parametrize("source", ["workspace", "repository"])
def test_build_is_byte_identical_across_hash_seeds_and_layouts(tmp_path, source):
    """The same specs give the same bytes whatever the hash seed, where the workspace lives, how deep it is,
    and how the paths are spelt on the command line."""
    layouts = [(tmp_path / "a", ("specs/",), "1"), (tmp_path / "a2", ("specs/",), "2"),
               (tmp_path / "deeper" / "x" / "y", ("specs",), "2"), (tmp_path / "b", ("./specs/",), "1")]
    results = []
    for root, spec_args, seed in layouts:
        if source == "repository":
            shutil.copytree(SPECS, root / "specs")
        else:
            write_specs(root)
        out = ok(codagen("build", *spec_args, cwd=root, seed=seed))
        results.append(snapshot(root / "generated"))
        assert f"generated/: {len(results[-1])} file(s) written, 0 removed" in out.stdout
    first = results[0]
    assert "kernels/__init__.py" in first
    if source == "workspace":
        tl_files = [rel for rel in first if not rel.startswith("kernels/gluon/")]  # Hopper: tests/test_gluon.py
        assert sorted(tl_files) == ["__init__.py", "kernels/__init__.py"] + [f"kernels/{n}.py" for n in MODULES]
        assert "kernels/gluon/__init__.py" in first
    for (root, _, seed), other in zip(layouts[1:], results[1:]):
        assert sorted(other) == sorted(first), root
        for rel in first:
            assert other[rel] == first[rel], f"{rel} differs between {layouts[0][0]} and {root} (seed {seed})"
    for rel, content in first.items():  # no machine paths, no temporary files
        assert str(tmp_path).encode() not in content, f"{rel} holds a machine path"
        assert not rel.endswith(".tmp")


def test_a_build_from_outside_the_project_writes_what_a_build_from_its_top_writes(built, tmp_path):
    """Specs and --out given as absolute paths from another folder: the headers name the specs relative to the
    folder that holds the output (no machine path), so the files are those of `codagen build specs/` at the
    project's top, and `--check` there finds them up to date."""
    expected = snapshot(built / "generated")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ok(codagen("build", str(built / "specs"), "--out", str(built / "generated2"), cwd=elsewhere))
    ok(codagen("build", str(built / "specs"), "--out", str(built / "generated"), cwd=elsewhere))
    assert snapshot(built / "generated") == expected
    for rel, content in snapshot(built / "generated2").items():
        assert str(tmp_path).encode() not in content, f"{rel} holds a machine path"
    assert ok(codagen("build", "specs/", "--check", cwd=built)).stdout == "generated/ is up to date\n"


def test_headers_name_the_spec_and_its_hash(built):
    files = snapshot(built / "generated")
    for rel, name in (("residual_norm.yaml", "residual_norm"), ("swiglu.yaml", "gate_up"),
                      ("backward/ce_head.yaml", "ce_head")):
        spec_bytes = (built / "specs" / rel).read_bytes()
        first_line, second_line = files[f"kernels/{name}.py"].decode().split("\n")[:2]
        assert first_line.startswith(f"{MARKER} from specs/{rel} (sha256 ")
        assert hashlib.sha256(spec_bytes).hexdigest() in first_line
        assert second_line == "# Regenerate with: codagen build specs/"
    for rel, content in files.items():
        assert content.decode().startswith(MARKER), rel
        compile(content, rel, "exec")  # every generated file is valid Python


def test_generated_files_get_ordinary_permissions(built):
    umask = os.umask(0)
    os.umask(umask)
    for p in (built / "generated").rglob("*.py"):
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, p


def test_check_passes_on_a_fresh_build(built):
    before = snapshot(built / "generated")
    result = ok(codagen("build", "specs/", "--check", cwd=built))
    assert "generated/ is up to date" in result.stdout
    assert result.stderr == ""
    assert snapshot(built / "generated") == before


def test_check_lists_stale_missing_and_extra_files(built):
    names = MODULES
    kernels = built / "generated" / "kernels"
    stale = kernels / f"{names[0]}.py"
    stale.write_text(stale.read_text() + "# a hand edit\n")
    missing = kernels / "__init__.py"
    missing.unlink()
    extra = kernels / "old_kernel.py"
    extra.write_text(f"{MARKER} from specs/old_kernel.yaml; do not edit.\n")
    before = snapshot(built / "generated")

    result = codagen("build", "specs/", "--check", cwd=built)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert f"stale: generated/kernels/{names[0]}.py" in lines
    assert "missing: generated/kernels/__init__.py" in lines
    assert "extra: generated/kernels/old_kernel.py" in lines
    assert lines[-1] == "generated/ is out of date; run: codagen build specs/"
    assert len(lines) == 4, result.stderr  # nothing else is called stale
    assert snapshot(built / "generated") == before, "--check wrote something"

    ok(codagen("build", "specs/", cwd=built))
    assert not extra.exists()
    ok(codagen("build", "specs/", "--check", cwd=built))


def test_check_of_a_missing_folder_fails(ws):
    result = codagen("build", "specs/", "--check", "--out", "nowhere", cwd=ws)
    assert result.returncode == 1
    assert "missing: nowhere/kernels/__init__.py" in result.stderr
    assert "run: codagen build specs/ --out nowhere" in result.stderr
    assert not (ws / "nowhere").exists()


def test_failed_build_leaves_the_output_folder_unchanged(built):
    before = snapshot(built / "generated")
    assert before
    # A change that would rewrite a module, and a bad spec among the good ones: nothing may be written.
    spec = built / "specs" / "swiglu.yaml"
    spec.write_text(spec.read_text() + "# an edit that changes the spec's hash\n")
    (built / "specs" / "broken.yaml").write_text(BAD_SPEC)
    result = codagen("build", "specs/", cwd=built)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "specs/broken.yaml:5:11: output 'o' is never written; add a step such as 'store: {x: ..., to: o}'",
        "specs/broken.yaml:7:25: store.to: 'oo' is not among the outputs; did you mean 'o'?",
        "2 error(s) in 1 file(s); nothing was written"]
    assert "nothing was written" in result.stderr
    assert "wrote" not in result.stdout
    assert snapshot(built / "generated") == before


def test_failed_build_writes_nothing_into_an_empty_folder(ws):
    (ws / "specs" / "broken.yaml").write_text(BAD_SPEC)
    (ws / "empty").mkdir()
    for out in ("empty", "absent"):
        result = codagen("build", "specs/", "--out", out, cwd=ws)
        assert result.returncode == 1 and "nothing was written" in result.stderr
    assert list((ws / "empty").iterdir()) == []
    assert not (ws / "absent").exists()


def test_a_file_codagen_did_not_write_is_never_overwritten(built):
    """A hand-written module where a generated one would go is refused, before anything else is written."""
    name = "gate_up"
    mine = built / "generated" / "kernels" / f"{name}.py"
    mine.write_text("# my own kernel, hand-tuned\n")
    spec = built / "specs" / "residual_norm.yaml"
    spec.write_text(spec.read_text() + "# a change that would be written if the build went ahead\n")
    before = snapshot(built / "generated")

    result = codagen("build", "specs/", cwd=built)
    assert result.returncode == 1
    assert f"generated/kernels/{name}.py" in result.stderr
    assert f"do not start with '{MARKER}'" in result.stderr
    assert "nothing was written" in result.stderr
    assert snapshot(built / "generated") == before
    assert mine.read_text() == "# my own kernel, hand-tuned\n"


def test_a_file_codagen_did_not_write_is_never_deleted(built):
    helper = built / "generated" / "kernels" / "my_helper.py"
    helper.write_text('"""Helpers I keep next to the generated kernels."""\n')
    before = snapshot(built / "generated")
    result = codagen("build", "specs/", cwd=built)
    assert result.returncode == 1
    assert "generated/kernels/my_helper.py" in result.stderr and "will not overwrite or delete" in result.stderr
    assert snapshot(built / "generated") == before
    # --check reports it as extra, too: CI notices.
    check = codagen("build", "specs/", "--check", cwd=built)
    assert check.returncode == 1 and "extra: generated/kernels/my_helper.py" in check.stderr


def test_files_outside_the_managed_folders_are_left_alone(built):
    """generated/ may hold other things (tuning tables, a README): the build neither lists nor touches them."""
    notes = built / "generated" / "README.md"
    notes.write_text("notes\n")
    table = built / "generated" / "tuning" / "table.py"
    table.parent.mkdir()
    table.write_text("TABLE = {}\n")
    ok(codagen("build", "specs/", "--check", cwd=built))
    ok(codagen("build", "specs/", cwd=built))
    assert notes.read_text() == "notes\n" and table.read_text() == "TABLE = {}\n"


def test_a_second_build_writes_nothing(built):
    folder = built / "generated"
    mtimes = {p: p.stat().st_mtime_ns for p in folder.rglob("*.py")}
    result = ok(codagen("build", "specs/", cwd=built))
    assert result.stdout == "generated/: 0 file(s) written, 0 removed\n"
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*.py")} == mtimes
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


def test_a_changed_spec_rewrites_only_its_module(built):
    spec = built / "specs" / "backward" / "ce_head.yaml"
    spec.write_text(spec.read_text() + "# a comment changes the hash in the header\n")
    result = ok(codagen("build", "specs/", cwd=built))
    assert result.stdout.splitlines() == ["wrote generated/kernels/ce_head.py",
                                          "wrote generated/kernels/gluon/ce_head.py",  # the Hopper backend's
                                          "generated/: 2 file(s) written, 0 removed"]


def test_removing_a_spec_removes_its_module(built):
    gone = "gate_up"
    (built / "specs" / "swiglu.yaml").unlink()
    result = ok(codagen("build", "specs/", cwd=built))
    assert f"generated/kernels/{gone}.py" in result.stdout
    assert "generated/kernels/__init__.py" in result.stdout  # its index no longer lists the kernel
    # and the Hopper package's index and its module of the kernel
    assert "generated/kernels/gluon/__init__.py" in result.stdout
    assert f"generated/kernels/gluon/{gone}.py" in result.stdout
    assert "generated/: 2 file(s) written, 2 removed" in result.stdout
    files = snapshot(built / "generated")
    assert f"kernels/{gone}.py" not in files and f"kernels/gluon/{gone}.py" not in files
    assert gone.encode() not in files["kernels/__init__.py"]
    ok(codagen("build", "specs/", "--check", cwd=built))


def test_an_output_folder_that_is_a_file_is_refused(ws):
    (ws / "out").write_text("not a folder\n")
    result = codagen("build", "specs/", "--out", "out", cwd=ws)
    assert result.returncode != 0
    assert (ws / "out").read_text() == "not a folder\n"
    assert "Traceback" not in result.stderr


def test_committed_generated_folder_is_up_to_date():
    """What CI runs: the repository's generated/ matches its specs/."""
    result = codagen("build", "specs/", "--check", cwd=REPO)
    assert result.returncode == 0, result.stderr


NEAR_MISS_NAMES = """\
kernel: names_probe
doc: Valid names that sit close to names of generated code, Python and torch.library.
gemm: {a: tensor, b: layout, b_layout: kn}
inputs: {tensor: [M, K], layout: [K, N], scalar: [N], index_: {shape: [M], dtype: index}, alpha: scalar,
         requires_grad: [M, N], mutates_args: [N], schema: [N], names_probe: [N], row: [M], col: [N]}
outputs: {result: [M, N], pin_memory: [M, N], returns: [M], kernel: [M, tiles(N)]}
epilogue:
  - scale: {x: acc, by: scalar, out: none_}
  - add: {x: none_, y: requires_grad, out: t}
  - mul: {x: t, y: alpha, out: alpha2}
  - scale: {x: alpha2, by: mutates_args, out: pid2}
  - scale: {x: pid2, by: schema, out: mask}
  - scale: {x: mask, by: names_probe, out: ptr}
  - scale: {x: ptr, by: row, out: rows2}
  - scale: {x: rows2, by: col, out: cols2}
  - store: {x: cols2, to: result}
  - store: {x: t, to: pin_memory}
  - select: {x: t, index: index_, to: returns}
  - reduce: {op: max, x: t, axis: cols, to: kernel}
"""


def test_near_miss_names_give_an_importable_module(tmp_path, monkeypatch):
    """Names that pass validation but resemble names of the generated code, of Python or of torch.library
    (the op's schema is inferred from its parameter names) give a module that imports and registers its op."""
    import importlib

    import torch

    from codagen import api

    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "names_probe.yaml").write_text(NEAR_MISS_NAMES)
    monkeypatch.chdir(tmp_path)
    api.build(["specs"], out="cg_names_probe")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    module = importlib.import_module("cg_names_probe.kernels.names_probe")
    assert module.NAME == "names_probe"
    assert hasattr(torch.ops.codagen, "names_probe")


def test_spelling_of_out_does_not_change_the_output(ws):
    ok(codagen("build", "specs/", "--out", "gen", cwd=ws))
    first = snapshot(ws / "gen")
    ok(codagen("build", "specs/", "--out", "./gen/", cwd=ws))
    assert snapshot(ws / "gen") == first


def test_removed_modules_are_reported_as_removed(built):
    (built / "specs" / "swiglu.yaml").unlink()
    result = ok(codagen("build", "specs/", cwd=built))
    assert "removed generated/kernels/gate_up.py" in result.stdout.splitlines()


# -- interrupted and concurrent builds ---------------------------------------------------------------------

def test_leftovers_of_an_interrupted_build_are_reported_and_removed(built):
    """A build killed mid-write leaves `.<name>.<random>.tmp` next to its target: --check names it, the
    next build removes it; other files are left alone."""
    kernels = built / "generated" / "kernels"
    leftover = kernels / ".gate_up.py.k3x_9a0q.tmp"
    leftover.write_text("# @generated by codagen from spe")  # a torn write
    (kernels / "notes.tmp").write_text("mine\n")
    result = codagen("build", "specs/", "--check", cwd=built)
    assert result.returncode == 1
    assert "leftover from an interrupted build: generated/kernels/.gate_up.py.k3x_9a0q.tmp" in result.stderr
    result = ok(codagen("build", "specs/", cwd=built))
    assert "removed generated/kernels/.gate_up.py.k3x_9a0q.tmp" in result.stdout.splitlines()
    assert not leftover.exists() and (kernels / "notes.tmp").read_text() == "mine\n"
    ok(codagen("build", "specs/", "--check", cwd=built))


def test_a_second_build_waits_for_the_first(built):
    """Two builds into one folder take turns (the folder's lock): the second starts writing only once the
    first is done, so the folder is never a mix of the two."""
    from codagen import writer

    (built / "specs" / "swiglu.yaml").unlink()  # what the waiting build will change
    with writer._locked(built / "generated"):  # a build in progress
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        second = subprocess.Popen([sys.executable, "-m", "codagen", "build", "specs/"], cwd=built, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            second.wait(timeout=8)  # validates and renders, then waits for the lock
        assert (built / "generated" / "kernels" / "gate_up.py").exists()
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "removed generated/kernels/gate_up.py" in out.splitlines()
    ok(codagen("build", "specs/", "--check", cwd=built))


def test_a_build_that_waits_too_long_fails_clearly(built, monkeypatch):
    from codagen import writer

    monkeypatch.setattr(writer, "LOCK_TIMEOUT", 0.3)
    files = writer.OutputFiles({"kernels/x.py": "# @generated by codagen\n"})
    with writer._locked(built / "generated"):
        with pytest.raises(TimeoutError, match=r"another codagen build has been writing into .*generated/ for over "
                                               r"0.3 s; wait for it to finish \(or stop it\) and run this again"):
            writer.write(files, built / "generated")
    assert not (built / "generated" / "kernels" / "x.py").exists()


def test_concurrent_builds_leave_one_complete_build(built):
    """Pairs of builds of different spec sets started at once: each succeeds, and the folder is exactly what
    one of them writes."""
    (built / "other").mkdir()
    shutil.copy(built / "specs" / "swiglu.yaml", built / "other" / "swiglu.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(3):
        runs = [subprocess.Popen([sys.executable, "-m", "codagen", "build", specs, "--out", "generated"], cwd=built,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for specs in ("specs/", "other/")]
        for run in runs:
            assert run.wait(timeout=120) == 0, run.stderr.read()
        checks = [codagen("build", specs, "--check", cwd=built).returncode for specs in ("specs/", "other/")]
        assert sorted(checks) == [0, 1]


def test_written_files_reach_the_disk_before_their_names(tmp_path, monkeypatch):
    """fsync of each file before it replaces its target, and of the folder after."""
    from codagen import writer

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(f"replace {Path(b).name}") or real_replace(a, b))
    writer.write(writer.OutputFiles({"kernels/a.py": "# @generated by codagen\n", "blocks/b.py": "#\n"}), tmp_path)
    assert events[:4] == ["fsync", "replace a.py", "fsync", "replace b.py"] or \
        events[:4] == ["fsync", "replace b.py", "fsync", "replace a.py"]
    assert events[4:] == ["fsync", "fsync"]  # the two folders


# -- paths that reach generated code ------------------------------------------------------------------------

def test_a_path_cannot_inject_code_into_generated_files(ws):
    """A folder named with a newline would end the header's comment and run the next line on import."""
    out = 'x\nprint("INJECTED")\n#'
    result = codagen("build", "specs/", "--out", out, cwd=ws)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --out 'x\\nprint(\"INJECTED\")\\n#' holds a control, format or line-separator character; rename it; "
        "nothing was written"]
    assert not (ws / out).exists()
    for name in ("specs\x1b[31m", "specs\u202e"):  # a terminal escape, a right-to-left override
        shutil.copytree(ws / "specs", ws / name)
        result = codagen("build", name, "--out", "gen", cwd=ws)
        assert result.returncode == 1 and "nothing was written" in result.stderr
        assert "\x1b" not in result.stderr and "\u202e" not in result.stderr  # shown escaped
        assert not (ws / "gen").exists()


def test_quotes_and_spaces_in_paths_are_quoted_in_headers(ws):
    """Printable names are fine: headers show them quoted as a shell needs, and the package imports."""
    ok(codagen("build", "specs/", "--out", "it's gen", cwd=ws))
    header = (ws / "it's gen" / "kernels" / "gate_up.py").read_text().splitlines()[1]
    assert header == "# Regenerate with: codagen build specs/ --out 'it'\"'\"'s gen'"
    compile((ws / "it's gen" / "kernels" / "gate_up.py").read_text(), "gate_up.py", "exec")
    result = codagen("build", "specs/", "--check", "--out", "it's gen", cwd=ws)
    assert result.returncode == 0, result.stderr
