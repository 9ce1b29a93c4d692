"""The Python API behind the CLI: find specs, load and validate them, generate the output files and write them."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .blockcheck import check_block
from .blockmodel import Block, CheckedBlock
from .blockspec import parse_block
from .emit import backends
from .emit.block import class_name, render_block
from .emit.package import render_package
from .errors import SpecError, ValidationFailed
from .quoting import quoted, showable
from .loader import parse_kernel_partly, read_spec
from .model import Kernel, Location, ValueType
from .tune.tables import check_tables
from .validate import check_kernel, check_partial_kernel
from .writer import Diff, OutputFiles, diff, write

_SAFE_PATH = re.compile(r"[A-Za-z0-9_./-]+")


class PathError(ValueError):
    """A path that codagen will not print into generated code or messages as it is."""


def quote_path(path: str | Path, what: str = "path") -> str:
    """A path as generated headers and messages show it: quoted for a shell where it needs quotes. A path
    with a character that could end a line or hide itself is refused (PathError, the path escaped), so that
    no folder name can change generated source or forge a line of output."""
    text = str(path)
    if not showable(text):
        raise PathError(f"{what} {ascii(text)} holds a control, format or line-separator character; rename it")
    return shlex.quote(text)


@dataclass(frozen=True)
class Checked:
    kernel: Kernel
    types: dict[str, ValueType]


Specs = list[Checked | CheckedBlock]  # every spec of a command as `load` returns it: loaded and validated once


@dataclass(frozen=True)
class Generated:
    """A build's files in memory, with the specs they came from: what a command reads after rendering (the
    Hopper notes, the stale tuning tables) comes from this one load."""

    specs: Specs
    output: OutputFiles

    @property
    def files(self) -> dict[str, str]:
        return self.output.files


@dataclass(frozen=True)
class Built:
    specs: Specs
    written: list[str]
    removed: list[str]


@dataclass(frozen=True)
class Compared:
    specs: Specs
    diff: Diff


def find_specs(paths: list[str | Path], base: Path | None = None) -> list[tuple[Path, str]]:
    """Spec files under the given files and folders, with the path each is shown by (`display_path`), sorted."""
    found: dict[str, Path] = {}
    for given in paths:
        p = Path(given)
        if p.is_dir():
            files = [f for f in p.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file()]
        elif p.is_file():
            files = [p]
        else:
            raise FileNotFoundError(f"{ascii(str(given))}: no such file or folder")
        for f in files:
            found.setdefault(display_path(f, base), f)
    return sorted((f, shown) for shown, f in found.items())


def display_path(p: Path, base: Path | None = None) -> str:
    """Relative to `base` (default: the working directory) when inside it, so that generated headers are the
    same on every machine; otherwise the path as given."""
    try:
        return p.resolve().relative_to((base or Path.cwd()).resolve()).as_posix()
    except ValueError:
        return p.as_posix()


def shown_from(paths: list[str | Path], out: str | Path) -> Path:
    """Where the paths of a build are shown from, in generated headers and the command to regenerate: the folder
    that holds `out` where it holds the specs too (the project's top, whichever the working directory: a build
    from outside the project writes what a build from its top writes); else the working directory (and paths
    outside it are shown as given)."""
    top = Path(out).resolve().parent
    return top if all(Path(p).resolve().is_relative_to(top) for p in paths) else Path.cwd()


def load(paths: list[str | Path], base: Path | None = None) -> Specs:
    """Load and validate every spec, kernels first, then blocks against them; raises ValidationFailed with
    all the errors of all the files. `base`: where the specs' paths are shown from (`display_path`)."""
    errors: list[SpecError] = []
    checked: list[Checked] = []
    blocks: list[Block] = []
    for path, shown in find_specs(paths, base):
        if not _SAFE_PATH.fullmatch(shown):
            errors.append(SpecError(Location(shown.encode("unicode_escape").decode(), 1, 1),
                                    "spec paths may hold only letters, digits and '_./-'; rename the file"))
            continue
        try:
            root, shown, sha = read_spec(path, shown)
            if isinstance(root.value, dict) and "block" in root.value:
                blocks.append(parse_block(root, shown, sha))
                continue
            kernel, structural = parse_kernel_partly(root, shown, sha)
            if structural:  # and, in the same run, the type errors that do not follow from those
                errors += structural + (check_partial_kernel(kernel) if kernel is not None else [])
                continue
            checked.append(Checked(kernel, check_kernel(kernel)))
        except ValidationFailed as e:
            errors += e.errors
    first: dict[str, Kernel] = {}
    for c in checked:
        k = c.kernel
        if k.name in first:
            errors.append(SpecError(k.loc, f"kernel '{k.name}' is already defined in {first[k.name].source}; "
                                           "kernel names are unique across specs"))
        first.setdefault(k.name, k)
    checked_blocks: list[CheckedBlock] = []
    block_first: dict[str, Block] = {}
    classes: dict[str, Block] = {}
    for b in blocks:
        if b.name in block_first or b.name in first:
            other = block_first.get(b.name) or first[b.name]
            errors.append(SpecError(b.loc, f"'{b.name}' is already defined in {other.source}; names are unique "
                                           "across specs"))
        block_first.setdefault(b.name, b)
        for cls in (class_name(b.name), f"{class_name(b.name)}Function"):  # blocks/__init__.py imports both
            other = classes.setdefault(cls, b)
            if other is not b:
                errors.append(SpecError(b.loc, f"block '{b.name}' generates the class {cls}, as block '{other.name}' "
                                               f"({other.source}) does; rename one of them"))
                break
        try:
            checked_blocks.append(check_block(b, first))
        except ValidationFailed as e:
            errors += e.errors
    if errors:
        raise ValidationFailed(errors)
    return [*checked, *checked_blocks]


