"""The `codagen` command: a thin shell over codagen.api."""
from __future__ import annotations

import sys

import click

from . import api
from .errors import ValidationFailed


def _report(e: ValidationFailed) -> None:
    for err in e.errors:
        click.echo(str(err), err=True)
    files = len({err.loc.file for err in e.errors})
    click.echo(f"{len(e.errors)} error(s) in {files} file(s); nothing was written", err=True)


@click.group()
@click.version_option(package_name="codagen")
def main() -> None:
    """GEMM-epilogue programs in YAML -> Triton kernels and PyTorch ops."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
def validate(paths: tuple[str, ...]) -> None:
    """Check specs and report every error as file:line:col."""
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
    """Validate specs and generate kernels into OUT."""
    try:
        if check_only:
            d = api.check(list(paths), out)
            for title, rels in (("stale", d.stale), ("missing", d.missing), ("extra", d.extra)):
                for rel in rels:
                    click.echo(f"{title}: {out}/{rel}", err=True)
            if not d.clean:
                click.echo(f"{out}/ is out of date; run: codagen build {' '.join(paths)}"
                           + ("" if out == "generated" else f" --out {out}"), err=True)
                sys.exit(1)
            click.echo(f"{out}/ is up to date")
            return
        written, removed = api.build(list(paths), out)
    except ValidationFailed as e:
        _report(e)
        sys.exit(1)
    except FileExistsError as e:
        click.echo(f"error: {e}; nothing was written", err=True)
        sys.exit(1)
    for rel in written:
        click.echo(f"wrote {out}/{rel}")
    for rel in removed:
        click.echo(f"removed {out}/{rel}")
    click.echo(f"{out}/: {len(written)} file(s) written, {len(removed)} removed")
