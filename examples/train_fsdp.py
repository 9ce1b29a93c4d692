"""Train a transformers Llama patched by codagen.hf with FSDP2: fully_shard on each decoder layer and on the root,
activation checkpointing per layer, on synthetic data. Launch it with torchrun:

    torchrun --nproc-per-node 2 examples/train_fsdp.py                     # CPU: gloo, fp32 (tiny model)
    torchrun --nproc-per-node 8 examples/train_fsdp.py --hidden 2048 --intermediate 8192 --layers 16 \\
        --heads 32 --kv-heads 8 --vocab 128256 --seq 2048 --batch 4        # GPUs: nccl, bf16 params, fp32 reduce

On GPUs each rank takes the GPU of its LOCAL_RANK and FSDP2's MixedPrecisionPolicy gathers the parameters in bf16
for the forward and backward and reduce-scatters the gradients in fp32 (the sharded parameters and the optimizer
stay fp32). On the CPU the process group is gloo and everything is fp32 (the kernels run through Triton's
interpreter there: keep the model tiny).

The order matters: apply_codagen before fully_shard (the patch checks the module classes; docs/huggingface.md),
then gradient checkpointing, which checkpoints each decoder layer's call (non-reentrant: the layer's blocks and
attention run again in the backward, FSDP2's all-gather of the layer included), then fully_shard on each layer and on
the root, then the optimizer (over the sharded parameters).

Every rank draws its own batch (--batch sequences of --seq tokens from --seed, the rank and the step); each rank's
loss is its mean, and FSDP2 averages the gradients over ranks. Rank 0 prints one line per step, and with --log-file
writes them as JSON lines. docs/distributed.md lists what else codagen runs under torch.distributed.
"""
from __future__ import annotations

import os

# The GPU machines require NVLink multicast off; both are read when the first communicator is made, and mean
# nothing without NCCL, so they are set before torch is imported.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `torchrun examples/train_fsdp.py` puts examples/, not the repository, on the path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from codagen import training  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=160)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (fixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    p.add_argument("--log-file", type=Path, default=None, help="JSON lines, one per step (rank 0)")
    return p.parse_args(argv)


def build_model(args, device: torch.device) -> torch.nn.Module:
    import transformers

    from codagen.hf import apply_codagen

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 64), attn_implementation="sdpa")
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before fully_shard shards them
    with device:
        model = transformers.LlamaForCausalLM(config)
    return apply_codagen(model)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    model = build_model(args, device)
    model.train()
    if not args.no_checkpointing:
        # transformers >= 5.x names it activation_checkpointing_enable; earlier, gradient_checkpointing_enable
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    # bf16 compute, fp32 gradient reduction and fp32 shards on GPUs; fp32 throughout on the CPU
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_cuda
              else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    records = []
    log = open(args.log_file, "w") if args.log_file and rank == 0 else None
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * world + rank)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        start = time.perf_counter()
        mean_loss = training.train_step(model, optimizer, ids).float()
        dist.all_reduce(mean_loss)
        record = dict(step=step, loss=mean_loss.item() / world, step_time_s=time.perf_counter() - start)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {step}: the loss is {record['loss']}")
        records.append(record)
        if rank == 0:
            print(f"step {step}  loss {record['loss']:.4f}  {record['step_time_s']:.2f} s", flush=True)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
    if log:
        log.close()
    return records


if __name__ == "__main__":
    main()
    training.leave_process_group()  # gloo may abort a rank in the interpreter's exit-time teardown
