"""apply_codagen(model, fp8=True) (docs/fp8.md, "FP8 in apply_codagen"): a transformers Llama whose q/k/v, gate/up and
down projections run the FP8 blocks (pre_attention_fp8, post_attention_fp8, norm_stats_fp8), against the unpatched model
in fp32 within FP8's error; the weights' FP8 copies made again after an optimizer step, and only then; what is
refused, before anything is patched."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import CodagenConfigError, CodagenDecoderLayer, apply_codagen  # noqa: E402
from codagen.runtime import fp8 as runtime_fp8  # noqa: E402
from conftest import DEVICE  # noqa: E402
from test_hf import BASE, hf_layout_grads, labelled_tokens, random_model, rel  # noqa: E402

BF16 = torch.bfloat16
# the FP8 blocks quantize in groups of 128 columns: hidden 128, 4 heads of 32, intermediate 256
FP8_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
VOCAB, BATCH, SEQ = BASE["vocab_size"], 2, 12
# measured on eight draws of these models (Llama and Mistral, the MLP's three projections in FP8): the loss within
# 5.0e-3 (relative) of fp32's, the gradients within 0.219 (q_proj's and k_proj's of the second layer, whose input
# has passed four FP8 GEMMs); e4m3 keeps 2^-4 of each value, which the forward carries into every gradient. Twice
# that and more, as bounds: a misplaced scale is off by O(1)
LOSS_TOL, GRAD_TOL = 2e-2, 0.45


def fp8_llama(**overrides):
    return random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**BASE, **FP8_SHAPE, **overrides}))


def fp8_model(family: str):
    """Llama; Qwen2 (q/k/v biases, added after the FP8 projection); Mistral (a sliding window shorter than the
    sequence): the families whose layers run Llama's blocks."""
    if family == "Llama":
        return fp8_llama()
    config = getattr(transformers, f"{family}Config")(**{**BASE, **FP8_SHAPE},
                                                     **({"sliding_window": SEQ - 4} if family == "Mistral" else {}))
    return random_model(getattr(transformers, f"{family}ForCausalLM"), config)


def grads_against(reference, model, ids, labels, autocast=False):
    """model's loss and gradients (Hugging Face names) against reference's (fp32): their relative errors."""
    reference.zero_grad(set_to_none=True)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    with torch.autocast(DEVICE.type, BF16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    got = hf_layout_grads(model)
    return rel(loss, want), {n: rel(got[n], p.grad) for n, p in reference.named_parameters()}


@pytest.mark.parametrize("family, precision", [("Llama", "bf16"), ("Llama", "amp"), ("Qwen2", "bf16"),
                                               ("Mistral", "bf16")])
def test_fp8_model_matches_transformers_within_fp8_error(family, precision):
    """bf16 parameters, and fp32 ones under torch.autocast(bfloat16) (the FP8 copies made from the fp32 master
    weights): the loss and every gradient against the fp32 unpatched model; the FP8 blocks are the ones that ran."""
    reference = fp8_model(family)
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ)
    model = copy.deepcopy(reference)
    model = apply_codagen(model.to(BF16) if precision == "bf16" else model, fp8=True)
    loss_err, grad_errs = grads_against(reference, model, ids, labels, autocast=precision == "amp")
    assert loss_err < LOSS_TOL
    assert max(grad_errs.values()) < GRAD_TOL, grad_errs
    for layer in model.model.layers:  # each layer's qkv_proj, gate_up_proj and down_proj weights, quantized once
        copies = layer.__dict__["_codagen_fp8_copies"]
        assert [c.weight for c in copies] == [layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight,
                                              layer.mlp.down_proj.weight]
    # the same model patched without fp8 computes another loss: the FP8 blocks ran
    plain = apply_codagen(copy.deepcopy(reference).to(BF16))
    if precision == "bf16":
        assert model(input_ids=ids, labels=labels).loss.item() != plain(input_ids=ids, labels=labels).loss.item()


def test_fp8_weights_are_quantized_again_after_a_step_and_only_then(monkeypatch):
    """A forward quantizes each FP8 weight once; a second forward without a change none; after an optimizer step
    (in place, the weights' versions bumped) each again, and the loss is that of the model patched afresh with the
    stepped weights, bit for bit."""
    calls = []
    quantize = runtime_fp8.quantize_blocks
    monkeypatch.setattr(runtime_fp8, "quantize_blocks", lambda w, *a: calls.append(w.shape) or quantize(w, *a))
    model = apply_codagen(fp8_llama().to(BF16), fp8=True)
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=labels).loss.backward()
    layers = len(model.model.layers)
    assert len(calls) == 3 * layers
    model(input_ids=ids, labels=labels)
    assert len(calls) == 3 * layers
    optimizer.step()
    loss = model(input_ids=ids, labels=labels).loss
    assert len(calls) == 6 * layers
    fresh = apply_codagen(fp8_llama().to(BF16), fp8=True)
    fresh.load_state_dict(model.state_dict())
    assert fresh(input_ids=ids, labels=labels).loss.item() == loss.item()


def test_fp8_refusals_say_what_and_patch_nothing():
    qwen3 = random_model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**{**BASE, **FP8_SHAPE}))
    with pytest.raises(TypeError, match=r"^apply_codagen\(fp8=True\): codagen has no FP8 blocks for Qwen3ForCausalLM "
                                        r"yet \(it has them for LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM\)"):
        apply_codagen(qwen3, fp8=True)
    biased = fp8_llama(mlp_bias=True)
    with pytest.raises(CodagenConfigError, match=r"config\.mlp_bias = True is not supported: the FP8 MLP block"):
        apply_codagen(biased, fp8=True)
    narrow = fp8_llama(intermediate_size=192)
    with pytest.raises(CodagenConfigError, match=r"config\.intermediate_size = 192 is not supported: the FP8 blocks "
                                                 r"quantize in groups of 128 columns"):
        apply_codagen(narrow, fp8=True)
    with pytest.raises(ValueError, match=r"fp8 must be True or False, got 'yes'"):
        apply_codagen(fp8_llama(), fp8="yes")
    for model in (qwen3, biased, narrow):
        assert not any(isinstance(layer, CodagenDecoderLayer) for layer in model.model.layers)
    # fp32 parameters without autocast: at the forward, saying what to do
    model = apply_codagen(fp8_llama(), fp8=True)
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ)
    with pytest.raises(TypeError, match=r"the FP8 blocks run in bfloat16, and the hidden states are torch\.float32; "
                                        r"use bfloat16 parameters, or call the model under torch\.autocast"):
        model(input_ids=ids, labels=labels)


def test_fp8_refuses_lora():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(fp8_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    with pytest.raises(TypeError, match=r"^apply_codagen\(fp8=True\): a PEFT \(LoRA\) model is not supported"):
        apply_codagen(model, fp8=True)
    with pytest.raises(TypeError, match=r"^apply_codagen\(fp8=True\): LoRA adapters are not supported"):
        apply_codagen(model.get_base_model(), fp8=True)


def test_compiled_fp8_model_is_one_graph_with_the_eager_loss_and_gradients():
    """torch.compile over an FP8-patched model: one graph with no break (the weights' FP8 copies are quantized in
    the graph, once per forward, instead of looked up in the copies kept outside it), the loss and the gradients of
    the model run eagerly. On the CPU the backend is aot_eager."""
    eager = apply_codagen(fp8_llama().to(BF16), fp8=True)
    compiled = copy.deepcopy(eager)
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled)(input_ids=ids, labels=labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    losses = []
    for model in (eager, step):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    torch._dynamo.reset()
    assert losses[0] == losses[1]
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad), name
