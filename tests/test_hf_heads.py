"""apply_codagen on the families' heads (<Family>ForSequenceClassification, <Family>ForTokenClassification,
<Family>ForQuestionAnswering) and on their decoder alone (<Family>Model): the decoder layers run codagen's blocks,
the head and its loss stay transformers' own. Against the same model unpatched, fp32: loss, logits and every
parameter gradient within 1e-4 relative, with padding (sequence classification pools the last token that is not
padding), regression and multi-label losses, start and end logits and the span loss, three AdamW steps alike, a
PEFT LoRA classifier and question-answering model (the head trained whole), the AutoCodagen classes of the heads
and the decoder on checkpoints saved by transformers, and the heads that are refused."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
import codagen.hf  # noqa: E402
from codagen.hf import CodagenDecoderLayer, apply_codagen  # noqa: E402
from test_hf import BASE, hf_layout_grads, random_model, rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ, PAD, LABELS = 97, 3, 10, 0, 3
TOL = 1e-4
# each family's config (class prefix -> its config's overrides of test_hf's BASE, its norms' center)
FAMILIES = {
    "Llama": ({"attention_bias": True}, 1.0),
    "Qwen2": ({"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, 1.0),
    "Mistral": ({"sliding_window": 4}, 1.0),
    "Qwen3": ({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}, 1.0),
    "Gemma2": ({"num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 4,
                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "attn_implementation": "eager"}, 0.0),
}


def tiny(family: str, head: str = "ForSequenceClassification", **overrides):
    config_overrides, norm_center = FAMILIES[family]
    config = getattr(transformers, family + "Config")(**{**BASE, "pad_token_id": PAD, "num_labels": LABELS,
                                                         **config_overrides, **overrides})
    return random_model(getattr(transformers, family + head), config, norm_center=norm_center)


def padded_batch(seed: int, labels: str = "sequence"):
    """Rows of 10, 6 and 8 tokens: right, left and right padding with the pad token, masked; labels per sequence
    (a class), per token (-100 on padding), "regression" (one float), "multi_label" (floats, one per class) or
    "span" (an answer's start and end positions within each row's tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)  # 0 is the pad token
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 8:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    if labels == "sequence":
        y = torch.randint(0, LABELS, (BATCH,), generator=g)
    elif labels == "token":
        y = torch.randint(0, LABELS, (BATCH, SEQ), generator=g).masked_fill(mask == 0, -100)
    elif labels == "regression":
        y = torch.randn(BATCH, 1, generator=g)
    elif labels == "span":
        start = torch.tensor([2, 5, 0]) + torch.randint(0, 3, (BATCH,), generator=g)
        end = start + torch.randint(0, 3, (BATCH,), generator=g)
        return dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), start_positions=start.to(DEVICE),
                    end_positions=end.to(DEVICE))
    else:
        y = (torch.rand(BATCH, LABELS, generator=g) > 0.5).float()
    return dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), labels=y.to(DEVICE))


def compare(reference, patched, inputs, seed=0, fields=("logits",), zero_grads=()):
    """Loss, the output's logits (`fields`) and every parameter's gradient (Hugging Face's names and layout) within
    TOL; `zero_grads`: gradients that are zero in exact arithmetic, rounding noise in both models."""
    outputs = []
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the token classifier's dropout: the same mask
        out = model(**inputs)
        out.loss.backward()
        outputs.append(out)
    (expected, got) = outputs
    assert rel(got.loss, expected.loss) < TOL, (got.loss.item(), expected.loss.item())
    for field in fields:
        a, b = getattr(got, field), getattr(expected, field)
        assert a.shape == b.shape and rel(a, b) < TOL, field
    grads = hf_layout_grads(patched)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        if name in zero_grads:
            assert max(grads[name].abs().max(), g.abs().max()) < 1e-6, name
        else:
            assert rel(grads[name], g) < TOL, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sequence_classification_matches_transformers(family):
    torch.manual_seed(1)
    reference = tiny(family)
    patched = apply_codagen(copy.deepcopy(reference))
    assert all(isinstance(layer, CodagenDecoderLayer) for layer in patched.model.layers)
    assert type(patched.score) is torch.nn.Linear and patched.forward.__func__ is type(reference).forward
    compare(reference, patched, padded_batch(1))


def test_hidden_states_through_the_head():
    """output_hidden_states, which the head passes to its decoder, comes back as transformers'."""
    torch.manual_seed(7)
    reference = tiny("Qwen2")
    patched = apply_codagen(copy.deepcopy(reference))
    inputs = padded_batch(7)
    with torch.no_grad():
        expected = reference(**inputs, output_hidden_states=True)
        got = patched(**inputs, output_hidden_states=True)
    assert rel(got.logits, expected.logits) < TOL
    assert len(got.hidden_states) == len(expected.hidden_states) == 4
    for a, b in zip(got.hidden_states, expected.hidden_states):
        assert rel(a, b) < TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_classification_matches_transformers(family):
    torch.manual_seed(2)
    reference = tiny(family, "ForTokenClassification")
    patched = apply_codagen(copy.deepcopy(reference))
    for model in (reference, patched):
        model.train()  # the classifier's dropout (0.1) on
    compare(reference, patched, padded_batch(2, "token"))


