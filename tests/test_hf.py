"""codagen.hf against transformers itself: a tiny random LlamaForCausalLM patched by apply_codagen and the same model
unpatched, fp32, loss and every parameter gradient within 1e-4 relative; save/load in Hugging Face's layout; the
configurations that are refused, each with its message."""
import copy
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

from codagen import runtime  # noqa: E402,F401  (Triton's interpreter where there is no GPU)
from codagen.convert import heads_to_halves  # noqa: E402
from codagen.hf import AutoCodagenForCausalLM, CodagenAttention, CodagenConfigError, apply_codagen  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, BATCH, SEQ = 97, 2, 12
TOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="sdpa")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def random_model(model_class, config, norm_center: float = 1.0):
    """A random fp32 model of a transformers causal-LM class (the tests of every family make theirs here): norm
    weights random too, around norm_center (Hugging Face starts them at one; Gemma's, scales of 1 + w, at zero)."""
    model = model_class(config).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    return model


def labelled_tokens(vocab: int, batch: int, seq: int, seed: int = 0):
    """Random token ids and their labels, one of them ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def tiny_llama(**overrides):
    """A random fp32 LlamaForCausalLM; norm weights random too (Hugging Face starts them at one)."""
    return random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**BASE, **overrides}))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_layout_grads(model):
    """The patched model's gradients in Hugging Face's names and layout (fused rows split back by hand)."""
    attn, out = next(m for m in model.modules() if isinstance(m, CodagenAttention)), {}
    hd = attn.head_dim  # the attention's own: a Qwen2Config has no head_dim field
    nq, nk = attn.num_heads * hd, attn.num_key_value_heads * hd
    for name, p in model.named_parameters():
        if ".self_attn.qkv_proj." in name:
            q, k, v = p.grad.split([nq, nk, nk])
            prefix, kind = name.split("qkv_proj.")
            out[prefix + "q_proj." + kind] = heads_to_halves(q, hd)
            out[prefix + "k_proj." + kind] = heads_to_halves(k, hd)
            out[prefix + "v_proj." + kind] = v
        elif ".mlp.gate_up_proj." in name:
            prefix, kind = name.split("gate_up_proj.")
            out[prefix + "gate_proj." + kind], out[prefix + "up_proj." + kind] = p.grad[0::2], p.grad[1::2]
        else:
            out[name] = p.grad
    return out


def compare(reference, patched, seed=0, **inputs):
    """Same inputs through both models: loss and every gradient (Hugging Face names) within TOL."""
    losses = []
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the same dropout masks, where there is dropout
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) < TOL, (losses[1].item(), losses[0].item())
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    got = hf_layout_grads(patched)
    assert got.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert rel(got[name], g) < TOL, name


def tokens_and_labels(generator_seed=0):
    return labelled_tokens(VOCAB, BATCH, SEQ, generator_seed)


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa"),
    pytest.param({"tie_word_embeddings": True, "num_key_value_heads": 4}, id="tied-mha"),
    pytest.param({"head_dim": 24}, id="head_dim-not-hidden-over-heads"),
    pytest.param({"rope_parameters": LLAMA3_ROPE}, id="llama3-rope"),
    pytest.param({"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}}, id="linear-rope"),
    pytest.param({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16}, "max_position_embeddings": 64},
                 id="yarn-rope"),
    pytest.param({"attention_dropout": 0.3, "attn_implementation": "eager"}, id="attention-dropout-eager"),
    pytest.param({"attention_bias": True, "rope_parameters": LLAMA3_ROPE}, id="attention-bias"),
    pytest.param({"mlp_bias": True}, id="mlp-bias"),
])
def test_patched_model_matches_transformers(overrides):
    torch.manual_seed(1)
    reference = tiny_llama(**overrides)
    patched = apply_codagen(copy.deepcopy(reference), chunk_rows=7)
    ids, labels = tokens_and_labels()
    compare(reference, patched, input_ids=ids, labels=labels)


def test_tied_embedding_stays_one_parameter():
    patched = apply_codagen(tiny_llama(tie_word_embeddings=True))
    assert patched.get_output_embeddings().weight is patched.get_input_embeddings().weight
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    names = [n for n, _ in patched.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask(side):
    torch.manual_seed(2)
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(1)
    mask = torch.ones_like(ids)
    pads = slice(SEQ - 4, None) if side == "right" else slice(0, 4)
    mask[1, pads] = 0
    labels[1, pads] = -100
    compare(reference, patched, input_ids=ids, attention_mask=mask, labels=labels)


def test_packed_sequences_with_position_ids():
    torch.manual_seed(3)
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(2)
    # each row holds documents of lengths 5+7 and 3+4+5, positions restarting at 0 (as DataCollatorWithFlattening)
    position_ids = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(4)) + list(range(5))],
                                device=DEVICE)
    labels[position_ids == 0] = -100
    # use_cache=False: with a cache (config.use_cache defaults to True) transformers does not look for packing
    compare(reference, patched, input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False)


def compare_checkpointed(reference, ids, labels, monkeypatch):
    """reference and its patched copy with gradient checkpointing on, in training: the loss and every gradient alike
    (compare), and each patched layer's call checkpointed (hooks included, as Hugging Face's
    GradientCheckpointingLayer does). The families' tests call it with their own models."""
    checkpointed = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *args, **kwargs: checkpointed.append(fn) or checkpoint(fn, *args, **kwargs))
    patched = apply_codagen(copy.deepcopy(reference))
    for model in (reference, patched):
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.train()
    assert patched.model.gradient_checkpointing
    compare(reference, patched, input_ids=ids, labels=labels, use_cache=False)
    assert checkpointed == list(patched.model.layers)


