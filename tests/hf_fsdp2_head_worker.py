"""Worker of tests/test_hf_fsdp2.py's classification-head test, run by torch.distributed.run in 2 CPU processes over
gloo: a tiny random transformers <Family>ForSequenceClassification of each family patched by codagen.hf (Llama with
and without gradient checkpointing, Gemma-2 with), fully_shard on each decoder layer and on the root (which holds
the score head), trained three AdamW steps on padded batches (one row right-padded, one left-padded: the head pools
each row's last token that is not padding); against the same patched model unwrapped in one process on the whole
batches. Rank r feeds row r of each batch (one label per row: FSDP2's average of the ranks' gradients is the
gradient of the whole batch's mean loss). Writes {"world", "runs": [{"family", "checkpointing", "losses",
"ref_losses", "max_rel_grad", "max_rel_weight", "params", "layer_calls"}]} as JSON to argv[1] on rank 0."""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from codagen.hf import CodagenDecoderLayer, apply_codagen
# tests/, the worker's folder, is on sys.path
from hf_fsdp2_worker import BATCH, SEQ, VOCAB, finish, full, random_causal_lm, rel, shard_layers, start

STEPS, PAD, LABELS = 3, 0, 3
RUNS = (("llama", False), ("llama", True), ("qwen2", False), ("mistral", False), ("qwen3", False), ("gemma2", True))


def padded_batch(g: torch.Generator) -> dict:
    """Fresh tokens (none the pad token but where padded), row 0 right-padded by 3, row 1 left-padded by 4, and a
    class per row."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 3:] = 0
    mask[1, :4] = 0
    return dict(input_ids=ids.masked_fill(mask == 0, PAD), attention_mask=mask,
                labels=torch.randint(0, LABELS, (BATCH,), generator=g))


def main(out: str) -> None:
    rank, world, mesh = start()
    g = torch.Generator().manual_seed(1)
    batches = [padded_batch(g) for _ in range(STEPS)]
    runs = []
    for family, checkpointing in RUNS:
        reference = apply_codagen(random_causal_lm(family, "ForSequenceClassification", pad_token_id=PAD,
                                                   num_labels=LABELS))
        model = copy.deepcopy(reference)
        if rank != 0:
            reference = None  # rank 0 compares; the others take part in the collectives only
        assert all(isinstance(layer, CodagenDecoderLayer) for layer in model.model.layers)
        calls = shard_layers(model.model.layers, mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model.score.weight, DTensor)
        optimizers = []
        for m in filter(None, (model, reference)):
            m.train()
            if checkpointing:
                (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
            optimizers.append(torch.optim.AdamW(m.parameters(), lr=1e-3))
        losses, ref_losses, worst_grad = [], [], 0.0
        for batch in batches:
            loss = model(**{k: v[rank: rank + 1] for k, v in batch.items()}, use_cache=False).loss
            loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            if reference is not None:
                ref_loss = reference(**batch, use_cache=False).loss
                ref_loss.backward()
                ref_losses.append(ref_loss.item())
                expected = dict(reference.named_parameters())
                worst_grad = max([worst_grad] + [rel(grad, expected[n].grad) for n, grad in grads.items()])
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        final = {n: full(p.detach()) for n, p in model.named_parameters()}
        if reference is None:
            continue
        weights = dict(reference.named_parameters())
        worst_weight = max(rel(weight, weights[n].detach()) for n, weight in final.items())
        runs.append(dict(family=family, checkpointing=checkpointing, losses=losses, ref_losses=ref_losses,
                         max_rel_grad=worst_grad, max_rel_weight=worst_weight, layer_calls=calls[0],
                         params=sorted(n for n, _ in model.named_parameters()) == sorted(weights)))
    finish(out, runs)


if __name__ == "__main__":
    main(sys.argv[1])
