"""The `codagen` command line: exit codes, where output goes (results to stdout, errors to stderr, one
`file:line:col: message` line per error), help, and both ways of starting it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ERROR_LINE, SCALED_SPEC

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"

THREE_ERRORS = """\
kernel: three
doc: Three independent mistakes.
gemm: {a: a, b: b}
inputs: {a: [M, K], b: [N, K], unused: [N]}
outputs: {o: [M, N], never: [M]}
epilogue:
  - store: {x: acc, to: o}
  - reduce: {op: sum, x: acc, axis: cols, to: o}
"""  # 4:32 input 'unused' is never used; 5:22 output 'never' is never written; 8:47 'o' is written twice


def run(*args: str, cwd: Path, program: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    program = program or [sys.executable, "-m", "codagen"]
    return subprocess.run([*program, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def ws(tmp_path) -> Path:
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "scaled.yaml").write_text(SCALED_SPEC)
    return tmp_path


def error_lines(stderr: str) -> list[re.Match]:
    """The file:line:col lines of stderr; every line but the summary must be one."""
    lines = stderr.splitlines()
    assert lines, "nothing on stderr"
    matches = [ERROR_LINE.match(line) for line in lines[:-1]]
    assert all(matches), f"a line of stderr is not file:line:col: message:\n{stderr}"
    return matches


def test_validate_a_good_folder(ws):
    result = run("validate", "specs", cwd=ws)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1 spec(s) valid\n"
    assert result.stderr == ""
    assert not (ws / "generated").exists(), "validate wrote something"


def test_validate_the_repository_specs():
    result = run("validate", "specs/", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{len(list(SPECS.rglob('*.yaml')))} spec(s) valid\n"


def test_validate_a_bad_spec(ws):
    (ws / "specs" / "bad.yaml").write_text(SCALED_SPEC.replace("scaled", "bad").replace("to: o}", "to: oo}"))
    result = run("validate", "specs", cwd=ws)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "specs/bad.yaml:5:11: output 'o' is never written; add a step such as 'store: {x: ..., to: o}'",
        "specs/bad.yaml:8:23: store.to: 'oo' is not among the outputs; did you mean 'o'?",
        "2 error(s) in 1 file(s); nothing was written"]
    error_lines(result.stderr)


def test_validate_reports_every_error_of_every_file(ws):
    (ws / "specs" / "three.yaml").write_text(THREE_ERRORS)
    (ws / "specs" / "tagged.yaml").write_text(SCALED_SPEC.replace("kernel: scaled", "kernel: !!python/name:os.system x"))
    result = run("validate", "specs", cwd=ws)
    assert result.returncode == 1
    found = [(m["file"], int(m["line"]), int(m["col"])) for m in error_lines(result.stderr)]
    assert found == [("specs/tagged.yaml", 1, 9), ("specs/three.yaml", 4, 32), ("specs/three.yaml", 5, 22),
                     ("specs/three.yaml", 8, 47)], result.stderr
    assert "reduce.to: output 'o' is already written at line 7" in result.stderr
    assert result.stderr.splitlines()[-1] == "4 error(s) in 2 file(s); nothing was written"


def test_hostile_specs_give_messages_not_tracebacks(ws):
    (ws / "specs" / "deep.yaml").write_text("kernel: " + "[" * 5000 + "]" * 5000 + "\n")
    (ws / "specs" / "huge.yaml").write_text(SCALED_SPEC + "#" * (300 * 1024) + "\n")
    (ws / "specs" / "latin1.yaml").write_bytes(SCALED_SPEC.replace("Scales", "Sc\xe4les").encode("latin-1"))
    (ws / "specs" / "injection.yaml").write_text(SCALED_SPEC.replace("out: s}", 'out: "s\\nimport os"}'))
    result = run("validate", "specs", cwd=ws)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    messages = {m["file"]: m["message"] for m in error_lines(result.stderr)}
    assert "nesting is too deep" in messages["specs/deep.yaml"]
    assert "256 KiB" in messages["specs/huge.yaml"]
    assert "not UTF-8" in messages["specs/latin1.yaml"]
    assert "'s\\nimport os' is not a valid name" in messages["specs/injection.yaml"]


def test_build_of_a_bad_spec_writes_nothing(ws):
    (ws / "specs" / "bad.yaml").write_text(THREE_ERRORS)
    result = run("build", "specs", cwd=ws)
    assert result.returncode == 1
    assert len(error_lines(result.stderr)) == 3
    assert result.stderr.endswith("nothing was written\n")
    assert not (ws / "generated").exists()


def test_build_then_check(ws):
    result = run("build", "specs", "--out", "gen", cwd=ws)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["wrote gen/__init__.py", "wrote gen/kernels/__init__.py",
                                          "wrote gen/kernels/gluon/__init__.py", "wrote gen/kernels/gluon/scaled.py",
                                          "wrote gen/kernels/scaled.py", "gen/: 5 file(s) written, 0 removed"]
    check = run("build", "specs", "--out", "gen", "--check", cwd=ws)
    assert check.returncode == 0 and check.stdout == "gen/ is up to date\n"


def test_check_shows_the_command_to_run_as_a_shell_takes_it(ws):
    """Paths with spaces or quotes come out quoted; one with a newline is refused, shown escaped on one line."""
    result = run("build", "specs", "--out", "my gen", "--check", cwd=ws)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "my gen/ is out of date; run: codagen build specs/ --out 'my gen'"
    result = run("build", "specs", "--out", "gen\nwrote gen/forged.py", "--check", cwd=ws)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["error: --out 'gen\\nwrote gen/forged.py' holds a control, format or "
                                          "line-separator character; rename it; nothing was written"]


@pytest.mark.parametrize("args, words", [
    (["--help"], ["Usage:", "validate", "build", "GEMM-epilogue programs"]),
    (["validate", "--help"], ["Usage:", "PATHS", "file:line:col"]),
    (["build", "--help"], ["Usage:", "--out", "--check", "[default: generated]"]),
])
def test_help(tmp_path, args, words):
    result = run(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for w in words:
        assert w in result.stdout


def test_version(tmp_path):
    result = run("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert re.search(r"\d+\.\d+\.\d+", result.stdout)


def test_the_console_script_works(ws):
    script = Path(sys.executable).parent / "codagen"
    if not script.exists():
        script = shutil.which("codagen")
    if not script:
        pytest.skip("the codagen console script is not installed")
    result = run("validate", "specs", cwd=ws, program=[str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1 spec(s) valid\n"


@pytest.mark.parametrize("args", [["validate"], ["build"], ["validate", "no_such_folder"], ["frobnicate"]])
def test_usage_errors_exit_2(ws, args):
    result = run(*args, cwd=ws)
    assert result.returncode == 2
    assert "Usage:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("gpu", [True, False])
def test_build_notes_the_tl_only_kernels_in_one_line_and_only_on_a_gpu(tmp_path, monkeypatch, gpu):
    """The kernels that the Hopper backend cannot take as a whole (no GEMM) are one note line, listing them, on a
    machine with a GPU; none without one (it only says where Hopper kernels will not run)."""
    from click.testing import CliRunner

    from codagen import cli
    monkeypatch.setattr(cli, "_gpu_present", lambda: gpu)
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(cli.main, ["build", "specs/", "--out", str(tmp_path / "gen")])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    no_gemm = [line for line in notes if "no GEMM" in line]
    if gpu:
        assert len(no_gemm) == 1, notes
        assert "kernel(s) keep the tl kernel only (no GEMM; " in no_gemm[0]
        assert "rmsnorm_stats, rmsnorm_stats_fp8, rope_bwd_rowdot" in no_gemm[0]
    else:
        assert no_gemm == [], notes


@pytest.mark.parametrize("command", [[], ["validate"], ["build"], ["tune"]])
def test_help_of_every_command_shows_an_example_that_parses(command, monkeypatch):
    """Each command's --help ends its text with examples, and each example is a command line that the command
    accepts (parsed, not run)."""
    import shlex

    from click.testing import CliRunner

    from codagen import cli
    monkeypatch.chdir(REPO)  # the examples' paths are the repository's
    result = CliRunner().invoke(cli.main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output
    examples = [line.split("#")[0].strip() for line in result.output.splitlines()
                if line.strip().startswith("codagen ")]
    assert examples, result.output
    for line in examples:
        words = shlex.split(line)[1:]
        if command:
            assert words[0] == command[0], line
        with cli.main.make_context("codagen", list(words)) as ctx:
            sub = cli.main.get_command(ctx, words[0])
            sub.make_context(words[0], words[1:], parent=ctx)  # raises on an option the command lacks


MIXED_ERRORS = """\
kernel: mixed
doc: A structural mistake and a type mistake.
gemm: {a: a, b: b}
inputs: {a: [M, K], b: [N, K], wn: [N]}
outputs: {o: [M, N], s: [M], h_out: [M, N]}
epilogue:
  - scale: {x: acc, by: wn, out: h, colour: red}
  - store: {x: acc, to: o}
  - store: {x: acc, to: s}
  - mul: {x: h, out: h2}
  - store: {x: h, to: h_out}