def test_gradient_checkpointing(monkeypatch):
    # dropout: the recomputation replays the same masks (checkpoint restores the RNG state)
    torch.manual_seed(8)
    compare_checkpointed(tiny_llama(attention_dropout=0.2, attn_implementation="eager"), *tokens_and_labels(8),
                         monkeypatch)


def test_num_items_in_batch_sums_the_loss_as_transformers_does():
    torch.manual_seed(4)
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(3)
    compare(reference, patched, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(37, device=DEVICE))


def test_without_labels_logits_and_hidden_states_are_transformers():
    torch.manual_seed(5)
    reference = tiny_llama(rope_parameters=LLAMA3_ROPE)
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(4)
    with torch.no_grad():
        assert rel(patched(input_ids=ids).logits, reference(input_ids=ids).logits) < TOL
        last = dict(input_ids=ids, logits_to_keep=1)
        assert rel(patched(**last).logits, reference(**last).logits) < TOL
        assert rel(patched.model(input_ids=ids).last_hidden_state,
                   reference.model(input_ids=ids).last_hidden_state) < TOL
        # eval loss: the generated block's no-gradient path (no logits kept)
        assert rel(patched(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
        embeds = reference.get_input_embeddings()(ids)
        assert rel(patched(inputs_embeds=embeds, labels=labels).loss,
                   reference(inputs_embeds=embeds, labels=labels).loss) < TOL
        # with labels no logits are made: the tuple holds the loss alone (ModelOutput.to_tuple drops None; and no
        # KV cache with use_cache=False: config.use_cache makes one outside a training step, as in transformers)
        (loss,) = patched(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
        assert torch.isfinite(loss)


def test_save_and_load_in_transformers_layout(tmp_path):
    torch.manual_seed(6)
    reference = tiny_llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    patched = apply_codagen(copy.deepcopy(reference))
    state = patched.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    patched.save_pretrained(tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    for name, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    again = AutoCodagenForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    ids, labels = tokens_and_labels(5)
    with torch.no_grad():
        assert rel(again(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss) < TOL
    # a Hugging Face state dict loads into a patched model (load_state_dict, strict)
    other = apply_codagen(tiny_llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True))
    other.load_state_dict(reference.state_dict())
    for name, p in patched.named_parameters():
        assert torch.equal(dict(other.named_parameters())[name], p), name


def test_from_pretrained_refuses_another_model_type_before_loading(tmp_path):
    """A checkpoint of a model type no family patches (here GPT-2's) is refused from its config: loaded as a Llama,
    its weights would not fit and be initialized at random. The folder holds no weights, so a load would fail
    with another error."""
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="'gpt2' model; codagen patches the model types 'llama', "):
        AutoCodagenForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_act": "gelu"}, "config.hidden_act = 'gelu' is not supported: the MLP kernels compute SwiGLU with silu"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.rope_parameters['rope_type'] = 'dynamic' is not supported: codagen takes RoPE frequencies fixed"),
])
def test_refused_configurations_name_the_field(overrides, message):
    model = tiny_llama(**overrides)
    layers = list(model.model.layers)
    with pytest.raises(CodagenConfigError, match="^apply_codagen: " + message.replace("[", r"\[").replace("(", r"\(")):
        apply_codagen(model)
    assert list(model.model.layers) == layers  # refused: nothing changed


