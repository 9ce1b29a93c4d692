"""codagen benchmark harness: times the Llama-block patterns of DESIGN.md section 3 in every variant.

    python benchmarks/bench.py --preset llama3-1b --preset llama3-8b --tokens 16384 --out OUTDIR
    python benchmarks/bench.py --quick                      # tokens 2048, short timing: a smoke test
    python benchmarks/bench.py --device cpu --quick         # tiny shapes on the CPU (no Liger, no compile)
    python benchmarks/bench.py --variants codagen           # only cuBLAS, eager and codagen: no compile time

A row of the results is (pattern, variant). Patterns are the fixed list PATTERNS below (forward, or
forward+backward with random upstream gradients). Variants come from a registry: the built-in baselines
(cuBLAS GEMMs alone, eager, torch.compile, Liger-Kernel; see baselines.py) plus whatever
``codagen_variants()`` returns -- the hook where codagen's generated modules are plugged in.

Method (/work/.library/device/METHOD.md): every variant's outputs (and gradients) are compared once with the
eager ones and with a higher-precision reference (the eager function on fp32 inputs with TF32 off on the
GPU, fp64 on the CPU) before timing; each row is timed with ``triton.testing.do_bench`` (median; L2 flushed
before each call; inputs rotated among a few sets when they would fit in L2) in two passes over all
variants, and the report gives the mean of the two medians and their spread; peak memory above the inputs
is read with ``torch.cuda.max_memory_allocated`` after a reset. Results: ``<gpu>.md``, ``<gpu>.json`` and a
bar chart ``<gpu>.png`` in --out. The report ends with each fused kernel against the cuBLAS GEMM of its shape
(kernels.py; ``--no-kernels`` skips it, ``--patterns kernels`` runs it alone).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402  (does not import triton)


def _cpu_run(argv) -> bool:
    """Whether this run is on the CPU (--device cpu, or no CUDA device): read before argparse, since Triton's
    interpreter must be switched on before triton is first imported."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1].startswith("cpu")
        if a.startswith("--device="):
            return a.split("=", 1)[1].startswith("cpu")
    return not torch.cuda.is_available()


# On the CPU, Triton kernels (codagen's generated ones; Liger's with --liger-interpret) run only under
# Triton's interpreter, which must be set before triton is imported anywhere (environment() imports it).
if "--liger-interpret" in sys.argv or (_cpu_run(sys.argv[1:]) and "TRITON_INTERPRET" not in os.environ):
    os.environ["TRITON_INTERPRET"] = "1"

import baselines as B  # noqa: E402


# ====================================================================================================
# presets


@dataclass(frozen=True)
class Preset:
    name: str
    d: int
    ffn: int
    n_q: int
    n_kv: int
    head_dim: int
    vocab: int
    seq: int = 4096           # tokens are split into batch x seq (seq = min(seq, tokens))
    eps: float = 1e-5
    rope_theta: float = 500000.0

    def dims(self, tokens: int) -> B.Dims:
        seq = min(self.seq, tokens)
        if tokens % seq:
            seq = tokens
        return B.Dims(d=self.d, ffn=self.ffn, n_q=self.n_q, n_kv=self.n_kv, head_dim=self.head_dim,
                      vocab=self.vocab, batch=tokens // seq, seq=seq, eps=self.eps)

    def describe(self) -> str:
        q, kv = self.n_q * self.head_dim, self.n_kv * self.head_dim
        return (f"D={self.d}, FFN={self.ffn}, QKV={q + 2 * kv} (q {self.n_q}x{self.head_dim} + k and v "
                f"{self.n_kv}x{self.head_dim} each), vocab {self.vocab}, eps {self.eps}, rope theta {self.rope_theta:g}")


PRESETS = {
    "llama3-1b": Preset("llama3-1b", d=2048, ffn=8192, n_q=32, n_kv=8, head_dim=64, vocab=128256),
    "llama3-8b": Preset("llama3-8b", d=4096, ffn=14336, n_q=32, n_kv=8, head_dim=128, vocab=128256),
    # CPU smoke test: small and ragged-ish (ffn and vocab are not powers of two)
    "tiny": Preset("tiny", d=64, ffn=160, n_q=4, n_kv=2, head_dim=16, vocab=1000, seq=32),
}


# ====================================================================================================
# patterns


@dataclass(frozen=True)
class Pattern:
    key: str                  # "<base>.<fwd|fwdbwd>"
    base: str                 # key into baselines.eager_fns(...) and baselines.GEMMS
    title: str
    backward: bool
    args: tuple               # input names, in the order the pattern functions take them
    outputs: tuple            # output names, in the order the pattern functions return them
    # inputs that get gradients in the fwd+bwd version (every float input except cos/sin)
    leaves: tuple = ()


_OPROJ = ("x0", "y0", "wo", "wn1", "wg", "wu")
_BLOCK = _OPROJ + ("w2", "wn2", "wqkv", "cos", "sin")
_DQR = ("x1", "y1", "w2", "wn2", "wqkv", "cos", "sin")
_LM = ("xf", "wnf", "wv", "target")


def _pattern(base, title, args, outputs, backward):
    leaves = tuple(a for a in args if a not in ("cos", "sin", "target")) if backward else ()
    return Pattern(f"{base}.{'fwdbwd' if backward else 'fwd'}", base, title + (", fwd+bwd" if backward else ", fwd"),
                   backward, args, outputs, leaves)


PATTERNS = [
    _pattern("oproj_swiglu", "out-proj + residual + RMSNorm + gate/up + SwiGLU", _OPROJ, ("x1", "y1"), False),
    _pattern("oproj_swiglu", "out-proj + residual + RMSNorm + gate/up + SwiGLU", _OPROJ, ("x1", "y1"), True),
    _pattern("post_attn", "out-proj + res + RMSNorm + gate/up + SwiGLU + down + res + RMSNorm",
             _OPROJ + ("w2", "wn2"), ("x2", "n2"), False),
    _pattern("down_qkv_rope", "down + residual + RMSNorm + QKV + RoPE", _DQR, ("x2", "q", "k", "v"), False),
    _pattern("block", "non-attention block (x0, y0 -> x2, RoPE'd q, k, v)", _BLOCK, ("x2", "q", "k", "v"), False),
    _pattern("block", "non-attention block (x0, y0 -> x2, RoPE'd q, k, v)", _BLOCK, ("x2", "q", "k", "v"), True),
    _pattern("lm_ce", "final RMSNorm + LM head + cross-entropy", _LM, ("loss",), False),
    _pattern("lm_ce", "final RMSNorm + LM head + cross-entropy", _LM, ("loss",), True),
]
PATTERN_BY_KEY = {p.key: p for p in PATTERNS}


@dataclass
class Case:
    """What a variant factory is told: one pattern at one preset, token count, dtype and device."""
    preset: Preset
    tokens: int
    dtype: torch.dtype
    device: torch.device
    pattern: Pattern

    @property
    def dims(self) -> B.Dims:
        return self.preset.dims(self.tokens)


@dataclass
class InputSet:
    """One set of inputs: named tensors (leaves have requires_grad in fwd+bwd patterns) and, for fwd+bwd,
    the upstream gradient of each output."""
    t: dict
    up: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in list(self.t.values()) + list(self.up.values())
                   if isinstance(x, torch.Tensor))


