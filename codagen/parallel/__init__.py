"""codagen under torch.distributed beyond data parallelism (docs/distributed.md).

`vocab_parallel`: the final RMSNorm, LM head and cross-entropy with the vocabulary (the LM head's rows) split
across the ranks of a process group; no rank holds more than a chunk of its own slice's logits.

Tensor-parallel decoder layers are not implemented: docs/distributed.md says where their all-reduces would sit.
"""
from .vocab_parallel import VocabParallelLmHeadLoss, vocab_parallel_lm_head_loss, vocab_range

__all__ = ["VocabParallelLmHeadLoss", "vocab_parallel_lm_head_loss", "vocab_range"]
