"""Which names a spec may use. Spec names become Python and Triton identifiers in generated code, so they
are checked against a strict pattern and every name the generated code itself uses."""
from __future__ import annotations

import builtins
import keyword
import re
import unicodedata

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,47}")

# Locals and module names of the generated kernels, launchers and blocks.
INTERNAL = frozenset("""
    tl triton torch math functools runtime tile codagen generated acc pid pid_m pid_n num_pid_m num_pid_n
    num_pid_in_group group_id first_pid_m group_size_m k0 a_tile b_tile rows cols cols_half cols_even
    cols_odd row_mask col_mask col_mask_half tile_mask tile_mask_half
    config grid device dtype out outs ctx self args kwargs library op fake meta m n k
    launch values sizes t_dtype tensors key plan tma tile_id offs_k path
""".split())


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a spec identifier, or None when it can."""
    if not isinstance(name, str):
        return "expected a name"
    if not IDENTIFIER.fullmatch(name):
        return f"'{_shorten(name)}' is not a valid name: {_why_invalid(name)}"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"'{name}' is a Python keyword; choose another name"
    if hasattr(builtins, name):
        return f"'{name}' is a Python builtin; choose another name"
    # *_even and *_odd: the halves of a value of interleaved pairs (see emit/epilogue.py)
    if name in INTERNAL or name.endswith(("_ptr", "_ptrs", "_even", "_odd")) or name.startswith(("stride_", "offs_")):
        return (f"'{name}' is reserved for generated code (names such as acc, tl, *_ptr, *_even, *_odd, stride_* "
                "and offs_* are taken); choose another name")
    return None


_RULE = "use lowercase ASCII letters, digits and '_', starting with a letter, at most 48 characters"


def _why_invalid(name: str) -> str:
    foreign = next((c for c in name if ord(c) > 127), None)
    if foreign is not None:
        label = unicodedata.name(foreign, "unnamed character")
        return f"it contains the non-ASCII character U+{ord(foreign):04X} ({label}); {_RULE}"
    if not name:
        return f"it is empty; {_RULE}"
    if len(name) > 48:
        return f"it is {len(name)} characters long; {_RULE}"
    if not ("a" <= name[0] <= "z"):
        return f"it must start with a lowercase letter; {_RULE}"
    other = next((c for c in name if not (c.islower() or c.isdigit() or c == "_")), None)
    if other is not None and other.isupper():
        return f"it contains the capital letter '{other}'; {_RULE}"
    if other is not None:
        return f"it contains '{_shorten(other)}'; {_RULE}"
    return _RULE


def _shorten(s: str, n: int = 40) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= n else s[:n] + "..."
