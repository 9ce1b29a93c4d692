"""Worker of tests/test_hf_fsdp2.py's LoRA test, run by torch.distributed.run in 2 CPU processes over gloo: a tiny
random transformers causal LM (Llama; Qwen2 and Mistral, with their sliding windows) wrapped by PEFT's get_peft_model
(LoRA on every projection, adapters random),
patched by codagen.hf, fully_shard on each decoder layer and on the root (the frozen base weights and the trainable
adapters in the same groups), trained three AdamW steps on the adapters; against the same PEFT model unpatched and
unwrapped in one process on the whole batch. Rank r feeds row r of each batch (no ignored labels: FSDP2's average
of the ranks' gradients is the gradient of the whole batch's mean). Writes {"world", "runs": [{"checkpointing",
"losses", "ref_losses", "max_rel_grad", "max_rel_weight", "trainable", "frozen_grads", "layer_calls", "family"}]} as
JSON to argv[1] on rank 0."""
from __future__ import annotations

import copy
import sys

import peft
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from codagen.hf import CodagenDecoderLayer, apply_codagen
# tests/, the worker's folder, is on sys.path
from hf_fsdp2_worker import BATCH, SEQ, VOCAB, finish, full, random_causal_lm, rel, shard_layers, start

STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(family: str) -> torch.nn.Module:
    """The same random PEFT model on every rank (and for the reference): norm weights and lora_B random too."""
    model = peft.get_peft_model(random_causal_lm(family), peft.LoraConfig(target_modules=TARGETS, r=4, lora_alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    return model


def main(out: str) -> None:
    rank, world, mesh = start()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    runs = []
    for family, checkpointing in ((f, c) for f in ("llama", "qwen2", "mistral") for c in (False, True)):
        reference = peft_model(family)  # unpatched, unwrapped, one process, the whole batch
        model = apply_codagen(copy.deepcopy(reference))
        decoder = model.get_base_model().model
        assert all(isinstance(layer, CodagenDecoderLayer) for layer in decoder.layers)
        calls = shard_layers(decoder.layers, mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(decoder.layers[0].self_attn.q_proj.lora_A["default"].weight, DTensor)
        optimizers = []
        for m in (model, reference):
            m.train()
            if checkpointing:
                (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
            optimizers.append(torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2))
        assert decoder.gradient_checkpointing == checkpointing
        losses, ref_losses, worst_grad = [], [], 0.0
        for ids in batches:
            loss = model(input_ids=ids[rank: rank + 1], labels=ids[rank: rank + 1], use_cache=False).loss
            loss.backward()
            ref_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
            ref_loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            ref_losses.append(ref_loss.item())
            expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
            got = {n: full(p.grad) for n, p in model.named_parameters() if p.requires_grad}
            assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
            worst_grad = max([worst_grad] + [rel(got[n], expected[n]) for n in expected])
            frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        weights = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        worst_weight = max(rel(full(p.detach()), weights[n].detach())
                           for n, p in model.named_parameters() if p.requires_grad)
        runs.append(dict(family=family, checkpointing=checkpointing, losses=losses, ref_losses=ref_losses, max_rel_grad=worst_grad,
                         max_rel_weight=worst_weight, trainable=len(weights), frozen_grads=frozen_grads,
                         layer_calls=calls[0]))
    finish(out, runs)


if __name__ == "__main__":
    main(sys.argv[1])
