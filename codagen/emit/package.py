"""The package files of the output folder: generated/__init__.py, kernels/__init__.py, blocks/__init__.py."""
from __future__ import annotations

from ..model import Kernel
from .block import class_name
from .templates import render


def render_package(kernels: list[Kernel], blocks: list, regenerate: str) -> dict[str, str]:
    files = {
        "__init__.py": render("package_init.py.j2", regenerate=regenerate),
        "kernels/__init__.py": render(
            "kernels_init.py.j2", kernels=kernels, regenerate=regenerate,
            entries=_entries((k.name, k.source, k.doc) for k in kernels),
            names=_names([k.name for k in kernels])),
    }
    if blocks:
        classes = {b.name: class_name(b.name) for b in blocks}
        files["blocks/__init__.py"] = render(
            "blocks_init.py.j2", blocks=blocks, regenerate=regenerate, classes=classes,
            entries=_entries((classes[b.name], b.source, b.doc) for b in blocks),
            names=_names([n for b in blocks for n in (classes[b.name], f"{classes[b.name]}Function")]))
    return files


def _entries(items) -> list[str]:
    """One docstring list item per module, `- name (spec): doc`."""
    return [f"- {name} ({source}): {doc}" for name, source, doc in items]


def _names(names: list[str]) -> str:
    return "__all__ = [" + ", ".join(f'"{n}"' for n in names) + "]"
