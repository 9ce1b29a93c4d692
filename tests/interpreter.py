"""Triton's CPU interpreter, made quicker for the test suite (about twice, measured on the tiny models of the
distributed tests), by two changes to what it does per operation and per call, neither to what it computes:

- no integer overflow checks (`sanitize_overflow`): the interpreter redoes every integer add, sub and mul of the
  kernels' index arithmetic in 64 bits and asserts the result fits; the tests' shapes are far from 32-bit limits,
  and a GPU compiles the kernels without the check;
- triton.language patched once per launch: the interpreter patches the language's builtins at the launch of a
  kernel and again at every call of a @triton.jit helper inside it (a scan of the modules each time), though the
  launch's patches hold until it ends. A helper whose modules the launch did not patch is still patched.

Both reach into the interpreter's internals (triton.runtime.interpreter, as Triton 3.9 has them); where those
differ, `quicken` changes nothing and the tests run as slowly as before."""
from __future__ import annotations

import dataclasses
import inspect
import os


def quicken() -> None:
    """Apply both, once per process, where kernels run on the interpreter (TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    launch = getattr(interpreter, "GridExecutor", None)
    options = getattr(builder, "options", None)
    if (patch_lang is None or launch is None or getattr(patch_lang, "quickened", False)
            or not (dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"))):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)

    patched = set()  # the sets of language modules patched during the current launch
    modules = {}  # a function's set of language modules (the ones the interpreter patches for it)

    def patch_once(fn):
        langs = modules.get(fn)
        if langs is None:
            langs = modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                            if inspect.ismodule(v) and v in (tl, tl.core))
        if langs in patched:
            return None  # only a helper's call ignores the result; a launch's first call always patches
        patched.add(langs)
        return patch_lang(fn)

    run = launch.__call__

    def launch_call(self, *args, **kwargs):
        patched.clear()
        try:
            return run(self, *args, **kwargs)
        finally:
            patched.clear()

    patch_once.quickened = True
    interpreter._patch_lang = patch_once
    launch.__call__ = launch_call
