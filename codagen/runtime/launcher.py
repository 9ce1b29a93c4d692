"""Launches of a @triton.jit kernel with less host work per call than kernel[grid](...).

Triton's kernel[grid](...) binds and specializes every argument again at each call (tens of microseconds in
Python, which a training step of small batches pays hundreds of times while the GPU waits). A Launcher makes the
first call of each kind through Triton, keeps the compiled kernel it returns, and later calls whose arguments
specialize the same way launch that kernel directly, the way Triton's own call ends. The key it keeps them by
holds everything Triton specializes on, and more: a tensor's dtype and whether its address is 16-byte aligned,
an int's value, a descriptor's dtype, block shape and layout, every keyword's value. An argument of another kind,
a launch hook (a profiler such as Proton), or the interpreter: the call goes through Triton as it is."""
from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.runtime import driver

from . import INTERPRETED

_PLAIN = (bool, int, str, type(None))
_CACHED_KINDS = 64  # kinds of call kept per kernel; beyond, calls of new kinds go through Triton unkept


def _hooked() -> bool:
    """Whether a profiler (Proton) hooks Triton's launches: they must go through Triton then."""
    return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)


def _hook_set(hook) -> bool:
    # a hook, or None; Triton 3.5 and later hold a HookChain there, never None, whose `calls` may be empty
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _device() -> int:
    return driver.active.get_current_device()


def _stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def _descriptor_key(d) -> tuple:
    base = d.base
    return (type(d), base.dtype, base.data_ptr() % 16 == 0, tuple(d.block_shape), len(d.shape), d.padding,
            getattr(d, "layout", None), getattr(d, "round_f32_to_tf32", None))


_SIMPLE = frozenset(_PLAIN)


def _arguments_key(args: tuple) -> tuple:
    """_argument_key of each argument, the usual kinds (exact ints, bools, strings and None, plain tensors) inline:
    about half the host time of a call per argument, which a launch of 20-odd arguments pays at every call."""
    return tuple([(kind, a) if (kind := type(a)) in _SIMPLE
                  else (a.dtype, a.data_ptr() % 16 == 0) if kind is torch.Tensor
                  else _argument_key(a) for a in args])


def _argument_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, _PLAIN):
        return type(a), a  # the type too: True and 1 are equal keys, yet Triton specializes them apart
    if isinstance(a, float):
        return float
    if hasattr(a, "block_shape") and hasattr(a, "base"):  # a TMA descriptor, Triton's or Gluon's
        return _descriptor_key(a)
    raise TypeError(type(a).__name__)


class Launcher:
    """launcher[grid](*args, **keywords): kernel[grid](*args, **keywords), with Triton's per-call argument binding
    done once per kind of call."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict = {}  # key -> (compiled kernel, the keywords' values in the kernel's parameter order)

    def __getitem__(self, grid):
        if INTERPRETED or callable(grid):
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **keywords):
        if _hooked():
            return self.kernel[grid](*args, **keywords)
        device = _device()
        try:
            key = (device, grid, _arguments_key(args), tuple(keywords.items()))
            found = self._compiled.get(key)
        except TypeError:  # an argument of another kind, or an unhashable keyword value
            return self.kernel[grid](*args, **keywords)
        if found is None:
            compiled = self.kernel[grid](*args, **keywords)
            if len(self._compiled) < _CACHED_KINDS and hasattr(compiled, "packed_metadata"):
                self._compiled[key] = (compiled, self._parameter_tail(len(args), keywords))
            return compiled
        compiled, tail = found
        if tail is None:  # parameters this call does not name (defaults): Triton binds them
            return self.kernel[grid](*args, **keywords)
        stream = _stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
        return compiled

    def _parameter_tail(self, positional: int, keywords: dict) -> tuple | None:
        """The keywords' values of the parameters after the positional ones, in the kernel's order (what Triton
        passes its compiled kernel after them); None where a parameter is left to its default."""
        names = [p.name for p in self.kernel.params][positional:]
        if any(name not in keywords for name in names):
            return None
        return tuple(keywords[name] for name in names)
