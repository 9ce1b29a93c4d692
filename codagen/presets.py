"""Model presets: the dimensions of the models that tuning, the benchmarks and the GPU tests run at, written
once. Only dimensions and constants are here; where each kernel runs, and on how many rows, follows from the
block specs (specs/blocks/), whose int attrs these values fill in by name."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LlamaShape:
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attn_dim(self) -> int:
        """The width of the attention output, n_heads * head_dim: the out-projection's input (dim in Llama, not
        in Gemma-2 or every Qwen3)."""
        return self.n_heads * self.head_dim

    def attrs(self) -> dict[str, int | float]:
        """Values for block attrs of the same names: every field, qkv_dim and attn_dim."""
        return {**asdict(self), "qkv_dim": self.qkv_dim, "attn_dim": self.attn_dim}


PRESETS: dict[str, LlamaShape] = {
    "llama3-1b": LlamaShape(dim=2048, ffn_dim=8192, n_heads=32, n_kv_heads=8, head_dim=64, n_layers=16,
                            vocab=128256, rope_theta=500000.0, eps=1e-5),
    "llama3-8b": LlamaShape(dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, head_dim=128, n_layers=32,
                            vocab=128256, rope_theta=500000.0, eps=1e-5),
    # small and ragged (ffn_dim and vocab are not powers of two): smoke tests on the CPU
    "tiny": LlamaShape(dim=64, ffn_dim=160, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=1000,
                       rope_theta=500000.0, eps=1e-5),
}
