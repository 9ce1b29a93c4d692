"""The finish-step section of docs/spec-reference.md, from the registry: the argument kinds and the table of
steps. codagen/primitives/docs.py writes and checks it with the primitives' tables
(`python -m codagen.primitives.docs [--check]`)."""
from __future__ import annotations

from . import FINISH_STEPS, KINDS, FinishArg, FinishStep


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _codes(words) -> str:
    return "/".join(f"`{w}`" for w in words)


def _argument(a: FinishArg, s: FinishStep) -> str:
    name = f"`{a.name}{'?' if a.optional else ''}`"
    if a.kind == "partials":
        kind = f"partials of {_codes(s.combines)}"
    elif a.kind == "choice":
        kind = f"choice {_codes(a.choices)}"
    elif a.kind == "keyword":
        kind = _codes(a.choices)
    else:
        kind = a.kind
    return " ".join(part for part in (name, kind, a.what) if part)


def _arguments(s: FinishStep) -> str:
    return ", ".join(_argument(a, s) for a in s.args)


def kinds_list() -> str:
    return "\n".join(f"- *{kind}*: {text};" if i < len(KINDS) - 1 else f"- *{kind}*: {text}."
                     for i, (kind, text) in enumerate(KINDS.items()))


def finish_table() -> str:
    rows = ["| step | arguments | makes | example step |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {_cell(_arguments(s))} | {_cell(s.doc)} | `- {s.example}` |"
             for s in FINISH_STEPS.values()]
    return "\n".join(rows)
