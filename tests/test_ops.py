"""The torch.library op of every generated kernel module: torch.library.opcheck (schema, autograd
registration, the fake implementation, AOT dispatch with dynamic shapes), for the kernels of specs/ as
committed in generated/ and for the test kernels of tests/specs/; and one torch.compile(fullgraph=True)
on the CPU against eager."""
from __future__ import annotations

import importlib
import inspect
import logging

import pytest
import torch

from codagen.runtime import Config
from conftest import REPO, all_test_kernels, draw_args

GENERATED = sorted(p.stem for p in (REPO / "generated" / "kernels").glob("*.py") if p.stem != "__init__")
SIZES = {"M": 19, "N": 22, "K": 13}  # ragged for every tile shape; N even for kernels with pairs
SPECIAL = {  # rope inputs as in a model; see test_primitives
    "freqs": lambda shape, g: 0.05 + 0.95 * torch.rand(shape, generator=g),
    "positions": lambda shape, g: torch.randint(0, 64, shape, generator=g),
}

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


def op_and_args(module, dtype=torch.float32, seed=0):
    """The module's op and positional arguments for it: inputs and host scalars, then inplace outputs (the
    positional parameters of `launch`, in order)."""
    group = getattr(module, "COLUMN_GROUP", 1)  # kernels with column groups take whole groups
    sizes = {**SIZES, "N": -(-SIZES["N"] // group) * group}
    args = draw_args(module, sizes, dtype, Config(), generator=torch.Generator().manual_seed(seed), special=SPECIAL)
    names = [n for n, p in inspect.signature(module.launch).parameters.items()
             if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return getattr(module, f"{module.NAME}_op"), tuple(args.kwargs[n] for n in names)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def opcheck(op, args) -> None:
    """torch.library.opcheck; for FP8 inputs, whose before-and-after comparison (test_schema's torch.allclose) torch
    has no FP8 CPU kernel for, the other checks, and the inputs compared bit for bit here instead."""
    fp8 = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in FP8]
    if not fp8:
        torch.library.opcheck(op, args)
        return
    before = [a.clone() for a in fp8]
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fp8, before))


@pytest.mark.parametrize("name", GENERATED)
def test_opcheck_generated(name):
    module = importlib.import_module(f"generated.kernels.{name}")
    opcheck(*op_and_args(module))


@pytest.mark.parametrize("name", all_test_kernels())
def test_opcheck_test_kernel(test_kernels, name):
    opcheck(*op_and_args(test_kernels(name), torch.bfloat16 if name.endswith(("_scale", "_gated")) else torch.float32))


def test_compile_fullgraph_matches_eager(test_kernels, caplog):
    """A compiled function around two ops (one with a host scalar, a 0-d tensor, row and column stores;
    one with partial reductions) and a little torch around them, against eager. Inductor lowers the ops as
    codagen registered them (runtime.ops.lowered_as_fallback), not through its implicit fallback, whose log message
    made the text of the whole graph before PyTorch 2.13 (minutes for a 16-layer model)."""
    scale, scale_args = op_and_args(test_kernels("t_scale"), seed=1)
    reduce, reduce_args = op_and_args(test_kernels("t_reduce"), seed=2)

    def f(scale_args, reduce_args):
        outs = scale(*scale_args)
        sums = reduce(*reduce_args)
        return outs[0] * 2.0, outs[-1] + 1.0, sums[0].sum(dim=1), sums[3]

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    eager = f(scale_args, reduce_args)
    from torch._inductor import config as inductor_config
    from torch._inductor.lowering import lowerings

    # no cache: Inductor lowers the graph in this test
    with caplog.at_level(logging.INFO, logger="torch._inductor.graph"), \
            inductor_config.patch(force_disable_caches=True):
        got = compiled(scale_args, reduce_args)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e)
    implicit = [r.getMessage() for r in caplog.records if "implicit fallback" in r.getMessage()]
    assert not [m for m in implicit if "codagen" in m], implicit
    assert {torch.ops.codagen.t_scale.default, torch.ops.codagen.t_reduce.default} <= set(lowerings)
