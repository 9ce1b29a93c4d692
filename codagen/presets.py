"""Model presets: the dimensions of the models that tuning, the benchmarks, the GPU tests and the training runs
(codagen.training, examples/) run at, written once. Only dimensions and constants are here; where each kernel runs,
and on how many rows, follows from the block specs (specs/blocks/, specs/<family>/blocks/) that the preset's model
family runs (its module, codagen/models/<family>.py, lists them), whose int attrs these values fill in by name."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import models

FAMILIES = models.NAMES  # the model families: codagen/models/<family>.py


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture model's dimensions; Qwen3 has the same ones (family "qwen3": QK-norm, and an
    attention width n_heads * head_dim that need not be dim)."""

    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    family: str = "llama"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attn_dim(self) -> int:
        """The width of the attention output, n_heads * head_dim: the out-projection's input (dim in Llama, not
        in Gemma-2 or every Qwen3)."""
        return self.n_heads * self.head_dim

    def attrs(self) -> dict[str, int | float]:
        """Values for block attrs of the same names: every numeric field, qkv_dim and attn_dim."""
        fields = {k: v for k, v in asdict(self).items() if isinstance(v, (int, float))}
        return {**fields, "qkv_dim": self.qkv_dim, "attn_dim": self.attn_dim}

    def runs_block(self, block: str) -> bool:
        """Whether a model of this family runs the block spec named `block` (codagen.models.runs_block: a block its
        family module lists, or for Llama, one that no family lists)."""
        return models.runs_block(self.family, block)


@dataclass(frozen=True)
class Gemma2Shape(LlamaShape):
    """Gemma-2's dimensions and constants (Gemma2Config's fields, by their meaning)."""

    family: str = "gemma2"
    query_pre_attn_scalar: int = 256  # attention scores are scaled by its inverse square root
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    sliding_window: int = 4096  # even layers (0, 2, ...) attend to at most this many past positions
    pad_token_id: int | None = 0  # the embedding row that gets no gradient from the lookup, as nn.Embedding's

    def attrs(self) -> dict[str, int | float]:
        """LlamaShape's, and softcap (the LM head's logit softcap) for the block attr of that name."""
        return {**super().attrs(), "softcap": self.final_softcap}


PRESETS: dict[str, LlamaShape] = {
    "llama3-1b": LlamaShape(dim=2048, ffn_dim=8192, n_heads=32, n_kv_heads=8, head_dim=64, n_layers=16,
                            vocab=128256, rope_theta=500000.0, eps=1e-5),
    "llama3-8b": LlamaShape(dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, head_dim=128, n_layers=32,
                            vocab=128256, rope_theta=500000.0, eps=1e-5),
    # Qwen3-1.7B (tied embeddings) and Gemma-2-2B, as their Hugging Face configs give them
    "qwen3-1.7b": LlamaShape(dim=2048, ffn_dim=6144, n_heads=16, n_kv_heads=8, head_dim=128, n_layers=28,
                             vocab=151936, rope_theta=1000000.0, eps=1e-6, family="qwen3"),
    "gemma2-2b": Gemma2Shape(dim=2304, ffn_dim=9216, n_heads=8, n_kv_heads=4, head_dim=256, n_layers=26,
                             vocab=256000, rope_theta=10000.0, eps=1e-6),
    # 124.6M parameters (75.5M in the 12 layers, 24.6M each in the embedding and the untied LM head): the model
    # that examples/train_llama.py trains on 1 and 2 GPUs
    "llama-100m": LlamaShape(dim=768, ffn_dim=2048, n_heads=12, n_kv_heads=4, head_dim=64, n_layers=12, vocab=32000),
    # small and ragged (ffn_dim and vocab are not powers of two): smoke tests on the CPU. Qwen3's kernels
    # normalize heads of 128 columns; Gemma-2's attention width (96) is not dim.
    "tiny": LlamaShape(dim=64, ffn_dim=160, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=1000,
                       rope_theta=500000.0, eps=1e-5),
    "qwen3-tiny": LlamaShape(dim=64, ffn_dim=160, n_heads=2, n_kv_heads=1, head_dim=128, n_layers=2, vocab=1000,
                             rope_theta=1000000.0, eps=1e-6, family="qwen3"),
    "gemma2-tiny": Gemma2Shape(dim=64, ffn_dim=160, n_heads=4, n_kv_heads=2, head_dim=24, n_layers=2, vocab=1000,
                               eps=1e-6),
}
