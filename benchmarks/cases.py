"""What the benchmark runs: model presets (codagen/presets.py) split into batch x sequence, the fixed lists of
patterns of each model family (Llama's block patterns; Qwen3's and Gemma-2's block and LM head), and their
random input sets."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import baselines as B
from codagen.presets import PRESETS as MODELS
from codagen.presets import Gemma2Shape, LlamaShape

SEQ = 4096  # tokens are split into batch x seq (seq = min(SEQ, tokens), or all the tokens when that does not divide)


@dataclass(frozen=True)
class Preset:
    """A model preset as the benchmark runs it."""

    name: str
    model: LlamaShape

    def dims(self, tokens: int) -> B.Dims:
        m = self.model
        seq = min(SEQ, tokens)
        if tokens % seq:
            seq = tokens
        softcap = m.final_softcap if isinstance(m, Gemma2Shape) else None
        return B.Dims(d=m.dim, ffn=m.ffn_dim, n_q=m.n_heads, n_kv=m.n_kv_heads, head_dim=m.head_dim,
                      vocab=m.vocab, batch=tokens // seq, seq=seq, eps=m.eps, family=m.family, softcap=softcap)

    @property
    def patterns(self) -> list:
        """The patterns of this preset's model family, in report order."""
        return FAMILY_PATTERNS[self.model.family]

    def describe(self) -> str:
        m = self.model
        q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        softcap = f", logit softcap {m.final_softcap:g}" if isinstance(m, Gemma2Shape) else ""
        return (f"{m.family}: D={m.dim}, FFN={m.ffn_dim}, QKV={q + 2 * kv} (q {m.n_heads}x{m.head_dim} + k and v "
                f"{m.n_kv_heads}x{m.head_dim} each), vocab {m.vocab}, eps {m.eps}, rope theta {m.rope_theta:g}"
                + softcap)


PRESETS = {name: Preset(name, model) for name, model in MODELS.items()}


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
_QWEN3_BLOCK = _OPROJ + ("w2", "wn2", "wqkv", "wqn", "wkn", "cos", "sin")   # wqn, wkn: q_norm, k_norm
# wna, wn1, wnm: the post-attention, pre-feedforward and post-feedforward norms; wn2 the next layer's input norm
_GEMMA2_BLOCK = ("x0", "y0", "wo", "wna", "wn1", "wg", "wu", "w2", "wnm", "wn2", "wqkv", "cos", "sin")


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
FAMILY_PATTERNS = {
    "llama": PATTERNS,
    "qwen3": [_pattern("block", "Qwen3 non-attention block with QK-norm (x0, y0 -> x2, RoPE'd q, k, v)",
                       _QWEN3_BLOCK, ("x2", "q", "k", "v"), bwd) for bwd in (False, True)]
    + [p for p in PATTERNS if p.base == "lm_ce"],   # Llama's LM head
    "gemma2": [_pattern("block", "Gemma-2 non-attention block, post-norms and GeGLU (x0, y0 -> x2, RoPE'd q, k, v)",
                        _GEMMA2_BLOCK, ("x2", "q", "k", "v"), bwd) for bwd in (False, True)]
    + [_pattern("lm_ce", "final RMSNorm + LM head + softcap + cross-entropy", _LM, ("loss",), bwd)
       for bwd in (False, True)],
}
PATTERN_BY_KEY = {p.key: p for p in PATTERNS}   # every family's keys are among Llama's


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
        x = B.make_tensor(name, dm, dtype, device, gen, case.preset.model.rope_theta)
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
