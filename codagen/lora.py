"""LoRA adapters (PEFT) on a model patched by codagen.hf: the frozen base weights stay in codagen's fused blocks, and
each adapter's low-rank product is computed in PyTorch from the same input and added where it is exact
(docs/huggingface.md, "LoRA (PEFT)"):

- q, k, v: from the input norm's output (recomputed from the residual stream, so that the adapters' gradient
  reaches it), rotated by RoPE and added to the PreAttention block's output (RoPE is linear);
- o: added to the residual stream before the PostAttention block, x + y W_o^T + delta = (x + delta) + y W_o^T;
- gate, up, down: inside the PostAttention block's fusion (norm -> gate/up -> SwiGLU -> down), so a layer with one
  of them runs its post-attention part in PyTorch ops (its GEMMs unfused), and the next norm's statistics in the
  NormStats block.

Order: get_peft_model (or PeftModel.from_pretrained), then apply_codagen. A LoRA layer or an adapter that appears
after apply_codagen is refused with what to do instead: the patch fused q/k/v and gate/up, where PEFT would find
no module to adapt and skip them without a word.

codagen never imports `peft`: PEFT's modules are told by their classes' names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ORDER = ("call get_peft_model (or PeftModel.from_pretrained, add_adapter, load_adapter) before apply_codagen, on the "
         "unpatched model, then apply_codagen on the PEFT model")


def is_peft(module: nn.Module) -> bool:
    """A module of PEFT's (a tuner layer in place of a projection)."""
    return type(module).__module__.partition(".")[0] == "peft"


def is_lora(module: nn.Module | None) -> bool:
    """PEFT's LoRA layer on a Linear (peft.tuners.lora.layer.Linear, not a subclass), the only PEFT layer codagen
    takes; told by its class's name, so that the forward imports nothing."""
    kind = type(module)
    return kind.__module__ == "peft.tuners.lora.layer" and kind.__qualname__ == "Linear"


def is_quantized(module: nn.Module) -> bool:
    """A quantized linear (bitsandbytes' Linear4bit, Linear8bitLt, or a PEFT layer over one), by its class name: no
    bitsandbytes needed to tell."""
    return any(bits in type(module).__name__ for bits in ("4bit", "8bit"))


def check_layer(name: str, module: nn.Module, refused: dict[str, str], projection: str) -> None:
    """Refuse, naming the module, a PEFT layer in place of a projection whose adapters codagen does not add exactly:
    a quantized base, another PEFT method, a LoRA variant (DoRA, ...), a LoRA bias, a target the family refuses
    (`refused`: projection -> why)."""
    def refuse(why: str):
        raise TypeError(f"apply_codagen: {name} is a {type(module).__module__}.{type(module).__qualname__}: {why}")

    if is_quantized(module) or is_quantized(getattr(module, "base_layer", module)):
        refuse("a quantized base layer (bitsandbytes 4-bit or 8-bit) is not supported; codagen's GEMMs take "
               "unquantized weights (bf16, fp16, fp32): load the base model unquantized")
    if not is_lora(module):
        refuse("codagen adds the adapters of PEFT's LoRA layer on a Linear (peft.tuners.lora.layer.Linear) only")
    if projection in refused:
        refuse(f"LoRA on {projection} is not supported: {refused[projection]}")
    if type(module.base_layer) not in (nn.Linear, FusedPart):
        refuse(f"its base layer is a {type(module.base_layer).__qualname__}, not a Linear")
    for adapter in module.lora_A:
        variant = module.lora_variant.get(adapter)
        if variant is not None:
            refuse(f"adapter {adapter!r} is a LoRA variant ({type(variant).__name__}: DoRA, aLoRA, ...), which "
                   "codagen does not compute; plain LoRA only (use_dora=False)")
        if module.lora_bias.get(adapter):
            refuse(f"adapter {adapter!r} has a LoRA bias (lora_bias=True), which codagen does not add")
    if getattr(module, "fan_in_fan_out", False):
        refuse("fan_in_fan_out=True (a Conv1D layout) is not a Linear's")


