"""Model families, each declared once, in its module codagen/models/<family>.py: the block specs its models chain,
its assembly (the model built from the generated blocks, and the same model in plain PyTorch, Hugging Face's
layout and names, as its reference), the weight conversion between the two, and, where codagen.hf patches the
family's transformers model, the Hugging Face mapping (which module and weight feeds which block).

A family module's `FAMILY` is its `Family` record. This package imports neither torch nor a family module until
one is asked for (`family`), so that codagen.presets, which `codagen build --check` imports, names the families
without torch. The dimensions of each family's models are codagen.presets' (LlamaShape, Gemma2Shape, PRESETS).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# the family modules of this package; the first (Llama) also runs every block spec no family lists (runs_block)
NAMES = ("llama", "qwen3", "gemma2")
GENERATED_PACKAGE = "codagen_generated"


@dataclass(frozen=True)
class Family:
    """What a model family is made of (see the module docstring).

    blocks: the block specs (by name) that its model chains, in order: what tuning and the benchmarks take at its
      presets (codagen.presets.LlamaShape.runs_block).
    model: the assembly, an nn.Module of generated blocks: model(shape, ignore_index=-100, chunk_rows=2048,
      device=None, dtype=None), called as model(tokens, targets) -> the mean cross-entropy loss.
    reference: the same model in plain PyTorch, parameters named as transformers' model: reference(shape,
      ignore_index=-100, device=None, dtype=None).
    from_hf, to_hf: state dict conversions, (state dict, shape) -> state dict: a Hugging Face (reference) state dict
      to the assembly's and back.
    hf: what codagen.hf reads to patch the family's transformers model in place; None where it does not.
    hf_alike: the mappings of other transformers models whose decoder layers compute what the family's do, which
      codagen.hf patches with the family's blocks (Llama's: Qwen2ForCausalLM, MistralForCausalLM).
    """

    name: str
    blocks: tuple[str, ...]
    model: type
    reference: type
    from_hf: Callable
    to_hf: Callable
    hf: Any = None
    hf_alike: tuple = ()


@dataclass(frozen=True)
class HfMapping:
    """How codagen.hf patches a family's transformers model in place (docs/huggingface.md).

    model_class: transformers' causal LM class ("LlamaForCausalLM"); modeling: the module of its classes.
    model_modules, layer_modules: the decoder's own modules, and each decoder layer's ("" the layer itself), by
      name -> their transformers class: a name in `modeling`, or torch.nn's "Linear" or "Embedding". The patch
      refuses any other (an adapter, a quantized linear).
    read: of those, the modules whose weights the patched forward reads as they are (checked again after one of
      them changes); the others are replaced by the patch.
    fused: a layer's fused projection -> the Hugging Face projections it is made of, in order (state_dict() and
      load_state_dict() of a patched model speak the Hugging Face layout).
    feeds: each block -> the Hugging Face weights it is given, a layer's by their names in the layer
      ("next.input_layernorm.weight": the next layer's, or "model.norm.weight" after the last), the model's own
      with "model." or "lm_head.".
    check_config: the family's own refusals, check_config(config, refuse), next to those every family shares
      (codagen.hf.check_config); refuse(field, value, why) raises CodagenConfigError naming the field. None: none.
    attention_modules: the attention's own submodules that the patched attention keeps as they are, under their
      names (Qwen3's q_norm, k_norm), read by pre_attention.
    layer_types: layer_types(config) -> transformers' attention type of each decoder layer, as the family's model
      reads it: "full_attention", or "sliding_attention" (the last config.sliding_window positions only: Hugging
      Face's sliding-window causal mask, and the window passed to its attention function). None: every layer
      full_attention.
    norm_stats, pre_attention, post_attention, lm_head_loss: the family's blocks as a patched model runs them
      (Llama's in codagen/models/llama.py, which the families made of Llama's blocks take):
      norm_stats(blocks, x, wn, dim, eps) -> (h, rstd), the first layer's input-norm statistics;
      pre_attention(layer, blocks, x, h, rstd, positions, freqs, wn, w_qkv, eps, cast) -> (x, qkv);
      post_attention(layer, blocks, y, x, wn_next, w_o, wn_mlp, w_gate_up, w_down, eps, cast) -> (x, h, rstd);
      lm_head_loss(config, blocks, x, target, wn, w_vocab, ignore_index, reduction, chunk_rows) -> the loss (the
      final norm, LM head and cross-entropy); with `layer` the patched decoder layer, `blocks` the generated blocks
      package, the weights already cast to the blocks' dtype (wn_mlp: post_attention_layernorm's) and `cast` the
      cast of any other weight.
    activation: (the config field naming the MLP's activation, the one value the family's MLP block computes, what
      that block computes, as the refusal of another value says it).
    layer_norms: the decoder layer's norms besides input_layernorm and post_attention_layernorm that the patched
      layer keeps as they are, under their names (Gemma-2's pre_feedforward_layernorm and
      post_feedforward_layernorm), read by post_attention.
    attention_args: the keyword arguments that transformers' attention module passes its attention function beyond
      Llama's and sliding_window (Gemma-2's softcap) -> the attribute of that module holding the value, which the
      patched attention keeps.
    final_logits: the logits as transformers' causal LM returns them, final_logits(config, logits), where they are
      not the LM head's output (Gemma-2 softcaps them); None: the LM head's.
    refused: transformers classes that look like the family's but that its blocks do not compute -> why, said by
      apply_codagen's TypeError (and by from_pretrained, before loading, for a checkpoint of that class).
    fp8: the functions that run the family's FP8 blocks in place of norm_stats, pre_attention and post_attention
      (their names -> functions of the same signatures, h then a pair (values, scales)), for apply_codagen(fp8=True);
      None: the family has none.
    lora_refused: the projections (layer_modules names) on which codagen.lora refuses a LoRA adapter -> why (the
      family's block takes their output non-linearly: Qwen3's QK-norm). None: none refused where the family runs
      Llama's blocks (pre_attention and post_attention Llama's), else LoRA refused on the family as a whole. A layer
      with adapters on its MLP runs the post-attention part as Llama's, in PyTorch ops (codagen.lora): a family
      whose post-attention math is another's refuses those projections here.
    """

    model_class: str
    modeling: str
    model_modules: dict
    layer_modules: dict
    read: tuple
    fused: dict
    feeds: dict
    norm_stats: Callable
    pre_attention: Callable
    post_attention: Callable
    lm_head_loss: Callable
    check_config: Callable | None = None
    attention_modules: tuple = ()
    layer_types: Callable | None = None
    activation: tuple = ("hidden_act", "silu", "SwiGLU with silu")
    layer_norms: tuple = ()
    attention_args: dict = field(default_factory=dict)
    final_logits: Callable | None = None
    refused: dict = field(default_factory=dict)
    lora_refused: dict | None = None
    fp8: dict | None = None


def family(name: str) -> Family:
    """The family declared by codagen/models/<name>.py (imports it, and with it torch)."""
    if name not in NAMES:
        raise ValueError(f"unknown model family {name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def runs_block(name: str, block: str) -> bool:
    """Whether a model of family `name` runs the block spec named `block`: one its family lists, or, for Llama
    (the first family), one that no family lists (the generic blocks: the cross-entropy variants, ...)."""
    if block in family(name).blocks:
        return True
    return name == NAMES[0] and not any(block in family(other).blocks for other in NAMES)


def generated_blocks():
    """The generated blocks the assemblies are built of: the checkout's generated/ (the package `generated` where
    that name is it, as the tests and examples run it), else the committed blocks installed with codagen
    (codagen_generated)."""
    root = Path(__file__).resolve().parents[2] / "generated"
    spec = importlib.util.find_spec("generated")
    if spec is not None and spec.origin and Path(spec.origin).resolve() == root / "__init__.py":
        return importlib.import_module("generated.blocks")
    return importlib.import_module(GENERATED_PACKAGE + ".blocks")
