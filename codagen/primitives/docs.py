"""What is generated from the registries outside the kernels: the step section of the JSON Schema
(codagen/schema/kernel.schema.json, `$defs.step`; its reserved names come from codagen/names.py) and the
tables of primitives, of reductions and of finish steps (codagen/finish_steps) in docs/spec-reference.md
(between `<!-- generated: NAME -->` and `<!-- end: NAME -->`).

    python -m codagen.primitives.docs           rewrite them
    python -m codagen.primitives.docs --check   fail, naming the files, if they are out of date (CI runs this)"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from .. import names
from ..finish_steps import combining
from ..finish_steps.docs import finish_table, kinds_list
from . import PRIMITIVES, Primitive
from .base import Arg
from .reduce import REDUCTIONS

ROOT = Path(__file__).resolve().parents[2]  # the repository (codagen is installed from it in editable mode)
SCHEMA = "codagen/schema/kernel.schema.json"
REFERENCE = "docs/spec-reference.md"
WIDTH = 120

_REF = {"index": "#/$defs/index_input", "out": "#/$defs/new_value", "target": "#/$defs/output_name"}


# -- the schema ---------------------------------------------------------------------------------------------
def _arg_schema(a: Arg) -> dict:
    if a.kind == "enum":
        return {"enum": list(a.choices)}
    if a.kind == "value":
        return {"$ref": "#/$defs/operand" if a.number else "#/$defs/value"}
    return {"$ref": _REF[a.kind]}


def _primitive_schema(p: Primitive) -> dict:
    return {"description": f"{p.doc.removesuffix('.')}. {p.typing}", "type": "object", "additionalProperties": False,
            "required": [a.name for a in p.args], "properties": {a.name: _arg_schema(a) for a in p.args}}


def step_schema() -> dict:
    return {"description": "One step: a mapping with exactly one key, the primitive.", "type": "object",
            "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
            "properties": {name: _primitive_schema(p) for name, p in PRIMITIVES.items()}}


def render_schema(text: str) -> str:
    """The schema with its step section replaced by the registry's, and the names it refuses by
    codagen/names.py's."""
    schema = json.loads(text)
    schema["$defs"]["step"] = step_schema()
    schema["$defs"]["reserved_generated"]["enum"] = sorted(names.RESERVED)
    schema["$defs"]["reserved_generated"]["description"] = (
        "Names in scope wherever a spec name is in generated code (codagen/names.py RESERVED); the generated "
        "code's other names start with '_'.")
    name = schema["$defs"]["name"]
    name["not"]["anyOf"] = name["not"]["anyOf"][:2]
    shown = ", ".join(sorted(names.RESERVED))
    name["description"] = ("A name: lowercase ASCII letters, digits and '_', starting with a letter, at most 48 "
                           f"characters; not a Python keyword or builtin, nor one of {shown}.")
    return _json(schema, 0, 0) + "\n"


def _json(value, indent: int, used: int) -> str:
    """JSON on one line where it fits in WIDTH columns (`used`: those the line already has), else one member
    per line; lists of plain values are packed into lines."""
    flat = json.dumps(value, ensure_ascii=False)
    if used + len(flat) + 1 <= WIDTH or not isinstance(value, (dict, list)) or not value:
        return flat
    inner, close = " " * (indent + 2), " " * indent
    if isinstance(value, dict):
        members = []
        for k, v in value.items():
            key = json.dumps(k, ensure_ascii=False) + ": "
            members.append(inner + key + _json(v, indent + 2, indent + 2 + len(key)))
        return "{\n" + ",\n".join(members) + "\n" + close + "}"
    if any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _json(v, indent + 2, indent + 2) for v in value) + "\n" + close + "]"
    lines, line = [], ""
    for v in value:
        piece = json.dumps(v, ensure_ascii=False)
        if line and len(inner) + len(line) + len(piece) + 3 > WIDTH:
            lines.append(line + ",")
            line = piece
        else:
            line = f"{line}, {piece}" if line else piece
    return "[\n" + "\n".join(inner + x for x in [*lines, line]) + "\n" + close + "]"


