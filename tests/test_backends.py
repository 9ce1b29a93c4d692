"""The generator's backends (codagen/emit/backends.py): a build asks each backend once per kernel whether it lowers
it, and writes what each registered backend renders; a new backend is one registry entry on this side."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from codagen import api
from codagen.emit import backends, gluon
from codagen.emit.epilogue import EpilogueEmitter

SPECS = Path(__file__).resolve().parents[1] / "specs"


def test_registered_backends_are_whole():
    names = [b.name for b in backends.BACKENDS]
    assert names[0] == "tl" and len(set(names)) == len(names)  # the tl module, which users import, first
    assert len({b.folder for b in backends.BACKENDS}) == len(names)
    for b in backends.BACKENDS:
        assert issubclass(b.emitter, EpilogueEmitter) and b.emitter.backend == b.name
        assert b.path("matmul") == f"{b.folder}matmul.py" and b.folder.startswith("kernels/")
    assert backends.backend("gluon").emitter is gluon.GluonEpilogueEmitter


def test_the_runtime_registry_names_the_generators_backends():
    """Each backend is one entry on each side: the runtime's (codagen/runtime/backends.py) names the generator's
    backends, in the same order, with the folder of their modules and its config type (tileconfig.CONFIGS)."""
    from codagen import tileconfig
    from codagen.runtime import backends as runtime_backends

    assert [b.name for b in runtime_backends.BACKENDS] == [b.name for b in backends.BACKENDS] == list(
        tileconfig.BACKENDS)
    for b in runtime_backends.BACKENDS:  # each with its config type, which names it
        assert b.config is tileconfig.CONFIGS[b.name] and b.config.backend == b.name
    for b in runtime_backends.BACKENDS[1:]:
        assert f"kernels/{b.folder}/" == backends.backend(b.name).folder
        assert b.default is not None and b.lowers("generated.kernels", "matmul")
        assert not b.lowers("generated.kernels", "rmsnorm_stats")  # no GEMM: the tl kernel only


def test_a_build_asks_each_backend_once_per_kernel(monkeypatch):
    """The Hopper backend's question, whether it lowers a kernel, is asked once per kernel in a build (it was asked
    twice: for the tl launcher's dispatch, and again for the Hopper modules)."""
    asked: list[str] = []
    steps = gluon.unsupported_steps

    def counted(kernel, backend):
        asked.append(kernel.name)
        return steps(kernel, backend)
    monkeypatch.setattr(gluon, "unsupported_steps", counted)
    files = api.generate([SPECS])
    assert asked and len(asked) == len(set(asked))
    assert {f"kernels/gluon/{name}.py" for name in asked} >= {f for f in files.files if f.startswith("kernels/gluon/")
                                                               and not f.endswith("__init__.py")}


class FakeEmitter(EpilogueEmitter):
    backend = "fake"


def test_a_new_backend_is_one_registry_entry(monkeypatch):
    """A backend added to the registry gets a module per kernel it lowers and its folder's __init__.py; the tl
    renderer is told which backends lower each kernel; every other file is as without it (the new backend lowers
    what the Hopper backend lowers, so that every tl module it concerns already hands launches to another
    backend)."""
    before = api.generate([SPECS]).files
    told: dict[str, frozenset[str]] = {}
    tl = backends.backend("tl")

    def render_tl(k, types, regenerate, lowering):
        told[k.name] = lowering
        return tl.render(k, types, regenerate, lowering)

    fake = backends.Backend(
        name="fake", emitter=FakeEmitter, folder="kernels/fake/", unlowered=backends.backend("gluon").unlowered,
        render=lambda k, types, regenerate, lowering: f"# {k.name}, lowered by {sorted(lowering)}\n",
        package=lambda lowered, fallbacks, regenerate:
            f'"""{[k.name for k in lowered]} {sorted({f.kernel.name for f in fallbacks})}"""\n')
    registry = tuple(dataclasses.replace(b, render=render_tl) if b is tl else b for b in backends.BACKENDS)
    monkeypatch.setattr(backends, "BACKENDS", (*registry, fake))
    after = api.generate([SPECS]).files
    added = {rel: text for rel, text in after.items() if rel not in before}
    lowered = sorted(name for name, lowering in told.items() if "fake" in lowering)
    not_lowered = sorted(set(told) - set(lowered))
    assert lowered and not_lowered
    assert sorted(told) == sorted(rel[len("kernels/"):-3] for rel in before if rel.count("/") == 1
                                  and rel.startswith("kernels/") and not rel.endswith("__init__.py"))
    assert set(added) == {f"kernels/fake/{name}.py" for name in lowered} | {"kernels/fake/__init__.py"}
    assert added["kernels/fake/__init__.py"] == f'"""{lowered} {not_lowered}"""\n'
    assert all("'fake'" in added[f"kernels/fake/{name}.py"] and "'tl'" in added[f"kernels/fake/{name}.py"]
               for name in lowered)
    assert {rel: after[rel] for rel in before} == before
