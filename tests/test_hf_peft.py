"""codagen.hf with PEFT's LoRA (codagen.lora): a tiny random Llama wrapped by get_peft_model, then patched by
apply_codagen, against the same PEFT model unpatched, fp32: the loss and every adapter's gradient within 1e-4
relative (lora_B random: PEFT starts it at zero, which would make the adapters add nothing), the base weights
frozen; merge_and_unload, saving and loading adapters, several adapters, disabled adapters; and each refusal with
its message."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")  # the test extra installs it; codagen never needs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import apply_codagen  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 97, 2, 12
TOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="sdpa")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def tiny_llama(**overrides):
    """A random fp32 LlamaForCausalLM, norm weights random too."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **overrides})).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.08)
    return model


def randomize_adapters(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)


def peft_llama(targets, model=None, **lora):
    """get_peft_model over a tiny Llama, adapters random."""
    config = peft.LoraConfig(target_modules=targets, **{"r": 4, "lora_alpha": 8, **lora})
    model = peft.get_peft_model(tiny_llama() if model is None else model, config)
    randomize_adapters(model)
    return model


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ragged_batch(seed=0):
    """Two rows of 12 and 7 tokens (right padding, masked and ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), labels=labels.to(DEVICE))


def compare(reference, patched, seed=0):
    """The same batch through both: loss, and the gradient of every trainable parameter (the adapters', under the
    same names), within TOL; nothing else trainable, no gradient elsewhere."""
    inputs = ragged_batch(seed)
    losses = []
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) < TOL, (losses[1].item(), losses[0].item())
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert got.keys() == expected.keys() and expected and all("lora_" in n for n in got)
    for name, g in expected.items():
        assert rel(got[name], g) < TOL, name
    assert all(p.grad is None for p in patched.parameters() if not p.requires_grad)


@pytest.mark.parametrize("targets, overrides, lora", [
    pytest.param(["q_proj", "k_proj", "v_proj"], {}, {}, id="qkv"),
    pytest.param(["q_proj", "v_proj"], {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0,
                                                            "factor": 3.0}}, {}, id="qv-linear-rope"),
    pytest.param(["o_proj"], {}, {}, id="o"),
    pytest.param(["down_proj"], {}, {}, id="down"),
    pytest.param(MLP, {}, {"use_rslora": True}, id="mlp-rslora"),
    pytest.param(ATTENTION + MLP, {"attention_bias": True, "mlp_bias": True}, {}, id="all-biases"),
    pytest.param("all-linear", {"tie_word_embeddings": True, "num_hidden_layers": 3}, {"r": 2, "lora_alpha": 5},
                 id="all-linear-tied"),
])
def test_lora_matches_peft_on_transformers(targets, overrides, lora):
    torch.manual_seed(1)
    reference = peft_llama(targets, tiny_llama(**overrides), **lora)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=7)
    assert patched.base_model.model.model.codagen_patch is not None  # the PeftModel is patched inside
    compare(reference, patched)


def test_lora_on_some_layers_only():
    """layers_to_transform: a layer without adapters runs its blocks as without PEFT."""
    torch.manual_seed(2)
    reference = peft_llama(ATTENTION + MLP, layers_to_transform=[1])
    patched = apply_codagen(copy.deepcopy(reference))
    assert not patched.base_model.model.model.layers[0].lora_adapters
    compare(reference, patched, seed=2)


def test_gradient_checkpointing():
    """Each patched layer's call is recomputed in the backward, the adapters' products with it."""
    torch.manual_seed(9)
    reference = peft_llama(ATTENTION + MLP)
    patched = apply_codagen(copy.deepcopy(reference))
    for model in (reference, patched):
        model.gradient_checkpointing_enable()
        model.train()
    assert patched.base_model.model.model.gradient_checkpointing
    compare(reference, patched, seed=12)


def test_autocast_and_a_copy_of_the_patched_model():
    """Under torch.autocast the blocks run in bf16 and the adapters in their own dtype (fp32), their products cast
    to the blocks' dtype: loss and gradients agree to bf16's precision. A deep copy of the patched PEFT model is
    one of its own (each fused part's LoRA layer reads its own copy's fused weight)."""
    torch.manual_seed(10)
    reference = peft_llama(ATTENTION + MLP)
    patched = apply_codagen(copy.deepcopy(reference))
    copied = copy.deepcopy(patched)
    assert copied.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr() != \
        patched.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
    compare(patched, copied, seed=13)
    inputs = ragged_batch(14)
    losses = []
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) < 2e-3
    expected = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32 and rel(p.grad, expected[name].grad) < 1e-1, name


def test_compiled_forward_is_one_graph():
    """torch.compile traces the patched PEFT model's forward, adapters included, as one graph: the adapters'
    state is read from their modules, nothing is imported or looked up on the way."""
    torch._dynamo.reset()
    patched = apply_codagen(peft_llama(ATTENTION + MLP))
    explained = torch._dynamo.explain(patched)(**ragged_batch())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    torch._dynamo.reset()


class FixedDropout(torch.nn.Module):
    """A dropout whose mask is drawn once, over the flattened rows: the same mask in both models, whatever their
    calling order and input shapes ([batch, seq, n] in transformers, [batch * seq, n] in codagen)."""

    def __init__(self, width, p=0.3):
        super().__init__()
        self.register_buffer("mask", (torch.rand(BATCH * SEQ, width) > p).float() / (1 - p))

    def forward(self, x):
        return (x.reshape(-1, x.shape[-1]) * self.mask.to(x.device)).reshape(x.shape)


def test_lora_dropout_applies_to_the_adapters_input_only():
    torch.manual_seed(3)
    reference = peft_llama(ATTENTION + MLP, lora_dropout=0.3)
    for module in reference.modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            assert isinstance(module.lora_dropout["default"], torch.nn.Dropout)
            module.lora_dropout["default"] = FixedDropout(module.in_features)
    patched = apply_codagen(copy.deepcopy(reference))
    compare(reference, patched, seed=3)


def test_several_adapters_disabled_and_switched():
    torch.manual_seed(4)
    base = tiny_llama()
    plain = copy.deepcopy(base)
    reference = peft_llama(["q_proj", "o_proj"], base)
    reference.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=3, target_modules=["v_proj", "up_proj"]))
    randomize_adapters(reference)
    patched = apply_codagen(copy.deepcopy(reference))
    compare(reference, patched, seed=4)
    for model in (reference, patched):
        model.set_adapter("other")
    compare(reference, patched, seed=5)
    inputs = ragged_batch(6)
    with torch.no_grad(), patched.disable_adapter():
        assert rel(patched(**inputs).loss, plain(**inputs).loss) < TOL
    # both at once (PEFT's base_model.set_adapter with a list): their products add up
    for model in (reference, patched):
        model.base_model.set_adapter(["default", "other"])
    compare(reference, patched, seed=7)


def test_merge_and_unload_gives_the_merged_model():
    torch.manual_seed(5)
    reference = peft_llama(ATTENTION + MLP, model=tiny_llama(attention_bias=True))
    patched = apply_codagen(copy.deepcopy(reference))
    inputs = ragged_batch(8)
    with torch.no_grad():
        expected = reference(**inputs).loss
        merged = patched.merge_and_unload()
        assert not any("lora" in type(m).__module__ for m in merged.modules())
        assert rel(merged(**inputs).loss, expected) < TOL
        unpatched = reference.merge_and_unload()
        state = merged.state_dict()
        assert state.keys() == unpatched.state_dict().keys()
        for name, value in unpatched.state_dict().items():
            assert rel(state[name], value) < 1e-6, name


def test_unload_drops_the_adapters():
    torch.manual_seed(6)
    base = tiny_llama()
    plain = copy.deepcopy(base)
    patched = apply_codagen(peft_llama(ATTENTION + MLP, base)).unload()
    inputs = ragged_batch(9)
    with torch.no_grad():
        assert rel(patched(**inputs).loss, plain(**inputs).loss) < TOL


def test_adapters_save_and_load(tmp_path):
    """The PeftModel's save_pretrained writes the adapters alone, as unpatched; they load into a new base
    (PeftModel.from_pretrained), which is patched after, and give the same loss. The whole state dict has PEFT's
    names."""
    torch.manual_seed(7)
    base = tiny_llama()
    reference = peft_llama(["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], copy.deepcopy(base))
    patched = apply_codagen(copy.deepcopy(reference))
    assert patched.state_dict().keys() == reference.state_dict().keys()
    patched.save_pretrained(tmp_path / "patched")
    reference.save_pretrained(tmp_path / "reference")
    from safetensors.torch import load_file
    saved, expected = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("patched", "reference"))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    loaded = apply_codagen(peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "patched"))
    # the unpatched PEFT model's whole state dict loads into a patched one (strict)
    other = apply_codagen(peft_llama(["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]))
    other.load_state_dict(reference.state_dict())
    inputs = ragged_batch(10)
    with torch.no_grad():
        expected = reference(**inputs).loss
        assert rel(loaded(**inputs).loss, expected) < TOL and rel(other(**inputs).loss, expected) < TOL


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_lora_on_every_projection_of_the_families_on_llama_s_blocks(family):
    """Qwen2 (q/k/v biases, a sliding window on its upper layers) and Mistral (a sliding window on every layer,
    sequences longer than it) run Llama's blocks: LoRA on all seven projections against PEFT on transformers."""
    from test_hf_mistral import tiny_mistral
    from test_hf_qwen2 import SLIDING, tiny_qwen2

    torch.manual_seed(9)
    base = tiny_qwen2(**SLIDING) if family == "qwen2" else tiny_mistral()
    reference = peft_llama(ATTENTION + MLP, base.to(DEVICE))
    compare(reference, apply_codagen(copy.deepcopy(reference)), seed=4)