def test_refused_models_and_calls():
    with pytest.raises(TypeError, match="expected a transformers LlamaForCausalLM, Qwen2ForCausalLM, "
                                        "MistralForCausalLM, Qwen3ForCausalLM or Gemma2ForCausalLM, .* got "
                                        "GPT2LMHeadModel"):
        apply_codagen(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    patched = apply_codagen(tiny_llama())
    with pytest.raises(ValueError, match="already patched"):
        apply_codagen(patched)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU a bad target is a device-side assert, which ends the "
                                                      "process's CUDA context; the CPU run checks the error")
def test_out_of_range_label_raises_as_in_transformers():
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(6)
    labels[1, 5] = VOCAB  # predicted at position 4: out of [0, vocab)
    for model in (reference, patched):
        with pytest.raises(IndexError, match=f"Target {VOCAB} is out of bounds"):
            model(input_ids=ids, labels=labels)


def test_all_ignored_labels_give_nan_as_in_transformers():
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(6)
    ignored = torch.full_like(labels, -100)
    for model in (reference, patched):
        assert torch.isnan(model(input_ids=ids, labels=ignored).loss)


def compare_under_autocast(reference, ids, labels):
    """reference and its patched copy under torch.autocast (as Trainer's bf16=True runs an fp32 model): the blocks
    run in bf16, residual stream included, where Hugging Face keeps the residual in fp32: loss and gradients agree to
    bf16's precision, and the gradients come back to the fp32 weights. The families' tests call it with their own
    models."""
    patched = apply_codagen(copy.deepcopy(reference))
    losses = []
    for model in (reference, patched):
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) < 2.0**-8  # a bfloat16 step (Qwen3 measured 2.1e-3, Llama under 2e-3)
    got = hf_layout_grads(patched)
    for name, p in reference.named_parameters():
        assert got[name].dtype == torch.float32 and rel(got[name], p.grad) < 1e-1, (name, rel(got[name], p.grad))


def test_autocast_runs_the_blocks_in_its_dtype():
    torch.manual_seed(7)
    compare_under_autocast(tiny_llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
                           *tokens_and_labels(7))


def test_modified_modules_are_refused():
    """An adapter or a quantized linear in place of a projection would be dropped by the fusion: refused, at patch
    time and, for the modules the patched model reads, when it is called."""
    class Adapted(torch.nn.Linear):
        pass

    message = r" is a .*Adapted, not Linear; codagen runs unmodified transformers Llama modules only"
    model = tiny_llama()
    model.model.layers[1].self_attn.k_proj = Adapted(64, 32, bias=False)
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.1\.self_attn\.k_proj" + message):
        apply_codagen(model)
    patched = apply_codagen(tiny_llama())
    patched.model.layers[0].mlp.down_proj = Adapted(80, 64, bias=False)
    ids, labels = tokens_and_labels()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.mlp\.down_proj" + message):
        patched(input_ids=ids, labels=labels)


