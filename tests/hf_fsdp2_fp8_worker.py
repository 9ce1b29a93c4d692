"""Worker of tests/test_hf_fsdp2.py's FP8 test, run by torch.distributed.run in 2 CPU processes over gloo: a tiny
random transformers LlamaForCausalLM (fp32 master weights; FP8 shapes: hidden 128, intermediate 256) patched by
codagen.hf with fp8=True, its forward under torch.autocast(bfloat16), fully_shard on each decoder layer and on the
root, trained three SGD steps; against the same patched model unwrapped in one process on the whole batches. Each
step's FP8 weights are made from the weights FSDP2 has just gathered: a copy kept from the step before (the gathered
weight in the same memory, its version unchanged) would train on stale weights. Writes {"world", "runs":
[{"checkpointing", "losses", "ref_losses", "max_rel_grads", "quantized", "ref_quantized", "stale",
"layer_calls"}]} as JSON to argv[1] on rank 0 (max_rel_grads: per step; quantized: the FP8 weight copies made over
the steps; stale: the copies read that were not the quantization of their weight as it was then)."""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from codagen.hf import apply_codagen
from codagen.runtime import fp8
# tests/, the worker's folder, is on sys.path
from hf_fsdp2_worker import BATCH, SEQ, VOCAB, finish, full, random_causal_lm, rel, shard_layers, start

STEPS = 3
FP8_SHAPE = dict(hidden_size=128, intermediate_size=256)  # the FP8 blocks quantize in groups of 128 columns


def main(out: str) -> None:
    rank, world, mesh = start()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    made, stale = [0], [0]
    quantize_blocks, get = fp8.quantize_blocks, fp8.BlockQuantized.get

    def counted(*args, **kwargs):
        made[0] += 1
        return quantize_blocks(*args, **kwargs)

    def checked(copy):
        """The copy get() gives, against the weight as it is now, quantized afresh."""
        values, scales = get(copy)
        want_values, want_scales = quantize_blocks(copy.weight.detach(), copy.block)
        stale[0] += not (torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
                         and torch.equal(scales, want_scales))
        return values, scales

    fp8.quantize_blocks, fp8.BlockQuantized.get = counted, checked
    runs = []
    for checkpointing in (False, True):
        reference = apply_codagen(random_causal_lm("llama", **FP8_SHAPE), fp8=True)
        model = copy.deepcopy(reference)
        if rank != 0:
            reference = None  # rank 0 compares; the others take part in the collectives only
        calls = shard_layers(model.model.layers, mesh)
        fully_shard(model, mesh=mesh)
        optimizers = []
        for m in filter(None, (model, reference)):
            m.train()
            if checkpointing:
                m.gradient_checkpointing_enable()
            optimizers.append(torch.optim.SGD(m.parameters(), lr=0.5))
        losses, ref_losses, grads, quantized, ref_quantized = [], [], [], 0, 0
        stale[0] = 0
        for ids in batches:
            made[0] = 0
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(input_ids=ids[rank: rank + 1], labels=ids[rank: rank + 1]).loss
            loss.backward()
            quantized += made[0]
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            gathered = {n: full(p.grad) for n, p in model.named_parameters()}
            if reference is not None:
                made[0] = 0
                with torch.autocast("cpu", torch.bfloat16):
                    ref_loss = reference(input_ids=ids, labels=ids).loss
                ref_loss.backward()
                ref_quantized += made[0]
                ref_losses.append(ref_loss.item())
                expected = dict(reference.named_parameters())
                grads.append(max(rel(grad, expected[n].grad) for n, grad in gathered.items()))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        runs.append(dict(checkpointing=checkpointing, losses=losses, ref_losses=ref_losses, max_rel_grads=grads,
                         quantized=quantized, ref_quantized=ref_quantized,
                         stale=stale[0], layer_calls=calls[0]))
    finish(out, runs)


if __name__ == "__main__":
    main(sys.argv[1])
