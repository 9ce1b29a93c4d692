"""The torch.library ops of generated kernel modules: one op per kernel name in a process.

Every generated kernel module registers its op `codagen::<kernel>` here when it is imported. An op is one
name in one process-wide namespace, whatever package its module belongs to: two modules that register it
share `torch.ops.codagen.<kernel>`. So the first module to register a name creates the op; a later module
whose kernel has the same FINGERPRINT (the same computation, arguments and op schema: the same kernel built
into another package, or imported under another module name) is given that op, with the first module's
implementation and fake; a later module whose kernel has the same name but computes something else is refused at
import, since one of the two would otherwise run the other's kernel.

Serving the later module with the first module's implementation runs the same computation; only its launch
configurations can differ, since each package reads its own tuning tables (`TUNING`): a call through the op
uses the first package's tables, which may change the tile shape and so the rounding of fp32 sums, never
what is computed. The fake stays the first module's too, so that the shapes it gives for partial-reduction
buffers (which follow the tile shape) are those the implementation allocates. Eager calls that skip the op
run the calling module's own launcher with its own tables."""
from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

NAMESPACE = "codagen"


@dataclass(frozen=True)
class RegisteredOp:
    """A kernel op and the module that created it."""

    op: torch._ops.OpOverload
    module: str
    spec: str
    fingerprint: str


_OPS: dict[str, RegisteredOp] = {}  # kernel name -> its op in this process
_LOCK = threading.Lock()  # modules imported from several threads register one at a time
_LIBRARIES: dict[str, torch.library.Library] = {}  # a namespace's registrations live as long as its Library


def define_op(qualname: str, fn: Callable, *, mutates_args: tuple[str, ...], fake: Callable,
              refusal: Callable[[], str] | None = None) -> torch._ops.OpOverload:
    """The op `qualname` (namespace::name), with the schema of fn's annotations, fn as its implementation on every
    device and `fake` as its fake.

    Defined through torch.library's Library rather than torch.library.custom_op: a call of a custom_op passes three
    Python layers (its autograd kernel, an ADInplaceOrView kernel, and a check that outputs alias no input) before
    fn, about 12 us against 1.4 us here, and a compiled step calls an op per kernel launch, hundreds a step. So the
    two things those layers gave are done here: mutated arguments' version counters are bumped, and with
    `refusal` a call that autograd would record is refused, with refusal()'s message, before it runs (a kernel op
    has no backward; autograd's own fallback would only warn once the backward reached it)."""
    namespace, name = qualname.split("::")
    library = _LIBRARIES.get(namespace)
    if library is None:
        library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    library.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args),
                   tags=(torch.Tag.pt2_compliant_tag,))
    overload = getattr(getattr(torch.ops, namespace), name).default
    mutated = [i for i, argument in enumerate(overload._schema.arguments)
               if argument.alias_info is not None and argument.alias_info.is_write]

    def implementation(*args, **kwargs):
        if refusal is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
            raise RuntimeError(refusal())
        result = fn(*args, **kwargs)
        for i in mutated:  # autograd's check that a saved tensor was not changed in place
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return result

    library.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, lowered_as_fallback(overload, fake), lib=library)
    return overload


def kernel_op(name: str, fingerprint: str, spec: str, module: str, *, mutates_args: tuple[str, ...],
              fake: Callable) -> Callable[[Callable], torch._ops.OpOverload]:
    """Decorator of a generated module's op function: the op `codagen::<name>`, created on the first
    registration of `name` (with `fake` as its fake implementation; a call that autograd would record is refused,
    since kernel ops have no backward); the op already registered for `name` when that one's kernel has the
    same `fingerprint`. Raises ImportError when it has another fingerprint, or when something other than a
    generated module defined `codagen::<name>`."""

    def register(fn: Callable) -> torch._ops.OpOverload:
        with _LOCK:
            first = _OPS.get(name)
            if first is None:
                if hasattr(getattr(torch.ops, NAMESPACE), name):
                    raise ImportError(
                        f"{module} ({spec}): the op {NAMESPACE}::{name} is already defined in this process, "
                        "not by a module generated with this codagen runtime (a module generated by an older "
                        f"codagen, or a torch.library registration of its own); rename the kernel '{name}' in "
                        f"{spec}, or do not import both in one process")
                op = define_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args, fake=fake,
                               refusal=lambda: no_backward(name, module))
                _OPS[name] = RegisteredOp(op, module, spec, fingerprint)
                return op
            if first.fingerprint != fingerprint:
                raise ImportError(
                    f"{module} defines the kernel '{name}' from {spec}, but {first.module} already registered "
                    f"the op {NAMESPACE}::{name} in this process for a different kernel '{name}', from "
                    f"{first.spec} (fingerprints {fingerprint[:12]} and {first.fingerprint[:12]}): both would "
                    f"share torch.ops.{NAMESPACE}.{name}, and one would run the other's kernel. Rename the kernel "
                    "in one of the specs (its `kernel:` name) and rebuild, or do not import both packages in "
                    "one process")
            return first.op

    return register


def no_backward(kernel: str, module: str) -> str:
    """The refusal of a kernel op's call that autograd would record: it points to the differentiable API, the blocks."""
    blocks = module.rsplit(".", 2)[0] + ".blocks"
    return (f"torch.ops.{NAMESPACE}.{kernel} has no backward: kernel ops are not differentiable. The differentiable "
            f"API is the block modules of {blocks} (nn.Modules and their torch.autograd.Functions), whose backward "
            "runs the backward kernels; call kernels under torch.no_grad() or on tensors that do not require grad")


def opaque_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator of a runtime function that launches a Triton kernel itself (the finish steps, merge_heads): while
    torch.compile traces, the function runs as the opaque op `codagen_runtime::<name>` with `fake` for its outputs'
    shapes; other calls run it as it is. Traced as a user-defined Triton kernel instead, each call site would be
    compiled to Triton IR once more for Inductor's mutation analysis (minutes for a 16-layer model's first step),
    and Triton's interpreter (no GPU) cannot be traced at all: as an op, a compiled model is one graph, the same
    on the CPU and on a GPU."""

    def wrap(fn: Callable) -> Callable:
        op = define_op(f"codagen_runtime::{name}", fn, mutates_args=mutates_args, fake=fake)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            return (op if torch.compiler.is_compiling() else fn)(*args, **kwargs)

        return run

    return wrap


def lowered_as_fallback(overload: torch._ops.OpOverload, fake: Callable) -> Callable:
    """`fake`, which also gives Inductor its lowering of `overload` the first time it runs while Inductor is loaded
    (AOTAutograd traces with the fakes before Inductor lowers the graph): the fallback, a call of the op, with the
    layout constraint Inductor's implicit fallback would take. Inductor before PyTorch 2.13 makes an implicit
    fallback's log message eagerly, the op's arguments as text, and the text of an IR node holds that of all its
    inputs: through a decoder of codagen ops that is the whole graph once per path (minutes for a 16-layer model's
    first compiled step). Registered first, no op of codagen's takes that path."""

    @functools.wraps(fake)
    def fake_and_lowering(*args, **kwargs):
        _lower_as_fallback(overload)
        return fake(*args, **kwargs)

    return fake_and_lowering


def _lower_as_fallback(overload: torch._ops.OpOverload) -> None:
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None or overload in lowering.lowerings:
        return
    try:
        from torch._library.utils import get_layout_constraint_tag

        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(overload, with_default=True))
        lowering.make_fallback(overload, layout_constraint=constraint, warn=False)
    except (AttributeError, ImportError, TypeError):  # another PyTorch's internals: Inductor's implicit fallback
        pass