def test_a_model_made_under_liger_kernel_s_patch_is_refused_with_what_to_undo():
    """Liger-Kernel's apply_liger_kernel_to_llama() rebinds transformers' Llama classes, so that a model made after
    it holds Liger's modules: refused, the error naming the patch to leave out (a module class of Liger's, here
    made without Liger installed)."""
    LigerRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {"__module__": "liger_kernel.transformers.rms_norm"})
    model = tiny_llama()
    model.model.norm = LigerRMSNorm()
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.norm is a liger_kernel\.transformers\.rms_norm\."
                                        r"LigerRMSNorm, not LlamaRMSNorm; .* made after Liger-Kernel's patch of "
                                        r"transformers \(apply_liger_kernel_to_llama\)"):
        apply_codagen(model)


def test_lm_head_with_bias_is_refused():
    """lm_head_loss adds no bias: an LM head given one (transformers' Llama has none) is refused, not dropped."""
    model = tiny_llama()
    model.lm_head = torch.nn.Linear(64, VOCAB, bias=True).to(DEVICE)
    with pytest.raises(TypeError, match="^apply_codagen: lm_head has a bias"):
        apply_codagen(model)


def test_forward_repeats_no_host_work_that_does_not_depend_on_its_inputs(monkeypatch):
    """Checks, imports, signature inspection and the RoPE frequencies are done once, not per step: each runs again
    only after what it depends on changed (a module replaced, inv_freq changed in place), and then once."""
    import types

    import codagen.hf as hf

    model = apply_codagen(tiny_llama())
    calls = {name: 0 for name in ("check_modules", "_check_lm_head", "_rope_freqs")}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(hf, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(hf, name, counted)
    def refused(*args, **kwargs):
        raise AssertionError("codagen.hf imported, looked up a module or inspected a signature on the forward path")
    monkeypatch.setattr(hf, "importlib", types.SimpleNamespace(import_module=refused, util=types.SimpleNamespace(
        find_spec=refused, spec_from_file_location=refused, module_from_spec=refused)))
    monkeypatch.setattr(hf, "inspect", types.SimpleNamespace(signature=refused))

    ids, labels = tokens_and_labels()

    def steps(n):
        for _ in range(n):
            model(input_ids=ids, labels=labels).loss.backward()
            model.model(input_ids=ids)

    steps(2)
    assert calls == {"check_modules": 0, "_check_lm_head": 0, "_rope_freqs": 1}  # the first call makes the freqs
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(80, 64, bias=False, device=DEVICE)  # allowed: a Linear
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(1.5)
    steps(2)
    assert calls == {"check_modules": 1, "_check_lm_head": 1, "_rope_freqs": 2}
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB, device=DEVICE))
    with pytest.raises(TypeError, match="^apply_codagen: lm_head has a bias"):
        model(input_ids=ids, labels=labels)


def test_forward_registers_no_module():
    """A forward registers no module, parameter or buffer anywhere (a slice of a ModuleList would, layer by layer):
    each registration runs PyTorch's global registration hooks, host work per call that a compiled forward would
    also guard on."""
    model = apply_codagen(tiny_llama())
    ids, labels = tokens_and_labels()
    model(input_ids=ids, labels=labels)
    registered = []
    hooks = [register(lambda module, name, value: registered.append((type(module).__name__, name)))
             for register in (torch.nn.modules.module.register_module_module_registration_hook,
                              torch.nn.modules.module.register_module_parameter_registration_hook,
                              torch.nn.modules.module.register_module_buffer_registration_hook)]
    try:
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    assert registered == []