def adapters(module: nn.Module) -> frozenset[str]:
    return frozenset(module.lora_A)


def check_patched(name: str, module: nn.Module, recorded: frozenset[str] | None, refused: dict[str, str],
                  projection: str) -> None:
    """A PEFT layer found in a patched model: it must have been there, with the same adapters or fewer, when
    apply_codagen ran (`recorded`: its adapters then, None if it was not a LoRA layer)."""
    if recorded is None:
        raise TypeError(f"apply_codagen: {name} became a PEFT layer after apply_codagen, which fused q/k/v and "
                        f"gate/up (PEFT finds no module to adapt there and skips them): {ORDER}")
    added = adapters(module) - recorded
    if added:
        raise TypeError(f"apply_codagen: {name} got adapter(s) {sorted(added)} after apply_codagen, which fused q/k/v "
                        f"and gate/up (PEFT finds no module to adapt there and skips them): {ORDER}")
    check_layer(name, module, refused, projection)


def refused_targets(mapping) -> dict[str, str] | None:
    """The projections of the family (`mapping`, an HfMapping) on which LoRA is refused -> why; None: LoRA is not
    declared for the family (it runs blocks of its own and names no LoRA refusals)."""
    from .models.llama import HF as LLAMA

    if mapping.lora_refused is not None:
        return mapping.lora_refused
    runs_llamas = (mapping.pre_attention, mapping.post_attention) == (LLAMA.pre_attention, LLAMA.post_attention)
    return {} if runs_llamas else None


def _projections(mapping) -> list[str]:
    return [name for name, kind in mapping.layer_modules.items() if kind == "Linear"]


