"""codagen.runtime.Launcher: a compiled kernel kept per kind of call and launched directly, each kind the way
Triton specializes it (a fake Triton kernel on the CPU, where kernels otherwise run interpreted), and on a GPU
(marker gpu) launches of a real kernel alternating between kinds, equal to PyTorch."""
from __future__ import annotations

import pytest
import torch

from codagen.runtime import launcher as L


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, kind):
        self.kind, self.runs = kind, []

    def run(self, *args):
        self.runs.append(args)


class FakeParam:
    def __init__(self, name):
        self.name = name


class FakeKernel:
    """What Launcher uses of a JITFunction: its parameters and kernel[grid](...), which returns the compiled kernel
    of the call's kind (here one per call, so that a launch through Triton is seen)."""

    def __init__(self, names):
        self.params = [FakeParam(n) for n in names]
        self.calls = []

    def __getitem__(self, grid):
        def call(*args, **keywords):
            self.calls.append((grid, args, keywords))
            return FakeCompiled(len(self.calls))
        return call


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setattr(L, "INTERPRETED", False)
    monkeypatch.setattr(L, "_hooked", lambda: False)
    monkeypatch.setattr(L, "_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda device: 1234)


def test_a_kind_of_call_goes_through_triton_once_then_launches_directly(compiled_mode):
    kernel = FakeKernel(["x", "y", "n", "BLOCK", "EVEN"])
    launch = L.Launcher(kernel)
    x, y = torch.randn(64), torch.randn(64)
    first = launch[(4,)](x, y, 64, EVEN=True, BLOCK=32, num_warps=4)
    assert len(kernel.calls) == 1
    second = launch[(4,)](x, y, 64, EVEN=True, BLOCK=32, num_warps=4)
    assert second is first and len(kernel.calls) == 1
    # the parameters in the kernel's order after the positional ones (BLOCK before EVEN), no option (num_warps)
    assert first.runs == [(4, 1, 1, 1234, "function", "metadata", None, None, None, x, y, 64, 32, True)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int value", "bool for int", "keyword", "option", "grid",
                                    "float"])
def test_a_call_that_specializes_otherwise_goes_through_triton(compiled_mode, change):
    kernel = FakeKernel(["x", "y", "n", "scale", "BLOCK"])
    launch = L.Launcher(kernel)
    x, y = torch.randn(65), torch.randn(64)
    base = dict(args=(x[:64], y, 64, 0.5), keywords=dict(BLOCK=32, num_warps=4), grid=(2,))
    call = {**base, "args": base["args"], "keywords": dict(base["keywords"])}
    if change == "misaligned":
        call["args"] = (x[1:], y, 64, 0.5)  # 4 bytes past an aligned address
    elif change == "dtype":
        call["args"] = (x[:64].double(), y, 64, 0.5)
    elif change == "int value":
        call["args"] = (x[:64], y, 1, 0.5)
    elif change == "bool for int":  # True == 1 in Python, yet Triton makes an i1 of one and a constant of the other
        base["args"] = (x[:64], y, 1, 0.5)
        call["args"] = (x[:64], y, True, 0.5)
    elif change == "keyword":
        call["keywords"]["BLOCK"] = 64
    elif change == "option":
        call["keywords"]["num_warps"] = 8
    elif change == "grid":
        call["grid"] = (3,)
    else:  # Triton does not specialize on a float's value: the same kernel
        call["args"] = (x[:64], y, 64, 0.25)
    first = launch[base["grid"]](*base["args"], **base["keywords"])
    other = launch[call["grid"]](*call["args"], **call["keywords"])
    if change == "float":
        assert other is first and len(kernel.calls) == 1 and len(first.runs) == 1
    else:
        assert other is not first and len(kernel.calls) == 2 and first.runs == []


@pytest.mark.parametrize("case", ["unknown argument", "default parameter", "hook", "callable grid"])
def test_calls_it_cannot_key_go_through_triton_every_time(compiled_mode, monkeypatch, case):
    kernel = FakeKernel(["x", "n", "BLOCK"])
    launch = L.Launcher(kernel)
    x = torch.randn(8)
    args, keywords, grid = (x, 8), dict(BLOCK=8), (1,)
    if case == "unknown argument":
        args = (x, [8])
    elif case == "default parameter":
        keywords = {}
    elif case == "hook":
        monkeypatch.setattr(L, "_hooked", lambda: True)
    else:
        grid = lambda meta: (1,)  # noqa: E731
    for _ in range(3):
        launch[grid](*args, **keywords)
    assert len(kernel.calls) == 3


def test_hooks_as_triton_holds_them(monkeypatch):
    """Triton's own launch-hook knobs: no hook set (as Triton starts) launches directly; a hook added (a profiler)
    sends launches through Triton. Triton 3.5 and later hold a HookChain there, never None; older ones None or a
    function."""
    from triton import knobs

    assert not L._hooked()
    hook = lambda *args: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert L._hooked()
        finally:
            chain.remove(hook)
        assert not L._hooked()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not L._hooked()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)
    assert L._hooked()


def test_interpreted_launches_are_triton_s_own(monkeypatch):
    monkeypatch.setattr(L, "INTERPRETED", True)
    kernel = FakeKernel(["x"])
    launch = L.Launcher(kernel)
    for _ in range(2):
        launch[(1,)](torch.randn(2))
    assert len(kernel.calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_real_kernel_alternating_kinds_equals_torch():
    """A real Triton kernel (y = x * scale + n) launched through one Launcher, alternating between an aligned and
    a misaligned x, dtypes, n == 1 (which Triton specializes) and other values: every result equals PyTorch's, and
    repeated kinds launch directly."""
    import triton
    import triton.language as tl

    @triton.jit
    def affine(x, y, n, scale, size, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < size) * scale + n, mask=i < size)

    launch = L.Launcher(affine)
    calls = []
    original = affine.run
    affine.run = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        base = torch.randn(4097, device="cuda")
        for repeat in range(3):
            for offset, dtype, n, scale in ((0, torch.float32, 3, 0.5), (1, torch.float32, 1, 2.0),
                                            (0, torch.bfloat16, 1, -1.5), (1, torch.bfloat16, 7, 0.25)):
                x = base.to(dtype)[offset:offset + 4000]
                y = torch.empty_like(x)
                launch[(triton.cdiv(4000, 1024),)](x, y, n, scale, 4000, BLOCK=1024)
                torch.testing.assert_close(y, (x.float() * scale + n).to(dtype))
    finally:
        del affine.run
    assert len(calls) == 4  # each kind once through Triton, then direct


def test_the_inline_key_is_each_argument_s_key():
    """_arguments_key, with the usual kinds inline, keys a call as _argument_key does each argument: a tensor by
    dtype and alignment (a Parameter too), an int, bool, str or None by type and value, a float by type alone."""
    x = torch.randn(65)
    args = (x, x[1:], torch.nn.Parameter(torch.randn(4)), x.double(), 3, True, 1, None, "s", 0.5, 2.5)
    assert L._arguments_key(args) == tuple(map(L._argument_key, args))
    assert L._arguments_key((True,)) != L._arguments_key((1,))
    with pytest.raises(TypeError):
        L._arguments_key(([8],))
