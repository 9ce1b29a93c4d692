"""codagen under torch.distributed beyond data parallelism (docs/distributed.md).

`vocab_parallel`: the final RMSNorm, LM head and cross-entropy with the vocabulary (the LM head's rows) split
across the ranks of a process group; no rank holds more than a chunk of its own slice's logits.
`tensor_parallel`: codagen's Llama assembly with tensor-parallel layers (QKV and gate/up column-parallel, the out
and down projections row-parallel) and the vocab-parallel head.
`hf_tensor_parallel`: `apply_tensor_parallel(model, group)`, the same layers in a codagen.hf-patched transformers
causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma-2: `hf_families`, Gemma-2's layer in `gemma2`), with a
vocab-parallel embedding and LM head.
"""
from .hf_tensor_parallel import (TensorParallelError, VocabParallelEmbedding, apply_tensor_parallel,
                                 full_state_dict)
from .tensor_parallel import TensorParallelLlama, layer_shards
from .vocab_parallel import VocabParallelLmHeadLoss, vocab_parallel_lm_head_loss, vocab_range

__all__ = ["TensorParallelError", "TensorParallelLlama", "VocabParallelEmbedding", "VocabParallelLmHeadLoss",
           "apply_tensor_parallel", "full_state_dict", "layer_shards", "vocab_parallel_lm_head_loss", "vocab_range"]