def test_packed_sequences_are_looked_for_only_in_given_position_ids(monkeypatch):
    """transformers looks for packed sequences in the position_ids its mask builder is given, a host sync on a GPU
    (`.all()` of a device tensor) that made the GPU wait for the host's whole next forward at every step. Positions
    the patched model makes itself are one sequence per row: the builder does not get them; position_ids a caller
    gives it does, as in the unpatched model."""
    from transformers import masking_utils

    looked = []
    find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: looked.append(p) or find(p))
    model = apply_codagen(tiny_llama())
    ids, labels = tokens_and_labels()
    model(input_ids=ids, labels=labels).loss.backward()
    assert looked == []
    positions = torch.arange(ids.shape[1], device=DEVICE).expand_as(ids)
    model(input_ids=ids, labels=labels, position_ids=positions)
    assert len(looked) == 1 and torch.equal(looked[0], positions)


def test_deep_copy_of_a_patched_model_is_checked_on_its_own():
    model = apply_codagen(tiny_llama())
    copied = copy.deepcopy(model)
    assert copied.model.codagen_patch is not model.model.codagen_patch
    ids, labels = tokens_and_labels()
    assert copied(input_ids=ids, labels=labels).loss.item() == model(input_ids=ids, labels=labels).loss.item()
    copied.model.layers[0].mlp.down_proj = torch.nn.Identity()
    model(input_ids=ids, labels=labels)  # the original is untouched
    with pytest.raises(TypeError, match=r"^apply_codagen: model\.layers\.0\.mlp\.down_proj is a .*Identity"):
        copied(input_ids=ids, labels=labels)


def test_compiled_model_is_one_graph_without_recompiles():
    """torch.compile over the patched model: the whole forward (decoder stack, loss) in one graph, fullgraph=True,
    no recompile in later steps, also when other patched models are made and freed between them (each model's
    modules are watched for changes in one process-wide list, which a trace must not guard on), and the gradients
    of the uncompiled model. On the CPU the backend is aot_eager (forward and backward traced by AOTAutograd, as
    Inductor gets them on a GPU)."""
    torch._dynamo.reset()
    base = tiny_llama()
    eager, compiled = apply_codagen(copy.deepcopy(base)), apply_codagen(copy.deepcopy(base))
    ids, labels = tokens_and_labels()
    explained = torch._dynamo.explain(compiled)(input_ids=ids, labels=labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    torch._dynamo.reset()
    mlp = compiled.model.layers[0].mlp
    mlp.down_proj = mlp.down_proj  # a registration, as of a new module: the first compiled call checks again
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for i in range(3):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            for model in (eager, step):
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=labels).loss.backward()
        other = apply_codagen(tiny_llama())
        other(input_ids=ids)
        del other
        gc.collect()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(p.grad, q.grad), name
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3", "gemma2"])
def test_compiled_model_of_each_family_is_one_graph_without_recompiles(family):
    """As the Llama test above, for the other families (tests/hf_fsdp2_worker.py's tiny configurations: Qwen2's and
    Mistral's sliding windows, Qwen3's QK-norm, Gemma-2's softcaps and eager attention): one graph without breaks,
    no recompile in the second step, and the uncompiled model's gradients."""
    from hf_fsdp2_worker import random_causal_lm
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    base = random_causal_lm(family).to(DEVICE)
    eager, compiled = apply_codagen(copy.deepcopy(base)), apply_codagen(copy.deepcopy(base))
    ids, labels = labelled_tokens(base.config.vocab_size, BATCH, SEQ)
    counter = CompileCounterWithBackend("aot_eager")  # fullgraph=True: a graph break is an error
    step = torch.compile(compiled, backend=counter, fullgraph=True)
    for _ in range(2):
        for model in (eager, step):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=labels).loss.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(p.grad, q.grad), name
    assert counter.frame_count == 1  # one graph, traced once
    torch._dynamo.reset()


