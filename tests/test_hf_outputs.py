"""output_hidden_states and output_attentions on a patched model, against the same model unpatched (fp32, 1e-4
relative): the hidden states (the decoder's input, each layer's output, the last one the final norm's), also
selected by index, from the causal LM (with and without labels), from the decoder itself and from the config; a
loss that reads them gives transformers' gradients; the attention weights where the attention function returns
them (eager), none where it does not (SDPA), as transformers; under autocast the hidden states in transformers'
dtypes. Llama, Qwen3 (QK-norm) and Gemma-2 (scaled embeddings, sandwich norms, softcaps)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import apply_codagen  # noqa: E402
from test_hf import BASE, hf_layout_grads, labelled_tokens, random_model, rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 97, 2, 10
TOL = 1e-4
FAMILIES = {
    "llama": lambda **o: random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**BASE, **o})),
    # QK-norm; head_dim 128, the column group of the Qwen3 kernels
    "qwen3": lambda **o: random_model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**{
        **BASE, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, **o})),
    # three layers: sliding and full; Gemma's norm weights are scales of 1 + w
    "gemma2": lambda **o: random_model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**{
        **BASE, "num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 4,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "pad_token_id": 0,
        "attn_implementation": "eager", **o}), norm_center=0.0),
}


def pair(name, **overrides):
    torch.manual_seed(11)
    reference = FAMILIES[name](**overrides)
    return reference, apply_codagen(copy.deepcopy(reference))


def assert_states_match(got, expected):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert (a is None) == (b is None), i
        if b is not None:
            assert a.shape == b.shape and rel(a, b) < TOL, (i, rel(a, b))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hidden_states_and_their_gradients_are_transformers(name):
    """A training step whose loss reads the hidden states too (a term on a middle layer's output and one on the
    last, the final norm's): every hidden state, the loss and every gradient are transformers'."""
    reference, patched = pair(name, attn_implementation="eager")
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ, 1)
    results = []
    for model in (reference, patched):
        model.train()
        out = model(input_ids=ids, labels=labels, output_hidden_states=True)
        states = out.hidden_states
        assert len(states) == model.config.num_hidden_layers + 1
        loss = out.loss + states[1].square().mean() + 0.5 * states[-1].square().mean()
        loss.backward()
        results.append((loss, states))
    (ref_loss, ref_states), (loss, states) = results
    assert rel(loss, ref_loss) < TOL
    assert_states_match(states, ref_states)
    assert torch.equal(states[0], reference.get_input_embeddings()(ids)) or name == "gemma2"  # Gemma scales them
    got = hf_layout_grads(patched)
    for n, p in reference.named_parameters():
        assert rel(got[n], p.grad) < TOL, n


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_selected_hidden_states_from_the_decoder_and_the_config(name):
    """output_hidden_states as indices (None where one is not selected), from the causal LM without labels and from
    its decoder (the base model), as a tuple with return_dict=False; and config.output_hidden_states."""
    reference, patched = pair(name)
    ids, _ = labelled_tokens(VOCAB, BATCH, SEQ, 2)
    with torch.no_grad():
        for selection in (True, [0, -1], -2, [1]):
            expected = reference(input_ids=ids, output_hidden_states=selection)
            got = patched(input_ids=ids, output_hidden_states=selection)
            assert rel(got.logits, expected.logits) < TOL
            assert_states_match(got.hidden_states, expected.hidden_states)
            expected = reference.model(input_ids=ids, output_hidden_states=selection)
            got = patched.model(input_ids=ids, output_hidden_states=selection)
            assert_states_match(got.hidden_states, expected.hidden_states)
        # as a tuple: (last_hidden_state, cache, hidden_states) in transformers' order
        expected = reference.model(input_ids=ids, output_hidden_states=True, return_dict=False, use_cache=False)
        got = patched.model(input_ids=ids, output_hidden_states=True, return_dict=False, use_cache=False)
        assert len(got) == len(expected) == 2
        assert rel(got[0], expected[0]) < TOL
        assert_states_match(got[1], expected[1])
        for model in (reference, patched):
            model.config.output_hidden_states = True
        expected, got = reference(input_ids=ids), patched(input_ids=ids)
        assert got.hidden_states is not None
        assert_states_match(got.hidden_states, expected.hidden_states)
        # the argument wins over the config
        assert patched(input_ids=ids, output_hidden_states=False).hidden_states is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_attention_weights_are_transformers(name):
    """output_attentions with eager attention: each layer's weights (q and k in codagen's interleaved column order,
    the same for both, leave q . k as it is), with and without labels; with SDPA none, as transformers returns
    none there."""
    reference, patched = pair(name, attn_implementation="eager")
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ, 3)
    with torch.no_grad():
        for kwargs in ({}, {"labels": labels}):
            expected = reference(input_ids=ids, output_attentions=True, **kwargs)
            got = patched(input_ids=ids, output_attentions=True, **kwargs)
            assert got.hidden_states is None
            assert len(got.attentions) == reference.config.num_hidden_layers
            assert_states_match(got.attentions, expected.attentions)
    if name == "gemma2":
        return  # Gemma-2's softcap has no SDPA
    reference, patched = pair(name, attn_implementation="sdpa")
    with torch.no_grad():
        expected = reference(input_ids=ids, output_attentions=True, output_hidden_states=True)
        got = patched(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert expected.attentions == got.attentions == ()
    assert_states_match(got.hidden_states, expected.hidden_states)


def test_hidden_states_under_gradient_checkpointing():
    reference, patched = pair("llama")
    ids, labels = labelled_tokens(VOCAB, BATCH, SEQ, 4)
    results = []
    for model in (reference, patched):
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        out = model(input_ids=ids, labels=labels, output_hidden_states=True, output_attentions=True, use_cache=False)
        (out.loss + out.hidden_states[1].mean()).backward()
        results.append(out)
    assert_states_match(results[1].hidden_states, results[0].hidden_states)
    assert results[0].attentions == results[1].attentions == ()  # SDPA
    got = hf_layout_grads(patched)
    for n, p in reference.named_parameters():
        assert rel(got[n], p.grad) < TOL, n


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_hidden_states_under_autocast_keep_transformers_dtypes(name):
    """Under torch.autocast(bf16) on an fp32 model the blocks run in bf16 while transformers keeps its residual stream
    in fp32: the hidden states come back in transformers' dtypes (each layer's output cast back to the residual's
    fp32, the final norm run on it; from the causal LM, from its decoder and with the logits), their values within
    bf16's precision of transformers'."""
    reference, patched = pair(name)
    ids, _ = labelled_tokens(VOCAB, BATCH, SEQ, 5)
    results = []
    with torch.no_grad(), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        for model in (reference, patched):
            results.append((model(input_ids=ids, output_hidden_states=True), model.model(input_ids=ids)))
    (expected, expected_decoder), (got, got_decoder) = results
    assert [h.dtype for h in got.hidden_states] == [h.dtype for h in expected.hidden_states]
    assert got.logits.dtype == expected.logits.dtype
    assert got_decoder.last_hidden_state.dtype == expected_decoder.last_hidden_state.dtype == torch.float32
    for a, b in zip(got.hidden_states, expected.hidden_states):
        assert rel(a, b) < 2e-2, rel(a, b)
    assert rel(got_decoder.last_hidden_state, expected_decoder.last_hidden_state) < 2e-2