"""  # 7:37 unknown key (structure), 10:10 mul missing y (structure), 9:25 [M] written with [M, N] (types)


def test_validate_reports_structural_and_type_errors_in_one_run(ws):
    """A spec with mistakes of structure (an unknown key, a missing argument) and of types: one run reports both
    kinds, and nothing that only follows from a step left out for its structural error ('h' then undefined or
    never used)."""
    (ws / "specs" / "mixed.yaml").write_text(MIXED_ERRORS)
    result = run("validate", "specs", cwd=ws)
    assert result.returncode == 1
    found = [(m["file"], int(m["line"]), int(m["col"])) for m in error_lines(result.stderr)]
    assert found == [("specs/mixed.yaml", 7, 37), ("specs/mixed.yaml", 9, 25), ("specs/mixed.yaml", 10, 10)], \
        result.stderr
    assert "unknown key 'colour'" in result.stderr
    assert "output 's' has shape [M], but this step writes [M, N]" in result.stderr
    assert result.stderr.splitlines()[-1] == "3 error(s) in 1 file(s); nothing was written"


@pytest.mark.parametrize("args", [["validate", "specs/"], ["build", "specs/", "--out", "gen"],
                                  ["build", "specs/", "--out", "gen", "--check"]])
def test_each_command_loads_each_spec_once(ws, monkeypatch, args):
    """A command reads and validates every spec once; what later stages need (the Hopper notes of a build, the
    stale tuning tables of --check) comes from that load, not from another."""
    from click.testing import CliRunner

    from codagen import api, cli
    read = []

    def counted(path, shown):
        read.append(shown)
        return read_spec(path, shown)
    read_spec = api.read_spec
    monkeypatch.setattr(api, "read_spec", counted)
    monkeypatch.chdir(ws)
    if "--check" in args:
        api.build(["specs/"], "gen")
        read.clear()
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert read == ["specs/scaled.yaml"]