def _compiled_sdpa_calls(model, **inputs) -> list[dict]:
    """The SDPA calls of the graph torch.compile traces of model(**inputs): each one's attn_mask (None, or "tensor")
    and is_causal."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep, fullgraph=True)(**inputs)
    torch._dynamo.reset()
    return [{"attn_mask": None if node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is None
             else "tensor", "is_causal": node.kwargs.get("is_causal")}
            for gm in graphs for node in gm.graph.nodes
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target)]


def test_compiled_model_gives_sdpa_no_mask_where_causality_alone_masks(monkeypatch):
    """Under torch.compile Hugging Face's mask builder makes a mask tensor even where causality alone masks (always
    with PyTorch before 2.14, whose Dynamo reads torch.compiler.is_exporting() as True: made so here), and SDPA with
    a mask skips no masked tiles and repeats the keys and values per head (2 to 3 times the attention's time on an
    H100). The patched model gives SDPA no mask and is_causal where the inputs have no padding, no given positions
    and no cache, as the builder decides outside torch.compile; the mask where they have padding, or where a
    sliding window is shorter than the sequence."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    model = apply_codagen(tiny_llama())
    ids, labels = tokens_and_labels()
    plain = _compiled_sdpa_calls(model, input_ids=ids, labels=labels)
    assert plain == [{"attn_mask": None, "is_causal": True}] * BASE["num_hidden_layers"]
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    masked = _compiled_sdpa_calls(model, input_ids=ids, labels=labels, attention_mask=padding)
    assert masked and all(call["attn_mask"] == "tensor" for call in masked)
    # the losses: the compiled patched model's, the unpatched model's
    reference = tiny_llama()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for mask in (None, padding):
        want = reference(input_ids=ids, labels=labels, attention_mask=mask).loss
        assert rel(compiled(input_ids=ids, labels=labels, attention_mask=mask).loss, want) < 1e-5
    torch._dynamo.reset()
    for window, mask in ((SEQ - 2, "tensor"), (SEQ + 1, None)):  # Mistral's layers attend within a sliding window
        windowed = apply_codagen(random_model(transformers.MistralForCausalLM,
                                              transformers.MistralConfig(**BASE, sliding_window=window)))
        calls = _compiled_sdpa_calls(windowed, input_ids=ids, labels=labels)
        assert [call["attn_mask"] for call in calls] == [mask] * BASE["num_hidden_layers"], window


@pytest.mark.parametrize("chunk_rows", [1.5, 0, -3, True, "2048", None])
def test_chunk_rows_must_be_a_positive_int(chunk_rows):
    """Refused where it enters, naming it (1.5 was accepted, and the first forward failed deep inside)."""
    model = tiny_llama()
    with pytest.raises(ValueError, match=f"^apply_codagen: chunk_rows must be a positive int, got {chunk_rows!r}$"):
        apply_codagen(model, chunk_rows=chunk_rows)
    assert not hasattr(model, "codagen_chunk_rows")  # refused before anything was patched


def test_a_model_on_the_meta_device_is_refused_by_name():
    """A model made on the meta device patches (its weights may be loaded later) but is not run: refused with a
    message that says why, not `Tensor.item() cannot be called on meta tensors` from inside the loss."""
    with torch.device("meta"):
        model = apply_codagen(transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)))
    ids, labels = tokens_and_labels()
    with pytest.raises(NotImplementedError, match="weights are on the meta device, where no kernel runs"):
        model(input_ids=ids, labels=labels)


def test_without_transformers_the_error_names_the_hf_extra(monkeypatch):
    """apply_codagen and from_pretrained on a machine without transformers: an ImportError that says to install the
    hf extra, not a bare ModuleNotFoundError from inside codagen.hf."""
    import sys

    from codagen import hf
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as where it is missing
    for call in (lambda: hf.apply_codagen(object()), lambda: hf.from_pretrained("some/model")):
        with pytest.raises(ImportError) as raised:
            call()
        assert type(raised.value) is ImportError and raised.value.name == "transformers"
        assert '.[hf]' in str(raised.value) and "transformers>=5" in str(raised.value)


