"""The `codagen` command: a thin shell over codagen.api."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from . import api
from .errors import ValidationFailed
from .presets import PRESETS


def _report(e: ValidationFailed) -> None:
    for err in e.errors:
        click.echo(str(err), err=True)
    files = len({err.loc.file for err in e.errors})
    click.echo(f"{len(e.errors)} error(s) in {files} file(s); nothing was written", err=True)


@click.group()
@click.version_option(package_name="codagen")
def main() -> None:
    """GEMM-epilogue programs in YAML -> Triton kernels and PyTorch ops.

    \b
    Example:
      codagen validate specs/          # every error as file:line:col
      codagen build specs/             # generate generated/
      codagen build specs/ --check     # fail if generated/ is out of date
    """


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
def validate(paths: tuple[str, ...]) -> None:
    """Check specs and report every error as file:line:col; nothing is written.

    \b
    Example:
      codagen validate specs/
      codagen validate specs/rmsnorm_stats.yaml specs/blocks/
    """
    try:
        checked = api.load(list(paths))
    except ValidationFailed as e:
        _report(e)
        sys.exit(1)
    click.echo(f"{len(checked)} spec(s) valid")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", default="generated", show_default=True, type=click.Path(file_okay=False),
              help="Folder of the generated package.")
@click.option("--check", "check_only", is_flag=True, help="Write nothing; fail if the folder is not up to date.")
def build(paths: tuple[str, ...], out: str, check_only: bool) -> None:
    """Validate specs and generate kernels into OUT.

    \b
    Example:
      codagen build specs/                    # writes generated/kernels/*.py, generated/blocks/*.py
      codagen build specs/ --out my_kernels   # into my_kernels/ instead
      codagen build specs/ --check            # in CI: fail if generated/ is out of date
    """
    try:
        if check_only:
            compared = api.check(list(paths), out)
            d = compared.diff
            for title, rels in (("stale", d.stale), ("missing", d.missing), ("extra", d.extra),
                                ("leftover from an interrupted build", d.leftover)):
                for rel in rels:
                    click.echo(f"{title}: {out}/{rel}", err=True)
            if not d.clean:
                click.echo(f"{out}/ is out of date; run: codagen build {api.command_args(list(paths), out)}",
                           err=True)
            tables = api.stale_tuning_tables(compared.specs, list(paths), out)
            for message in tables:
                click.echo(message, err=True)
            if not d.clean or tables:
                sys.exit(1)
            click.echo(f"{out}/ is up to date")
            return
        built = api.build(list(paths), out)
    except ValidationFailed as e:
        _report(e)
        sys.exit(1)
    except (FileExistsError, api.PathError) as e:
        click.echo(f"error: {e}; nothing was written", err=True)
        sys.exit(1)
    except TimeoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    for rel in built.written:
        click.echo(f"wrote {out}/{rel}")
    for rel in built.removed:
        click.echo(f"removed {out}/{rel}")
    click.echo(f"{out}/: {len(built.written)} file(s) written, {len(built.removed)} removed")
    for note in api.backend_notes(built.specs, gpu=_gpu_present()):
        click.echo(f"note: {note}", err=True)


def _gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU, without importing torch (build and validate never load it):
    torch's answer where torch is loaded already, else the driver's device files (Linux), else nvidia-smi."""
    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return any(gpus.iterdir())
    return shutil.which("nvidia-smi") is not None


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--shapes", required=True, metavar="PRESET|MxNxK,...",
              help=f"Model presets ({', '.join(PRESETS)}: each kernel at the shapes where the block specs among "
                   "PATHS run it) and/or literal MxNxK shapes applied to every selected kernel, comma-separated. "
                   "Refused: a size 0, an N no multiple of a kernel's column_group, operands over 128 GiB in bf16 "
                   "(or the GPU's memory).")
@click.option("--out", default="generated", show_default=True, type=click.Path(file_okay=False),
              help="Folder of the generated package; tables go to OUT/tuning/<gpu>/.")
@click.option("--budget", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Stop cleanly after this long; shapes finished by then are written.")
@click.option("--kernels", default=None, metavar="A,B", help="Tune only these kernels.")
@click.option("--tokens", default="8192,32768", show_default=True, metavar="T,...",
              help="Token counts (M) of the presets.")
@click.option("--attrs", default=None, metavar="NAME=N,...",
              help="Block attrs for the presets' shapes, over the presets' values and the specs' defaults, e.g. "
                   "chunk_rows=1024 (the LM heads' row chunks).")
@click.option("--missing-only", is_flag=True, help="Skip shapes the table already holds (to continue a run).")
@click.option("--only", default=None, metavar="TEXT",
              help="Time only the candidates whose label contains TEXT (e.g. 'direct'), each shape's against the "
                   "table's present choice, re-timed: a table changes only where one of them is faster.")
@click.option("--compile-jobs", type=click.IntRange(min=0), default=min(12, (os.cpu_count() or 1) - 1),
              show_default="the cores but one, at most 12", metavar="N",
              help="Compile every candidate first on N worker processes (Triton compiles on one core, and a "
                   "Hopper kernel takes seconds: on an H200's host, 145 candidates in 22 s on 12 processes); 0 "
                   "or 1: as the run launches them.")
def tune(paths: tuple[str, ...], shapes: str, out: str, budget: float | None, kernels: str | None, tokens: str,
         attrs: str | None, missing_only: bool, only: str | None, compile_jobs: int) -> None:
    """Time tile configurations of the kernels of PATHS on this GPU and write the tuning tables.

    \b
    Example:
      codagen tune specs/ --shapes llama3-1b --tokens 8192 --budget 600
      codagen tune specs/ --shapes 8192x2048x2048 --kernels matmul
    """
    from .tune import TuneError, command  # torch and triton load only for this command

    try:
        command.run(list(paths), shapes, out=out, budget=budget, kernels=kernels, tokens=tokens, attrs=attrs,
                    missing_only=missing_only, only=only, log=click.echo, compile_jobs=compile_jobs)
    except ValidationFailed as e:
        _report(e)
        sys.exit(1)
    except TuneError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
