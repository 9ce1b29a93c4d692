"""The import graph of codagen/ has no circles: every module imports only modules that do not import it back,
directly or through others, so that the package reads (and loads) bottom-up. And nothing under codagen/, benchmarks/
or tests/ imports the scripts of examples/ (test_nothing_imports_the_examples).

The graph is read from the source with ast, without importing anything: every `import` and `from ... import`
statement of a module, at module level and inside functions alike (an import inside a function is a dependency
too, only a later one), relative ones resolved. `from package import name` is an edge to the submodule
package.name where there is one, else to the package. Two kinds of statements are not edges:

- a module's import of a package it lies in (`from . import INTERPRETED` in codagen/runtime/launcher.py): Python
  imports a module's packages before the module itself, so that edge is there whatever the module says, and
  a package's __init__.py that imports its own submodules is how packages are made;
- imports under `if TYPE_CHECKING:` are edges of a second graph, checked as well (a type named from a module
  that imports this one is a circle for a reader, if not for Python)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "codagen"

def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__.py), for every .py file under root."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_only: bool = False):
    """(import statement, whether it is under `if TYPE_CHECKING:`) for every import in the tree."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_only)
        else:
            yield from _imports(node, type_only)


def graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The import graph of the package under root: (edges run at import or call time, type-only edges)."""
    mods = modules(root)
    run: dict[str, set[str]] = {m: set() for m in mods}
    typed: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, package) in mods.items():
        here = name.split(".") if package else name.split(".")[:-1]
        for node, type_only in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
            for target in targets:
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    (typed if type_only else run)[name].add(target)
    return run, typed


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _shown(found: list[list[str]], edges: dict[str, set[str]]) -> str:
    return "\n".join(f"{' <-> '.join(c)}:\n" + "\n".join(f"  {m} imports {', '.join(sorted(edges[m] & set(c)))}"
                                                         for m in c) for c in found)


def test_no_import_circles():
    run, _ = graph()
    found = circles(run)
    assert not found, f"import circles in codagen/:\n{_shown(found, run)}"


def test_no_import_circles_with_type_only_imports():
    run, typed = graph()
    both = {m: run[m] | typed[m] for m in run}
    found = circles(both)
    assert not found, f"import circles in codagen/, type-only imports included:\n{_shown(found, both)}"


def test_graph_reads_every_kind_of_import(tmp_path):
    """The reader itself, on a small package: module-level, function-level, relative, `from package import
    submodule`, type-only imports and a submodule's import of its own package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from .b import g\n    return g\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nimport pkg.sub.c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\nfrom . import d\nfrom pkg import sub\n",
        "sub/d.py": "import os\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    run, typed = graph(pkg)
    assert run == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(),
                   "pkg.sub.c": {"pkg.a", "pkg.sub.d"}, "pkg.sub.d": set()}
    assert typed["pkg.b"] == {"pkg.a"}
    assert circles(run) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


REPO = PACKAGE.parent
EXAMPLES = REPO / "examples"


def examples_imported(root: Path) -> list[str]:
    """`file:line: module` for each import, in a .py file under root, of examples/ or of a script in it by its own
    name (as after putting examples/ on sys.path)."""
    scripts = {path.stem for path in EXAMPLES.glob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: inside root's own packages
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.relative_to(root.parent)}:{node.lineno}: {name}" for name in names
                      if name.partition(".")[0] in {"examples", *scripts}]
    return found


@pytest.mark.parametrize("folder", ["codagen", "benchmarks", "tests"])
def test_nothing_imports_the_examples(folder):
    """examples/ holds scripts that use the library; the library, the benchmarks and the tests import the library
    (codagen.*), never a script: what a script shares goes into codagen (codagen.training, for instance), and the
    tests run the scripts as scripts."""
    found = examples_imported(REPO / folder)
    assert not found, "imports of examples/:\n" + "\n".join(found)


def test_examples_imported_finds_each_kind_of_import(tmp_path):
    (tmp_path / "a.py").write_text("import examples.convergence\nfrom examples import demo\n"
                                   "def f():\n    from convergence import main\n    from . import examples\n")
    assert examples_imported(tmp_path) == [f"{tmp_path.name}/a.py:1: examples.convergence",
                                           f"{tmp_path.name}/a.py:2: examples",
                                           f"{tmp_path.name}/a.py:4: convergence"]
