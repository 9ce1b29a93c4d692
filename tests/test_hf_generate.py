"""generate() on a patched model with transformers' KV cache: greedy tokens and every step's logits equal the unpatched
model's (fp32, tiny, several layers, a batch with left padding), for Llama, Qwen2, Mistral and Qwen3 (sliding-window
layers over more positions than the window) and Gemma-2 (sliding and full layers, softcaps); each step after the
prompt runs the new token only (the cache holds the rest), with a static cache too, and with PEFT's LoRA adapters;
and a cache that the patched model cannot fill exactly is refused."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.hf import apply_codagen  # noqa: E402
from test_hf import DEVICE, rel, tiny_llama  # noqa: E402
from test_hf_gemma2 import tiny_gemma2  # noqa: E402
from test_hf_mistral import tiny_mistral  # noqa: E402
from test_hf_qwen2 import SLIDING, tiny_qwen2  # noqa: E402
from test_hf_qwen3 import tiny_qwen3  # noqa: E402

VOCAB, PROMPT, NEW = 97, 7, 5
TOL = 1e-4


def left_padded_prompts(seed):
    """Three prompts of 7, 4 and 6 tokens, left-padded with token 0 (the configs' pad_token_id), drawn fresh."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((PROMPT, 4, 6)):
        ids[row, : PROMPT - length] = 0
        mask[row, : PROMPT - length] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def greedy(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)


def layer_rows(model):
    """The [batch, seq] of the first decoder layer's input at each call, recorded by a forward hook."""
    seen = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape[:2])))
    return seen


@pytest.mark.parametrize("make", [
    pytest.param(lambda: tiny_llama(num_hidden_layers=3, attention_bias=True, pad_token_id=0), id="llama"),
    # layer 0 full, layers 1 and 2 over the last 4 positions: prompt and new tokens are 12
    pytest.param(lambda: tiny_qwen2(pad_token_id=0, **SLIDING), id="qwen2-sliding"),
    # every layer over the last 4 positions
    pytest.param(lambda: tiny_mistral(pad_token_id=0), id="mistral-sliding"),
    pytest.param(lambda: tiny_gemma2(), id="gemma2"),
    # Qwen3PreAttention (QK-norm); layer 1 over the last 4 positions
    pytest.param(lambda: tiny_qwen3(pad_token_id=0, vocab_size=VOCAB, use_sliding_window=True, sliding_window=4,
                                    max_window_layers=1), id="qwen3-sliding"),
])
def test_greedy_generate_with_the_kv_cache_is_transformers(make):
    torch.manual_seed(11)
    reference = make().eval()
    patched = apply_codagen(copy.deepcopy(reference)).eval()
    ids, mask = left_padded_prompts(12)
    expected = greedy(reference, ids, mask)
    rows = layer_rows(patched)
    got = greedy(patched, ids, mask)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.logits) == len(expected.logits) == NEW
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        assert rel(a, b) < TOL, step
    # the prompt once, then one token per step: the cache holds the positions before it
    assert rows == [(3, PROMPT)] + [(3, 1)] * (NEW - 1)
    assert type(got.past_key_values if hasattr(got, "past_key_values") else got.cache).__name__ == "DynamicCache"


def test_greedy_generate_with_a_static_cache_is_transformers():
    """cache_implementation="static": transformers' StaticCache (preallocated, its length counted on the device),
    filled through the same cache.update."""
    torch.manual_seed(18)
    reference = tiny_llama(num_hidden_layers=2, pad_token_id=0).eval()
    patched = apply_codagen(copy.deepcopy(reference)).eval()
    ids, mask = left_padded_prompts(19)
    expected = greedy(reference, ids, mask, cache_implementation="static")
    rows = layer_rows(patched)
    got = greedy(patched, ids, mask, cache_implementation="static")
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        assert rel(a, b) < TOL, step
    assert rows == [(3, PROMPT)] + [(3, 1)] * (NEW - 1)


def test_generate_without_the_cache_recomputes_every_position_and_gives_the_same_tokens():
    """use_cache=False: each step runs the whole sequence again, as transformers does; the same tokens."""
    torch.manual_seed(13)
    reference = tiny_llama(num_hidden_layers=2, pad_token_id=0).eval()
    patched = apply_codagen(copy.deepcopy(reference)).eval()
    ids, mask = left_padded_prompts(14)
    rows = layer_rows(patched)
    got = greedy(patched, ids, mask, use_cache=False)
    assert torch.equal(got.sequences, greedy(reference, ids, mask, use_cache=False).sequences)
    assert rows == [(3, PROMPT + i) for i in range(NEW)]


def test_a_forward_continues_the_cache_it_returned():
    """model(ids, use_cache=True) returns transformers' cache (config.use_cache asks for one in evaluation too);
    the next call with it and the next tokens gives the logits of the whole sequence at once. A training step makes
    none."""
    torch.manual_seed(15)
    patched = apply_codagen(tiny_llama(num_hidden_layers=2))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(16)).to(DEVICE)
    patched.train()
    assert patched(input_ids=ids).cache is None  # a training step: nothing reads a cache
    patched.eval()
    with torch.no_grad():
        whole = patched(input_ids=ids).logits
        first = patched(input_ids=ids[:, :6])
        assert first.cache.get_seq_length() == 6
        rest = patched(input_ids=ids[:, 6:], cache=first.cache)
        assert patched(input_ids=ids, use_cache=False).cache is None
    assert rel(rest.logits, whole[:, 6:]) < TOL
    assert rest.cache is first.cache and first.cache.get_seq_length() == 9


def test_a_cache_under_gradient_checkpointing_in_training_is_refused():
    """Its recomputation in the backward would put every layer's k and v into the cache again."""
    patched = apply_codagen(tiny_llama())
    (getattr(patched, "activation_checkpointing_enable", None) or patched.gradient_checkpointing_enable)()
    patched.train()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(17)).to(DEVICE)
    cache = transformers.DynamicCache(config=patched.config)
    with pytest.raises(NotImplementedError, match="KV cache .* under gradient checkpointing in training is not "
                                                  "supported; call it without one"):
        patched(input_ids=ids, labels=ids, cache=cache)
    assert patched(input_ids=ids, labels=ids).cache is None  # use_cache from the config: no cache, no refusal


def test_greedy_generate_of_a_peft_lora_model_is_peft_s():
    """LoRA on every projection (codagen.lora: q, k, v products added and rotated after PreAttention, before k and v
    go into the cache): PeftModel.generate, patched and not."""
    pytest.importorskip("peft")
    from test_hf_peft import ATTENTION, MLP, peft_llama

    torch.manual_seed(20)
    reference = peft_llama(ATTENTION + MLP, tiny_llama(num_hidden_layers=2, pad_token_id=0)).eval()
    patched = apply_codagen(copy.deepcopy(reference)).eval()
    ids, mask = left_padded_prompts(21)
    expected, got = greedy(reference, ids, mask), greedy(patched, ids, mask)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        assert rel(a, b) < TOL, step