def generate(paths: list[str | Path], out: str | Path = "generated") -> Generated:
    """Every file a build into `out` writes, in memory (`out` only shapes the regenerate command they show), and
    the specs, loaded and validated."""
    base = shown_from(paths, out)
    checked = load(paths, base)
    regenerate = f"codagen build {command_args(paths, out, base)}"
    result = OutputFiles()
    kernels = sorted((c for c in checked if isinstance(c, Checked)), key=lambda c: c.kernel.name)
    blocks = sorted((c for c in checked if isinstance(c, CheckedBlock)), key=lambda c: c.block.name)
    for rel, content in backends.render_backends([(c.kernel, c.types) for c in kernels], regenerate).items():
        result.add(rel, content)
    for c in blocks:
        result.add(f"blocks/{c.block.name}.py", render_block(c, regenerate))
    package = render_package([c.kernel for c in kernels], [c.block for c in blocks], regenerate)
    for rel, content in package.items():
        result.add(rel, content)
    specs = {b.path(c.kernel.name): c.kernel.loc for c in kernels for b in backends.BACKENDS}
    specs.update({f"blocks/{c.block.name}.py": c.block.loc for c in blocks})
    _check_compiles(result, specs)
    return Generated(checked, result)


def _check_compiles(files: OutputFiles, specs: dict[str, Location]) -> None:
    """Every generated module compiles, so that an accepted spec can never be written out as broken Python;
    one that does not is a bug of codagen's, reported at the spec it came from (`specs`: file -> spec)."""
    for rel, source in files.files.items():
        try:
            compile(source, rel, "exec")
        except SyntaxError as e:
            loc = specs.get(rel, Location(rel, e.lineno or 1, e.offset or 1))
            raise ValidationFailed([SpecError(loc, f"codagen generated {rel}, which does not compile ({e.msg}, "
                                                   f"line {e.lineno}): a bug in codagen; please report it with "
                                                   "this spec")]) from None


