"""codagen.hf on a transformers Gemma2ForCausalLM (codagen/models/gemma2.py's HF mapping: Gemma2NormStats,
Gemma2PreAttention, Hugging Face's eager attention with score softcapping, Gemma2PostAttention with the sandwich
norms, gemma2_lm_head_loss with logit softcapping): a tiny random fp32 Gemma-2 patched by apply_codagen against the
same model unpatched, loss, logits and every parameter gradient within 1e-4 relative (three layers, so sliding and
full layers both run, sequences longer than the window, GQA, tied and untied embeddings, padding masks), three
AdamW steps alike, save/load in transformers' layout, the refused configuration fields, and Gemma-3's text model
refused."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it
if not hasattr(transformers, "Gemma2ForCausalLM"):
    pytest.skip("this transformers has no Gemma-2", allow_module_level=True)

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import AutoCodagenForCausalLM, CodagenConfigError, apply_codagen  # noqa: E402
from test_hf import (  # noqa: E402
    compare, compare_checkpointed, compare_under_autocast, labelled_tokens, random_model, rel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ, WINDOW = 97, 2, 12, 4
TOL = 1e-4
# the softcaps are small so that tanh bends the tiny model's scores and logits; query_pre_attn_scalar is not
# head_dim, so the scores' scale is Gemma-2's own; the attention is wider than hidden_size, as in Gemma-2 2B
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=WINDOW,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, max_position_embeddings=64, rms_norm_eps=1e-6,
            pad_token_id=0, attn_implementation="eager")


def tiny_gemma2(**overrides):
    """A random fp32 Gemma2ForCausalLM; norm weights random too (Hugging Face starts them at zero: a scale of 1)."""
    return random_model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**{**BASE, **overrides}),
                        norm_center=0.0)


def tokens_and_labels(seed=0):
    return labelled_tokens(VOCAB, BATCH, SEQ, seed)


def test_layers_of_both_types_and_sequences_longer_than_the_window():
    config = tiny_gemma2().config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"} and SEQ > config.sliding_window


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa-tied"),
    pytest.param({"tie_word_embeddings": False}, id="gqa-untied"),
    # transformers' Gemma-2 reads hidden_activation and ignores hidden_act (Gemma-1 checkpoints set it to "gelu")
    pytest.param({"num_key_value_heads": 4, "attn_logit_softcapping": None, "hidden_act": "gelu"},
                 id="mha-no-score-softcap"),
    pytest.param({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                  "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}},
                 id="layer-types-linear-rope"),
    pytest.param({"attention_dropout": 0.3}, id="attention-dropout"),
])
def test_patched_gemma2_matches_transformers(overrides):
    torch.manual_seed(1)
    reference = tiny_gemma2(**overrides)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=5)
    if reference.config.tie_word_embeddings:
        assert patched.lm_head.weight is patched.model.embed_tokens.weight
    ids, labels = tokens_and_labels()
    compare(reference, patched, input_ids=ids, labels=labels)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask(side):
    torch.manual_seed(2)
    reference = tiny_gemma2()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(1)
    mask = torch.ones_like(ids)
    pads = slice(SEQ - 3, None) if side == "right" else slice(0, 3)
    mask[1, pads] = 0
    labels[1, pads] = -100
    compare(reference, patched, input_ids=ids, attention_mask=mask, labels=labels)


def test_logits_softcapped_as_transformers():
    """In evaluation (and without labels) the logits are Hugging Face's: final norm, LM head, softcap."""
    torch.manual_seed(5)
    reference = tiny_gemma2()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(3)
    reference.eval(), patched.eval()
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels)
        got = patched(input_ids=ids, labels=labels)
        assert rel(got.loss, want.loss) < TOL
        assert want.logits.abs().max() < reference.config.final_logit_softcapping  # capped
        assert rel(got.logits, want.logits) < TOL
        assert rel(patched(input_ids=ids).logits, want.logits) < TOL


