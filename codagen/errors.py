"""Errors for people: each names the file, line and column, and says what was expected."""
from __future__ import annotations

from .model import Location


class SpecError(Exception):
    def __init__(self, loc: Location, message: str):
        super().__init__(f"{loc}: {message}")
        self.loc = loc
        self.message = message


class ValidationFailed(Exception):
    """All the errors found in a set of specs, reported together."""

    def __init__(self, errors: list[SpecError]):
        self.errors = sorted(errors, key=lambda e: (e.loc.file, e.loc.line, e.loc.col))
        super().__init__("\n".join(str(e) for e in self.errors))


class ErrorSink:
    """Collects errors so that one pass reports every problem of a file."""

    def __init__(self):
        self.errors: list[SpecError] = []

    def add(self, loc: Location, message: str) -> None:
        self.errors.append(SpecError(loc, message))

    def raise_if_any(self) -> None:
        if self.errors:
            raise ValidationFailed(self.errors)