@pytest.mark.parametrize("problem", ["regression", "multi_label"])
def test_regression_and_multi_label_losses(problem):
    torch.manual_seed(3)
    overrides = {"num_labels": 1} if problem == "regression" else {"problem_type": "multi_label_classification"}
    reference = tiny("Llama", **overrides)
    patched = apply_codagen(copy.deepcopy(reference))
    compare(reference, patched, padded_batch(3, problem))


@pytest.mark.parametrize("family, head, checkpointing", [
    ("Llama", "ForSequenceClassification", False),
    ("Llama", "ForSequenceClassification", True),
    ("Mistral", "ForTokenClassification", False),
    ("Qwen3", "ForTokenClassification", False),
])
def test_training_steps_match_transformers(family, head, checkpointing):
    """Three AdamW steps on fresh batches (the token classifier's dropout masks the same in both): the losses and
    then every parameter alike (the fused projections' in Hugging Face's layout, through state_dict)."""
    torch.manual_seed(4)
    reference = tiny(family, head)
    patched = apply_codagen(copy.deepcopy(reference))
    labels = "token" if head == "ForTokenClassification" else "sequence"
    losses = {}
    for key, model in (("reference", reference), ("patched", patched)):
        if checkpointing:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            torch.manual_seed(step)
            loss = model(**padded_batch(10 + step, labels), use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.setdefault(key, []).append(loss.item())
    for got, expected in zip(losses["patched"], losses["reference"]):
        assert abs(got - expected) / abs(expected) < TOL
    assert losses["reference"][0] != losses["reference"][-1]  # the steps changed the model
    expected = reference.state_dict()
    state = patched.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert rel(state[name], value) < TOL, name


def test_the_decoder_alone():
    """<Family>Model patched by itself: last_hidden_state and the gradients of a loss on it are transformers'."""
    torch.manual_seed(5)
    reference = tiny("Llama", "Model")
    patched = apply_codagen(copy.deepcopy(reference))
    inputs = padded_batch(5)
    del inputs["labels"]
    outputs = []
    for model in (reference, patched):
        out = model(**inputs)
        out.last_hidden_state.square().mean().backward()
        outputs.append(out.last_hidden_state)
    assert rel(outputs[1], outputs[0]) < TOL

    class Wrapped(torch.nn.Module):  # hf_layout_grads reads model.model
        def __init__(self, model):
            super().__init__()
            self.model = model
    grads = hf_layout_grads(Wrapped(patched))
    for name, p in reference.named_parameters():
        assert rel(grads["model." + name], p.grad) < TOL, name


@pytest.mark.parametrize("task, head, labels, trained", [
    ("SEQ_CLS", "ForSequenceClassification", "sequence", "score"),
    ("QUESTION_ANS", "ForQuestionAnswering", "span", "qa_outputs"),
])
def test_peft_lora_heads(task, head, labels, trained):
    """PEFT's LoRA for sequence classification and question answering (task_type SEQ_CLS, QUESTION_ANS: adapters
    on the projections, the head trained whole as a module to save; the question-answering head's decoder is
    `transformer`): patched, the loss and every trainable gradient are the unpatched PEFT model's (qa_outputs' bias
    has a gradient of zero in exact arithmetic: rounding noise in both)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(6)
    config = peft.LoraConfig(task_type=task, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    reference = peft.get_peft_model(tiny("Llama", head), config)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    patched = apply_codagen(copy.deepcopy(reference))
    base = patched.get_base_model()
    assert all(isinstance(layer, CodagenDecoderLayer) for layer in getattr(base, base.base_model_prefix).layers)
    inputs = padded_batch(6, labels)
    losses = []
    for model in (reference, patched):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) < TOL
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert got.keys() == expected.keys() and any(trained in n for n in got) and any("lora_" in n for n in got)
    for name, g in expected.items():
        if name.endswith("qa_outputs.modules_to_save.default.bias"):
            assert max(got[name].abs().max(), g.abs().max()) < 1e-6, name
        else:
            assert rel(got[name], g) < TOL, name


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral", "Qwen3"])
def test_question_answering_matches_transformers(family):
    """<Family>ForQuestionAnswering (Gemma-2 has none), whose decoder is `transformer` (Llama, Qwen2, Qwen3: their
    base_model_prefix) or `model` (Mistral): start and end logits, the span loss and every gradient (the bias of
    qa_outputs adds the same to every position's logit, which the softmax over positions cancels: its gradient is
    zero)."""
    torch.manual_seed(8)
    reference = tiny(family, "ForQuestionAnswering")
    patched = apply_codagen(copy.deepcopy(reference))
    decoder = getattr(patched, patched.base_model_prefix)
    assert all(isinstance(layer, CodagenDecoderLayer) for layer in decoder.layers)
    compare(reference, patched, padded_batch(8, "span"), fields=("start_logits", "end_logits"),
            zero_grads=("qa_outputs.bias",))
    # as Trainer calls a model whose forward takes loss keywords: num_items_in_batch reaches the patched decoder
    counted = {**padded_batch(9, "span"), "num_items_in_batch": torch.tensor(2 * BATCH, device=DEVICE)}
    compare(reference, patched, counted, fields=("start_logits", "end_logits"), zero_grads=("qa_outputs.bias",))


@pytest.mark.parametrize("auto, family, head, labels", [
    ("AutoCodagenForSequenceClassification", "Qwen3", "ForSequenceClassification", "sequence"),
    ("AutoCodagenForTokenClassification", "Mistral", "ForTokenClassification", "token"),
    ("AutoCodagenForQuestionAnswering", "Llama", "ForQuestionAnswering", "span"),
])
def test_auto_classes_load_a_saved_head(tmp_path, auto, family, head, labels):
    """A head saved by transformers loads through its AutoCodagen class as the family's head, patched, and computes
    what the saved model computes; saved again, it loads into plain transformers with the same weights."""
    torch.manual_seed(12)
    reference = tiny(family, head)
    reference.save_pretrained(tmp_path / "saved")
    loaded = getattr(codagen.hf, auto).from_pretrained(tmp_path / "saved").to(DEVICE)
    assert type(loaded) is type(reference)
    assert all(isinstance(layer, CodagenDecoderLayer) for layer in getattr(loaded, loaded.base_model_prefix).layers)
    for model in (reference, loaded):
        model.train()  # the token classifier's dropout, the same masks in both
    compare(reference, loaded, padded_batch(12, labels), fields=("start_logits", "end_logits") if labels == "span"
            else ("logits",), zero_grads=("qa_outputs.bias",))
    loaded.save_pretrained(tmp_path / "again")
    again = type(reference).from_pretrained(tmp_path / "again").to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_auto_classes_make_a_head_of_a_causal_lm_and_load_its_decoder(tmp_path):
    """As transformers' AutoModelForSequenceClassification: a causal LM's checkpoint gives the family's head with a
    new score (num_labels from the keyword arguments) on the saved decoder; AutoCodagenModel gives the decoder
    alone, whose last_hidden_state is the saved model's."""
    torch.manual_seed(13)
    tiny("Gemma2", "ForCausalLM").save_pretrained(tmp_path)
    torch.manual_seed(14)
    expected = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=5).to(DEVICE)
    torch.manual_seed(14)  # the same new score weights
    got = codagen.hf.AutoCodagenForSequenceClassification.from_pretrained(tmp_path, num_labels=5).to(DEVICE)
    assert type(got) is transformers.Gemma2ForSequenceClassification and got.score.out_features == 5
    inputs = padded_batch(13)
    del inputs["labels"]
    with torch.no_grad():
        assert rel(got(**inputs).logits, expected(**inputs).logits) < TOL
        decoder = codagen.hf.AutoCodagenModel.from_pretrained(tmp_path).to(DEVICE)
        assert type(decoder) is transformers.Gemma2Model
        assert rel(decoder(**inputs).last_hidden_state, expected.model(**inputs).last_hidden_state) < TOL