def _child(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:  # a part that the patch fused, without an adapter
        return None


def record(layer: nn.Module, mapping) -> dict[str, frozenset[str]]:
    """A Hugging Face decoder layer's LoRA layers among its projections -> their adapters."""
    return {name: adapters(m) for name in _projections(mapping) if is_lora(m := _child(layer, name))}


def check(llama: nn.Module, mapping, prefix: str, patched: bool) -> None:
    """Refuse, naming the module, what codagen does not add exactly among the PEFT layers in place of the decoder's
    projections: at patch time (check_layer), and in a patched model (patched=True) also a LoRA layer or an adapter
    that came after apply_codagen (check_patched)."""
    refused = refused_targets(mapping)
    for i, layer in enumerate(llama.layers):
        for projection in _projections(mapping):
            module = _child(layer, projection)
            if module is None or not is_peft(module):
                continue
            name = f"{prefix}layers.{i}.{projection}"
            if refused is None:
                raise TypeError(f"apply_codagen: {name} is a PEFT layer: LoRA on a "
                                f"{mapping.model_class} is not supported by codagen.hf yet")
            if patched:
                check_patched(name, module, layer.lora_adapters.get(projection), refused, projection)
            else:
                check_layer(name, module, refused, projection)


def watched(llama: nn.Module):
    """The modules of a patched model's LoRA layers whose change (a new adapter, a new base layer) the patch checks
    again (codagen.hf.CodagenPatch)."""
    for layer in llama.layers:
        for name in layer.lora_adapters:
            module = _child(layer, name)
            if is_lora(module):
                yield from (module, module.lora_A)


def mlp_adapted(mlp: nn.Module) -> bool:
    """Whether a patched MLP has a LoRA layer (gate, up, down): its block then runs in PyTorch ops."""
    return any(is_lora(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj"))


# ---- the adapters' product ----

def delta(module: nn.Module | None, x: torch.Tensor) -> torch.Tensor | None:
    """What PEFT's LoRA layer `module` adds to its base layer's output for input x (lora.Linear.forward): the sum
    over its active adapters of lora_B(lora_A(dropout(x))) * scaling (lora_alpha / r, or / sqrt(r) with
    use_rslora), computed in the adapters' dtype and returned in x's; None where it adds nothing (not a LoRA layer,
    adapters disabled, no active adapter)."""
    if not is_lora(module) or module.disable_adapters:
        return None
    if module.merged:
        raise NotImplementedError(f"codagen's patched model: adapter(s) {module.merged_adapters} of a LoRA layer are "
                                  "merged (merge_adapter()), which codagen's fused weights do not take: "
                                  "unmerge_adapter(), or merge_and_unload()")
    if module._forward_pre_hooks or module._forward_hooks:
        raise NotImplementedError("codagen's patched model computes the LoRA layers' products without calling them, "
                                  "so their hooks would not run: a mixed-adapter batch (adapter_names=...) or a "
                                  "hook on a LoRA layer is not supported")
    out = None
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        d = b(a(module.lora_dropout[adapter](x.to(a.weight.dtype)))) * module.scaling[adapter]
        out = d if out is None else out + d
    return None if out is None else out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: the norm's output that the projections take, differentiable in x and weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qkv_delta(attn: nn.Module, x: torch.Tensor, wn: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The q, k, v adapters' products for the residual stream x (their input, the input norm's output, made again
    from x so that their gradient reaches x: the PreAttention block takes the norm's statistics as values), in the
    fused qkv column layout (CodagenAttention.fuse: q and k columns of each head interleaved), zeros where a part
    has none; None if none adds anything."""
    layers = [getattr(attn, name, None) for name in attn.parts]
    if not any(is_lora(m) for m in layers):
        return None
    normed = rms_norm(x, wn, eps)
    parts = [delta(m, normed) for m in layers]
    if all(d is None for d in parts):
        return None
    hd, nq, nkv = attn.head_dim, attn.num_heads, attn.num_key_value_heads
    widths = (nq * hd, nkv * hd, nkv * hd)
    parts = [normed.new_zeros(normed.shape[0], w) if d is None else d for d, w in zip(parts, widths)]
    return attn.fuse(*(d.t() for d in parts)).t()


def post_attention(layer: nn.Module, blocks, y: torch.Tensor, x: torch.Tensor, wn_next: torch.Tensor,
                   w_o: torch.Tensor, wn_mlp: torch.Tensor, eps: float, cast) -> tuple:
    """Llama's PostAttention block in PyTorch ops, for a layer whose MLP has adapters (they sit inside the block's
    fusion): out-projection + residual, RMSNorm, gate/up (+ adapters) and SwiGLU, down (+ adapter) + residual, then
    the next norm's statistics by NormStats. -> (x, h, rstd) as the block returns them."""
    mlp = layer.mlp
    x = x + F.linear(y, w_o)
    normed = rms_norm(x, wn_mlp, eps)
    gate_up = mlp.gate_up_proj
    z = F.linear(normed, cast(gate_up.weight), None if gate_up.bias is None else cast(gate_up.bias))
    gate, up = z[:, 0::2], z[:, 1::2]  # rows interleaved (CodagenMLP.fuse)
    d_gate, d_up = delta(getattr(mlp, "gate_proj", None), normed), delta(getattr(mlp, "up_proj", None), normed)
    gate = gate if d_gate is None else gate + d_gate
    up = up if d_up is None else up + d_up
    act = F.silu(gate) * up
    down = mlp.down_proj
    out = F.linear(act, cast(down.weight), None if down.bias is None else cast(down.bias))
    d_down = delta(down, act)
    x = x + (out if d_down is None else out + d_down)
    h, rstd = blocks.NormStatsFunction.apply(x, wn_next, x.shape[1], eps)
    return x, h, rstd


# ---- fused projections: the LoRA layers of their parts ----

class FusedPart(nn.Module):
    """The base layer of a LoRA layer whose projection codagen fused (q, k, v into self_attn.qkv_proj; gate, up into
    mlp.gate_up_proj): its weight lives in the fused parameter, stored once. `weight` reads the part's rows in
    Hugging Face's layout (a copy: PEFT reads its device and dtype); the forward is the base projection. PEFT's
    merge_adapter() writes into that copy, so a merged adapter is refused at the next call (codagen.lora.delta);
    merge_and_unload() merges into the fused weight (unload)."""

    def __init__(self, owner: nn.Module, fused: str, index: int, in_features: int, out_features: int):
        super().__init__()
        # not a submodule: the fused parameter keeps one name in the state dict
        self.__dict__["_owner"] = owner
        self.fused, self.index = fused, index
        self.in_features, self.out_features = in_features, out_features

    @property
    def weight(self) -> torch.Tensor:
        owner = self.__dict__["_owner"]
        return owner.unfuse(getattr(owner, self.fused).weight)[self.index]

    @property
    def bias(self) -> torch.Tensor | None:
        owner = self.__dict__["_owner"]
        bias = getattr(owner, self.fused).bias
        return None if bias is None else owner.unfuse(bias)[self.index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows of {self.fused}[{self.index}]"


def base_layers(parts: list[nn.Module]) -> list[nn.Module]:
    """The Linear of each part: a LoRA layer's base layer, else the part itself."""
    return [p.base_layer if is_lora(p) else p for p in parts]


def state_name(layer: nn.Module, part: str) -> str:
    """The state dict name of a fused part's weights (a layer's "self_attn.q_proj"): under a LoRA layer, its base
    layer's, as PEFT names them ("self_attn.q_proj.base_layer")."""
    return part + ".base_layer" if is_lora(_child(layer, part)) else part


def keep_parts(owner: nn.Module, fused: str, names: tuple[str, ...], parts: list[nn.Module]) -> None:
    """After the fusion: each LoRA layer among `parts` stays under its Hugging Face name in `owner` (so PEFT's
    adapter names, state dict keys, disable_adapter and set_adapter are as unpatched), its base layer a FusedPart
    of the fused weight."""
    for i, (name, part) in enumerate(zip(names, parts)):
        if is_lora(part):
            part.base_layer = FusedPart(owner, fused, i, part.in_features, part.out_features)
            setattr(owner, name, part)


def unload(owner: nn.Module, fused: str, names: tuple[str, ...], merge: bool, safe_merge: bool,
           adapter_names: list[str] | None) -> nn.Module:
    """PEFT's merge_and_unload() / unload() for a fused projection (PEFT calls a module's
    unload_and_optionally_merge_module): each part's adapters (adapter_names, else its active ones) merged into the
    fused weight (delta = lora_B @ lora_A * scaling, in the fused layout), and the parts' LoRA layers dropped.
    Returns owner, which PEFT puts back in place."""
    parts = [getattr(owner, name, None) for name in names]
    if not any(is_lora(p) for p in parts):
        return owner
    weight = getattr(owner, fused).weight
    if merge:
        deltas = [None if not is_lora(p) else _merged_delta(p, adapter_names) for p in parts]
        with torch.no_grad():
            merged = owner.fuse(*(w if d is None else w + d.to(w.dtype)
                                  for w, d in zip(owner.unfuse(weight), deltas)))
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights of {fused}: an adapter seems to be broken")
            weight.copy_(merged)
    for name, part in zip(names, parts):
        if is_lora(part):
            delattr(owner, name)
    return owner


def _merged_delta(part: nn.Module, adapter_names: list[str] | None) -> torch.Tensor | None:
    """The weight delta of a LoRA layer's adapters to merge (adapter_names, else its active ones), in its base
    weight's layout, as PEFT's merge() adds it; None for none."""
    total = None
    for adapter in part.active_adapters if adapter_names is None else adapter_names:
        if adapter in part.lora_A:
            d = part.get_delta_weight(adapter)
            total = d if total is None else total + d
    return total
