"""Worker of tests/test_hf_fsdp2.py, run by torch.distributed.run in 2 CPU processes over gloo: a tiny random
transformers causal LM of each family codagen.hf patches (Llama; Qwen2 and Mistral with sliding windows shorter than
the sequences; Qwen3; Gemma-2), patched by codagen.hf, fully_shard on each decoder layer and on the root, against the
same patched model unwrapped in one process on the whole batch. Rank r feeds row r of the batch (no ignored labels,
so every rank has as many tokens and FSDP2's average of the ranks' gradients is the gradient of the whole batch's
mean). Writes {"world", "runs": [{"family", "checkpointing", "loss", "ref_loss", "max_rel_grad", "layer_calls",
"params"}]} as JSON to argv[1] on rank 0; asserts that every layer's forward saw plain tensors only (parameters and
arguments), and that FSDP2 did not warn of a layer output that is a view."""
from __future__ import annotations

import copy
import json
import sys
import warnings

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from codagen.hf import apply_codagen
from codagen.training import leave_process_group

VOCAB, BATCH, SEQ = 97, 2, 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="sdpa")


# each family's model and config classes, and its fields beyond CONFIG
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}),
            "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=True, sliding_window=4,
                                                              max_window_layers=1)),
            "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4)),
            "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=128)),  # QK-norm's 128-column heads
            # eager attention: SDPA leaves out the score softcap
            "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16,
                                                                 sliding_window=4, attn_implementation="eager"))}


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """The same random weights on every rank: norm weights random too (not ones)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.08)
    return model


def random_causal_lm(family: str, head: str = "ForCausalLM", **overrides) -> torch.nn.Module:
    """A random model of one of FAMILIES, unpatched: its causal LM, or its class with another `head`
    ("ForSequenceClassification", ...); `overrides` of the config's fields."""
    model_class, config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**CONFIG, **fields, **overrides})
    return randomized(getattr(transformers, model_class.replace("ForCausalLM", head))(config))


def tiny_model(family: str) -> torch.nn.Module:
    return apply_codagen(random_causal_lm(family))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def start() -> tuple[int, int, object]:
    """The gloo process group of this worker's processes, one per row of the batch: (rank, world, its 1-d mesh)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == BATCH
    return rank, world, init_device_mesh("cpu", (world,))


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole; a plain one as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_layers(layers, mesh) -> list[int]:
    """fully_shard on each decoder layer; the returned [count] of the layers' forward calls grows as they run."""
    calls = [0]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def finish(out: str, runs: list[dict]) -> None:
    """{"world", "runs"} as JSON to `out` on rank 0, then every rank leaves (codagen.training.leave_process_group)."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world": dist.get_world_size(), "runs": runs}, f)
    leave_process_group()


def main(out: str) -> None:
    rank, world, mesh = start()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    runs = []
    for family, checkpointing in ((f, c) for f in FAMILIES for c in (False, True)):
        reference = tiny_model(family)
        model = copy.deepcopy(reference)
        if rank != 0:
            reference = None  # rank 0 compares; the others take part in the collectives only
        calls = [0]

        def plain_only(module, args, kwargs):
            """After FSDP's pre-forward hook (FSDP prepends its own): the layer's parameters are gathered, and no
            argument (the next norm's weight included) is a DTensor."""
            for name, p in module.named_parameters():
                assert not isinstance(p, DTensor), f"{name} is a DTensor in the layer's forward"
            for a in list(args) + list(kwargs.values()):
                assert not isinstance(a, DTensor), "a layer argument is a DTensor"
            calls[0] += 1

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
            layer.register_forward_pre_hook(plain_only, with_kwargs=True)
        fully_shard(model, mesh=mesh)
        # at rest every layer's weights are sharded: the next norm's weight is a DTensor when a layer reads it
        assert isinstance(model.model.layers[1].input_layernorm.weight, DTensor)
        for m in filter(None, (model, reference)):
            m.train()
            if checkpointing:
                m.gradient_checkpointing_enable()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(input_ids=ids[rank: rank + 1], labels=ids[rank: rank + 1]).loss
            loss.backward()
        # FSDP2 warns of a layer that returns a view (an in-place op on it would drop the pre-backward hook)
        views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
        assert not views, views
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        grads = {name: full(p.grad) for name, p in model.named_parameters()}
        if reference is None:
            continue
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_grads = dict(reference.named_parameters())
        worst = max(rel(grad, ref_grads[name].grad) for name, grad in grads.items())
        runs.append(dict(family=family, checkpointing=checkpointing, loss=mean_loss.item(), ref_loss=ref_loss.item(),
                         max_rel_grad=worst, layer_calls=calls[0],
                         params=sorted(n for n, _ in model.named_parameters()) == sorted(ref_grads)))
    finish(out, runs)


if __name__ == "__main__":
    main(sys.argv[1])