def test_three_adamw_steps_alike():
    torch.manual_seed(3)
    reference = tiny_gemma2()
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
    reference = tiny_gemma2(tie_word_embeddings=False)
    patched = apply_codagen(copy.deepcopy(reference))
    state = patched.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    patched.save_pretrained(tmp_path)
    reloaded = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    again = AutoCodagenForCausalLM.from_pretrained(tmp_path).to(DEVICE)  # the checkpoint's family: Gemma-2
    assert type(again).__name__ == "Gemma2ForCausalLM" and hasattr(again.model, "codagen_patch")
    ids, labels = tokens_and_labels(5)
    with torch.no_grad():
        assert rel(again(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
    # a Hugging Face state dict loads into a patched model (load_state_dict, strict)
    other = apply_codagen(tiny_gemma2(tie_word_embeddings=False))
    other.load_state_dict(reference.state_dict())
    for name, p in patched.named_parameters():
        assert torch.equal(dict(other.named_parameters())[name], p), name


@pytest.mark.parametrize("overrides, message", [
    ({"attention_bias": True}, "config.attention_bias = True is not supported: o_proj's bias comes before the "
                               "post-attention norm"),
    ({"use_bidirectional_attention": True}, "config.use_bidirectional_attention = True is not supported: the patched "
                                            "decoder is causal"),
    ({"final_logit_softcapping": None}, "config.final_logit_softcapping = None is not supported: the Gemma-2 loss "
                                        "block softcaps the logits"),
    ({"layer_types": ["sliding_attention", "full_attention", "chunked_attention"]},
     "config.layer_types = ['sliding_attention', 'full_attention', 'chunked_attention'] is not supported"),
    ({"sliding_window": None}, "config.sliding_window = None is not supported: layer_types ['sliding_attention', "
                               "'full_attention', 'sliding_attention'] has sliding_attention layers"),
    ({"hidden_activation": "gelu"}, "config.hidden_activation = 'gelu' is not supported: the MLP kernels compute "
                                    "GeGLU with gelu_pytorch_tanh only"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.rope_parameters['rope_type'] = 'dynamic' is not supported"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "config.num_key_value_heads = 3 is not supported"),
])
def test_refused_configurations_name_the_field(overrides, message):
    model = tiny_gemma2(**overrides)
    layers = list(model.model.layers)
    with pytest.raises(CodagenConfigError, match="^apply_codagen: " + message.replace("[", r"\[").replace("(", r"\(")):
        apply_codagen(model)
    assert list(model.model.layers) == layers  # refused: nothing changed


def test_attention_that_drops_the_softcap_is_refused():
    """transformers refuses SDPA for Gemma-2 itself; a config that names it anyway is refused too (SDPA has no
    softcap), and is accepted without attn_logit_softcapping."""
    model = tiny_gemma2()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(CodagenConfigError, match=r"^apply_codagen: config\._attn_implementation = 'sdpa' is not "
                                                 r"supported: its attention function drops attn_logit_softcapping"):
        apply_codagen(model)
    model.config.attn_logit_softcapping = None
    apply_codagen(model)


def test_modified_feedforward_norm_is_refused():
    patched = apply_codagen(tiny_gemma2())
    patched.model.layers[2].post_feedforward_layernorm = torch.nn.Identity()
    ids, labels = tokens_and_labels()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.2\.post_feedforward_layernorm is a "
                                        r".*Identity"):
        patched(input_ids=ids, labels=labels)


def test_gemma3_text_model_is_refused_naming_what_does_not_fit(tmp_path, monkeypatch):
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip("this transformers has no Gemma-3")
    config = transformers.Gemma3TextConfig(**BASE)
    model = transformers.Gemma3ForCausalLM(config)
    why = r"^apply_codagen: a transformers Gemma3ForCausalLM is not supported: its layers do not fit the Gemma-2 blocks"
    with pytest.raises(TypeError, match=why + r".*q_norm.*RoPE frequencies.*final_logit_softcapping"):
        apply_codagen(model)
    model.save_pretrained(tmp_path)

    def load(*args, **kwargs):
        raise AssertionError("loaded a checkpoint that is refused")

    monkeypatch.setattr(transformers.Gemma3ForCausalLM, "from_pretrained", load)
    with pytest.raises(TypeError, match=why):  # before loading its weights
        AutoCodagenForCausalLM.from_pretrained(tmp_path)
    # its text decoder and the classifier over it: the same reason, not the list of supported classes
    for name in ("Gemma3TextModel", "Gemma3TextForSequenceClassification"):
        with pytest.raises(TypeError, match=f"^apply_codagen: a transformers {name} is not supported: its layers do "
                                            "not fit the Gemma-2 blocks"):
            apply_codagen(getattr(transformers, name)(config))


def test_gemma2_mapping_names_transformers_modules_and_weights():
    """codagen/models/gemma2.py's HF: its classes, modules and the weights each block is fed are transformers'."""
    from transformers.models.gemma2 import modeling_gemma2

    from codagen import models

    gemma2 = models.family("gemma2")
    hf = gemma2.hf
    model = tiny_gemma2(tie_word_embeddings=False)
    assert type(model).__name__ == hf.model_class and modeling_gemma2.__name__ == hf.modeling

    def kind(name):
        return getattr(torch.nn, name) if name in ("Linear", "Embedding") else getattr(modeling_gemma2, name)

    for name, cls in hf.model_modules.items():
        assert type(model.model.get_submodule(name)) is kind(cls), name
    for name, cls in hf.layer_modules.items():
        assert type(model.model.layers[0].get_submodule(name)) is kind(cls), name
    assert set(hf.read) <= set(hf.model_modules) | set(hf.layer_modules)
    assert set(hf.layer_norms) <= set(hf.read)
    attention = model.model.layers[0].self_attn
    assert all(hasattr(attention, name) for name in hf.attention_args.values())
    weights = dict(model.named_parameters(), **{"lm_head.weight": model.lm_head.weight})
    layer = {n.removeprefix("model.layers.0."): p for n, p in weights.items() if n.startswith("model.layers.0.")}
    assert set(hf.feeds) == set(gemma2.blocks)
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
    compare_under_autocast(tiny_gemma2(), *tokens_and_labels(7))


def test_gradient_checkpointing_gives_the_unpatched_gradients(monkeypatch):
    torch.manual_seed(9)
    compare_checkpointed(tiny_gemma2(), *tokens_and_labels(9), monkeypatch)
