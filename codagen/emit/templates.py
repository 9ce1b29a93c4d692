"""The Jinja environment of the generated files: strict about undefined names, nothing autoescaped
(the output is Python source), whitespace controlled by the templates."""
from __future__ import annotations

import jinja2

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("codagen", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


def render(template: str, **context) -> str:
    return _ENV.get_template(template).render(**context)
