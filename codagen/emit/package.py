"""The package files of the output folder: generated/__init__.py, kernels/__init__.py, blocks/__init__.py."""
from __future__ import annotations

from ..model import Kernel
from .block import class_name
from .templates import render


def render_package(kernels: list[Kernel], blocks: list, regenerate: str) -> dict[str, str]:
    files = {
        "__init__.py": render("package_init.py.j2", regenerate=regenerate),
        "kernels/__init__.py": render("kernels_init.py.j2", kernels=kernels, regenerate=regenerate),
    }
    if blocks:
        files["blocks/__init__.py"] = render("blocks_init.py.j2", blocks=blocks, regenerate=regenerate,
                                             classes={b.name: class_name(b.name) for b in blocks})
    return files
