"""The line breaker of generated modules: one pass over a rendered module that breaks every line longer than
WIDTH columns, so that templates and emitters write each statement on one line and never measure it.

What it breaks, and how (nothing else changes; a line it cannot break stays as it is):

- code: inside the outermost brackets with the most inside, their items continued under the first one, or,
  where that takes as many lines or more, on lines of their own four columns in, the closing bracket alone
  after them; items inside brackets at their commas, then before their top-level ' + ', ' if ' and ' else '. A
  statement's comma list or sum (`return a, b`, `x = a + b`) is put in parentheses first, an assigned value
  or a target list (`a, b = ...`) where nothing else fits;
- a comment after code moves onto lines of its own above it; a comment is wrapped at spaces, continued two
  columns further in;
- a docstring's line is wrapped at spaces at its indentation (a list item's, `- ...`, continued two columns
  further in), and a one-line docstring that is too long gets its closing quotes on a line of their own.

The provenance header (the comment lines that open the module) is left as it is."""
from __future__ import annotations

import io
import textwrap
import tokenize

WIDTH = 120  # the longest line of a generated module, its header aside


def layout(source: str, width: int = WIDTH) -> str:
    """`source` with every line longer than `width` broken as the module's docstring says."""
    lines = source.split("\n")
    depth, docstring = _line_facts(source)
    out: list[str] = []
    header = True
    for n, line in enumerate(lines, 1):
        header = header and line.startswith("#")
        if len(line) <= width or header:
            out.append(line)
        elif n in docstring:
            out += _docstring_line(line, docstring[n], width)
        else:
            out += _code_line(line, depth.get(n, 0) > 0, width)
    return "\n".join(out)


