"""codagen.hf on a transformers MistralForCausalLM (codagen/models/llama.py's MISTRAL_HF, Llama's blocks): a tiny random
fp32 Mistral patched by apply_codagen against the same model unpatched, loss, logits and every parameter gradient
within 1e-4 relative (GQA, tied embeddings, a head_dim other than hidden / heads as Mistral-Nemo's, the sliding
window over sequences longer than it, with padding masks and packed sequences, and without one), the window passed
to the attention function as transformers passes it, save/load in transformers' layout, and the refused
configuration fields."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it
if not hasattr(transformers, "MistralForCausalLM"):
    pytest.skip("this transformers has no Mistral", allow_module_level=True)

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import AutoCodagenForCausalLM, CodagenConfigError, apply_codagen  # noqa: E402
from test_hf import (  # noqa: E402
    compare, compare_checkpointed, compare_under_autocast, labelled_tokens, random_model, rel)
from test_hf_qwen2 import (  # noqa: E402
    assert_mapping_names_transformers_modules_and_weights, compare_with_logits, recording_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 97, 2, 12
TOL = 1e-4
WINDOW = 4  # every layer attends to the last 4 positions of 12 (Mistral-7B-v0.1 has 4096)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=WINDOW,
            tie_word_embeddings=False, attn_implementation="sdpa")


def tiny_mistral(**overrides):
    """A random fp32 MistralForCausalLM; norm weights random too."""
    return random_model(transformers.MistralForCausalLM, transformers.MistralConfig(**{**BASE, **overrides}))


def tokens_and_labels(seed=0):
    return labelled_tokens(VOCAB, BATCH, SEQ, seed)


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="sliding-window-sdpa"),
    pytest.param({"attn_implementation": "eager"}, id="sliding-window-eager"),
    pytest.param({"sliding_window": None}, id="no-sliding-window"),  # Mistral-7B-v0.2 and later
    pytest.param({"sliding_window": SEQ + 1}, id="window-longer-than-the-sequence"),
    pytest.param({"head_dim": 24, "sliding_window": None, "tie_word_embeddings": True}, id="head_dim-tied"),
    # MistralModel ignores layer_types (every layer slides): so does the patch
    pytest.param({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, id="layer-types-ignored"),
])
def test_patched_mistral_matches_transformers(overrides):
    torch.manual_seed(1)
    reference = tiny_mistral(**overrides)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=7)
    if reference.config.tie_word_embeddings:
        assert patched.lm_head.weight is patched.model.embed_tokens.weight
    ids, labels = tokens_and_labels()
    compare_with_logits(reference, patched, input_ids=ids, labels=labels)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_with_the_sliding_window(side):
    torch.manual_seed(2)
    reference = tiny_mistral()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(1)
    mask = torch.ones_like(ids)
    pads = slice(SEQ - 3, None) if side == "right" else slice(0, 3)
    mask[1, pads] = 0
    labels[1, pads] = -100
    compare_with_logits(reference, patched, input_ids=ids, attention_mask=mask, labels=labels)


def test_packed_sequences_with_the_sliding_window():
    torch.manual_seed(3)
    reference = tiny_mistral()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(2)
    # documents of lengths 7+5 and 3+9, positions restarting at 0 (as DataCollatorWithFlattening makes them)
    position_ids = torch.tensor([list(range(7)) + list(range(5)), list(range(3)) + list(range(9))], device=DEVICE)
    labels[position_ids == 0] = -100
    compare(reference, patched, input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False)


def test_autocast_runs_the_blocks_in_its_dtype():
    torch.manual_seed(7)
    compare_under_autocast(tiny_mistral(), *tokens_and_labels(7))


def test_gradient_checkpointing_with_the_sliding_window(monkeypatch):
    """Each checkpointed layer's recomputation gets its layer's mask again."""
    torch.manual_seed(7)
    compare_checkpointed(tiny_mistral(), *tokens_and_labels(7), monkeypatch)


@pytest.mark.parametrize("window", [WINDOW, None])
def test_attention_function_gets_the_window_as_in_transformers(window):
    """Each patched layer's attention function gets the window transformers' MistralAttention passes."""
    implementation, windows = recording_attention()
    torch.manual_seed(4)
    reference = tiny_mistral(sliding_window=window, attn_implementation=implementation)
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(3)
    compare(reference, patched, input_ids=ids, labels=labels)
    assert windows == [window] * 6


def test_save_and_load_in_transformers_layout(tmp_path):
    torch.manual_seed(6)
    reference = tiny_mistral()
    patched = apply_codagen(copy.deepcopy(reference))
    state = patched.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    patched.save_pretrained(tmp_path)
    reloaded = transformers.MistralForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    again = AutoCodagenForCausalLM.from_pretrained(tmp_path).to(DEVICE)  # the checkpoint's family: Mistral
    assert type(again).__name__ == "MistralForCausalLM" and hasattr(again.model, "codagen_patch")
    ids, labels = tokens_and_labels(5)
    with torch.no_grad():
        assert rel(again(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
    # a Hugging Face state dict loads into a patched model (load_state_dict, strict)
    other = apply_codagen(tiny_mistral())
    other.load_state_dict(reference.state_dict())
    for name, p in patched.named_parameters():
        assert torch.equal(dict(other.named_parameters())[name], p), name


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_act": "gelu"}, "config.hidden_act = 'gelu' is not supported: the MLP kernels compute SwiGLU"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.rope_parameters['rope_type'] = 'dynamic' is not supported"),
    ({"is_causal": False}, "config.is_causal = False is not supported: the patched decoder is causal"),
])
def test_refused_configurations_name_the_field(overrides, message):
    model = tiny_mistral(**overrides)
    layers = list(model.model.layers)
    with pytest.raises(CodagenConfigError, match="^apply_codagen: " + message.replace("[", r"\[").replace("(", r"\(")):
        apply_codagen(model)
    assert list(model.model.layers) == layers  # refused: nothing changed


def test_modified_modules_are_refused_naming_mistral():
    patched = apply_codagen(tiny_mistral())
    patched.model.layers[1].mlp.down_proj = torch.nn.Identity()
    ids, labels = tokens_and_labels()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.1\.mlp\.down_proj is a .*Identity, not "
                                        r"Linear; codagen runs unmodified transformers Mistral modules only"):
        patched(input_ids=ids, labels=labels)


def test_mistral_mapping_names_transformers_modules_and_weights():
    """codagen/models/llama.py's MISTRAL_HF: its classes, modules and weights are transformers' Mistral's; every
    weight of a layer feeds a Llama block."""
    from codagen import models

    llama = models.family("llama")
    assert_mapping_names_transformers_modules_and_weights(llama.hf_alike[1], tiny_mistral(), llama.blocks, unfed=())
