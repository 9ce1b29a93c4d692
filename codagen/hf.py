"""Hugging Face integration: codagen's generated blocks inside a `transformers` LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, Qwen3ForCausalLM or Gemma2ForCausalLM, or in the decoder of such a family's sequence or token
classification head or question-answering head (LlamaForSequenceClassification, ...; the head itself stays
transformers') or of its bare <Family>Model.

    from codagen.hf import apply_codagen
    model = apply_codagen(LlamaForCausalLM.from_pretrained(path))    # or codagen.hf.from_pretrained(path)

Each family is declared in its module codagen/models/<family>.py as an HfMapping (its transformers classes, its
fused projections, its layers' attention types, its refusals, how it runs its blocks; Qwen2's and Mistral's, which
run Llama's blocks, in Llama's module); this module reads the mapping of the model's class and holds nothing
family-specific.

`apply_codagen` patches the model in place. The decoder layers, the final norm and the LM-head loss then run in the
committed generated blocks (NormStats, PreAttention, PostAttention, lm_head_loss); embeddings and attention stay
Hugging Face's own (its mask builder and its attention function: SDPA, eager or flash attention), so padding masks
and packed sequences behave exactly as in the unpatched model. The calling convention is Hugging Face's
(input_ids, attention_mask, position_ids, labels shifted inside with -100 ignored, num_items_in_batch), and
state_dict() / save_pretrained() write the Hugging Face layout again. A PEFT LoRA model is patched with its
adapters (codagen.lora). docs/huggingface.md lists what is supported and what is refused.

`transformers` is imported here only, inside the functions: `import codagen` never needs it. On a machine without a
GPU, importing codagen.hf switches Triton's interpreter on (codagen.runtime), also when transformers' models, which
import triton, were imported first.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import numbers
import sys
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

# without a GPU, the runtime switches Triton's interpreter on, for the generated kernels these functions run
from . import runtime  # noqa: F401
from . import lora
from .convert import heads_to_halves, heads_to_interleaved, interleave_rows, split_rows
from .models import NAMES as FAMILY_NAMES
from .models import HfMapping, family
from .models.llama import HF as LLAMA  # the Llama family's Hugging Face mapping: modules, fused projections
from .runtime.heads import split_heads

__all__ = ["AutoCodagenForCausalLM", "AutoCodagenForQuestionAnswering", "AutoCodagenForSequenceClassification",
           "AutoCodagenForTokenClassification", "AutoCodagenModel", "CodagenConfigError", "apply_codagen",
           "from_pretrained"]

# rope types whose inverse frequencies are fixed at construction: codagen's RoPE epilogue takes them as they are
# ("yarn" scales cos and sin too, which is a scale of the attention scores: see _attention_scaling)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the attention types of decoder layers (HfMapping.layer_types) -> the function of transformers.masking_utils that
# makes their mask, as transformers' models call it
MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
GENERATED_PACKAGE = "codagen_generated"


class CodagenConfigError(ValueError):
    """A model configuration that codagen's blocks do not compute exactly; the message names the field."""


def _transformers():
    """transformers, or an ImportError that says how to install it (codagen's `hf` extra)."""
    try:
        import transformers
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "transformers":
            raise
        raise ImportError("codagen.hf needs transformers (>= 5), which is not installed: install codagen with its "
                          "hf extra (pip install -e \".[hf]\" in a checkout) or pip install \"transformers>=5\"",
                          name="transformers") from e
    return transformers


# ---- the families codagen.hf patches: each family module's HfMapping (codagen.models) ----

@functools.cache
def _mappings() -> tuple[HfMapping, ...]:
    """The Hugging Face mappings of the families that declare one, in codagen.models.NAMES order (Llama first), each
    family's own before those of the models alike (Family.hf_alike)."""
    return tuple(m for f in map(family, FAMILY_NAMES) for m in (f.hf, *f.hf_alike) if m is not None)


