"""Packages (the rest of the metadata is in pyproject.toml): codagen itself, and the committed generated Llama kernels
and blocks (generated/), installed under the import name codagen_generated so that they can never collide with a
user's own `codagen build` output, whose default folder is also named generated. codagen.hf imports them."""
from setuptools import find_packages, setup

GENERATED = "codagen_generated"

setup(
    packages=find_packages(include=["codagen", "codagen.*"])
    + [GENERATED] + [f"{GENERATED}.{name}" for name in find_packages("generated")],
    package_dir={GENERATED: "generated"},
    package_data={"codagen": ["templates/*.j2", "schema/*.json"], GENERATED: ["tuning/*/*.json"]},
)
