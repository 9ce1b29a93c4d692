"""The Jinja environment of the generated files: strict about undefined names, nothing autoescaped
(the output is Python source), whitespace controlled by the templates. Every rendered module goes through the
line breaker (layout.py) once: templates and emitters write each statement on one line."""
from __future__ import annotations

import jinja2

from .layout import layout

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("codagen", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


def _pytuple(items) -> str:
    """Source items as a Python tuple: `(a, b)`, `(a,)`, `()`."""
    items = list(items)
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _keywords(names) -> str:
    """Names passed on by name: `a=a, b=b`."""
    return ", ".join(f"{n}={n}" for n in names)


_ENV.filters.update(pytuple=_pytuple, keywords=_keywords)


def render(template: str, **context) -> str:
    return layout(_ENV.get_template(template).render(**context))