def _line_facts(source: str) -> tuple[dict[int, int], dict[int, int]]:
    """The bracket depth at the start of each line, and the lines of docstrings (line -> the docstring's indent)."""
    depth: dict[int, int] = {}
    docstring: dict[int, int] = {}
    level, previous = 0, tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        depth.setdefault(tok.start[0], level)
        if tok.type == tokenize.OP and tok.string in "([{":
            level += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            level -= 1
        elif tok.type == tokenize.STRING and tok.string.startswith('"""') and previous in (
                tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            for n in range(tok.start[0], tok.end[0] + 1):
                docstring[n] = tok.start[1]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return depth, docstring


def _docstring_line(line: str, indent: int, width: int) -> list[str]:
    text = line.strip()
    if not text:
        return [line]
    closes = text.startswith('"""') and text.endswith('"""') and len(text) >= 6
    body = text[:-3] if closes else text
    pad = " " * (len(line) - len(line.lstrip(" ")) if not text.startswith('"""') else indent)
    hanging = "  " if text.startswith("- ") else ""  # a list item's lines continue under its text
    lines = textwrap.wrap(body, width - len(pad), subsequent_indent=hanging, break_long_words=False,
                          break_on_hyphens=False)
    return [pad + piece for piece in lines + (['"""'] if closes else [])]


def _code_line(line: str, inside: bool, width: int) -> list[str]:
    """A line of code (or a comment alone), `inside`: within brackets opened on an earlier line."""
    col = len(line) - len(line.lstrip(" "))
    text = line[col:]
    pad = " " * col
    at = _comment_at(text)
    if at is not None:
        code, comment = text[:at].rstrip(), text[at:]
        wrapped = textwrap.wrap(comment.lstrip("#").strip(), width - col - 4, break_long_words=False,
                                break_on_hyphens=False)
        # continued two columns further in, so that a comment that opens an epilogue step stays one comment
        comments = [f"{pad}{'  ' if i else ''}# {piece}" for i, piece in enumerate(wrapped)]
        if not code:
            return comments
        return comments + _code_line(pad + code, inside, width)
    first, *rest = _fit(text, col, width, inside)
    return [pad + first, *rest]


def _fit(text: str, col: int, width: int, inside: bool) -> list[str]:
    """`text` starting at column `col` (`inside` brackets: it may break at its commas, additions and conditional
    expressions): its first line without indentation, the others with theirs."""
    if col + len(text) <= width:
        return [text]
    if inside:
        items = _split(text, ", ")
        if len(items) > 1:
            return _pack([item + "," for item in items[:-1]] + [items[-1]], col, width)
        for operator in (" + ", " if ", " else "):
            terms = _split(text, operator)
            if len(terms) > 1:
                lines = [terms[0]]
                for term in terms[1:]:
                    first, *rest = _fit(operator.lstrip() + term, col, width, True)
                    lines += [" " * col + first, *rest]
                return lines
        return _at_brackets(text, col, width)
    grouped, sum_or_list = _grouped(text)
    if sum_or_list:  # a sum, or the comma list of `return`/`del`, breaks best between its terms
        return _at_brackets(grouped, col, width)
    candidates = [_at_brackets(text, col, width)]
    parts = _split(text, " = ")
    if len(parts) == 2:  # the value in parentheses of its own
        candidates.append(_at_brackets(f"{parts[0]} = ({parts[1]})", col, width))
    if grouped != text:  # a target list, only where nothing else breaks
        candidates.append(_at_brackets(grouped, col, width))
    return next((lines for lines in candidates if _fits(lines, col, width)), candidates[0])


def _at_brackets(text: str, col: int, width: int) -> list[str]:
    """`text` broken inside its outermost brackets with the most inside whose opening fits on the line: the items
    under the first one, or, where that takes as many lines or more, on lines of their own four columns in, the
    closing bracket alone after them."""
    brackets = _outer_brackets(text)
    if not brackets:
        return [text]
    opening_fits = [b for b in brackets if col + b[0] < width]
    open_at, close_at = max(opening_fits or brackets, key=lambda b: b[1] - b[0])
    head, tail = text[:open_at + 1], text[close_at:]
    items = _split(text[open_at + 1:close_at], ", ")
    commas = [item + "," for item in items[:-1]]
    first, *rest = _pack(commas + [items[-1] + tail], col + len(head), width)
    aligned = [head + first, *rest]
    # a trailing comma only after several items: one item and a comma in parentheses would make a tuple
    closing = _at_brackets(tail, col, width) if col + len(tail) > width else [tail]  # `) = f(...)`
    hanging = [head, *_pack(commas + [items[-1] + ("," if commas else "")], col + 4, width, indent_first=True),
               " " * col + closing[0], *closing[1:]]
    return aligned if _fits(aligned, col, width) and len(aligned) < len(hanging) else hanging


def _fits(lines: list[str], col: int, width: int) -> bool:
    return col + len(lines[0]) <= width and all(len(line) <= width for line in lines[1:])


def _pack(items: list[str], col: int, width: int, indent_first: bool = False) -> list[str]:
    """Items (each with its comma) over as few lines as fit from column `col`; an item too long alone is broken
    in turn. The first line without indentation (unless `indent_first`), the others with theirs."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 1 + len(item) <= width:
            lines[-1] += " " + item
        else:
            first, *rest = _fit(item, col, width, True)
            lines += [" " * col + first, *rest]
    if not indent_first:
        lines[0] = lines[0][col:]
    return lines


def _grouped(statement: str) -> tuple[str, bool]:
    """A statement whose comma list or sum can only break in parentheses, with them (`a, b = x` -> `(a, b) = x`,
    `return a, b` -> `return (a, b)`, `x = a + b` -> `x = (a + b)`), and whether that is a value's (not a
    target's); else the statement."""
    for keyword in ("return ", "del "):
        if statement.startswith(keyword) and _breaks_in_parentheses(statement[len(keyword):]):
            return f"{keyword}({statement[len(keyword):]})", True
    parts = _split(statement, " = ")
    if len(parts) == 2:
        target, value = parts
        if _breaks_in_parentheses(value):
            return f"{target} = ({value})", True
        if len(_split(target, ", ")) > 1:
            return f"({target}) = {value}", False
    return statement, False


def _breaks_in_parentheses(expr: str) -> bool:
    return len(_split(expr, ", ")) > 1 or len(_split(expr, " + ")) > 1


def _scan(text: str):
    """(index, character, bracket depth) of each character outside string literals, the depth counted before an
    opening bracket and after a closing one, so that both have the depth of the text around them."""
    depth, i, quote = 0, 0, None
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        else:
            if ch in ")]}":
                depth -= 1
            yield i, ch, depth
            if ch in "([{":
                depth += 1
        i += 1


def _comment_at(text: str) -> int | None:
    return next((i for i, ch, _ in _scan(text) if ch == "#"), None)


def _outer_brackets(text: str) -> list[tuple[int, int]]:
    """The (opening, closing) index of each bracket pair with something inside at the outermost depth of `text`
    (a line's tail may close brackets opened before it: `b) = f(x)`)."""
    scanned = list(_scan(text))
    outer = min((depth for _, _, depth in scanned), default=0)
    pairs, opened = [], None
    for i, ch, depth in scanned:
        if depth == outer and ch in "([{":
            opened = i
        elif depth == outer and ch in ")]}" and opened is not None:
            if i > opened + 1:
                pairs.append((opened, i))
            opened = None
    return pairs


def _split(text: str, separator: str) -> list[str]:
    """`text` split at the separators outside brackets, strings and a lambda's parameters (and before the end of
    a bracket that opened before `text`)."""
    cuts, params = [], False
    for i, ch, depth in _scan(text):
        if depth < 0:
            break
        if depth == 0 and text.startswith("lambda ", i) and (i == 0 or not text[i - 1].isidentifier()):
            params = True
        elif depth == 0 and ch == ":":
            params = False
        elif depth == 0 and not params and text.startswith(separator, i):
            cuts.append(i)
    bounds = [0, *(i + len(separator) for i in cuts)]
    return [text[a:b] for a, b in zip(bounds, [*cuts, len(text)])]
