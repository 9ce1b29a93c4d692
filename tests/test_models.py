"""codagen.models: each model family declared once (codagen/models/<family>.py): its blocks are block specs, the
presets run exactly them (as the block-name rule they replace did), its assembly and reference convert into each
other, and Llama's Hugging Face mapping names transformers' own modules and weights."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codagen import models
from codagen.presets import FAMILIES, PRESETS
from conftest import REPO

SPEC_BLOCKS = sorted(p.stem for p in (REPO / "specs").rglob("blocks/*.yaml"))


def test_every_family_is_a_module_declaring_it():
    assert FAMILIES == models.NAMES
    assert sorted(p.stem for p in Path(models.__file__).parent.glob("*.py") if p.stem != "__init__") == \
        sorted(models.NAMES)
    for name in models.NAMES:
        family = models.family(name)
        assert family.name == name
        assert set(family.blocks) <= set(SPEC_BLOCKS), f"{name} lists blocks with no spec"
    with pytest.raises(ValueError, match="unknown model family 'mistral'"):
        models.family("mistral")


def _prefix_rule(family: str, block: str) -> bool:
    """presets.runs_block before codagen.models: a family's own list, and for Llama every block not named
    <family>_... for another family."""
    lists = {"qwen3": ("norm_stats", "qwen3_pre_attention", "qwen3_post_attention", "lm_head_loss"),
             "gemma2": ("gemma2_norm_stats", "gemma2_pre_attention", "gemma2_post_attention", "gemma2_lm_head_loss")}
    if family in lists:
        return block in lists[family]
    return not block.startswith(tuple(f"{f}_" for f in lists))


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_run_the_blocks_their_family_lists(preset):
    """Every block spec of specs/ is run by the same presets as under the block-name rule: Llama runs its own
    and every block no family lists (the cross-entropy variants, oproj_swiglu), Qwen3 and Gemma-2 theirs."""
    model = PRESETS[preset]
    for block in SPEC_BLOCKS:
        assert model.runs_block(block) == _prefix_rule(model.family, block), (preset, block)
    family = models.family(model.family)
    assert all(model.runs_block(b) for b in family.blocks)


# each family at its smallest preset
SMALLEST = {f: min((p for p, s in PRESETS.items() if s.family == f), key=lambda p: PRESETS[p].dim * PRESETS[p].vocab)
            for f in models.NAMES if any(s.family == f for s in PRESETS.values())}


def test_every_family_has_a_preset():
    assert set(SMALLEST) == set(models.NAMES)


@pytest.mark.parametrize("preset", SMALLEST.values())
def test_assembly_and_reference_convert_into_each_other(preset):
    """from_hf maps the reference's (Hugging Face's) state dict onto the assembly's parameters, to_hf back (with
    lm_head.weight besides, where the reference ties it to the embedding)."""
    shape = PRESETS[preset]
    family = models.family(shape.family)
    torch.manual_seed(0)
    reference = family.reference(shape)
    model = family.model(shape)
    state = reference.state_dict()
    converted = family.from_hf(state, shape)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted)
    back = family.to_hf(converted, shape)
    for name, value in state.items():
        assert torch.equal(back[name], value), name


def test_llamas_hugging_face_mapping_names_transformers_modules_and_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    hf = models.family("llama").hf
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    assert type(model).__name__ == hf.model_class and modeling_llama.__name__ == hf.modeling

    def kind(name):
        return getattr(torch.nn, name) if name in ("Linear", "Embedding") else getattr(modeling_llama, name)

    for name, cls in hf.model_modules.items():
        assert type(model.model.get_submodule(name)) is kind(cls), name
    for name, cls in hf.layer_modules.items():
        assert type(model.model.layers[0].get_submodule(name)) is kind(cls), name
    assert set(hf.read) <= set(hf.model_modules) | set(hf.layer_modules)
    for fused, parts in hf.fused.items():
        assert set(parts) <= set(hf.layer_modules) and fused.rpartition(".")[0] in hf.layer_modules
    weights = dict(model.named_parameters(), **{"lm_head.weight": model.lm_head.weight})
    layer = {n.removeprefix("model.layers.0."): p for n, p in weights.items() if n.startswith("model.layers.0.")}
    assert set(hf.feeds) <= set(models.family("llama").blocks)
    for block, names in hf.feeds.items():
        for name in names:
            if name.startswith(("model.", "lm_head.")):
                assert name in weights, (block, name)
            elif name.endswith(".bias"):  # mlp_bias only: the config above has none
                assert name.removesuffix(".bias") + ".weight" in layer, (block, name)
            else:
                assert name.removeprefix("next.") in layer, (block, name)


def test_the_family_names_need_no_torch():
    """codagen.presets (imported by `codagen build --check`) takes the family names from codagen.models, whose
    package imports no family module and no torch."""
    result = subprocess.run([sys.executable, "-c", "import sys, codagen.presets\n"
                             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
                             " or m.startswith('codagen.models.')))"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