def build(paths: list[str | Path], out: str | Path = "generated") -> Built:
    """Generate into `out`; returns the specs and the files written and removed. Validation and rendering
    finish before any file is touched, so a failed build leaves `out` as it was."""
    generated = generate(paths, out)
    return Built(generated.specs, *write(generated.output, Path(out)))


def check(paths: list[str | Path], out: str | Path = "generated") -> Compared:
    """How `out` differs from what a build would write, and the specs."""
    generated = generate(paths, out)
    return Compared(generated.specs, diff(generated.output, Path(out)))


def _unlowered(c: Checked):
    """Why each backend besides tl (the Hopper backend's today) cannot lower a kernel: its Fallbacks."""
    return [f for b in backends.BACKENDS if b is not backends.TL for f in b.unlowered(c.kernel, c.types)]


def fallbacks(specs: Specs) -> list[str]:
    """Each step (file:line:col) that a backend besides tl cannot lower yet, and why: its kernel keeps the tl path
    only."""
    return [str(f) for c in specs if isinstance(c, Checked) for f in _unlowered(c)]


def backend_notes(specs: Specs, gpu: bool = True) -> list[str]:
    """What `codagen build` notes of the backends besides tl: each step one cannot lower yet (file:line:col), and in
    one line per reason the kernels it cannot take as a whole (no GEMM, ...), which keep the tl kernel only; that
    line only where the machine has a GPU (`gpu`), since it only says where their kernels will not run."""
    notes: list[str] = []
    whole: dict[str, list[str]] = {}
    for c in specs:
        if isinstance(c, Checked):
            for f in _unlowered(c):
                if f.step is None:
                    whole.setdefault(f.reason, []).append(c.kernel.name)
                else:
                    notes.append(str(f))
    if gpu:
        notes += [f"{len(names)} kernel(s) keep the tl kernel only ({reason}): {', '.join(sorted(names))}"
                  for reason, names in whole.items()]
    return notes


def stale_tuning_tables(specs: Specs, paths: list[str | Path], out: str | Path = "generated") -> list[str]:
    """The tuning tables under `out`/tuning/ that no kernel of the specs can use, each as a message that says
    why and what to do: a file that is no tuning table, or entries of a table that no launch of its kernel can use,
    as file:line:col errors; a table of a computation the kernel no longer performs (a comment or doc edit to a
    spec keeps its tables in use; an edit to what the kernel computes makes them stale), or of no kernel. Names
    from the disk are quoted, and the command to re-tune (over `paths`) is written from the keys' numbers only."""
    kernels = [c.kernel for c in specs if isinstance(c, Checked)]
    stale, errors = check_tables(Path(out) / "tuning", kernels)
    messages = [f"{e.located()}; delete {'the entry' if e.entry else 'it'}, or run codagen tune to write it again"
                for e in errors]
    for t in stale:
        fix = "delete it"
        if t.kernel is not None and t.shapes:
            fix = (f"re-run on a {quoted(t.gpu)} GPU: codagen tune {command_args(paths, out)} --kernels "
                   f"{shlex.quote(t.kernel.name)} --shapes {shlex.quote(','.join(t.shapes))}")
        messages.append(f"stale tuning table {quoted(display_path(t.path))}: {t.problem}; {fix}")
    return messages


def command_args(paths: list[str | Path], out: str | Path, base: Path | None = None) -> str:
    """The paths and --out of a codagen command, as a reader would type them into a shell: 'specs/ --out gen'.
    Paths are shown from `base` (`display_path`; default: the working directory). Raises PathError for a path
    that cannot be shown as it is (see `quote_path`)."""
    args = " ".join(sorted(quote_path(display_path(Path(p), base) + ("/" if Path(p).is_dir() else ""), "spec path")
                           for p in paths))
    out_arg = quote_path(display_path(Path(out), base), "--out")
    return args + ("" if out_arg == "generated" else f" --out {out_arg}")
