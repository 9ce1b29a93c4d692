"""The package files of the output folder: generated/__init__.py and generated/kernels/__init__.py."""
from __future__ import annotations

from ..model import Kernel
from .templates import render


def render_package(kernels: list[Kernel], regenerate: str) -> dict[str, str]:
    return {
        "__init__.py": render("package_init.py.j2", kernels=kernels, regenerate=regenerate),
        "kernels/__init__.py": render("kernels_init.py.j2", kernels=kernels, regenerate=regenerate),
    }
