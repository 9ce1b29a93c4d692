"""codagen.hf on a transformers Qwen3ForCausalLM (codagen/models/qwen3.py's HF mapping: Qwen3PreAttention with QK-norm,
Qwen3PostAttention, NormStats, LmHeadLoss): a tiny random fp32 Qwen3 patched by apply_codagen against the same model
unpatched, loss and every parameter gradient within 1e-4 relative (GQA, tied and untied embeddings, a left-padding
mask), three AdamW steps alike, save/load in transformers' layout, and the refused configuration fields."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it
if not hasattr(transformers, "Qwen3ForCausalLM"):
    pytest.skip("this transformers has no Qwen3", allow_module_level=True)

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import AutoCodagenForCausalLM, CodagenConfigError, apply_codagen  # noqa: E402
from test_hf import (  # noqa: E402
    compare, compare_checkpointed, compare_under_autocast, labelled_tokens, random_model, rel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 300, 2, 8
TOL = 1e-4
# head_dim 128: the column group of the Qwen3 kernels; kept small otherwise (Triton's interpreter on the CPU)
BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, max_position_embeddings=64, rms_norm_eps=1e-6,
            tie_word_embeddings=False, attn_implementation="sdpa")


def tiny_qwen3(**overrides):
    """A random fp32 Qwen3ForCausalLM; norm weights (q_norm and k_norm included) random too."""
    return random_model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**{**BASE, **overrides}))


def tokens_and_labels(seed=0):
    return labelled_tokens(VOCAB, BATCH, SEQ, seed)


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa-untied"),
    pytest.param({"tie_word_embeddings": True}, id="gqa-tied"),
    pytest.param({"num_key_value_heads": 2, "tie_word_embeddings": True,
                  "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}},
                 id="mha-linear-rope"),
    # layer 0 full attention, layer 1 over the last 4 of the 8 positions, as Qwen3Config makes layer_types
    pytest.param({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, id="sliding-window"),
    pytest.param({"use_sliding_window": True, "sliding_window": 3, "attn_implementation": "eager",
                  "layer_types": ["sliding_attention", "full_attention"]}, id="sliding-window-given-layer-types"),
])
def test_patched_qwen3_matches_transformers(overrides):
    torch.manual_seed(1)
    reference = tiny_qwen3(**overrides)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=5)
    assert type(patched.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"  # kept as it is
    if reference.config.tie_word_embeddings:
        assert patched.lm_head.weight is patched.model.embed_tokens.weight
    ids, labels = tokens_and_labels()
    compare(reference, patched, input_ids=ids, labels=labels)
    with torch.no_grad():
        assert rel(patched(input_ids=ids).logits, reference(input_ids=ids).logits) < TOL


def test_left_padding_mask():
    torch.manual_seed(2)
    reference = tiny_qwen3()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels[1, :3] = -100
    compare(reference, patched, input_ids=ids, attention_mask=mask, labels=labels)


def test_three_adamw_steps_alike():
    torch.manual_seed(3)
    reference = tiny_qwen3(tie_word_embeddings=True)
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
    torch.manual_seed(4)
    reference = tiny_qwen3()
    patched = apply_codagen(copy.deepcopy(reference))
    state = patched.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    patched.save_pretrained(tmp_path)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    again = AutoCodagenForCausalLM.from_pretrained(tmp_path).to(DEVICE)  # the checkpoint's family: Qwen3
    assert type(again).__name__ == "Qwen3ForCausalLM" and hasattr(again.model, "codagen_patch")
    ids, labels = tokens_and_labels(5)
    with torch.no_grad():
        assert rel(again(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
    # a Hugging Face state dict loads into a patched model (load_state_dict, strict)
    other = apply_codagen(tiny_qwen3())
    other.load_state_dict(reference.state_dict())
    for name, p in patched.named_parameters():
        assert torch.equal(dict(other.named_parameters())[name], p), name


@pytest.mark.parametrize("overrides, message", [
    ({"head_dim": 64}, "config.head_dim = 64 is not supported: the Qwen3 kernels normalize q and k heads of 128"),
    ({"attention_bias": True}, "config.attention_bias = True is not supported: Qwen3's q and k biases"),
    ({"layer_types": ["full_attention", "sliding_attention"]},  # without use_sliding_window: no window
     "config.sliding_window = None is not supported: layer_types ['full_attention', 'sliding_attention'] has "
     "sliding_attention layers"),
    ({"hidden_act": "gelu"}, "config.hidden_act = 'gelu' is not supported: the MLP kernels compute SwiGLU"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.rope_parameters['rope_type'] = 'dynamic' is not supported"),
])
def test_refused_configurations_name_the_field(overrides, message):
    model = tiny_qwen3(**overrides)
    layers = list(model.model.layers)
    with pytest.raises(CodagenConfigError, match="^apply_codagen: " + message.replace("[", r"\[").replace("(", r"\(")):
        apply_codagen(model)
    assert list(model.model.layers) == layers  # refused: nothing changed


def test_modified_qk_norm_is_refused():
    patched = apply_codagen(tiny_qwen3())
    patched.model.layers[1].self_attn.k_norm = torch.nn.Identity()
    ids, labels = tokens_and_labels()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.1\.self_attn\.k_norm is a .*Identity"):
        patched(input_ids=ids, labels=labels)


def test_qwen3_mapping_names_transformers_modules_and_weights():
    """codagen/models/qwen3.py's HF: its classes, modules and the weights each block is fed are transformers'."""
    from transformers.models.qwen3 import modeling_qwen3

    from codagen import models

    qwen3 = models.family("qwen3")
    hf = qwen3.hf
    model = tiny_qwen3()
    assert type(model).__name__ == hf.model_class and modeling_qwen3.__name__ == hf.modeling

    def kind(name):
        return getattr(torch.nn, name) if name in ("Linear", "Embedding") else getattr(modeling_qwen3, name)

    for name, cls in hf.model_modules.items():
        assert type(model.model.get_submodule(name)) is kind(cls), name
    for name, cls in hf.layer_modules.items():
        assert type(model.model.layers[0].get_submodule(name)) is kind(cls), name
    assert set(hf.read) <= set(hf.model_modules) | set(hf.layer_modules)
    assert {f"self_attn.{name}" for name in hf.attention_modules} <= set(hf.read)
    weights = dict(model.named_parameters(), **{"lm_head.weight": model.lm_head.weight})
    layer = {n.removeprefix("model.layers.0."): p for n, p in weights.items() if n.startswith("model.layers.0.")}
    assert set(hf.feeds) == set(qwen3.blocks)
    fed = set()
    for block, names in hf.feeds.items():
        for name in names:
            if name.startswith(("model.", "lm_head.")):
                assert name in weights, (block, name)
            else:
                assert name.removeprefix("next.") in layer, (block, name)
                fed.add(name.removeprefix("next."))
    assert fed == set(layer)  # every weight of a layer feeds a block



def test_autocast_runs_the_blocks_in_its_dtype():
    torch.manual_seed(7)
    compare_under_autocast(tiny_qwen3(), *tokens_and_labels(7))


def test_gradient_checkpointing_gives_the_unpatched_gradients(monkeypatch):
    torch.manual_seed(9)
    compare_checkpointed(tiny_qwen3(), *tokens_and_labels(9), monkeypatch)
