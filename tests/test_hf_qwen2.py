"""codagen.hf on a transformers Qwen2ForCausalLM (Qwen2, Qwen2.5: codagen/models/llama.py's QWEN2_HF, Llama's blocks
with q/k/v biases): a tiny random fp32 Qwen2 patched by apply_codagen against the same model unpatched, loss, logits
and every parameter gradient within 1e-4 relative (GQA, tied and untied embeddings, yarn RoPE, padding masks,
packed sequences, sliding-window layers over sequences longer than the window), the window passed to the attention
function as transformers passes it, save/load in transformers' layout, and the refused configuration fields."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it
if not hasattr(transformers, "Qwen2ForCausalLM"):
    pytest.skip("this transformers has no Qwen2", allow_module_level=True)

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import AutoCodagenForCausalLM, CodagenConfigError, apply_codagen  # noqa: E402
from test_hf import (  # noqa: E402
    compare, compare_checkpointed, compare_under_autocast, labelled_tokens, random_model, rel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 97, 2, 12
TOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attn_implementation="sdpa")
# layer 0 full attention, layers 1 and 2 over the last 4 positions (of 12): as Qwen2Config makes layer_types
SLIDING = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)


def tiny_qwen2(**overrides):
    """A random fp32 Qwen2ForCausalLM; norm weights and the q/k/v biases random too."""
    return random_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**{**BASE, **overrides}))


def tokens_and_labels(seed=0):
    return labelled_tokens(VOCAB, BATCH, SEQ, seed)


def compare_with_logits(reference, patched, **inputs):
    """Loss and every gradient (test_hf.compare), and the logits of the same inputs without labels."""
    compare(reference, patched, **inputs)
    inputs.pop("labels")
    with torch.no_grad():
        assert rel(patched(**inputs).logits, reference(**inputs).logits) < TOL


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa-untied"),
    pytest.param({"tie_word_embeddings": True}, id="gqa-tied"),  # Qwen2.5 0.5B to 3B
    pytest.param({"num_key_value_heads": 4, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                "factor": 4.0, "original_max_position_embeddings": 16}},
                 id="mha-yarn-rope"),  # Qwen2.5's long-context configuration
    pytest.param({"head_dim": 24}, id="head_dim-not-hidden-over-heads"),
    pytest.param(SLIDING, id="sliding-window-sdpa"),
    pytest.param({**SLIDING, "attn_implementation": "eager"}, id="sliding-window-eager"),
    pytest.param({**SLIDING, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                 id="sliding-window-given-layer-types"),
])
def test_patched_qwen2_matches_transformers(overrides):
    torch.manual_seed(1)
    reference = tiny_qwen2(**overrides)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=7)
    assert patched.model.layers[0].self_attn.qkv_proj.bias is not None  # q, k and v have biases
    if reference.config.tie_word_embeddings:
        assert patched.lm_head.weight is patched.model.embed_tokens.weight
    ids, labels = tokens_and_labels()
    compare_with_logits(reference, patched, input_ids=ids, labels=labels)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-window"])
def test_padding_mask(side, sliding):
    torch.manual_seed(2)
    reference = tiny_qwen2(**(SLIDING if sliding else {}))
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(1)
    mask = torch.ones_like(ids)
    pads = slice(SEQ - 4, None) if side == "right" else slice(0, 4)
    mask[1, pads] = 0
    labels[1, pads] = -100
    compare_with_logits(reference, patched, input_ids=ids, attention_mask=mask, labels=labels)


def test_packed_sequences_with_a_sliding_window():
    torch.manual_seed(3)
    reference = tiny_qwen2(**SLIDING)
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(2)
    # documents of lengths 7+5 and 3+9, positions restarting at 0 (as DataCollatorWithFlattening makes them)
    position_ids = torch.tensor([list(range(7)) + list(range(5)), list(range(3)) + list(range(9))], device=DEVICE)
    labels[position_ids == 0] = -100
    compare(reference, patched, input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False)


def recording_attention() -> tuple[str, list]:
    """An attention implementation (transformers' SDPA, by a name of its own) that records the sliding_window each
    call is passed: flash attention applies that window itself (its mask carries padding only)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    windows = []

    def recording(module, query, key, value, attention_mask, sliding_window="not passed", **kwargs):
        windows.append(sliding_window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("codagen_test_recording", recording)
    AttentionMaskInterface.register("codagen_test_recording", sdpa_mask)
    return "codagen_test_recording", windows


def test_attention_function_gets_each_layers_window_as_in_transformers():
    """Each patched layer's attention function gets the window transformers' Qwen2Attention passes, None for full
    attention."""
    implementation, windows = recording_attention()
    torch.manual_seed(4)
    reference = tiny_qwen2(**SLIDING, attn_implementation=implementation)
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(3)
    compare(reference, patched, input_ids=ids, labels=labels)
    assert windows == [None, 4, 4] * 2


def test_three_adamw_steps_alike():
    torch.manual_seed(5)
    reference = tiny_qwen2(tie_word_embeddings=True, **SLIDING)
    patched = apply_codagen(copy.deepcopy(reference))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (reference, patched)]
    for step in range(3):
        ids, labels = tokens_and_labels(10 + step)
        losses = []
        for model, optimizer in zip((reference, patched), optimizers):
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        assert rel(losses[1], losses[0]) < TOL, (step, losses)
    got = patched.state_dict()  # Hugging Face's layout
    for name, value in reference.state_dict().items():
        assert rel(got[name], value) < TOL, name


def test_save_and_load_in_transformers_layout(tmp_path):
    torch.manual_seed(6)
    reference = tiny_qwen2(**SLIDING)
    patched = apply_codagen(copy.deepcopy(reference))
    state = patched.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert "model.layers.0.self_attn.k_proj.bias" in state and "model.layers.0.self_attn.o_proj.bias" not in state
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    patched.save_pretrained(tmp_path)
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    again = AutoCodagenForCausalLM.from_pretrained(tmp_path).to(DEVICE)  # the checkpoint's family: Qwen2
    assert type(again).__name__ == "Qwen2ForCausalLM" and hasattr(again.model, "codagen_patch")
    assert [layer.self_attn.sliding_window for layer in again.model.layers] == [None, 4, 4]
    ids, labels = tokens_and_labels(5)
    with torch.no_grad():
        assert rel(again(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
    # a Hugging Face state dict loads into a patched model (load_state_dict, strict)
    other = apply_codagen(tiny_qwen2(**SLIDING))
    other.load_state_dict(reference.state_dict())
    for name, p in patched.named_parameters():
        assert torch.equal(dict(other.named_parameters())[name], p), name


@pytest.mark.parametrize("overrides, message", [
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "config.layer_types = ['full_attention', 'chunked_attention', 'full_attention'] is not supported: the patched "
     "decoder builds Hugging Face's masks of full_attention and sliding_attention layers only"),
    # sliding layers given, but no use_sliding_window: Qwen2Config drops the window (transformers' forward fails)
    ({"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "config.sliding_window = None is not supported: layer_types "),
    ({"hidden_act": "gelu"}, "config.hidden_act = 'gelu' is not supported: the MLP kernels compute SwiGLU"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.rope_parameters['rope_type'] = 'dynamic' is not supported"),
])
def test_refused_configurations_name_the_field(overrides, message):
    model = tiny_qwen2(**overrides)
    layers = list(model.model.layers)
    with pytest.raises(CodagenConfigError, match="^apply_codagen: " + message.replace("[", r"\[").replace("(", r"\(")):
        apply_codagen(model)
    assert list(model.model.layers) == layers  # refused: nothing changed


def test_modified_modules_are_refused_naming_qwen2():
    model = tiny_qwen2()
    model.model.layers[2].self_attn.v_proj = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.2\.self_attn\.v_proj is a .*Identity, not "
                                        r"Linear; codagen runs unmodified transformers Qwen2 modules only"):
        apply_codagen(model)


def assert_mapping_names_transformers_modules_and_weights(hf, model, blocks, unfed):
    """A mapping's classes, modules and the weights each block is fed are `model`'s (a transformers model of its
    class); every weight of a layer feeds a block but `unfed`."""
    import importlib

    modeling = importlib.import_module(hf.modeling)
    assert type(model).__name__ == hf.model_class and type(model).__module__ == hf.modeling

    def kind(name):
        return getattr(torch.nn, name) if name in ("Linear", "Embedding") else getattr(modeling, name)

    for name, cls in hf.model_modules.items():
        assert type(model.model.get_submodule(name)) is kind(cls), name
    for name, cls in hf.layer_modules.items():
        assert type(model.model.layers[0].get_submodule(name)) is kind(cls), name
    assert set(hf.read) <= set(hf.model_modules) | set(hf.layer_modules)
    for fused, parts in hf.fused.items():
        assert set(parts) <= set(hf.layer_modules) and fused.rpartition(".")[0] in hf.layer_modules
    weights = dict(model.named_parameters(), **{"lm_head.weight": model.lm_head.weight})
    layer = {n.removeprefix("model.layers.0."): p for n, p in weights.items() if n.startswith("model.layers.0.")}
    assert set(hf.feeds) <= set(blocks)
    fed = set()
    for block, names in hf.feeds.items():
        for name in names:
            if name.startswith(("model.", "lm_head.")):
                assert name in weights, (block, name)
            else:
                assert name.removeprefix("next.") in layer, (block, name)
                fed.add(name.removeprefix("next."))
    assert fed == set(layer) - set(unfed)


def test_qwen2_mapping_names_transformers_modules_and_weights():
    """codagen/models/llama.py's QWEN2_HF: its classes, modules and weights are transformers' Qwen2's; every weight
    of a layer feeds a Llama block but the q/k/v biases, which codagen.hf adds after PreAttention."""
    from codagen import models

    llama = models.family("llama")
    assert_mapping_names_transformers_modules_and_weights(
        llama.hf_alike[0], tiny_qwen2(), llama.blocks,
        unfed={f"self_attn.{p}_proj.bias" for p in "qkv"})



def test_autocast_runs_the_blocks_in_its_dtype():
    torch.manual_seed(7)
    compare_under_autocast(tiny_qwen2(), *tokens_and_labels(7))


def test_gradient_checkpointing_gives_the_unpatched_gradients(monkeypatch):
    torch.manual_seed(9)
    compare_checkpointed(tiny_qwen2(), *tokens_and_labels(9), monkeypatch)