def test_qwen3_lora_on_v_o_and_mlp_and_refused_on_q_k():
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="sdpa")
    torch.manual_seed(8)
    base = transformers.Qwen3ForCausalLM(config).to(DEVICE)
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.05)
    reference = peft_llama(["v_proj", "o_proj", "up_proj", "down_proj"], copy.deepcopy(base))
    compare(reference, apply_codagen(copy.deepcopy(reference)), seed=11)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.self_attn\.k_proj is a peft\..*: LoRA on "
                                        r"self_attn\.k_proj is not supported: QK-norm"):
        apply_codagen(peft_llama(["k_proj"], base))


# ---- refusals ----

def test_patching_before_get_peft_model_is_refused_with_the_order_to_use():
    patched = apply_codagen(tiny_llama())
    model = peft_llama(["o_proj"], patched)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.self_attn\.o_proj became a PEFT layer "
                                        r"after apply_codagen.*: call get_peft_model .* before apply_codagen"):
        model(**ragged_batch())


def test_an_adapter_added_after_patching_is_refused():
    patched = apply_codagen(peft_llama(["q_proj", "o_proj"]))
    patched(**ragged_batch())
    patched.add_adapter("late", peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.self_attn\.q_proj got adapter\(s\) "
                                        r"\['late'\] after apply_codagen"):
        patched(**ragged_batch())


