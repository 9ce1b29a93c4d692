"""codagen under torch.distributed beyond data parallelism (docs/distributed.md).

`vocab_parallel`: the final RMSNorm, LM head and cross-entropy with the vocabulary (the LM head's rows) split
across the ranks of a process group; no rank holds more than a chunk of its own slice's logits.
`tensor_parallel`: codagen's Llama assembly with tensor-parallel layers (QKV and gate/up column-parallel, the out
and down projections row-parallel) and the vocab-parallel head.
"""
from .tensor_parallel import TensorParallelLlama, layer_shards
from .vocab_parallel import VocabParallelLmHeadLoss, vocab_parallel_lm_head_loss, vocab_range

__all__ = ["TensorParallelLlama", "VocabParallelLmHeadLoss", "layer_shards", "vocab_parallel_lm_head_loss",
           "vocab_range"]
