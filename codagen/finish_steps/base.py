"""What a finish step is: its arguments, type rule, the reductions whose partials it combines, its runtime
function and its description. The family modules build the steps; codagen/finish_steps/__init__.py lists
them."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol

from ..blockmodel import Arg, Block, BlockStep, Partial, Value


# What a finish step's type rule is handed, as far as the rules rely on it. The class itself, FinishCheck, lives in
# codagen/blockcheck.py, which imports this registry; naming it here would make this module import it back.
class Checker(Protocol):
    """A type rule's view of one block step: codagen.blockcheck.FinishCheck."""

    op: str
    step: BlockStep
    block: Block

    def type(self, arg: str) -> Value | Partial | None:
        """The type of a value argument; None for a number, an attr or an argument left out."""

    def arg(self, arg: str) -> Arg | None:
        """The resolved argument; None where it is left out."""

    def error(self, message: str, at: str | None = None) -> None:
        """Report an error at the step, or at the value of argument `at`."""

# The kinds of a finish step's argument: what a block step may pass for it. Each is checked where the step is
# resolved (codagen/blockcheck.py), before the step's own type rule runs; the docs' table says them in words.
KINDS = {
    "partials": "a value holding the partials of one of the reductions the step combines (a kernel's "
                "`reduce` output, [rows, tiles(...)] float32)",
    "value": "a value name",
    "operand": "a value name, a number or an int/float attr",
    "size": "an int attr or a positive integer (a count or a divisor: 0 or -1 would fail or mislead at run time)",
    "int": "an int attr or any integer (`ignore_index: -100`, as PyTorch's)",
    "number": "an attr or a number",
    "choice": "one of `choices`, or a choice attr whose choices are all among them",
    "keyword": "one of `choices`, as written (no attr)",
    "kernel": "a kernel spec's name",
    "out": "a new value name, or `_` (discarded)",
}


@dataclass(frozen=True)
class FinishArg:
    name: str
    kind: str  # one of KINDS
    optional: bool = False  # may be left out (the runtime function's default applies)
    choices: tuple[str, ...] = ()  # of a choice or keyword
    what: str = ""  # what it must be beyond its kind, for the docs: "`[M]` index"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"finish argument {self.name}: unknown kind {self.kind!r}; kinds: {', '.join(KINDS)}")


@dataclass(frozen=True)
class FinishStep:
    name: str
    args: tuple[FinishArg, ...]  # in the order the generated block passes them (by keyword) and the docs list them
    doc: str  # what it makes, for the docs' table
    example: str  # one block step in flow style, without the leading '- '
    # its type rule: the types (blockmodel.Value or Partial) of the values its `out` arguments define, in their
    # order; None after reporting an error. `c` is a codagen.blockcheck.FinishCheck
    check: Callable[[Checker], list | None]
    combines: tuple[str, ...] = ()  # the reductions (codagen/primitives/reduce.py) whose partials it takes

    @property
    def runtime(self) -> Callable:
        """The function the generated block calls, `finish.<name>(...)` of codagen/runtime/finish.py, its
        arguments by keyword (imported on first use: loading and checking specs must not import torch)."""
        return getattr(importlib.import_module("codagen.runtime.finish"), self.name)

    @property
    def outs(self) -> tuple[FinishArg, ...]:
        return tuple(a for a in self.args if a.kind == "out")


def fmt(dims) -> str:
    """A block shape as messages write it: [M, tiles(vocab)]."""
    return "[" + ", ".join(str(d) for d in dims) + "]"