def test_merge_adapter_is_refused_at_the_next_call():
    patched = apply_codagen(peft_llama(["q_proj"]))
    patched.merge_adapter()
    with pytest.raises(NotImplementedError, match=r"are merged \(merge_adapter\(\)\).*unmerge_adapter\(\), or "
                                                  r"merge_and_unload\(\)"):
        patched(**ragged_batch())
    patched.unmerge_adapter()
    patched(**ragged_batch())


@pytest.mark.parametrize("lora, message", [
    ({"use_dora": True}, r"adapter 'default' is a LoRA variant \(DoraLinearVariant"),
    ({"lora_bias": True}, r"adapter 'default' has a LoRA bias"),
])
def test_lora_variants_are_refused_by_name(lora, message):
    model = peft_llama(["v_proj"], **lora)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.self_attn\.v_proj is a "
                                        r"peft\.tuners\.lora\.layer\.Linear: " + message):
        apply_codagen(model)
    assert not hasattr(model.base_model.model, "codagen_chunk_rows")  # refused before anything was patched


def test_a_quantized_base_is_refused():
    """bitsandbytes' Linear4bit (here a stand-in of that name), bare or under PEFT's LoRA."""
    Linear4bit = type("Linear4bit", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    model = tiny_llama()
    model.model.layers[1].mlp.up_proj = Linear4bit(64, 80, bias=False)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.1\.mlp\.up_proj is a bitsandbytes\.nn\."
                                        r"modules\.Linear4bit, a quantized linear"):
        apply_codagen(model)
    model = peft_llama(["q_proj"])
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer = Linear4bit(64, 64, bias=False)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.self_attn\.q_proj is a peft\..*: a "
                                        r"quantized base layer"):
        apply_codagen(model)


def test_a_mixed_adapter_batch_is_refused():
    """adapter_names=... (PEFT's mixed batch) runs through hooks on the LoRA layers, which codagen does not call."""
    model = peft_llama(["o_proj"])
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["o_proj"]))
    patched = apply_codagen(model).eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="mixed-adapter batch"):
        patched(**ragged_batch(), adapter_names=["default", "other"])
