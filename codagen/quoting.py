"""Names from the disk or from a file (paths, a table's keys) as messages and suggested commands show them.
Standard library only: the generator and the runtime both quote with it."""
from __future__ import annotations

import shlex
import unicodedata

# characters that end a line, or change or hide what is shown: controls (newline, carriage return, escape),
# format characters (bidirectional overrides), line and paragraph separators, lone surrogates
UNSHOWABLE = ("Cc", "Cf", "Zl", "Zp", "Cs")


def showable(text: str) -> bool:
    """Whether `text` can be printed as it is: no character of it could end a line or hide itself."""
    return not any(unicodedata.category(c) in UNSHOWABLE for c in text)


def quoted(text) -> str:
    """A name as messages show it: quoted for a shell where it needs quotes (as spec paths are, api.quote_path), or,
    when it holds a character that could end a line or hide itself, escaped on one line as Python's ascii() writes
    it, so that no name can forge a line of output or a command."""
    text = str(text)
    return shlex.quote(text) if showable(text) else ascii(text)
