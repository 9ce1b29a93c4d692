"""Which names a spec may use. Spec names become Python and Triton identifiers in generated code, so they
are checked against a strict pattern and every name the generated code itself uses."""
from __future__ import annotations

import builtins
import keyword
import re

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,47}")

# Locals and module names of the generated kernels, launchers and blocks.
INTERNAL = frozenset("""
    tl triton torch math functools runtime tile codagen generated acc pid pid_m pid_n num_pid_m num_pid_n
    num_pid_in_group group_id first_pid_m group_size_m k0 a_tile b_tile rows cols cols_half cols_double
    row_mask col_mask col_mask_half col_mask_double tile_mask tile_mask_half tile_mask_double
    config grid device dtype out outs ctx self args kwargs library op fake meta m n k
""".split())


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a spec identifier, or None when it can."""
    if not isinstance(name, str):
        return "expected a name"
    if not IDENTIFIER.fullmatch(name):
        return (f"'{_shorten(name)}' is not a valid name: use lowercase ASCII letters, digits and '_', "
                "starting with a letter, at most 48 characters")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"'{name}' is a Python keyword; choose another name"
    if hasattr(builtins, name):
        return f"'{name}' is a Python builtin; choose another name"
    if name in INTERNAL or name.endswith(("_ptr", "_ptrs")) or name.startswith(("stride_", "offs_")):
        return f"'{name}' is reserved for generated code; choose another name"
    return None


def _shorten(s: str, n: int = 40) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= n else s[:n] + "..."
