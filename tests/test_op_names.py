"""Kernel op names are process-wide (`torch.ops.codagen.<kernel>`), whatever package a module belongs to: the
same kernel built into two packages shares one op and works through both; a different kernel under a name
already taken is refused at import, naming both modules and both specs, and the first op keeps its kernel.

Each test uses kernel names of its own: the registrations last as long as the pytest process."""
from __future__ import annotations

import importlib

import pytest
import torch

from codagen import api
from conftest import DEVICE

SCALE_ROWS = """\
kernel: {name}
doc: {doc}
inputs: {{x: [M, N], w: [N]}}
outputs: {{y: [M, N]}}
epilogue:
  - scale: {{x: x, by: w, out: v}}
{extra}  - store: {{x: v{suffix}, to: y}}
"""


def spec(name: str, doc: str = "Scales the columns of x by w.", add_x: bool = False) -> str:
    """x * w, or with add_x, x * w + x: another kernel under the same name."""
    extra = "  - add: {x: v, y: x, out: v2}\n" if add_x else ""
    return SCALE_ROWS.format(name=name, doc=doc, extra=extra, suffix="2" if add_x else "")


def build(tmp_path, monkeypatch, package: str, text: str) -> str:
    """`text` built into `package` under tmp_path; returns the spec's path as the module's SPEC names it."""
    folder = tmp_path / f"{package}_specs"
    folder.mkdir()
    path = folder / "k.yaml"
    path.write_text(text, encoding="utf-8")
    api.build([path], out=tmp_path / package)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return path.relative_to(tmp_path).as_posix()  # from the folder that holds the package (api.shown_from)


def arguments():
    """Fresh random x [13, 40] and w [40] (a ragged shape, one tile under the interpreter's default)."""
    return torch.randn(13, 40, device=DEVICE), torch.randn(40, device=DEVICE)


def expected(x, w, add_x=False):
    x64, w64 = x.double(), w.double()
    return (x64 * w64 + x64 if add_x else x64 * w64).float()


def test_same_kernel_in_two_packages_shares_one_op(tmp_path, monkeypatch):
    build(tmp_path, monkeypatch, "cg_ops_share_a", spec("op_share_probe"))
    # the same computation, documented differently: the same fingerprint, so the same op
    build(tmp_path, monkeypatch, "cg_ops_share_b", spec("op_share_probe", doc="Column scale of x, by w."))
    a = importlib.import_module("cg_ops_share_a.kernels.op_share_probe")
    b = importlib.import_module("cg_ops_share_b.kernels.op_share_probe")
    assert a.SHA256 != b.SHA256 and a.FINGERPRINT == b.FINGERPRINT
    assert b.op_share_probe_op is a.op_share_probe_op
    for module in (a, b):
        x, w = arguments()
        want = expected(x, w)
        torch.testing.assert_close(module.op_share_probe(x, w), want)  # eager: the module's own launcher
        torch.testing.assert_close(module.op_share_probe_op(x, w), want)  # through the shared op
        torch.testing.assert_close(torch.ops.codagen.op_share_probe(x, w), want)
        y = torch.full_like(x, float("nan"))
        module.launch(x, w, y=y)
        torch.testing.assert_close(y, want)
    # the fake and the refusal of autograd, registered once by the first module, serve the second module's calls
    x, w = arguments()
    torch.library.opcheck(b.op_share_probe_op, (x, w), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match=r"torch.ops.codagen.op_share_probe has no backward"):
        b.op_share_probe(x.requires_grad_(), w)


def test_different_kernel_under_a_taken_name_is_refused_at_import(tmp_path, monkeypatch):
    first_spec = build(tmp_path, monkeypatch, "cg_ops_clash_a", spec("op_clash_probe"))
    second_spec = build(tmp_path, monkeypatch, "cg_ops_clash_b", spec("op_clash_probe", add_x=True))
    a = importlib.import_module("cg_ops_clash_a.kernels.op_clash_probe")
    with pytest.raises(ImportError) as refused:
        importlib.import_module("cg_ops_clash_b.kernels.op_clash_probe")
    message = str(refused.value)
    for part in ("cg_ops_clash_b.kernels.op_clash_probe", second_spec, "cg_ops_clash_a.kernels.op_clash_probe",
                 first_spec, "codagen::op_clash_probe", "Rename the kernel",
                 "do not import both packages in one process"):
        assert part in message
    # the op still runs the first module's kernel
    x, w = arguments()
    torch.testing.assert_close(torch.ops.codagen.op_clash_probe(x, w), expected(x, w))
    torch.testing.assert_close(a.op_clash_probe_op(x, w), expected(x, w))


def test_op_defined_outside_generated_modules_is_refused_at_import(tmp_path, monkeypatch):
    @torch.library.custom_op("codagen::op_foreign_probe", mutates_args=())
    def foreign(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x + w

    build(tmp_path, monkeypatch, "cg_ops_foreign", spec("op_foreign_probe"))
    with pytest.raises(ImportError, match=r"cg_ops_foreign.kernels.op_foreign_probe .*: the op "
                                          r"codagen::op_foreign_probe is already defined in this process"):
        importlib.import_module("cg_ops_foreign.kernels.op_foreign_probe")
    x, w = arguments()
    torch.testing.assert_close(torch.ops.codagen.op_foreign_probe(x, w), x + w)
