"""codagen.training, what examples/convergence.py and the training benchmarks are built from: its models'
transformers configs at codagen/presets.py's dimensions, the synthetic data, and Hugging Face's modeling_llama kept
whole around a patch of it."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

from codagen import training  # noqa: E402
from codagen.presets import PRESETS  # noqa: E402


@pytest.mark.parametrize("name", training.MODELS)
def test_each_model_has_its_presets_dimensions(name):
    model = training.MODELS[name]
    config, shape = model.config(), PRESETS[model.preset]
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size, config.rms_norm_eps) == (
        shape.dim, shape.ffn_dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.vocab, shape.eps)
    assert config.num_hidden_layers == (model.layers or shape.n_layers)
    assert config.tie_word_embeddings is model.tied_embeddings and not config.use_cache


def test_llama_3_2_1b_is_its_config_json():
    """meta-llama/Llama-3.2-1B's config.json, in the fields that set what a training step computes."""
    config = training.MODELS["llama3.2-1b"].config()
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps,
            config.tie_word_embeddings, config.max_position_embeddings) == (
        128256, 2048, 8192, 16, 32, 8, 64, 1e-5, True, 131072)
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]) == ("llama3", 500000.0, 32.0, 1.0, 4.0, 8192)


def test_bigram_data_is_the_chain_drawn_from_seed_and_step():
    data = training.BigramData(vocab=50, seed=3)
    tokens = data.batch(7, 2, 16, "cpu")
    assert torch.equal(tokens, training.BigramData(50, 3).batch(7, 2, 16, "cpu"))
    assert not torch.equal(tokens, data.batch(8, 2, 16, "cpu"))
    for row in tokens.tolist():
        assert all(b in data.successors[a].tolist() for a, b in zip(row, row[1:]))


def test_hugging_face_kept_puts_modeling_llama_back():
    """Liger-Kernel's patch rebinds names in transformers' modeling_llama for every model made after it: they are put
    back on leaving (each variant of benchmarks/train_speed.py, each model of examples/convergence.py and
    benchmarks/profile_train.py gets Hugging Face's own Llama)."""
    module = transformers.models.llama.modeling_llama
    mlp, rope = module.LlamaMLP, module.apply_rotary_pos_emb
    with training.hugging_face_kept():
        module.LlamaMLP = module.apply_rotary_pos_emb = None
    assert module.LlamaMLP is mlp and module.apply_rotary_pos_emb is rope
