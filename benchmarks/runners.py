"""How a variant runs (Runner), the registry entry that makes one (Variant), and the built-in baselines:
cuBLAS GEMMs alone, eager PyTorch, torch.compile and Liger-Kernel (baselines.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import baselines as B
from cases import PATTERNS, Case, InputSet, Pattern


class Runner:
    """How a variant runs: prepare (untimed, once per input set), run (timed), named (untimed: the
    outputs and gradients under the pattern's names -- outputs by name, gradients as "d<leaf>" -- in the
    eager layout, for the check; None means "do not check")."""

    def prepare(self, inset: InputSet):
        return inset

    def run(self, state):
        raise NotImplementedError

    def named(self, state, result) -> Optional[dict]:
        return None


class AutogradRunner(Runner):
    """Runs a forward function fn(*inputs in pattern.args order) -> tuple of outputs (pattern.outputs order).
    Forward patterns run under torch.no_grad(); fwd+bwd patterns run the forward, then
    torch.autograd.grad(outputs, leaves, upstream) (no .grad accumulation).

    prepare: optional f(InputSet) -> InputSet, e.g. to re-layout weights (untimed). fn gets the prepared
             set's tensors named by ``args`` (default pattern.args); gradients are taken with respect to
             ``leaves`` (default pattern.leaves) in the prepared set.
    to_reference: optional f(named: dict, prepared: InputSet) -> dict mapping this variant's outputs and
             gradients to the eager names/layouts (e.g. un-interleave, un-permute).
    outputs: optional names of what fn returns (default pattern.outputs), for a fn whose results are not the
             pattern's outputs one for one (e.g. h and rstd, from which to_reference makes n2). In fwd+bwd
             patterns fn must return the pattern's outputs first; upstream gradients go to those."""

    def __init__(self, pattern: Pattern, fn: Callable, prepare=None, to_reference=None, leaves=None, args=None,
                 outputs=None):
        self.pattern, self.fn = pattern, fn
        self._prepare, self._to_reference = prepare, to_reference
        self.leaves = (tuple(leaves) if leaves is not None else pattern.leaves) if pattern.backward else ()
        self.args = tuple(args) if args is not None else pattern.args
        self.outputs = tuple(outputs) if outputs is not None else pattern.outputs

    def prepare(self, inset):
        return self._prepare(inset) if self._prepare else inset

    def run(self, state):
        p = self.pattern
        args = [state.t[a] for a in self.args]
        if not p.backward:
            with torch.no_grad():
                return self.fn(*args), ()
        outs = self.fn(*args)
        grads = torch.autograd.grad(outs[:len(p.outputs)], [state.t[n] for n in self.leaves],
                                    [state.up[o] for o in p.outputs])
        return outs, grads

    def named(self, state, result):
        outs, grads = result
        d = dict(zip(self.outputs, outs))
        d.update({"d" + n: g for n, g in zip(self.leaves, grads)})
        return self._to_reference(d, state) if self._to_reference else d


class RawRunner(Runner):
    """Times step(state) as it is; never checked (for the GEMMs-alone speed of light)."""

    def __init__(self, step: Callable, prepare: Callable = None):
        self.step, self._prepare = step, prepare

    def prepare(self, inset):
        return self._prepare(inset) if self._prepare else inset

    def run(self, state):
        return self.step(state)


@dataclass
class Variant:
    """A registry entry: (pattern key, variant name, factory). The factory gets the Case and returns a
    Runner, or raises (the row is then reported as failed with the reason). families: the model families
    (codagen/presets.py) whose presets run it; empty: every family that has the pattern."""
    pattern: str
    name: str
    factory: Callable[[Case], Runner]
    note: str = ""
    families: tuple = ()


CUBLAS = "cuBLAS GEMMs alone"


def _cublas_factory(case: Case) -> Runner:
    pat, dm = case.pattern, case.dims

    def prepare(inset):
        ops = B.gemm_operands(pat.base, inset.t, dm, case.dtype, case.device)
        return ops

    step = (lambda ops: B.gemms_forward_backward(ops)) if pat.backward else (lambda ops: B.gemms_forward(ops))
    return RawRunner(step, prepare)


def _eager_factory(case: Case) -> Runner:
    return AutogradRunner(case.pattern, B.eager_fns(case.dims, "eager")[case.pattern.base])


def _compile_factory(mode: str | None):
    """torch.compile of the eager function: the default mode, or "max-autotune" (Inductor autotunes its own
    Triton GEMM templates against cuBLAS, fuses pointwise epilogues into them, and uses CUDA graphs)."""
    def factory(case: Case) -> Runner:
        fn = B.eager_fns(case.dims, "eager")[case.pattern.base]
        return AutogradRunner(case.pattern, torch.compile(fn, dynamic=False, mode=mode))
    return factory


def _liger_factory(impl: str):
    def factory(case: Case) -> Runner:
        if case.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Liger-Kernel needs a CUDA device (or --liger-interpret on the CPU)")
        return AutogradRunner(case.pattern, B.eager_fns(case.dims, impl)[case.pattern.base])
    return factory


def builtin_variants(args) -> list:
    out = []
    for p in PATTERNS:
        out.append(Variant(p.key, CUBLAS, _cublas_factory))
        out.append(Variant(p.key, "eager", _eager_factory))
        if args.compile:
            out.append(Variant(p.key, "torch.compile", _compile_factory(None)))
            if args.max_autotune:
                out.append(Variant(p.key, MAX_AUTOTUNE, _compile_factory("max-autotune")))
        if args.liger:
            out.append(Variant(p.key, "liger", _liger_factory("liger")))
            if p.base != "lm_ce":   # patterns with a residual add + RMSNorm; Liger's Llama only
                out.append(Variant(p.key, "liger+addnorm", _liger_factory("liger+addnorm"), families=("llama",)))
    return out


MAX_AUTOTUNE = "torch.compile max-autotune"
BASELINES = [CUBLAS, "eager", "torch.compile", MAX_AUTOTUNE, "liger", "liger+addnorm"]  # in report order
