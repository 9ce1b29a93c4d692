"""What apply_tensor_parallel runs in each transformers family it supports, by causal LM class (FAMILIES), where the
families differ: the non-attention rest of a layer (its row-parallel products all-reduced before the norms that
follow them) and the options of the vocab-parallel loss. Shared by all (hf_tensor_parallel): the sharding, the first
layer's norm statistics, and the block before attention (Llama's tensor-parallel function, or the family's own
single-process block on the rank's heads); docs/distributed.md#a-transformers-model-tensor-parallel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .gemma2 import gemma2_post_attention
from .tensor_parallel import TensorParallelPostAttentionFunction


def llama_post_attention(layer, y, x, wn_next, cast, group):
    """Llama's post-attention (codagen.parallel.tensor_parallel), with the gate/up bias of the rank's pairs and
    down_proj's bias, replicated, where mlp_bias gives them; Qwen3's is Llama's for an attention width other than
    the model's."""
    attn, mlp = layer.self_attn, layer.mlp
    b_gate_up, b_down = (None if b is None else cast(b) for b in (mlp.gate_up_proj.bias, mlp.down_proj.bias))
    return TensorParallelPostAttentionFunction.apply(
        y, x, wn_next, cast(attn.o_proj.weight), cast(layer.post_attention_layernorm.weight),
        cast(mlp.gate_up_proj.weight), b_gate_up, cast(mlp.down_proj.weight), b_down, layer.dim, layer.eps, group)


@dataclass(frozen=True)
class TensorParallelFamily:
    """post_attention(layer, y, x, wn_next, cast, group) -> (x, h, rstd): a layer's rest after attention, with `y`
    the attention's output on the rank's heads [M, rank's heads * head_dim], `x` the residual stream, `wn_next` the
    next norm's weight and `cast` the cast of a weight to the blocks' dtype. loss_options(config) -> the keyword
    arguments of vocab_parallel_lm_head_loss for the family's head."""

    post_attention: Callable
    loss_options: Callable = field(default=lambda config: {})


LLAMA = TensorParallelFamily(llama_post_attention)
# Gemma-2's head: its final norm's (1 + w) scale and the logits' softcap (gemma2_lm_head_loss)
GEMMA2 = TensorParallelFamily(gemma2_post_attention, lambda config: dict(softcap=config.final_logit_softcapping,
                                                                         norm_plus_one=True))

# the transformers causal LMs apply_tensor_parallel supports -> what it runs in them
FAMILIES = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA, "Qwen2ForCausalLM": LLAMA,
            "Qwen3ForCausalLM": LLAMA, "Gemma2ForCausalLM": GEMMA2}