def test_forward_and_backward_raise_no_future_warning():
    """A training step of the patched model (padding mask, given positions, checkpointed layers too) with
    transformers' FutureWarnings (deprecations) as errors."""
    import warnings

    torch.manual_seed(0)
    model = apply_codagen(tiny_llama())
    model.train()
    ids, labels = tokens_and_labels()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = torch.arange(SEQ, device=DEVICE).repeat(BATCH, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model(input_ids=ids, labels=labels).loss.backward()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()
        model.model.gradient_checkpointing = True
        model(input_ids=ids, labels=labels).loss.backward()


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def test_forward_hooks_see_each_layer_run_with_its_input_and_output():
    """The patched decoder loop calls each layer module: a forward hook on each layer fires once per forward, with the
    residual stream going in and coming out, [batch, seq, hidden], which are the unpatched layers' own."""
    torch.manual_seed(9)
    reference = tiny_llama(num_hidden_layers=3)
    patched = apply_codagen(copy.deepcopy(reference))
    seen = {"reference": [], "patched": []}
    for key, model in (("reference", reference), ("patched", patched)):
        for i, layer in enumerate(model.model.layers):
            def hook(module, args, kwargs, output, _i=i, _seen=seen[key]):
                hidden = args[0] if args else kwargs["hidden_states"]
                _seen.append((_i, hidden.detach().clone(), _first(output).detach().clone()))
            layer.register_forward_hook(hook, with_kwargs=True)
    ids, labels = tokens_and_labels(9)
    for n in (1, 2):
        for model in (reference, patched):
            model(input_ids=ids, labels=labels).loss.backward()
        assert [i for i, _, _ in seen["patched"]] == [0, 1, 2] * n
    for (_, x_ref, y_ref), (_, x, y) in zip(seen["reference"], seen["patched"]):
        assert x.shape == y.shape == (BATCH, SEQ, 64)
        assert rel(x, x_ref) < TOL and rel(y, y_ref) < TOL


def test_evaluation_with_labels_returns_the_logits_as_trainer_asks():
    """Trainer's prediction_step calls the model in eval mode under torch.no_grad() and hands compute_metrics the
    output's values other than the loss: in evaluation, a forward with labels returns transformers' logits (and
    its loss); a training forward makes no logits (the loss block keeps none); return_logits=False opts out,
    return_logits=True returns them always."""
    torch.manual_seed(10)
    reference = tiny_llama()
    patched = apply_codagen(copy.deepcopy(reference))
    ids, labels = tokens_and_labels(10)
    for model in (reference, patched):
        model.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=labels)
        out = patched(input_ids=ids, labels=labels)
        assert rel(out.loss, expected.loss) < 1e-5
        assert out.logits.shape == expected.logits.shape and rel(out.logits, expected.logits) < 1e-5
        # as prediction_step collects them (ModelOutput.items() leaves out None; Trainer leaves out the loss and,
        # by default, the KV cache, which config.use_cache asks for outside a training step)
        (logits,) = tuple(v for k, v in out.items() if k not in ("loss", "cache", "past_key_values"))
        assert logits is out.logits
        loss, logits, _ = patched(input_ids=ids, labels=labels, return_dict=False)
        assert rel(logits, expected.logits) < 1e-5
    patched.train()
    out = patched(input_ids=ids, labels=labels)
    assert out.logits is None and rel(out.loss, expected.loss) < TOL  # no dropout in this config
    with torch.no_grad():  # an evaluation loss in training mode: no logits either
        assert patched(input_ids=ids, labels=labels).logits is None
    patched.eval()
    assert patched(input_ids=ids, labels=labels).logits is None  # eval mode, gradients on: a training-like step
    opted_out = apply_codagen(copy.deepcopy(reference), return_logits=False).eval()
    always = apply_codagen(copy.deepcopy(reference), return_logits=True)
    with torch.no_grad():
        assert opted_out(input_ids=ids, labels=labels).logits is None
    out = always(input_ids=ids, labels=labels)
    assert rel(out.logits, expected.logits) < 1e-5 and out.logits.requires_grad
    with pytest.raises(ValueError, match="^apply_codagen: return_logits must be 'eval', True or False, got 1$"):
        apply_codagen(tiny_llama(), return_logits=1)