EXTRA_INPUTS = ("positions", "inv_freq")   # not used by the baselines; there for codagen's RoPE


def make_input_set(case: Case, seed: int, dtype=None, device=None) -> InputSet:
    dtype = dtype or case.dtype
    device = device or case.device
    dm, pat = case.dims, case.pattern
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    t = {}
    for name in pat.args + (EXTRA_INPUTS if "cos" in pat.args else ()):
        x = B.make_tensor(name, dm, dtype, device, gen, case.preset.rope_theta)
        if name in pat.leaves:
            x.requires_grad_(True)
        t[name] = x
    up = {}
    if pat.backward:
        for o in pat.outputs:
            shape = B.output_shape(o, dm)
            if o == "loss":
                up[o] = torch.ones((), dtype=torch.float32, device=device)
            else:   # contiguous in the logical (B, H, S, hd) order for q/k/v, like a real attention backward
                up[o] = torch.randn(*shape, dtype=torch.float32, device=device, generator=gen).to(dtype)
    return InputSet(t, up)


def upcast(inset: InputSet, dtype) -> InputSet:
    """A higher-precision copy of an input set (for the reference), leaves re-made as leaves."""
    def cast(x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        y = x.detach().to(dtype)
        return y.requires_grad_(x.requires_grad)
    return InputSet({k: cast(v) for k, v in inset.t.items()}, {k: cast(v) for k, v in inset.up.items()})


# ====================================================================================================
# runners and variants


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
    Runner, or raises (the row is then reported as failed with the reason)."""
    pattern: str
    name: str
    factory: Callable[[Case], Runner]
    note: str = ""


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


def _compile_factory(case: Case) -> Runner:
    fn = B.eager_fns(case.dims, "eager")[case.pattern.base]
    return AutogradRunner(case.pattern, torch.compile(fn, dynamic=False))


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
            out.append(Variant(p.key, "torch.compile", _compile_factory))
        if args.liger:
            out.append(Variant(p.key, "liger", _liger_factory("liger")))
            if p.base != "lm_ce":   # patterns with a residual add + RMSNorm
                out.append(Variant(p.key, "liger+addnorm", _liger_factory("liger+addnorm")))
    return out


# ====================================================================================================
# >>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>  CODAGEN HOOK (for the lead)  <<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<
#
# Return codagen's rows here: a list of Variant(pattern_key, "codagen", factory), where pattern_key is a
# key of PATTERN_BY_KEY (e.g. "oproj_swiglu.fwd", "block.fwdbwd", "lm_ce.fwdbwd") and factory(case)
# returns a Runner. Usually:
#
#     from generated.blocks import llama_block            # whatever codagen generates
#     def factory(case):
#         dm = case.dims
#         def prepare(inset):   # untimed, per input set: e.g. interleave gate/up rows, permute q/k rows
#             ...; return InputSet({...}, inset.up)
#         def fwd(x0, y0, wo, ...): return x2, q, k, v    # same outputs/layouts as baselines.eager_fns
#         return AutogradRunner(case.pattern, fwd, prepare=prepare, to_reference=..., leaves=...)
#     return [Variant("block.fwdbwd", "codagen", factory)]
#
# Input sets carry the pattern's inputs (see Pattern.args) plus "positions" (T,) int32 and
# "inv_freq" (head_dim/2,) fp32 wherever RoPE is involved. Outputs/gradients are compared with eager's
# through Runner.named (use to_reference to map layouts back). Do not report numbers not measured here.


def codagen_variants(preset, tokens, dtype) -> list:
    """codagen's variants for this preset (Preset), token count and dtype.

    Every pattern except oproj_swiglu.fwdbwd: codagen has no block that ends after gate/up + SwiGLU (its
    PostAttention block runs on through the down projection), so that partial pattern's backward has no
    codagen counterpart; post_attn and block cover the same kernels with their backward.

    The generated modules are imported when a factory runs, so a broken import fails codagen's rows only.
    Weight relayout (interleaved gate/up rows, q/k rows in interleaved-pair order, per-column RoPE
    frequencies) happens in prepare, untimed; outputs and gradients go back to the eager layout in
    to_reference, untimed. The eps of every codagen block is the preset's (as eager uses it)."""
    notes = {
        "oproj_swiglu.fwd": "kernels out_proj_residual_norm -> finish.rstd -> gate_up_swiglu",
        "post_attn.fwd": "PostAttentionFunction (n2 = h_next * rstd_next formed untimed, for the check)",
        "down_qkv_rope.fwd": "kernels out_proj_residual_norm -> finish.rstd -> qkv_norm_rope",
        "block.fwd": "PostAttentionFunction -> PreAttentionFunction",
        "block.fwdbwd": "PostAttentionFunction -> PreAttentionFunction",
        "lm_ce.fwd": "NormStatsFunction -> LmHeadLossFunction",
        "lm_ce.fwdbwd": "NormStatsFunction -> LmHeadLossFunction (logits recomputed in row chunks)",
    }
    factories = {
        "oproj_swiglu.fwd": _cg_oproj_swiglu,
        "post_attn.fwd": _cg_post_attn,
        "down_qkv_rope.fwd": _cg_down_qkv_rope,
        "block.fwd": _cg_block,
        "block.fwdbwd": _cg_block,
        "lm_ce.fwd": _cg_lm_ce,
        "lm_ce.fwdbwd": _cg_lm_ce,
    }
    return [Variant(key, "codagen", factory, note=notes[key]) for key, factory in factories.items()]


# ---- codagen's factories and the layout helpers they share ----


def _cg_modules():
    """codagen's runtime, generated kernels and blocks, and the layout converters (imported on first use;
    importing codagen.runtime switches Triton's interpreter on where there is no GPU)."""
    from codagen import convert, runtime  # noqa: F401
    from codagen.runtime import finish
    from generated import blocks, kernels
    return convert, finish, kernels, blocks


def _cg_freqs(case: Case) -> torch.Tensor:
    """Per-pair RoPE frequencies over the qkv columns (q and k heads: the preset's theta; v: 0)."""
    convert = _cg_modules()[0]
    p = case.preset
    shape = convert.LlamaShape(dim=p.d, ffn_dim=p.ffn, n_heads=p.n_q, n_kv_heads=p.n_kv, head_dim=p.head_dim,
                               n_layers=1, vocab=p.vocab, rope_theta=p.rope_theta, eps=p.eps)
    return convert.rope_freqs(shape).to(case.device)


def _cg_last_dim(t: torch.Tensor, head_dim: int, to_halves: bool) -> torch.Tensor:
    """Reorder the last dimension (one head's head_dim) between HF's rotate_half order and codagen's
    interleaved pairs, with codagen.convert's row permutation."""
    convert = _cg_modules()[0]
    f = convert.heads_to_halves if to_halves else convert.heads_to_interleaved
    return f(t.movedim(-1, 0), head_dim).movedim(0, -1)


def _cg_weights(case: Case, t: dict) -> dict:
    """The prepared (untimed) inputs: eager tensors as they are, plus codagen's weight layouts, RoPE
    frequencies and positions. New weights are leaves of their own in fwd+bwd patterns."""
    convert = _cg_modules()[0]
    dm, grad = case.dims, case.pattern.backward
    out = dict(t)
    with torch.no_grad():
        if "wg" in t:
            out["w_gate_up"] = convert.interleave_rows(t["wg"], t["wu"]).contiguous().requires_grad_(grad)
        if "wqkv" in t:
            q, k, v = t["wqkv"].split([dm.q_width, dm.kv_width, dm.kv_width])
            out["w_qkv"] = torch.cat([convert.heads_to_interleaved(q, dm.head_dim),
                                      convert.heads_to_interleaved(k, dm.head_dim), v]).requires_grad_(grad)
            out["freqs"] = _cg_freqs(case)
    return out


def _cg_prepare(case: Case):
    """prepare for AutogradRunner: weights re-laid out; in fwd+bwd, q/k upstream gradients permuted into
    codagen's column order (the gradient of a permuted output is the permuted gradient)."""
    hd = case.dims.head_dim

    def prepare(inset: InputSet) -> InputSet:
        up = dict(inset.up)
        for o in ("q", "k"):
            if o in up:
                up[o] = _cg_last_dim(up[o], hd, to_halves=False).contiguous()
        return InputSet(_cg_weights(case, inset.t), up)
    return prepare


def _cg_to_reference(case: Case):
    """to_reference: q/k columns back to rotate_half order; gradients of codagen's weights back to the
    eager weights (w_gate_up -> wg, wu; w_qkv's q and k rows -> halves order)."""
    dm = case.dims
    hd = dm.head_dim

    def to_reference(named: dict, state: InputSet) -> dict:
        convert = _cg_modules()[0]
        d = dict(named)
        for o in ("q", "k"):
            if o in d:
                d[o] = _cg_last_dim(d[o], hd, to_halves=True)
        if "dw_gate_up" in d:
            d["dwg"], d["dwu"] = convert.split_rows(d.pop("dw_gate_up"))
        if "dw_qkv" in d:
            q, k, v = d.pop("dw_qkv").split([dm.q_width, dm.kv_width, dm.kv_width])
            d["dwqkv"] = torch.cat([convert.heads_to_halves(q, hd), convert.heads_to_halves(k, hd), v])
        return d
    return to_reference


def _cg_oproj_swiglu(case: Case) -> Runner:
    """oproj_swiglu.fwd: K1 -> R1 -> K2 (DESIGN.md section 3), the kernels called directly -> (x1, y1)."""
    _, finish, kernels, _ = _cg_modules()
    dm, eps = case.dims, case.preset.eps

    def fwd(x0, y0, wo, wn1, w_gate_up):
        x1, h1, ss1 = kernels.out_proj_residual_norm.out_proj_residual_norm(y0, wo, x0, wn1)
        r1 = finish.rstd(ss1, dm.d, eps)
        _z1, y1 = kernels.gate_up_swiglu.gate_up_swiglu(h1, w_gate_up, r1)
        return x1, y1
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up"))


def _cg_post_attn(case: Case) -> Runner:
    """post_attn.fwd: the PostAttention block -> (x2, h2 = x2 * wn2, r2). Eager's n2 is r2 * h2, which the
    next GEMM's epilogue applies in codagen; it is formed here only for the check (untimed)."""
    _, _, _, blocks = _cg_modules()
    dm, eps, dtype = case.dims, case.preset.eps, case.dtype

    def fwd(x0, y0, wo, wn1, w_gate_up, w2, wn2):
        return blocks.PostAttentionFunction.apply(y0, x0, wn2, wo, wn1, w_gate_up, w2, dm.d, dm.ffn, eps)

    def to_reference(named, state):
        return {"x2": named["x2"], "n2": (named["h2"].float() * named["r2"][:, None]).to(dtype)}
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=to_reference,
                          args=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2"), outputs=("x2", "h2", "r2"))


def _cg_down_qkv_rope(case: Case) -> Runner:
    """down_qkv_rope.fwd: K3 -> R2 -> K4, the kernels called directly -> (x2, q, k, v) as views of qkv."""
    _, finish, kernels, _ = _cg_modules()
    dm, eps = case.dims, case.preset.eps

    def fwd(x1, y1, w2, wn2, w_qkv, positions, freqs):
        x2, h2, ss2 = kernels.out_proj_residual_norm.out_proj_residual_norm(y1, w2, x1, wn2)
        r2 = finish.rstd(ss2, dm.d, eps)
        qkv = kernels.qkv_norm_rope.qkv_norm_rope(h2, w_qkv, r2, positions, freqs)
        return (x2, *B.split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x1", "y1", "w2", "wn2", "w_qkv", "positions", "freqs"))


def _cg_block(case: Case) -> Runner:
    """block.fwd / .fwdbwd: PostAttention(y0, x0, wn2) -> (x2, h2, r2), then PreAttention(x2, h2, r2,
    positions, freqs) -> (x2, qkv), as examples/llama.py chains them. wn2 is PreAttention's norm weight (its
    gradient comes from there; PostAttention only applies it in the forward)."""
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.eps

    def fwd(x0, y0, wo, wn1, w_gate_up, w2, wn2, w_qkv, positions, freqs):
        x2, h2, r2 = blocks.PostAttentionFunction.apply(y0, x0, wn2, wo, wn1, w_gate_up, w2, dm.d, dm.ffn, eps)
        x2, qkv = blocks.PreAttentionFunction.apply(x2, h2, r2, positions, freqs, wn2, w_qkv, dm.d, dm.qkv_width)
        return (x2, *B.split_heads(qkv, dm))
    return AutogradRunner(case.pattern, fwd, prepare=_cg_prepare(case), to_reference=_cg_to_reference(case),
                          args=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv", "positions", "freqs"),
                          leaves=("x0", "y0", "wo", "wn1", "w_gate_up", "w2", "wn2", "w_qkv"))


def _cg_lm_ce(case: Case) -> Runner:
    """lm_ce.fwd / .fwdbwd: NormStats(xf, wnf) -> (h, rstd), then LmHeadLoss(xf, h, rstd, target) with wnf as
    its norm weight (NormStats applies wnf in the forward; LmHeadLoss's backward computes its gradient and
    xf's) and its default chunk_rows."""
    import inspect
    _, _, _, blocks = _cg_modules()
    dm, eps = case.dims, case.preset.eps
    chunk_rows = inspect.signature(blocks.LmHeadLoss).parameters["chunk_rows"].default

    def fwd(xf, wnf, wv, target):
        h, rstd = blocks.NormStatsFunction.apply(xf, wnf, dm.d, eps)
        loss = blocks.LmHeadLossFunction.apply(xf, h, rstd, target, wnf, wv, dm.d, dm.vocab, -100, "mean",
                                               chunk_rows)
        return (loss,)
    return AutogradRunner(case.pattern, fwd)


# <<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<  END CODAGEN HOOK  >>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>>
# ====================================================================================================


# ====================================================================================================
# measurement helpers


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (fp32 on the GPU, in chunks, to bound memory)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
    acc = torch.float64 if a.device.type == "cpu" else torch.float32
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    num = den = 0.0
    chunk = 1 << 26
    for i in range(0, max(a.numel(), 1), chunk):
        aa, bb = a[i:i + chunk].to(acc), b[i:i + chunk].to(acc)
        num += float(torch.sum((aa - bb) ** 2))
        den += float(torch.sum(bb * bb))
        if not math.isfinite(num):
            return float("nan")
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return math.sqrt(num / den)


def compare(named: dict, ref: dict) -> tuple:
    """(max relative error, name of the worst tensor, {name: err})."""
    errs = {}
    for k, r in ref.items():
        if k not in named:
            raise KeyError(f"variant output lacks {k!r} (has {sorted(named)})")
        errs[k] = rel_err(named[k], r)
    worst = max(errs, key=lambda k: (math.isnan(errs[k]), errs[k]))
    return errs[worst], worst, errs


def detach_named(named: dict) -> dict:
    return {k: v.detach() for k, v in named.items()}


def bench_ms(fn, device, warmup_ms, rep_ms) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    # CPU: host clock around synchronous calls, median
    t_end = time.perf_counter() + warmup_ms / 1e3
    for i in range(1000):
        fn()
        if i >= 1 and time.perf_counter() > t_end:
            break
    times, t_end = [], time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def one_call(fn, device) -> tuple:
    """Run once; return (ms, peak bytes allocated above what was allocated before)."""
    sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize(device)
        return e0.elapsed_time(e1), torch.cuda.max_memory_allocated(device) - base
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, None


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ====================================================================================================
# the run


@dataclass
class Row:
    preset: str
    tokens: int
    pattern: str
    title: str
    variant: str
    ms: Optional[float] = None
    ms_passes: list = field(default_factory=list)
    peak_mib: Optional[float] = None
    err_eager: Optional[float] = None
    err_ref: Optional[float] = None
    worst: str = ""
    errs: dict = field(default_factory=dict)
    gemm_tflop: float = 0.0
    note: str = ""
    error: str = ""


def log(msg):
    print(msg, flush=True)


def run_case(preset: Preset, tokens: int, args, variants: list, rows: list, checkpoint=None) -> list:
    """Build, check and time every (pattern, variant) of one preset and token count; appends to rows and
    calls checkpoint() after each pattern (the report is rewritten then, so a killed run leaves results)."""
    device, dtype = args.device_obj, args.dtype_obj
    patterns = [p for p in PATTERNS if _selected(p.key, args.patterns)]
    by_pattern = {}
    for v in variants:
        if v.name in (CUBLAS, "eager") or _selected(v.name, args.variants):
            by_pattern.setdefault(v.pattern, []).append(v)
    unknown = sorted(set(by_pattern) - set(PATTERN_BY_KEY))
    if unknown:
        log(f"WARNING: variants registered for unknown patterns {unknown}; known: {sorted(PATTERN_BY_KEY)}")
    l2 = _l2_bytes(device)
    for pat in patterns:
        case = Case(preset, tokens, dtype, device, pat)
        dm = case.dims
        vlist = by_pattern.get(pat.key, [])
        # eager first (the check's reference), then the rest in registry order
        vlist = sorted(vlist, key=lambda v: (v.name != "eager", v.name != CUBLAS))
        log(f"\n== {preset.name} T={tokens} (batch {dm.batch} x seq {dm.seq})  {pat.key}: {pat.title}")
        t0 = time.time()
        sets = [make_input_set(case, seed=1000 + i) for i in range(1)]
        nbytes = sets[0].nbytes()
        n_sets = 1 if nbytes >= 3 * l2 else min(args.max_sets, max(2, math.ceil(3 * l2 / max(nbytes, 1))))
        sets += [make_input_set(case, seed=1000 + i) for i in range(1, n_sets)]
        flops = B.gemm_flops(pat.base, dm, pat.backward)

        # higher-precision reference on set 0
        ref = None
        if args.ref:
            try:
                ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
                hi = upcast(sets[0], ref_dtype)
                r = AutogradRunner(pat, B.eager_fns(dm, "eager")[pat.base])
                ref = detach_named(r.named(hi, r.run(hi)))
                del hi, r
            except Exception as e:  # noqa: BLE001
                log(f"   reference failed: {type(e).__name__}: {e}")
                ref = None
            free(device)

        eager_named = None
        # build + check every variant
        built = []
        for v in vlist:
            row = Row(preset.name, tokens, pat.key, pat.title, v.name, gemm_tflop=flops / 1e12, note=v.note)
            rows.append(row)
            try:
                tb = time.time()
                runner = v.factory(case)
                states = [runner.prepare(s) for s in sets]
                result = runner.run(states[0])               # first call: compiles / JITs
                sync(device)
                named = runner.named(states[0], result)
                if named is not None:
                    named = detach_named(named)
                    if v.name == "eager":
                        eager_named = named
                    elif eager_named is not None:
                        row.err_eager, row.worst, row.errs = compare(named, eager_named)
                    if ref is not None:
                        row.err_ref, worst_ref, errs_ref = compare(named, ref)
                        row.errs.update({k + "@ref": e for k, e in errs_ref.items()})
                        if not row.worst:
                            row.worst = worst_ref
                del result, named
                sync(device)
                bad = [e for e in (row.err_eager, row.err_ref) if e is not None and not (e <= args.tol)]
                if bad:   # NaN or over tolerance: keep timing it, but say so loudly
                    row.note = (row.note + "; " if row.note else "") + f"CHECK: error {max(bad):.2e} > tol {args.tol:g}"
                    log(f"   !! {v.name}: {row.note}")
                built.append((row, runner, states))
                log(f"   {v.name:22s} built+checked in {time.time() - tb:6.1f}s   "
                    f"err vs eager {_fmt_err(row.err_eager)}  vs ref {_fmt_err(row.err_ref)}"
                    f"{'  (worst: ' + row.worst + ')' if row.worst else ''}")
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log(f"   {v.name:22s} FAILED: {row.error}")
                if args.verbose:
                    traceback.print_exc()
                free(device)
        eager_named = None

        # peak memory and a first time estimate, one call each
        for row, runner, states in built:
            try:
                est, peak = one_call(lambda: runner.run(states[0]), device)
                row.peak_mib = None if peak is None else peak / 2**20
                row._est = est
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {e}"[:300]
        # timing: passes over all variants, interleaved
        for _ in range(args.passes):
            for row, runner, states in built:
                if row.error:
                    continue
                idx = [0]

                def step(runner=runner, states=states, idx=idx):
                    s = states[idx[0] % len(states)]
                    idx[0] += 1
                    runner.run(s)
                rep = max(args.rep, args.min_iters * getattr(row, "_est", 0.0))
                try:
                    row.ms_passes.append(bench_ms(step, device, args.warmup, rep))
                except Exception as e:  # noqa: BLE001
                    row.error = f"{type(e).__name__}: {e}"[:300]
        cub = next((r.ms_passes for r, _, _ in built if r.variant == CUBLAS and r.ms_passes), None)
        eag = next((r.ms_passes for r, _, _ in built if r.variant == "eager" and r.ms_passes), None)
        for row, _, _ in built:
            if row.ms_passes and not row.error:
                row.ms = statistics.fmean(row.ms_passes)
        for row, _, _ in built:
            if row.ms is None:
                continue
            log(f"   {row.variant:22s} {row.ms:9.3f} ms  x{_ratio(row.ms, cub):>6s} cuBLAS  x{_ratio(row.ms, eag):>6s} eager"
                f"  spread {_spread(row.ms_passes)}  peak+ {_fmt_mib(row.peak_mib)}"
                f"  ({sets[0].nbytes() / 2**20:.0f} MiB inputs, {len(sets)} set{'s' if len(sets) > 1 else ''})")
        log(f"   [{pat.key} done in {time.time() - t0:.1f}s]")
        del built, sets, ref
        free(device)
        if checkpoint:
            checkpoint()
    return rows


def _selected(name, patterns):
    if not patterns:
        return True
    return any(fnmatch.fnmatch(name, p) or p in name for p in patterns)


def _l2_bytes(device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) or (60 << 20))
    return 32 << 20


def _fmt_err(e):
    return "   -    " if e is None else f"{e:.2e}"


def _fmt_mib(m):
    return "-" if m is None else f"{m:,.0f} MiB"


def _ratio(ms, base_passes):
    if ms is None or not base_passes:
        return "-"
    return f"{ms / statistics.fmean(base_passes):.2f}"


def _spread(passes):
    if len(passes) < 2:
        return "-"
    m = statistics.fmean(passes)
    return f"{(max(passes) - min(passes)) / m * 100:.1f}%"


# ====================================================================================================
# report


def environment(args) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "dtype": str(args.dtype_obj).replace("torch.", ""),
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = "not installed"
    try:
        from importlib.metadata import version
        env["liger-kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger-kernel"] = "not installed"
    if args.device_obj.type == "cuda":
        p = torch.cuda.get_device_properties(args.device_obj)
        env["device"] = p.name
        env["gpu"] = (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                      f"L2 {_l2_bytes(args.device_obj) / 2**20:.0f} MiB, CUDA {torch.version.cuda}")
    else:
        env["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} threads)"
    return env


def slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-").replace("--", "-") or "device"


def write_report(rows: list, env: dict, args, out: Path, kernel_rows: tuple = (), chart: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = slug(env["device"]) + ("-quick" if args.quick else "") + (f"-{slug(args.tag)}" if args.tag else "")
    variants = []
    for r in rows:
        if r.variant not in variants:
            variants.append(r.variant)
    variants = sorted(variants, key=lambda v: (BASELINES.index(v) if v in BASELINES else len(BASELINES), v))

    L = [f"# codagen benchmarks: {env['device']}", ""]
    L += [f"- date: {env['date']}",
          f"- GPU: {env['gpu']}",
          f"- torch {env['torch']}, triton {env['triton']}, liger-kernel {env['liger-kernel']}, python {env['python']}",
          f"- dtype {env['dtype']}; command: `{' '.join(['python'] + [_rel(a) for a in sys.argv])}`",
          "- timing: "
          + (f"triton.testing.do_bench median (L2 flushed before each call), warmup {args.warmup} ms, "
             if args.device_obj.type == "cuda" else "host clock (perf_counter) median, ")
          + f"rep >= {args.rep} ms (and >= {args.min_iters} calls), "
          f"inputs rotated among up to {args.max_sets} sets when one set is under 3x L2; {args.passes} passes over all "
          f"variants, ms = mean of the passes' medians, spread = (max - min) / mean",
          "- fwd rows run under torch.no_grad(); fwd+bwd rows run forward then torch.autograd.grad w.r.t. every "
          "input except cos/sin/target with random upstream gradients (loss: 1.0)",
          "- 'x cuBLAS' = time / time of the same GEMMs alone (F.linear / torch.mm; fwd+bwd: forward, input-grad and "
          "weight-grad GEMM per linear layer); GEMM TFLOP/s = those GEMMs' FLOPs / the row's time",
          "- err = ||out - ref|| / ||ref||, worst over outputs and gradients, vs eager bf16 and vs the eager function "
          "on fp32 inputs (TF32 off; fp64 on the CPU); peak+ = max_memory_allocated during one call minus what was "
          "allocated before it",
          "- variants: eager = plain PyTorch HF-Llama style (baselines.py); torch.compile = the same functions, "
          "default mode, dynamic=False; liger = Liger-Kernel as apply_liger_kernel_to_llama uses it (LigerRMSNorm, "
          "LigerSiLUMulFunction, liger_rotary_pos_emb, liger_fused_linear_cross_entropy); liger+addnorm = also "
          "LigerFusedAddRMSNorm for residual add + RMSNorm",
          ""]
    groups = []
    for r in rows:
        if (r.preset, r.tokens) not in groups:
            groups.append((r.preset, r.tokens))
    for preset_name, tokens in groups:
        pr = PRESETS[preset_name]
        dm = pr.dims(tokens)
        L += [f"## {preset_name}, {tokens} tokens", "",
              f"{pr.describe()}; batch {dm.batch} x seq {dm.seq}", "",
              "ms (x cuBLAS GEMMs alone):", "",
              "| pattern | " + " | ".join(variants) + " |",
              "|---|" + "---|" * len(variants)]
        grows = [r for r in rows if (r.preset, r.tokens) == (preset_name, tokens)]
        pats = []
        for r in grows:
            if r.pattern not in pats:
                pats.append(r.pattern)
        for pk in pats:
            cells = []
            cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
            for v in variants:
                r = next((r for r in grows if r.pattern == pk and r.variant == v), None)
                if r is None:
                    cells.append("-")
                elif r.ms is None:
                    cells.append("failed" if r.error else "-")
                else:
                    cells.append(f"{r.ms:.3f}" + (f" ({r.ms / cub:.2f}x)" if cub else ""))
            L.append(f"| {PATTERN_BY_KEY[pk].title if pk in PATTERN_BY_KEY else pk} | " + " | ".join(cells) + " |")
        for v in variants:
            if v not in BASELINES:
                L += [""] + vs_baselines_table(grows, pats, v)
        L += ["", "<details><summary>all rows</summary>", "",
              "| pattern | variant | ms | x cuBLAS | x eager | spread | GEMM TFLOP/s | peak+ MiB | err vs eager | "
              "err vs fp32 ref | worst | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for pk in pats:
            pr_rows = [r for r in grows if r.pattern == pk]
            cub = next((r.ms for r in pr_rows if r.variant == CUBLAS), None)
            eag = next((r.ms for r in pr_rows if r.variant == "eager"), None)
            for r in sorted(pr_rows, key=lambda r: (variants.index(r.variant))):
                tf = "-" if not r.ms else f"{r.gemm_tflop / (r.ms / 1e3):.3g}"
                note = r.error or r.note
                L.append(f"| {pk} | {r.variant} | {_f(r.ms, '.3f')} | {_div(r.ms, cub)} | {_div(r.ms, eag)} | "
                         f"{_spread(r.ms_passes)} | {tf} | {_f(r.peak_mib, ',.0f')} | {_fmt_err(r.err_eager).strip()} | "
                         f"{_fmt_err(r.err_ref).strip()} | {r.worst} | {note} |")
        L += ["", "</details>", ""]
    if kernel_rows:
        import kernels

        L += kernels.report_lines(list(kernel_rows))
    md = out / f"{stem}.md"
    md.write_text("\n".join(L) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": [_row_json(r) for r in rows],
                                                  "kernels": [r.as_dict() for r in kernel_rows]}, indent=1) + "\n")
    if chart:
        try:
            plot(rows, variants, groups, out / f"{stem}.png", env)
        except ImportError as e:
            log(f"(no chart: {e})")
    return md


BASELINES = [CUBLAS, "eager", "torch.compile", "liger", "liger+addnorm"]


def _ms_of(rows, pattern, variant):
    return next((r.ms for r in rows if r.pattern == pattern and r.variant == variant and r.ms), None)


def vs_baselines_table(grows: list, pats: list, variant: str) -> list:
    """Markdown lines: per pattern, the variant's time divided by each baseline's time in the same run
    (< 1: the variant is faster), with the variant's check result."""
    present = [b for b in BASELINES if any(r.variant == b for r in grows)]
    L = [f"{variant} vs each baseline: time ratio {variant} / baseline (< 1: {variant} is faster; cuBLAS GEMMs "
         f"alone is the speed of light, so there the ratio is >= 1 and 1.00 means a free epilogue):", "",
         f"| pattern | {variant} ms | " + " | ".join(f"/ {b}" for b in present)
         + f" | {variant} err vs fp32 ref | eager err vs fp32 ref |",
         "|---|---|" + "---|" * len(present) + "---|---|"]
    for pk in pats:
        r = next((r for r in grows if r.pattern == pk and r.variant == variant), None)
        if r is None:
            continue
        eag = next((e for e in grows if e.pattern == pk and e.variant == "eager"), None)
        cells = [_div(r.ms, _ms_of(grows, pk, b)) for b in present]
        flag = " (CHECK)" if "CHECK" in (r.note or "") else ""
        L.append(f"| {pk} | {'failed' if r.error else _f(r.ms, '.3f')} | " + " | ".join(cells)
                 + f" | {_fmt_err(r.err_ref).strip()}{flag} | {_fmt_err(eag.err_ref if eag else None).strip()} |")
    return L


def _rel(a: str) -> str:
    try:
        return str(Path(a).resolve().relative_to(ROOT)) if os.path.exists(a) else a
    except ValueError:
        return a


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def _div(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"


def _row_json(r: Row) -> dict:
    return {k: v for k, v in r.__dict__.items() if not k.startswith("_")}


def plot(rows, variants, groups, path: Path, env):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(groups)
    fig, axes = plt.subplots(n, 1, figsize=(14, 4.2 * n), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, (preset_name, tokens) in zip(axes[:, 0], groups):
        grows = [r for r in rows if (r.preset, r.tokens) == (preset_name, tokens)]
        pats = []
        for r in grows:
            if r.pattern not in pats:
                pats.append(r.pattern)
        width = 0.8 / max(len(variants), 1)
        for j, v in enumerate(variants):
            xs, ys = [], []
            for i, pk in enumerate(pats):
                cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
                r = next((r for r in grows if r.pattern == pk and r.variant == v), None)
                if r is not None and r.ms and cub:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r.ms / cub)
            bars = ax.bar(xs, ys, width, label=v, color=colors(j))
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(pats)))
        ax.set_xticklabels(pats, fontsize=8)
        ax.set_ylabel("time / cuBLAS GEMMs alone")
        ax.set_title(f"{preset_name}, {tokens} tokens, {env['dtype']} — {env['device']} "
                     f"(torch {env['torch']}, triton {env['triton']}, liger {env['liger-kernel']})", fontsize=9)
        ax.legend(fontsize=7, ncol=len(variants))
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ====================================================================================================
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS),
                    help="model shapes (repeatable; default llama3-1b and llama3-8b on CUDA, tiny on the CPU)")
    ap.add_argument("--tokens", type=int, nargs="+", help="token counts (default 16384; --quick: 2048; CPU: 128)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for <gpu>.md/.json/.png")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="smoke test: tokens 2048 (CPU: 128), short timing, first preset only")
    ap.add_argument("--patterns", nargs="+", help="only patterns matching these (substring or glob), e.g. block lm_ce.fwd; "
                                                  "'kernels' selects the fused-kernel section")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="skip the section of fused kernels vs the cuBLAS GEMM of the same shape")
    ap.add_argument("--variants", nargs="+",
                    help="only these variants (substring or glob; cuBLAS and eager, the check's reference, always "
                         "run), e.g. --variants codagen, or --variants codagen torch.compile liger")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help="include torch.compile rows")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-liger", dest="liger", action="store_false", default=None)
    ap.add_argument("--liger-interpret", action="store_true",
                    help="CPU only: run the Liger rows under TRITON_INTERPRET=1 (slow; to check the calls)")
    ap.add_argument("--no-ref", dest="ref", action="store_false", help="skip the fp32/fp64 reference")
    ap.add_argument("--warmup", type=int, default=None, help="do_bench warmup, ms (default 25; quick 5)")
    ap.add_argument("--rep", type=int, default=None, help="do_bench rep, ms (default 100; quick 20)")
    ap.add_argument("--min-iters", type=int, default=None, help="timed calls at least (rep is raised to fit)")
    ap.add_argument("--passes", type=int, default=2, help="timing passes over all variants")
    ap.add_argument("--max-sets", type=int, default=4, help="input sets to rotate among when one set fits in L2")
    ap.add_argument("--tol", type=float, default=5e-2,
                    help="flag rows whose relative error vs eager or vs the reference exceeds this (or is NaN)")
    ap.add_argument("--tag", default="", help="suffix for the output file names (<gpu>[-quick][-TAG].md)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failed rows")
    args = ap.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device_obj = torch.device(args.device)
    if args.device_obj.type == "cuda" and args.device_obj.index is None:
        args.device_obj = torch.device("cuda", torch.cuda.current_device())
    cpu = args.device_obj.type == "cpu"
    args.dtype_obj = getattr(torch, args.dtype)
    if args.preset is None:
        args.preset = ["tiny"] if cpu else ["llama3-1b", "llama3-8b"]
    if args.quick and len(args.preset) > 1:
        args.preset = args.preset[:1]
    if args.tokens is None:
        args.tokens = [128] if cpu else ([2048] if args.quick else [16384])
    if args.compile is None:
        args.compile = not cpu
    if args.liger is None:
        args.liger = (not cpu) or args.liger_interpret
    if args.warmup is None:
        args.warmup = 5 if args.quick else 25
    if args.rep is None:
        args.rep = 20 if args.quick else 100
    if args.min_iters is None:
        args.min_iters = 3 if args.quick else 7
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    # one compiled graph per (pattern, preset, tokens, grad mode): room for all of them
    import torch._dynamo
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(256, torch._dynamo.config.accumulated_cache_size_limit)
    # the reference runs fp32 GEMMs: keep them true fp32 (TF32 off; it is off by default too)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    env = environment(args)
    log(f"codagen bench: {env['gpu']}; torch {env['torch']}, triton {env['triton']}, liger-kernel {env['liger-kernel']}")
    rows, kernel_rows = [], []
    out = Path(args.out)
    for pname in args.preset:
        preset = PRESETS[pname]
        for tokens in args.tokens:
            variants = builtin_variants(args) + list(codagen_variants(preset, tokens, args.dtype_obj))
            run_case(preset, tokens, args, variants, rows,
                     checkpoint=lambda: write_report(rows, env, args, out, kernel_rows, chart=False))
            if args.kernels and _selected("kernels", args.patterns):
                import kernels

                log(f"\n== {pname} T={tokens}  fused kernels vs the cuBLAS GEMM of the same shape")
                kernel_rows += kernels.run(preset, tokens, args.device_obj, args.dtype_obj,
                                           lambda fn: bench_ms(fn, args.device_obj, args.warmup, args.rep), log)
                write_report(rows, env, args, out, kernel_rows, chart=False)
            log(f"[{time.time() - t_start:.0f}s elapsed]")
    md = write_report(rows, env, args, out, kernel_rows)
    failed = [r for r in rows if r.error] + [r for r in kernel_rows if r.error]
    log(f"\nwrote {md} (+ .json, .png) in {time.time() - t_start:.0f}s; {len(rows)} rows, {len(failed)} failed")
    # last: the short table (the device tool returns the tail of the output)
    log(summary(rows))
    return 1 if failed and not any(r.ms for r in rows) else 0


def summary(rows) -> str:
    lines = []
    groups = []
    for r in rows:
        if (r.preset, r.tokens) not in groups:
            groups.append((r.preset, r.tokens))
    for g in groups:
        lines.append(f"\n{g[0]} T={g[1]}   ms (x cuBLAS)")
        grows = [r for r in rows if (r.preset, r.tokens) == g]
        for pk in dict.fromkeys(r.pattern for r in grows):
            cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
            cells = []
            for r in grows:
                if r.pattern != pk:
                    continue
                val = "FAILED" if r.error else (f"{r.ms:.3f}" + (f"({r.ms / cub:.2f})" if cub else "") if r.ms else "-")
                cells.append(f"{r.variant}={val}")
            lines.append(f"  {pk:20s} " + "  ".join(cells))
            for r in grows:
                if r.pattern == pk and r.variant not in BASELINES and r.ms:
                    ratios = [f"{b}={_div(r.ms, _ms_of(grows, pk, b))}" for b in BASELINES if _ms_of(grows, pk, b)]
                    check = "  CHECK FAILED" if "CHECK" in (r.note or "") else ""
                    lines.append(f"  {'':20s} {r.variant} / " + "  ".join(ratios) + check)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
