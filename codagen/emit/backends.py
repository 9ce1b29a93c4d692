"""The generator's backends: each renders a module per kernel it lowers into a folder of its own under the output
folder. `codagen.api.generate` asks each backend once per kernel whether it lowers it (`unlowered`), renders the
modules of those it does, and writes its folder's __init__.py where it has one.

The "tl" backend (Triton's language: emit/kernel.py, templates/kernel.py.j2) lowers every kernel, and its module
is the one users import: its launcher runs another backend's module of the same kernel where the config says so
(the `backend` of its config type, codagen/tileconfig.py CONFIGS; codagen/runtime/backends.py). docs/design.md
("Backends") lists what a new backend touches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..model import Kernel, ValueType
from . import gluon
from .epilogue import EpilogueEmitter
from .kernel import render_kernel

Types = dict[str, ValueType]


@dataclass(frozen=True)
class Backend:
    name: str  # as its config type's `backend` (codagen.tileconfig.CONFIGS) and each primitive's `emitters` name it
    emitter: type[EpilogueEmitter]  # its epilogue emitter (emitter.backend is `name`)
    folder: str  # where its modules go, under the output folder
    # why it cannot lower a kernel: a Fallback (file:line:col, reason) per step or for the kernel; none: it lowers it
    unlowered: Callable[[Kernel, Types], list[gluon.Fallback]]
    # a kernel's module: (kernel, types, the command that regenerates it, the names of the backends that lower it)
    render: Callable[[Kernel, Types, str, frozenset[str]], str]
    # its folder's __init__.py, from the kernels it lowers and the Fallbacks of those it does not; None: none
    package: Callable[[list[Kernel], list[gluon.Fallback], str], str] | None = None

    def path(self, kernel: str) -> str:
        """Where a kernel's module goes, under the output folder."""
        return f"{self.folder}{kernel}.py"


TL = Backend(
    name="tl", emitter=EpilogueEmitter, folder="kernels/",
    unlowered=lambda k, types: [],
    # the tl launcher runs the module of another backend that lowers the kernel where the config names it
    render=lambda k, types, regenerate, lowering: render_kernel(k, types, regenerate, others=bool(lowering - {"tl"})))

GLUON = Backend(
    name="gluon", emitter=gluon.GluonEpilogueEmitter, folder="kernels/gluon/",
    unlowered=gluon.unlowered,
    render=lambda k, types, regenerate, lowering: gluon.render_gluon_kernel(k, types, regenerate),
    package=gluon.render_package_init)

BACKENDS: tuple[Backend, ...] = (TL, GLUON)  # in the order their files are written


def backend(name: str) -> Backend:
    return next(b for b in BACKENDS if b.name == name)


def render_backends(kernels: list[tuple[Kernel, Types]], regenerate: str) -> dict[str, str]:
    """Every backend's files, by path under the output folder, backend by backend: a module per kernel it
    lowers (each backend asked once per kernel), then its folder's __init__.py."""
    found = [{b.name: b.unlowered(k, types) for b in BACKENDS} for k, types in kernels]
    files: dict[str, str] = {}
    for b in BACKENDS:
        lowered = []
        for (k, types), fallbacks in zip(kernels, found):
            if not fallbacks[b.name]:
                lowered.append(k)
                lowering = frozenset(name for name, why in fallbacks.items() if not why)
                files[b.path(k.name)] = b.render(k, types, regenerate, lowering)
        if b.package is not None:
            files[f"{b.folder}__init__.py"] = b.package(lowered, [f for fallbacks in found for f in fallbacks[b.name]],
                                                        regenerate)
    return files