def test_auto_classes_refuse_before_loading(tmp_path):
    """A checkpoint of a family without that head (Gemma-2 has no question-answering head), or of a model type of no
    family, is refused from its config, naming why, and so are the LM head's options; the folders hold no weights,
    so a load would fail otherwise."""
    transformers.Gemma2Config(**BASE).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(TypeError, match=r"^AutoCodagenForQuestionAnswering.from_pretrained: .* is a 'gemma2' model, "
                                        r"and transformers has no Gemma2ForQuestionAnswering$"):
        codagen.hf.AutoCodagenForQuestionAnswering.from_pretrained(tmp_path / "gemma2")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(TypeError, match=r"^AutoCodagenForTokenClassification.from_pretrained: .* is a 'gpt2' model; "
                                        r"codagen patches the model types 'llama', "):
        codagen.hf.AutoCodagenForTokenClassification.from_pretrained(tmp_path / "gpt2")
    with pytest.raises(TypeError, match=r"^AutoCodagenModel.from_pretrained takes no chunk_rows: options of the LM head"):
        codagen.hf.AutoCodagenModel.from_pretrained(tmp_path / "gemma2", chunk_rows=512)


def test_other_heads_are_refused_by_name():
    """A head of a model that is not of a family, and one whose decoder is not the family's, are refused, not run
    unpatched."""
    with pytest.raises(TypeError, match=r"^apply_codagen: expected a transformers LlamaForCausalLM, .*"
                                        r"<Family>ForSequenceClassification, <Family>ForTokenClassification or "
                                        r"<Family>ForQuestionAnswering .*got GPT2ForQuestionAnswering$"):
        apply_codagen(transformers.GPT2ForQuestionAnswering(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**BASE))
    model.model = transformers.MistralModel(transformers.MistralConfig(**BASE))
    with pytest.raises(TypeError, match=r"^apply_codagen: model is a .*MistralModel, not LlamaModel"):
        apply_codagen(model)
