"""What a primitive is: its arguments, type rule, emitters per backend, float64 reference and description.
The family modules build the primitives; codagen/primitives/__init__.py lists them."""
from __future__ import annotations

import importlib
import string
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from ..model import Step, ValueType


# What a primitive's functions are handed, as far as this module relies on it. The classes themselves live in
# the modules that use the registry (codagen/primitives/__init__.py describes them); naming them here would
# make this module, which they import, import them back.
class Checker(Protocol):
    """A type rule's view of one step: codagen.validate.StepCheck."""

    def typed(self, arg: str) -> ValueType | None: ...


class Evaluator(Protocol):
    """The float64 reference's view of a kernel's values: codagen.reference.Evaluation."""


class Emitter(Protocol):
    """A backend's epilogue emitter: codagen.emit.epilogue.EpilogueEmitter, or a backend's subclass of it."""

    lang: str  # the language module, as generated code names it

    def elementwise(self, s: Step, template: str, operands: dict[str, object]) -> None: ...


@dataclass(frozen=True)
class Arg:
    name: str
    # value: a value name (or a number where `number` is set); index: an index input's name;
    # enum: one of `choices`; out: the value this step defines; target: the output it writes
    kind: str
    number: bool = False
    choices: tuple[str, ...] = ()


X = Arg("x", "value")
OUT = Arg("out", "out")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")

EmitFn = Callable[[Emitter, Step], None]


@dataclass(frozen=True)
class Primitive:
    name: str
    args: tuple[Arg, ...]
    doc: str  # what it computes, in a sentence: the schema's hover text and the docs' table
    typing: str  # what its arguments must be and what it defines or writes
    example: str  # one step in flow style, without the leading '- '
    check: Callable[[Checker], ValueType | None]  # the type of the value it defines (None: error, or none)
    reference: Callable[[Evaluator, Step], object]  # the value it defines, or the tensor it writes
    emitters: Mapping[str, EmitFn] = field(default_factory=dict)  # backend name -> emitter

    @property
    def target(self) -> Arg | None:
        """The argument naming the output this primitive writes, if it writes one."""
        return next((a for a in self.args if a.kind == "target"), None)


def same_type(c: Checker) -> ValueType | None:
    """The rule of elementwise steps on one value: the result has the kind and width of x."""
    return c.typed("x")


def expression(template: str) -> EmitFn:
    """An emitter for `out = template`, elementwise (once per half of a pair), where `{x}`, `{y}`, ... stand for
    the step's value arguments and `{lang}` for the backend's language module (`tl`)."""
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f and f != "lang"]

    def emit(e: Emitter, s: Step) -> None:
        e.elementwise(s, template.replace("{lang}", e.lang), {name: s.args[name] for name in names})
    return emit


class _Lazy:
    """A module imported on first use: loading and checking specs must not import torch."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


torch = _Lazy("torch")
F = _Lazy("torch.nn.functional")