# the transformers classes besides a family's causal LM whose decoder apply_codagen patches, their head (and loss)
# left as transformers' own: <Family>Model, the decoder itself, and the heads that call it as their base model and
# read its last_hidden_state (transformers' GenericForSequenceClassification, GenericForTokenClassification,
# GenericForQuestionAnswering)
DECODER_CLASSES = ("Model", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _family_prefix(mapping: HfMapping) -> str:
    return mapping.model_class.removesuffix("ForCausalLM")


def _mapping_of(model) -> tuple[HfMapping, str] | tuple[None, None]:
    """The mapping of the family whose transformers class `model` is an instance of, and which class: "ForCausalLM"
    (the family's causal LM, HfMapping.model_class) or one of DECODER_CLASSES; else (None, None)."""
    transformers = _transformers()
    for mapping in _mappings():
        for kind in ("ForCausalLM", *DECODER_CLASSES):
            cls = getattr(transformers, _family_prefix(mapping) + kind, None)
            if cls is not None and isinstance(model, cls):
                return mapping, kind
    return None, None


def _refused() -> list[tuple[type, str]]:
    """The transformers classes that a family refuses (HfMapping.refused) and why, those this version has."""
    transformers = _transformers()
    return [(getattr(transformers, name), why) for m in _mappings() for name, why in m.refused.items()
            if hasattr(transformers, name)]


def _refuse_class(model_class: type) -> None:
    """Raise the TypeError of a class that a family refuses, saying why; else nothing."""
    for cls, why in _refused():
        if issubclass(model_class, cls):
            raise TypeError(f"apply_codagen: a transformers {cls.__name__} is not supported: {why}")


def _mapping_named(model_class: str) -> HfMapping:
    return next(m for m in _mappings() if m.model_class == model_class)


# ---- the committed generated package ----

def _generated():
    """The committed kernels and blocks: installed as `codagen_generated` (pip install), or, in a source checkout
    that is not installed, the repository's generated/ next to codagen/: the package `generated` itself where
    that name is it (so that its kernel ops are not registered a second time under another module name), else
    loaded as `codagen_generated`, so that a user's own `generated` package (the default output of `codagen
    build`) is never picked up instead."""
    if GENERATED_PACKAGE in sys.modules:
        return sys.modules[GENERATED_PACKAGE]
    if importlib.util.find_spec(GENERATED_PACKAGE) is not None:
        return importlib.import_module(GENERATED_PACKAGE)
    root = Path(__file__).resolve().parent.parent / "generated"
    if not (root / "blocks" / "__init__.py").is_file():
        raise ModuleNotFoundError(f"codagen's committed kernels ({GENERATED_PACKAGE}) are not installed; "
                                  "reinstall codagen (pip install .)")
    same_name = importlib.util.find_spec("generated")
    if same_name is not None and same_name.origin and Path(same_name.origin).resolve() == root / "__init__.py":
        return importlib.import_module("generated")
    spec = importlib.util.spec_from_file_location(GENERATED_PACKAGE, root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[GENERATED_PACKAGE] = package
    spec.loader.exec_module(package)
    return package


@functools.cache
def _api() -> types.SimpleNamespace:
    """What the patched forward calls, resolved once (at apply time): the generated blocks and transformers' own
    functions and output classes. Nothing on the forward path imports, inspects a signature or looks a module up,
    which would cost host time on every step and break torch.compile's graph."""
    _transformers()
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    package = _generated().__name__
    parameters = inspect.signature(create_causal_mask).parameters
    return types.SimpleNamespace(
        blocks=importlib.import_module(package + ".blocks"),
        mask_builders={kind: getattr(masking_utils, name) for kind, name in MASK_BUILDERS.items()},
        # the name of the cache argument of this transformers version's mask builders (newer versions take
        # `cache` and warn when the older `past_key_values` is passed too)
        mask_cache_argument=next((name for name in ("cache", "past_key_values") if name in parameters), None),
        mask_takes_cache_position="cache_position" in parameters,
        attention_functions=ALL_ATTENTION_FUNCTIONS,
        model_output=BaseModelOutputWithPast,
        lm_output=CausalLMOutputWithPast,
        # the KV cache a forward makes where it is asked for one and given none, as transformers' models make it;
        # the name of the outputs' cache field (`cache`; `past_key_values` in older versions)
        cache_class=DynamicCache,
        output_cache_field=next(name for name in ("cache", "past_key_values")
                                if name in BaseModelOutputWithPast.__dataclass_fields__),
        # FSDP2's sharded parameters (None where torch.distributed is not built)
        dtensor=_dtensor_class(),
    )


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


# ---- configuration checks ----

def _refuse(field: str, value, why: str) -> None:
    raise CodagenConfigError(f"apply_codagen: config.{field} = {value!r} is not supported: {why}")


def check_config(config, mapping: HfMapping = LLAMA) -> None:
    """Refuse, naming the field, every configuration of the family (`mapping`, Llama's by default) whose math the
    generated blocks do not compute: the fields every family shares, then the family's own (mapping.check_config)."""
    field, value, computed = mapping.activation
    if getattr(config, field, value) != value:
        _refuse(field, getattr(config, field), f"the MLP kernels compute {computed} only")
    rope = _rope_type(config)
    if rope not in ROPE_TYPES:
        _refuse("rope_parameters['rope_type']", rope,
                f"codagen takes RoPE frequencies fixed at construction ({', '.join(ROPE_TYPES)})")
    if getattr(config, "num_attention_heads", 1) % getattr(config, "num_key_value_heads", 1):
        _refuse("num_key_value_heads", config.num_key_value_heads, "it must divide num_attention_heads")
    if getattr(config, "is_causal", True) is not True:
        _refuse("is_causal", config.is_causal, "the patched decoder is causal")
    layer_types = _layer_types(config, mapping)
    if not set(layer_types) <= set(MASK_BUILDERS):
        _refuse("layer_types", getattr(config, "layer_types", layer_types),
                f"the patched decoder builds Hugging Face's masks of {' and '.join(MASK_BUILDERS)} layers only")
    if "sliding_attention" in layer_types and getattr(config, "sliding_window", None) is None:
        _refuse("sliding_window", None, f"layer_types {list(layer_types)} has sliding_attention layers, which attend "
                                        "to the last sliding_window positions (transformers' own forward fails "
                                        "without it too)")
    if mapping.check_config is not None:
        mapping.check_config(config, _refuse)


def check_modules(llama: nn.Module, patched: bool = False, prefix: str = "model.", mapping: HfMapping = LLAMA) -> None:
    """Refuse modules other than transformers' own ones of the family (`mapping`, Llama's by default: an adapter,
    a quantized linear, another library's patch) in its decoder (a LlamaModel), but for PEFT's LoRA layers in place
    of its projections, which codagen.lora checks: the patch reads their weights and would silently drop what they
    add. Checked at patch time, and, for the modules whose weights the
    patched model reads (patched=True), on its first call after one of them changed (CodagenPatch)."""
    hf = _modeling(mapping)

    def class_of(name: str) -> type:
        return getattr(nn, name) if name in ("Linear", "Embedding") else getattr(hf, name)

    expected = {name: class_of(k) for name, k in mapping.model_modules.items()
                if not patched or name in mapping.read}
    for i in range(len(llama.layers)):
        layer = f"layers.{i}"
        expected.update({f"{layer}.{name}".rstrip("."): class_of(k) for name, k in mapping.layer_modules.items()
                         if not patched or name in mapping.read})
    for name, kind in expected.items():
        module = llama.get_submodule(name)
        if kind is nn.Linear and lora.is_peft(module):
            continue  # a PEFT layer in place of a projection: lora.check's
        _check_type(prefix + name, module, kind, mapping.model_class.removesuffix("ForCausalLM"))
    lora.check(llama, mapping, prefix, patched)


_MODELING: dict[str, types.ModuleType] = {}


def _modeling(mapping: HfMapping = LLAMA) -> types.ModuleType:
    """transformers' modeling module of the family's classes (mapping.modeling), imported once: at patch time, so
    that a trace of the forward (torch.compile) reads a global and calls no importlib, which Dynamo does not
    trace."""
    module = _MODELING.get(mapping.modeling)
    if module is None:
        module = _MODELING[mapping.modeling] = importlib.import_module(mapping.modeling)
    return module


def _check_type(name: str, module: nn.Module, kind: type, family: str = "Llama") -> None:
    if type(module) is not kind:
        where = type(module).__module__
        if lora.is_quantized(module):
            raise TypeError(f"apply_codagen: {name} is a {where}.{type(module).__qualname__}, a quantized linear: "
                            "codagen's GEMMs take unquantized weights (bf16, fp16, fp32); load the model unquantized")
        undo = (f" The model was made after Liger-Kernel's patch of transformers (apply_liger_kernel_to_"
                f"{family.lower()}), which replaces the same layers: make it without that patch, or in a process "
                "that does not apply it." if where.split(".")[0] == "liger_kernel" else "")
        raise TypeError(f"apply_codagen: {name} is a {where}.{type(module).__qualname__}, "
                        f"not {kind.__qualname__}; codagen runs unmodified transformers {family} modules only "
                        "(and PEFT's LoRA layers on the projections; other adapters and other libraries' patches are "
                        "not supported)."
                        + undo)


def _check_lm_head(lm_head: nn.Module) -> None:
    """transformers' Llama LM head is a Linear without bias; lm_head_loss has no bias to add."""
    _check_type("lm_head", lm_head, nn.Linear)
    if lm_head.bias is not None:
        raise TypeError("apply_codagen: lm_head has a bias, which transformers' Llama LM head does not have and "
                        "codagen's loss block does not add")


def _layer_types(config, mapping: HfMapping) -> tuple[str, ...]:
    """Each decoder layer's attention type, as the family's transformers model reads it (HfMapping.layer_types)."""
    if mapping.layer_types is None:
        return ("full_attention",) * config.num_hidden_layers
    return tuple(mapping.layer_types(config))


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


# ---- the patched modules: parameters that keep their meaning keep their Hugging Face names ----

class FusedProjection(nn.Module):
    """A weight (and bias) made of several Hugging Face projections, in codagen's interleaved row layout
    (codagen.convert)."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)


class CodagenAttention(nn.Module):
    """Fused qkv_proj (q and k rows interleaved per head for RoPE), Hugging Face's o_proj, and the attributes that
    Hugging Face's attention functions read from their module. The PEFT LoRA layers of q, k, v stay under their
    names, their base weights in qkv_proj (codagen.lora)."""

    parts = ("q_proj", "k_proj", "v_proj")  # qkv_proj's, in its row order

    def __init__(self, attn: nn.Module, config, mapping: HfMapping = LLAMA):
        super().__init__()
        self.config = config
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.attention_dropout = attn.attention_dropout
        self.is_causal = True
        # a sliding-window layer gets transformers' sliding-window mask (decode) and its window, which its attention
        # function is passed as transformers' attention passes it (flash attention applies it itself)
        self.attention_type = _layer_types(config, mapping)[self.layer_idx]
        self.sliding_window = config.sliding_window if self.attention_type == "sliding_attention" else None
        parts = [attn.get_submodule(name) for name in self.parts]
        projections = lora.base_layers(parts)  # a LoRA layer's frozen Linear
        with torch.no_grad():
            qkv = self.fuse(*(p.weight for p in projections))
            bias = None if projections[0].bias is None else self.fuse(*(p.bias for p in projections))
        self.qkv_proj = FusedProjection(qkv, projections[0].weight.requires_grad, bias)
        lora.keep_parts(self, "qkv_proj", self.parts, parts)
        self.o_proj = attn.o_proj
        for name in mapping.attention_modules:  # the family's own (Qwen3's q_norm, k_norm), as they are
            setattr(self, name, attn.get_submodule(name))
        # what its attention function is given beyond Llama's and the window (Gemma-2's softcap)
        self.attention_args = {arg: getattr(attn, name) for arg, name in mapping.attention_args.items()}

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([heads_to_interleaved(q, self.head_dim), heads_to_interleaved(k, self.head_dim), v])

    def unfuse(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hd = self.head_dim
        q, k, v = qkv.split([self.num_heads * hd, self.num_key_value_heads * hd, self.num_key_value_heads * hd])
        return heads_to_halves(q, hd), heads_to_halves(k, hd), v

    def unload_and_optionally_merge_module(self, merge: bool = True, safe_merge: bool = False,
                                           adapter_names: list[str] | None = None) -> nn.Module:
        """PEFT's merge_and_unload() and unload() call this: q, k, v's adapters merged into qkv_proj."""
        return lora.unload(self, "qkv_proj", self.parts, merge, safe_merge, adapter_names)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[M, qkv_dim] -> Hugging Face's [batch, heads, seq, head_dim] q, k, v (q and k in interleaved order: the
        same permutation of both leaves q . k unchanged)."""
        return split_heads(qkv, self.num_heads, self.num_key_value_heads, self.head_dim)


class CodagenMLP(nn.Module):
    """Fused gate_up_proj (gate and up rows interleaved, and their biases with mlp_bias) and Hugging Face's
    down_proj. The PEFT LoRA layers of gate and up stay under their names, their base weights in gate_up_proj
    (codagen.lora)."""

    parts = ("gate_proj", "up_proj")  # gate_up_proj's

    def __init__(self, mlp: nn.Module):
        super().__init__()
        parts = [mlp.get_submodule(name) for name in self.parts]
        gate, up = lora.base_layers(parts)  # a LoRA layer's frozen Linear
        with torch.no_grad():
            gate_up = interleave_rows(gate.weight, up.weight)
            bias = None if gate.bias is None else interleave_rows(gate.bias, up.bias)
        self.gate_up_proj = FusedProjection(gate_up, gate.weight.requires_grad, bias)
        lora.keep_parts(self, "gate_up_proj", self.parts, parts)
        self.down_proj = mlp.down_proj

    def fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return interleave_rows(gate, up)

    def unfuse(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.contiguous() for t in split_rows(gate_up))

    def unload_and_optionally_merge_module(self, merge: bool = True, safe_merge: bool = False,
                                           adapter_names: list[str] | None = None) -> nn.Module:
        """PEFT's merge_and_unload() and unload() call this: gate and up's adapters merged into gate_up_proj."""
        return lora.unload(self, "gate_up_proj", self.parts, merge, safe_merge, adapter_names)


class CodagenDecoderLayer(nn.Module):
    """A Llama decoder layer run by PreAttention -> Hugging Face attention -> PostAttention. Its norm weights are the
    Hugging Face modules' own; state_dict() and load_state_dict() speak the Hugging Face layout.

    The patched decoder loop calls each layer module, so module hooks (forward hooks, FSDP2's fully_shard,
    accelerate's hooks) see every layer run, and the layer's forward reads its own parameters only. The one weight
    from outside, the next norm's (the next layer's input_layernorm, or the final norm) whose row scale this layer's
    last epilogue applies, comes in as an argument (next_norm_weight, no gradient through it): the loop passes it,
    gathered whole where FSDP2 keeps it sharded (_next_norm_weight)."""

    def __init__(self, layer: nn.Module, config, mapping: HfMapping = LLAMA):
        super().__init__()
        self.hf_mapping = mapping  # the family's: its blocks where they are not Llama's, its fused projections
        # PEFT's LoRA layers among the projections -> their adapters, as apply_codagen found them (codagen.lora)
        self.lora_adapters = lora.record(layer, mapping)
        self.input_layernorm = layer.input_layernorm
        self.self_attn = CodagenAttention(layer.self_attn, config, mapping)
        self.post_attention_layernorm = layer.post_attention_layernorm
        for name in mapping.layer_norms:  # the family's own (Gemma-2's feedforward norms), as they are
            setattr(self, name, layer.get_submodule(name))
        self.mlp = CodagenMLP(layer.mlp)
        self.dim = config.hidden_size
        self.eps = config.rms_norm_eps
        self.register_state_dict_post_hook(_to_hf_layout)
        self.register_load_state_dict_pre_hook(_from_hf_layout)

    def forward(self, hidden_states: torch.Tensor, norm_stats: tuple[torch.Tensor, torch.Tensor] | None,
                next_norm_weight: torch.Tensor, *, blocks, positions: torch.Tensor, rope_freqs: torch.Tensor,
                attention, attention_mask, position_ids, score_scale: float = 1.0, dtype: torch.dtype | None = None,
                cache=None, attentions: list | None = None,
                **attention_kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """hidden_states [batch, seq, dim], the residual stream, and norm_stats, (h, rstd) of this layer's input norm
        as the previous layer's last epilogue made them (None: made here, from this layer's own norm weight, as for
        the first layer) -> the residual stream after the layer, [batch, seq, dim], and the next norm's (h, rstd),
        made with next_norm_weight. blocks: the generated blocks package; attention: Hugging Face's attention
        function; dtype: the blocks' dtype under autocast (weights cast to it), else None; cache: the KV cache
        (a transformers Cache) that this layer's k and v go into and its attention reads, else None; attentions: a
        list that the attention weights go into, where the attention function returns them (output_attentions)."""
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        batch, seq, dim = hidden_states.shape
        attn, mlp, eps = self.self_attn, self.mlp, self.eps
        x = hidden_states.reshape(batch * seq, dim)
        wn = cast(self.input_layernorm.weight)
        mapping = self.hf_mapping
        h, rstd = norm_stats if norm_stats is not None else mapping.norm_stats(blocks, x, wn, dim, eps)
        x, qkv = mapping.pre_attention(self, blocks, x, h, rstd, positions, rope_freqs, wn, cast(attn.qkv_proj.weight),
                                       eps, cast)
        if attn.qkv_proj.bias is not None:
            qkv = qkv + _rotated(cast(attn.qkv_proj.bias), positions, rope_freqs)
        adapted = self.lora_adapters
        if adapted:  # LoRA's q, k, v products: from the norm's output, rotated as the bias is
            delta = lora.qkv_delta(attn, x, wn, eps)
            if delta is not None:
                qkv = qkv + _rotated(delta, positions, rope_freqs)
        y = self.attend(qkv.view(batch, seq, -1), attention, attention_mask, position_ids, score_scale, cache,
                        attentions, attention_kwargs)
        if attn.o_proj.bias is not None:
            x = x + cast(attn.o_proj.bias)  # the out-projection's bias joins the residual it is added to
        y = y.reshape(batch * seq, -1)
        if adapted:  # LoRA's o product joins the residual, as the bias does
            delta = lora.delta(attn.o_proj, y)
            x = x if delta is None else x + delta
        w_o, wn_mlp, w_down = (cast(t) for t in (attn.o_proj.weight, self.post_attention_layernorm.weight,
                                                 mlp.down_proj.weight))
        wn_next = cast(next_norm_weight)
        if adapted and lora.mlp_adapted(mlp):  # inside the block's fusion: the block in PyTorch ops
            x, h, rstd = lora.post_attention(self, blocks, y, x, wn_next, w_o, wn_mlp, eps, cast)
        else:
            x, h, rstd = mapping.post_attention(self, blocks, y, x, wn_next, w_o, wn_mlp, cast(mlp.gate_up_proj.weight),
                                                w_down, eps, cast)
        # [batch, seq, dim] as a tensor of its own, not a view of the block's [M, dim] output, which nothing else
        # holds (the block saves none of its outputs): a view would make FSDP2 warn that an in-place op on the
        # layer's output drops its pre-backward hook. No copy: the same storage, as view() would share it.
        return torch.ops.aten._unsafe_view(x, (batch, seq, dim)), (h, rstd)

    def codagen_fp8_weight(self, weight: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 copy of one of this layer's weights, (values, scales) (apply_codagen(fp8=True): the FP8 blocks'
        block-quantized weights), made again only after the weight changes (codagen.runtime.fp8.BlockQuantized).
        While torch.compile traces, the quantization itself is traced, once per forward: the copy's check of the
        weight's storage and version would break the graph."""
        from .runtime import fp8

        if torch.compiler.is_compiling():
            with torch.no_grad():
                return fp8.quantize_blocks(weight.detach())
        copies = self.__dict__.setdefault("_codagen_fp8_copies", [])  # not a buffer: never in a state dict
        for copy in copies:
            if copy.weight is weight:
                return copy.get()
        parameters = set(map(id, self.parameters()))  # a replaced parameter's copy goes
        copies[:] = [copy for copy in copies if id(copy.weight) in parameters]
        copies.append(fp8.BlockQuantized(weight))
        return copies[-1].get()

    def attend(self, qkv: torch.Tensor, attention, attention_mask, position_ids, score_scale: float, cache,
               attentions: list | None, attention_kwargs: dict) -> torch.Tensor:
        """Hugging Face's attention function on qkv [batch, seq, qkv_dim] (the PreAttention block's output, the
        heads of self_attn's num_heads and num_key_value_heads), through the KV cache where there is one ->
        [batch, seq, heads, head_dim], as transformers' attention functions return it."""
        attn = self.self_attn
        q, k, v = attn.split(qkv)
        if cache is not None:
            # k after RoPE, its heads' columns in codagen's interleaved order as q's are: scores are unchanged,
            # and only the patched model reads this cache
            k, v = cache.update(k, v, attn.layer_idx)
        # position_ids as Hugging Face's decoder layers pass them: flash attention finds packing in them
        if attentions is not None:  # as transformers passes it: SDPA warns that it returns no weights
            attention_kwargs["output_attentions"] = True
        # the weights q . k: q's and k's columns in the same (interleaved) order leave them Hugging Face's
        y, weights = attention(attn, q, k, v, attention_mask,
                               dropout=attn.attention_dropout if attn.training else 0.0,
                               scaling=attn.scaling * score_scale, sliding_window=attn.sliding_window,
                               position_ids=position_ids, **attn.attention_args, **attention_kwargs)
        if attentions is not None and weights is not None:
            attentions.append(weights)
        return y


def _to_hf_layout(module: CodagenDecoderLayer, state_dict, prefix: str, local_metadata) -> None:
    """Each fused projection (the family's HfMapping.fused) back to the Hugging Face projections it is made of."""
    for kind in ("weight", "bias"):
        for name, parts in module.hf_mapping.fused.items():
            fused = state_dict.pop(prefix + f"{name}.{kind}", None)
            if fused is not None:
                owner = module.get_submodule(name.rpartition(".")[0])  # CodagenAttention, CodagenMLP
                for part, t in zip(parts, owner.unfuse(fused)):
                    state_dict[prefix + f"{lora.state_name(module, part)}.{kind}"] = t


def _from_hf_layout(module: CodagenDecoderLayer, state_dict, prefix: str, *_) -> None:
    for kind in ("weight", "bias"):
        for name, parts in module.hf_mapping.fused.items():
            names = [prefix + f"{lora.state_name(module, part)}.{kind}" for part in parts]
            if all(n in state_dict for n in names):
                owner = module.get_submodule(name.rpartition(".")[0])
                state_dict[prefix + f"{name}.{kind}"] = owner.fuse(*(state_dict.pop(n) for n in names))


# ---- what the patched forward needs that does not depend on its inputs ----

class CodagenPatch:
    """A patched model's state that does not depend on the inputs, made by apply_codagen: the functions its
    forward calls (_api), the RoPE frequencies (cached per inv_freq tensor and version: model.to() or an in-place
    change makes them again), and whether the modules whose weights the forward reads were checked since one of
    them last changed. Module registration hooks (torch.nn.modules.module) mark it unchecked when a watched module
    gets a new child or parameter (an adapter or a quantized linear in place of a projection, a bias given to the
    LM head), so that the forward checks again then, instead of on every call."""

    def __init__(self, mapping: HfMapping = LLAMA):
        self.api = _api()
        self.hf = mapping  # the family's Hugging Face mapping
        self.eager_attention = _modeling(mapping).eager_attention_forward
        self.decoder_checked = self.head_checked = False
        self._freqs: tuple | None = None

    def check(self, llama: nn.Module, causal_lm: nn.Module | None = None) -> None:
        """Check the decoder's modules (and the LM head of causal_lm, when given) if they may have changed, and
        watch them from then on."""
        # while torch.compile traces, each trace checks and nothing is watched: a traced change of the watch list,
        # a process-wide dict, would make Dynamo guard on its length and compile again whenever any other patched
        # model is made or freed (Dynamo guards on the modules themselves)
        watch = not torch.compiler.is_compiling()
        if not self.decoder_checked:
            check_modules(llama, patched=True, mapping=self.hf)
            if watch:
                _watch(self, [llama, llama.layers, *(m for layer in llama.layers
                                                     for m in (layer, layer.self_attn, layer.mlp)),
                              *lora.watched(llama)])
                self.decoder_checked = True
        if causal_lm is not None and not self.head_checked:
            _check_lm_head(causal_lm.lm_head)
            if watch:
                _watch(self, [causal_lm, causal_lm.lm_head])
                self.head_checked = True

    def rope_freqs(self, llama: nn.Module) -> torch.Tensor:
        inv = llama.rotary_emb.inv_freq
        if torch.compiler.is_compiling():
            return _rope_freqs(llama, llama.config)  # in the graph: no Python state to guard on
        cached = self._freqs
        if cached is None or cached[0] is not inv or cached[1] != inv._version:
            cached = self._freqs = (inv, inv._version, _rope_freqs(llama, llama.config))
        return cached[2]

    def __deepcopy__(self, memo) -> "CodagenPatch":
        return CodagenPatch(self.hf)  # the copy's modules are others: checked and watched on its first call

    def __getstate__(self) -> dict:
        return {"model_class": self.hf.model_class}

    def __setstate__(self, state: dict) -> None:
        self.__init__(_mapping_named(state.get("model_class", LLAMA.model_class)))


_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # watched module -> its model's CodagenPatch


def _watch(patch: CodagenPatch, modules) -> None:
    _install_registration_hooks()
    for module in modules:
        _WATCHED[module] = patch


@functools.cache
def _install_registration_hooks() -> None:
    def changed(module, name, value):
        patch = _WATCHED.get(module)
        if patch is not None:
            patch.decoder_checked = patch.head_checked = False
        # returns None: the registration goes on unchanged

    torch.nn.modules.module.register_module_module_registration_hook(changed)
    torch.nn.modules.module.register_module_parameter_registration_hook(changed)


# ---- forward ----

def _attention_interface(api, config, eager):
    """The attention function of config._attn_implementation; `eager`: the family's own eager attention, as its
    transformers layers call it (Gemma-2's softcaps the scores)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "eager":
        return eager
    return api.attention_functions[implementation]


def _causal_masks(api, config, layer_types, inputs_embeds, attention_mask, position_ids, cache, past: int) -> dict:
    """Hugging Face's own mask for these inputs, for each of the layers' attention types (full, sliding-window):
    padding (left or right), packed sequences (position_ids that restart at 0) and the KV cache's `past` positions
    before them as the unpatched model sees them."""
    kwargs = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids)
    if api.mask_cache_argument:
        kwargs[api.mask_cache_argument] = cache
    if api.mask_takes_cache_position:
        kwargs["cache_position"] = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
    plain = attention_mask is None and position_ids is None and cache is None and \
        getattr(config, "_attn_implementation", None) == "sdpa"
    return {kind: None if plain and _causal_alone(config, kind, inputs_embeds.shape[1])
            else api.mask_builders[kind](**kwargs) for kind in layer_types}


def _causal_alone(config, kind: str, seq: int) -> bool:
    """Whether, for inputs with no padding mask, no caller's position_ids (packed sequences) and no KV cache, a layer
    of attention type `kind` masks by causality alone: then SDPA is given no mask and applies causality itself
    (is_causal), as Hugging Face's own mask builder decides outside torch.compile. Under torch.compile that builder
    always makes the mask tensor (it cannot tell a decoding step apart while tracing), and SDPA with a mask runs
    without causal tile skipping and without native GQA (the keys and values repeated per head): 2 to 3 times the
    attention's time, measured on an H100. A sliding-window layer masks by causality alone while the sequence is
    shorter than its window (the condition Hugging Face's builder takes)."""
    return kind == "full_attention" or (kind == "sliding_attention" and seq < config.sliding_window)


def _rope_freqs(llama: nn.Module, config) -> torch.Tensor:
    """Per-pair frequencies over the qkv columns (codagen.convert.rope_freqs), from Hugging Face's own inverse
    frequencies, so every rope type it computes at construction (default, linear, llama3, yarn) is taken as is."""
    inv = llama.rotary_emb.inv_freq.float()
    n_kv = config.num_key_value_heads
    return torch.cat([inv.repeat(config.num_attention_heads + n_kv), inv.new_zeros(n_kv * inv.numel())])


def _rotated(bias: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE of the qkv bias [qkv_dim] (or of LoRA's product, [M, qkv_dim]) at each row's position, [M, qkv_dim]:
    RoPE is linear, so rope(z + b) = rope(z) + rope(b) and the bias is added after the PreAttention block (whose
    backward needs only its own output). Pairs (2j, 2j+1) rotate by position * freqs[j] as in Hugging Face's
    rotate_half (v's frequencies are 0: unchanged)."""
    angle = positions.float()[:, None] * freqs[None, :]
    cos, sin = angle.cos(), angle.sin()
    even, odd = bias.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(1).to(bias.dtype)


def _attention_scaling(llama: nn.Module) -> float:
    """Hugging Face multiplies cos and sin by attention_scaling (1 but for yarn): q and k each get the factor, so the
    scores get its square."""
    return float(getattr(llama.rotary_emb, "attention_scaling", 1.0)) ** 2


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _refuse_call(what: str) -> None:
    raise NotImplementedError(f"codagen's patched Llama: {what}")


def decode(llama: nn.Module, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
           cache=None, collected: Collected | None = None, **attention_kwargs):
    """The decoder stack on [batch, seq] tokens: the residual stream x [batch * seq, hidden] after the last layer
    (lm_head_loss makes the final norm's statistics itself), (batch, seq), and the dtype transformers keeps the
    residual stream in, inputs_embeds' (under autocast x is in its dtype, as the blocks run there: the hidden states
    collected and the final norm's input are cast back to it, as transformers returns them). With a KV cache (a
    transformers Cache: _cache), the tokens come after the cache's positions: each layer's k and v (after RoPE) go
    into it and its attention reads all of them, as transformers' attention does. `collected` (_collected: what
    output_hidden_states and output_attentions ask for) gets the decoder's input and each layer's output, and each
    layer's attention weights."""
    config, patch = llama.config, llama.codagen_patch
    api = patch.api
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = llama.embed_tokens(input_ids)
    if inputs_embeds.is_meta:
        _refuse_call("its weights are on the meta device, where no kernel runs; load them first (from_pretrained, "
                     "or to_empty() and load_state_dict())")
    batch, seq, dim = inputs_embeds.shape
    layers = list(llama.layers)[: config.num_hidden_layers]  # a slice of the ModuleList would be a new one: its
    # modules registered again, through the registration hooks, at every forward (and a trace would guard on them)
    # the positions before these tokens, the cache's, read only where they are needed (as transformers' models read
    # them: a static cache counts them in a device tensor)
    past = 0
    if cache is not None and (position_ids is None or api.mask_takes_cache_position):
        past = cache.get_seq_length()
    # the caller's position_ids only: given, Hugging Face looks for packed sequences in them, a host sync (the GPU
    # waits for the host's whole next forward); positions made here are one sequence per row, nothing to find
    masks = _causal_masks(api, config, dict.fromkeys(layer.self_attn.attention_type for layer in layers),
                          inputs_embeds, attention_mask, position_ids, cache, past)
    if position_ids is None:
        position_ids = torch.arange(past, past + seq, device=inputs_embeds.device).unsqueeze(0)
    positions = position_ids.expand(batch, seq).reshape(-1)
    freqs = patch.rope_freqs(llama)
    score_scale = _attention_scaling(llama)
    attention = _attention_interface(api, config, patch.eager_attention)
    final_norm = llama.norm.weight

    # under torch.autocast the blocks run in its dtype, the residual stream included; weights are cast (a
    # differentiable cast: their gradients come back in their own dtype) as autocast casts them for a matmul
    dtype = _autocast_dtype(inputs_embeds.device)
    context = dict(blocks=api.blocks, positions=positions, rope_freqs=freqs, attention=attention,
                   position_ids=position_ids, score_scale=score_scale, dtype=dtype, **attention_kwargs)
    # gradient checkpointing (model.gradient_checkpointing_enable()): each layer's call (its hooks included) is
    # recomputed in the backward, as Hugging Face's layers are
    checkpointing = llama.gradient_checkpointing and llama.training and torch.is_grad_enabled()
    if checkpointing and cache is not None:
        # the recomputation in the backward would put each layer's k and v into the cache a second time
        _refuse_call("a KV cache (cache / past_key_values) under gradient checkpointing in training is not "
                     "supported; call it without one (use_cache=False), or without gradient checkpointing")
    if cache is not None:
        context["cache"] = cache
    if collected is not None:
        collected.hidden(inputs_embeds)
        if collected.attentions is not None:
            context["attentions"] = collected.attentions
    with torch.autocast(inputs_embeds.device.type, enabled=False):
        x = inputs_embeds if dtype is None else inputs_embeds.to(dtype)
        stats = None  # the first layer makes its input norm's statistics itself
        for i, layer in enumerate(layers):
            wn_next = _next_norm_weight(layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else final_norm,
                                        x.dtype, api.dtensor)
            mask = masks[layer.self_attn.attention_type]
            if checkpointing:
                x, stats = torch.utils.checkpoint.checkpoint(layer, x, stats, wn_next, use_reentrant=False,
                                                             attention_mask=mask, **context)
            else:
                x, stats = layer(x, stats, wn_next, attention_mask=mask, **context)
            if collected is not None:
                collected.hidden(x.to(inputs_embeds.dtype))
    return x.reshape(batch * seq, dim), (batch, seq), inputs_embeds.dtype


def _next_norm_weight(weight: torch.Tensor, dtype: torch.dtype, dtensor: type | None) -> torch.Tensor:
    """The weight of the norm after a layer, which that layer's last epilogue applies (design.md, "RMSNorm split
    across GEMMs"), as an argument of the layer's forward: a value only (the block that owns the norm, the next
    layer's PreAttention or lm_head_loss, computes its gradient). Under FSDP2 (fully_shard on each layer) the next
    layer's parameters are sharded DTensors while this layer runs: the weight is gathered whole here, one
    all-gather of `hidden_size` elements, in the dtype the blocks run in."""
    if dtensor is not None and isinstance(weight, dtensor):
        return weight.detach().full_tensor().to(dtype)
    return weight.detach()


class Collected:
    """What a call's output_hidden_states and output_attentions ask to be returned, collected as transformers'
    capture_outputs collects them from its decoder layers: the hidden states, the decoder's input (inputs_embeds)
    then each layer's output, the last one replaced by the final norm's output (last_hidden_state), None where an
    index selection (output_hidden_states=[0, -1]) leaves one out; and each layer's attention weights, where its
    attention function returns them (eager; SDPA returns none, and warns, as in transformers)."""

    def __init__(self, selected: set[int] | None, hidden_states: bool, attentions: bool):
        self.selected = selected  # the hidden states' indices kept; None: all
        self.hidden_states = [] if hidden_states else None
        self.attentions = [] if attentions else None

    def hidden(self, x: torch.Tensor) -> None:
        if self.hidden_states is not None:
            keep = self.selected is None or len(self.hidden_states) in self.selected
            self.hidden_states.append(x if keep else None)

    def outputs(self, config, last_hidden_state: torch.Tensor | None) -> dict:
        """The output fields: hidden_states and attentions, tuples, where they were asked for."""
        out = {}
        if self.hidden_states is not None:
            states = self.hidden_states
            if getattr(config, "tie_last_hidden_states", None) is not False and states and states[-1] is not None:
                states[-1] = last_hidden_state
            out["hidden_states"] = tuple(states)
        if self.attentions is not None:
            out["attentions"] = tuple(self.attentions)
        return out


def _collected(config, kwargs) -> Collected | None:
    """What the call asks to be returned besides the output (popped from its kwargs: output_hidden_states,
    output_attentions, else the config's), as transformers reads it: output_hidden_states True, or the indices of
    the hidden states to keep (negative ones from the end of the num_hidden_layers + 1)."""
    wanted = {}
    for name in ("output_hidden_states", "output_attentions"):
        value = kwargs.pop(name, None)
        wanted[name] = getattr(config, name, False) if value is None else value
    hidden, attentions = wanted["output_hidden_states"], wanted["output_attentions"]
    if not hidden and not attentions:
        return None
    selected = None
    if hidden and not isinstance(hidden, bool):
        count = config.num_hidden_layers + 1
        indices = [hidden] if isinstance(hidden, numbers.Integral) else list(hidden)
        selected = {int(i) % count for i in indices if -count <= i < count}
    return Collected(selected, bool(hidden), bool(attentions))


def _cache(llama: nn.Module, kwargs: dict):
    """The KV cache of a call (popped from its kwargs): the caller's (`cache`, or `past_key_values` as older
    transformers versions name it), else a new one (transformers' DynamicCache) where use_cache asks for one (the
    argument, else config.use_cache, as transformers' models read it) outside a training step, else None. A
    training step (train mode, gradients on) makes none: nothing reads it there, and the step's forward stays the
    same with and without one (transformers makes none there either under gradient checkpointing)."""
    given = [kwargs.pop(name, None) for name in ("cache", "past_key_values")]
    use_cache = kwargs.pop("use_cache", None)
    cache = next((c for c in given if c is not None), None)
    if cache is not None:
        return cache
    if use_cache is None:
        use_cache = getattr(llama.config, "use_cache", False)
    if not use_cache or (llama.training and torch.is_grad_enabled()):
        return None
    return llama.codagen_patch.api.cache_class(config=llama.config)


def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
    """LlamaModel.forward, patched: last_hidden_state is the final norm's output, as in Hugging Face; hidden_states
    and attentions where output_hidden_states and output_attentions ask for them (Collected)."""
    collected = _collected(self.config, kwargs)
    self.codagen_patch.check(self)
    return_dict = kwargs.pop("return_dict", None) is not False
    cache = _cache(self, kwargs)
    x, (batch, seq), residual = decode(self, input_ids, attention_mask, position_ids, inputs_embeds, cache,
                                       collected, **kwargs)
    api = self.codagen_patch.api
    hidden = self.norm(x.view(batch, seq, -1).to(residual))
    fields = {} if collected is None else collected.outputs(self.config, hidden)
    output = api.model_output(last_hidden_state=hidden, **fields, **{api.output_cache_field: cache})
    return output if return_dict else output.to_tuple()


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                       labels=None, logits_to_keep=0, **kwargs):
    """LlamaForCausalLM.forward, patched. With labels (or shift_labels), the loss comes from lm_head_loss, and the
    logits are made only where they are asked for (apply_codagen's return_logits: by default in evaluation, the model
    in eval mode and gradients off, as Trainer's prediction_step calls it), else logits is None; without labels, the
    logits are Hugging Face's."""
    collected = _collected(self.config, kwargs)
    patch = self.model.codagen_patch
    patch.check(self.model, self)
    return_dict = kwargs.pop("return_dict", None) is not False  # PEFT's forward passes None
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    llama = self.model
    # codagen.parallel.apply_tensor_parallel's state: the group and this rank's slice of the vocabulary; else None
    tensor_parallel = getattr(self, "codagen_tensor_parallel", None)
    cache = _cache(llama, kwargs)
    x, (batch, seq), residual = decode(llama, input_ids, attention_mask, position_ids, inputs_embeds, cache,
                                       collected, **kwargs)
    loss = logits = hidden = None
    if labels is not None or shift_labels is not None:
        if shift_labels is None:
            # Hugging Face's shift: position t predicts labels[t + 1], the last position nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        weight, norm_weight = self.lm_head.weight, llama.norm.weight
        if x.dtype != weight.dtype:  # under autocast (decode)
            weight, norm_weight = weight.to(x.dtype), norm_weight.to(x.dtype)
        reduction = "mean" if num_items_in_batch is None else "sum"
        target = shift_labels.reshape(-1).to(x.device)
        with torch.autocast(x.device.type, enabled=False):
            if tensor_parallel is not None:  # the vocab-parallel head: this rank's slice of the vocabulary
                loss = tensor_parallel.loss(x, target, norm_weight, weight, self.config.rms_norm_eps, ignore_index,
                                            reduction, self.codagen_chunk_rows)
            else:
                loss = patch.hf.lm_head_loss(self.config, patch.api.blocks, x, target, norm_weight, weight,
                                             ignore_index, reduction, self.codagen_chunk_rows)
        if num_items_in_batch is not None:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
    if collected is not None and collected.hidden_states is not None:
        hidden = llama.norm(x.view(batch, seq, -1).to(residual))
    if loss is None or _logits_wanted(self.codagen_return_logits, self.training):
        if hidden is None:
            hidden = llama.norm(x.view(batch, seq, -1).to(residual))
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        if tensor_parallel is not None:  # the slices' logits, gathered
            logits = tensor_parallel.logits(hidden[:, kept, :], self.lm_head.weight)
        else:
            logits = self.lm_head(hidden[:, kept, :])
        if patch.hf.final_logits is not None:
            logits = patch.hf.final_logits(self.config, logits)
    fields = {} if collected is None else collected.outputs(self.config, hidden)
    output = patch.api.lm_output(loss=loss, logits=logits, **fields, **{patch.api.output_cache_field: cache})
    return output if return_dict else output.to_tuple()


def _logits_wanted(return_logits, training: bool) -> bool:
    """Whether a forward with labels also makes the logits: return_logits True always, False never, "eval" in
    evaluation only (eval mode and no gradients: Trainer's evaluation and prediction), never in a training step,
    whose loss block keeps no logits."""
    if return_logits == "eval":
        return not training and not torch.is_grad_enabled()
    return bool(return_logits)


# ---- entry points ----

def apply_codagen(model, *, chunk_rows: int = 2048, return_logits: bool | str = "eval", fp8: bool = False):
    """Patch a transformers LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM or
    Gemma2ForCausalLM in place to run codagen's generated blocks (its family's: its mapping in
    codagen.models.<family>), and return it. A family's <Family>ForSequenceClassification,
    <Family>ForTokenClassification or <Family>ForQuestionAnswering (LlamaForSequenceClassification, ...), or its
    decoder alone (<Family>Model), is patched in its decoder: the decoder layers run the blocks, the final norm, the
    head and its loss stay transformers' own (chunk_rows and return_logits, which concern the LM head's loss, do not
    apply there).

    The q/k/v and gate/up projections become one fused parameter each (self_attn.qkv_proj.weight,
    mlp.gate_up_proj.weight), converted once; every other parameter is the model's own, under its own name (a tied
    embedding stays one parameter). Make the optimizer after patching. chunk_rows bounds the logits the loss keeps
    at once (chunk_rows x vocab). return_logits says when a forward with labels also returns the logits (the loss
    block makes none): "eval" (the default) in evaluation, the model in eval mode with gradients off, as Trainer
    evaluates and predicts, so that compute_metrics gets them; True always; False never. Raises CodagenConfigError,
    naming the field, for a configuration it does not compute exactly.

    A PEFT model (get_peft_model, PeftModel.from_pretrained) is patched inside, its LoRA adapters kept and added
    (codagen.lora), and returned; make it, and add or load every adapter, before patching.

    fp8=True runs the q/k/v, gate/up and down projections' forward in FP8 (docs/fp8.md, "FP8 in apply_codagen"): the
    normalized inputs and SwiGLU's output quantized in the epilogues that make them (float8_e4m3fn, 1 x 128 scales),
    the weights block-quantized (128 x 128) once after each change; the backward in bfloat16 from the master weights.
    The model runs in bfloat16 (bf16 parameters, or fp32 ones under torch.autocast(bfloat16)) on a GPU with FP8
    matrix instructions (sm_89 and later) or on the CPU. Refused for families without FP8 blocks (Qwen3, Gemma-2),
    mlp_bias, hidden or intermediate sizes not multiples of 128, and LoRA adapters.
    """
    if fp8 is not True and fp8 is not False:
        raise ValueError(f"apply_codagen: fp8 must be True or False, got {fp8!r}")
    if lora.is_peft(model) and hasattr(model, "get_base_model"):  # a PeftModel: LoRA's layers are in its base model
        if fp8:
            raise TypeError("apply_codagen(fp8=True): a PEFT (LoRA) model is not supported: the FP8 blocks take no "
                            "adapters; patch it without fp8")
        apply_codagen(model.get_base_model(), chunk_rows=chunk_rows, return_logits=return_logits)
        return model
    mapping, kind = _mapping_of(model)
    if mapping is None:
        _refuse_class(type(model))
        *others, last = (m.model_class for m in _mappings())
        *heads, last_head = ("<Family>" + k for k in DECODER_CLASSES[1:])
        raise TypeError(f"apply_codagen: expected a transformers {', '.join(others)} or {last}, the family's "
                        f"{', '.join(heads)} or {last_head} (the head left as "
                        f"transformers' own) or its decoder (<Family>Model: {_family_prefix(_mappings()[0])}Model, "
                        f"...), got {type(model).__name__}")
    causal_lm = kind == "ForCausalLM"
    if kind == "Model":
        llama, prefix = model, ""
    else:
        # the heads call their decoder, the family's <Family>Model, by their base_model_prefix: `model`, or
        # `transformer` (the question-answering heads of Llama, Qwen2 and Qwen3, as their checkpoints name it)
        name = model.base_model_prefix
        decoder = getattr(_modeling(mapping), _family_prefix(mapping) + "Model")
        llama = getattr(model, name, None)
        _check_type(name, llama, decoder, _family_prefix(mapping))
        prefix = name + "."
    if any(isinstance(layer, CodagenDecoderLayer) for layer in llama.layers):
        raise ValueError("apply_codagen: this model is already patched")
    check_config(model.config, mapping)
    check_modules(llama, mapping=mapping, prefix=prefix)
    if causal_lm:
        _check_lm_head(model.lm_head)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral) or chunk_rows < 1:
        raise ValueError(f"apply_codagen: chunk_rows must be a positive int, got {chunk_rows!r}")
    if not (return_logits is True or return_logits is False or return_logits == "eval"):
        raise ValueError(f"apply_codagen: return_logits must be 'eval', True or False, got {return_logits!r}")
    layer_mapping = _fp8_mapping(mapping, model.config, llama) if fp8 else mapping
    for i, layer in enumerate(llama.layers):
        llama.layers[i] = CodagenDecoderLayer(layer, model.config, layer_mapping)
    llama.codagen_patch = CodagenPatch(mapping)
    llama.forward = types.MethodType(_model_forward, llama)
    if not causal_lm:
        # a head (sequence or token classification, question answering) or the decoder alone: the decoder runs the
        # blocks and returns its last_hidden_state (the final norm's output), which the head, transformers' own
        # forward, reads
        llama.codagen_patch.check(llama)
        return model
    model.codagen_chunk_rows = int(chunk_rows)
    model.codagen_return_logits = return_logits
    llama.codagen_patch.check(llama, model)
    model.forward = types.MethodType(_causal_lm_forward, model)
    return model


FP8_GROUP = 128  # the FP8 blocks' group of columns (specs/fp8/blocks: `group: 128`)


def _fp8_mapping(mapping: HfMapping, config, llama: nn.Module) -> HfMapping:
    """The family's mapping with its FP8 blocks in place of norm_stats, pre_attention and post_attention; refused
    where there are none, or where the model has what they do not compute."""
    if mapping.fp8 is None:
        fp8_families = [m.model_class for m in _mappings() if m.fp8 is not None]
        raise TypeError(f"apply_codagen(fp8=True): codagen has no FP8 blocks for {mapping.model_class} yet (it has "
                        f"them for {', '.join(fp8_families)}); patch it without fp8")
    if getattr(config, "mlp_bias", False):
        _refuse("mlp_bias", config.mlp_bias, "the FP8 MLP block (post_attention_fp8) adds no bias; patch the model "
                                             "without fp8")
    for field in ("hidden_size", "intermediate_size"):  # the K of an FP8 GEMM, in groups of 128 columns
        if getattr(config, field) % FP8_GROUP:
            _refuse(field, getattr(config, field), f"the FP8 blocks quantize in groups of {FP8_GROUP} columns, and "
                                                   f"{field} must be a multiple of {FP8_GROUP}; patch the model "
                                                   "without fp8")
    if any(lora.is_peft(m) for m in llama.modules()):
        raise TypeError("apply_codagen(fp8=True): LoRA adapters are not supported: the FP8 blocks take no adapters; "
                        "patch the model without fp8")
    return dataclasses.replace(mapping, **mapping.fp8)


def from_pretrained(name_or_path, *args, chunk_rows: int = 2048, return_logits: bool | str = "eval", **kwargs):
    """<Family>ForCausalLM.from_pretrained(name_or_path, *args, **kwargs), patched by apply_codagen: the family whose
    configuration class the checkpoint's config is (config.model_type: LlamaForCausalLM for "llama",
    Qwen2ForCausalLM for "qwen2", MistralForCausalLM for "mistral", Qwen3ForCausalLM for "qwen3", Gemma2ForCausalLM
    for "gemma2"). A checkpoint of any other model type, or of a class that a family refuses (Gemma3ForCausalLM), is
    refused before its weights load: loaded as another family's class, its weights would not fit."""
    model_class = _pretrained_class(name_or_path, "ForCausalLM", kwargs, "codagen.hf.from_pretrained")
    return apply_codagen(model_class.from_pretrained(name_or_path, *args, **kwargs), chunk_rows=chunk_rows,
                         return_logits=return_logits)


def _pretrained_class(name_or_path, kind: str, kwargs: dict, caller: str) -> type:
    """The transformers class that loads the checkpoint at name_or_path as `kind` ("ForCausalLM" or one of
    DECODER_CLASSES) of its family, the family read from the checkpoint's config.model_type (or from kwargs' config);
    a TypeError, before any weight loads, for a model type of no family, a class a family refuses, or a kind the
    family's transformers classes do not have (Gemma-2 has no question-answering head)."""
    transformers = _transformers()
    config = kwargs.get("config")
    if not isinstance(config, transformers.PretrainedConfig):
        config_kwargs = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                                "subfolder", "trust_remote_code") if k in kwargs}
        config = transformers.AutoConfig.from_pretrained(config if isinstance(config, (str, Path)) else name_or_path,
                                                         **config_kwargs)
    classes = [getattr(transformers, m.model_class) for m in _mappings()] + [cls for cls, _ in _refused()]
    model_type = getattr(config, "model_type", None)
    model_class = next((cls for cls in classes if cls.config_class.model_type == model_type), None)
    if model_class is None:
        known = ", ".join(repr(m.config_class.model_type) for m in classes[:len(_mappings())])
        raise TypeError(f"{caller}: {name_or_path} is a {model_type!r} model; codagen patches the model types "
                        f"{known}")
    _refuse_class(model_class)  # before loading its weights
    if kind == "ForCausalLM":
        return model_class
    name = model_class.__name__.removesuffix("ForCausalLM") + kind
    head = getattr(transformers, name, None)
    if head is None:
        raise TypeError(f"{caller}: {name_or_path} is a {model_type!r} model, and transformers has no {name}")
    return head


class AutoCodagenForCausalLM:
    """`AutoCodagenForCausalLM.from_pretrained(path)`: the Hugging Face model at path (Llama, Qwen2, Mistral,
    Qwen3, Gemma-2), patched by apply_codagen."""

    from_pretrained = staticmethod(from_pretrained)


class _AutoCodagenDecoder:
    """What the AutoCodagen classes of the heads and of the decoder share: from_pretrained(path, *args, **kwargs) loads
    the checkpoint as its family's transformers class of their `kind`, as transformers' AutoModelFor<kind> does (a
    causal LM's checkpoint gives a head of new weights; num_labels and the other config fields as keyword
    arguments), and patches its decoder with apply_codagen."""

    kind: str

    @classmethod
    def from_pretrained(cls, name_or_path, *args, **kwargs):
        options = [name for name in ("chunk_rows", "return_logits") if name in kwargs]
        if options:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no {' or '.join(options)}: options of the LM "
                            "head's loss (AutoCodagenForCausalLM), which this model does not have")
        model_class = _pretrained_class(name_or_path, cls.kind, kwargs, f"{cls.__name__}.from_pretrained")
        return apply_codagen(model_class.from_pretrained(name_or_path, *args, **kwargs))


class AutoCodagenForSequenceClassification(_AutoCodagenDecoder):
    """`AutoCodagenForSequenceClassification.from_pretrained(path, num_labels=...)`: the family's
    <Family>ForSequenceClassification (LlamaForSequenceClassification, ...), its decoder patched by apply_codagen."""

    kind = "ForSequenceClassification"


class AutoCodagenForTokenClassification(_AutoCodagenDecoder):
    """`AutoCodagenForTokenClassification.from_pretrained(path, num_labels=...)`: the family's
    <Family>ForTokenClassification, its decoder patched by apply_codagen."""

    kind = "ForTokenClassification"


class AutoCodagenForQuestionAnswering(_AutoCodagenDecoder):
    """`AutoCodagenForQuestionAnswering.from_pretrained(path)`: the family's <Family>ForQuestionAnswering (Llama,
    Qwen2, Mistral, Qwen3), its decoder patched by apply_codagen."""

    kind = "ForQuestionAnswering"


class AutoCodagenModel(_AutoCodagenDecoder):
    """`AutoCodagenModel.from_pretrained(path)`: the family's decoder alone, <Family>Model, patched by
    apply_codagen."""

    kind = "Model"