# -- the docs -----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*")


def _arguments(p: Primitive) -> str:
    names = "`{" + ", ".join(a.name for a in p.args) + "}`"
    keywords = [f"{a.name}: " + " ".join(f"`{c}`" for c in a.choices) for a in p.args if a.kind == "enum"]
    return "<br>".join([names, *keywords])


def primitive_table() -> str:
    rows = ["| primitive | arguments | what it computes | typing | example step |", "|---|---|---|---|---|"]
    rows += [f"| `{p.name}` | {_arguments(p)} | {_cell(p.doc)} | {_cell(p.typing)} | `- {p.example}` |"
             for p in PRIMITIVES.values()]
    return "\n".join(rows)


def reduction_table() -> str:
    rows = ["| `op` | partial (over the in-range elements of one tile) | combine the partials with | finish steps "
            "that combine them |", "|---|---|---|---|"]
    for r in REDUCTIONS:
        steps = ", ".join(f"`{s}`" for s in combining(r.name)) or "none"
        rows.append(f"| `{r.name}` | `{r.partial}` | `{r.combine}` | {steps} |")
    return "\n".join(rows)


def reserved_names() -> str:
    """The names of codagen/names.py, as a list."""
    def item(text: str) -> str:
        return textwrap.fill(text, 110, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
    modules = ", ".join(f"`{n}`" for n in sorted(names.MODULES))
    functions = ", ".join(f"`<kernel>_{f}`" for f in names.KERNEL_FUNCTIONS)
    taken = ", ".join(f"`{n}`" for n in sorted(names.TAKEN_KERNEL_NAMES))
    return "\n".join([
        item(f"`{names.CONFIG}`, the keyword argument of every generated `launch()`, and `acc`, the GEMM "
             "accumulator;"),
        item(f"{modules}: the modules a generated kernel module imports, and its `launch`;"),
        item(f"in a kernel, {functions}: the functions of its generated module;"),
        item(f"as a kernel's name, {taken}: an attribute of torch's op namespace `torch.ops.codagen`."),
    ])


TABLES = {"primitives": primitive_table, "reductions": reduction_table, "reserved": reserved_names,
          "finish_kinds": kinds_list, "finish_steps": finish_table}


def render_reference(text: str, path: str = REFERENCE) -> str:
    """The reference with each generated table replaced by the registry's."""
    for name, table in TABLES.items():
        pattern = re.compile(rf"(<!-- generated: {name} [^\n]*-->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{path}: no '<!-- generated: {name} ... -->' ... '<!-- end: {name} -->' markers")
        text = pattern.sub(lambda m: m.group(1) + table() + "\n" + m.group(2), text)
    return text


# -- files --------------------------------------------------------------------------------------------------
def generated(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """Relative path -> (current text, generated text) of each file."""
    schema = (root / SCHEMA).read_text(encoding="utf-8")
    reference = (root / REFERENCE).read_text(encoding="utf-8")
    return {SCHEMA: (schema, render_schema(schema)), REFERENCE: (reference, render_reference(reference))}


def outdated(root: Path = ROOT) -> list[str]:
    return [rel for rel, (now, want) in generated(root).items() if now != want]


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the files that are out of date; returns them."""
    stale = []
    for rel, (now, want) in generated(root).items():
        if now != want:
            (root / rel).write_text(want, encoding="utf-8")
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codagen.primitives.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail if a file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = outdated()
        for rel in stale:
            print(f"stale: {rel}", file=sys.stderr)
        if stale:
            print("generated from the primitive and finish-step registries; run: python -m codagen.primitives.docs",
                  file=sys.stderr)
            return 1
        print(f"{SCHEMA} and {REFERENCE} are up to date")
        return 0
    for rel in write():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
