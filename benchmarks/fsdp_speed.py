"""Training speed under FSDP2 on several GPUs: a transformers Llama (Llama-3.1-8B's shape, cut to --layers) sharded
with fully_shard on each decoder layer and on the root, in each variant, from the same initial weights on the same
random tokens; tokens/s and peak memory per GPU, and the final loss. Launch it with torchrun, once per GPU count:

    torchrun --nproc-per-node 8 benchmarks/fsdp_speed.py --out $OUT      # GPUs: nccl, bf16 params, fp32 reduce
    torchrun --nproc-per-node 2 benchmarks/fsdp_speed.py --tiny --seq 32 --variants hf,codagen --out /tmp/x  # CPU

Variants: `hf` (Hugging Face's own), `hf+compile` and `codagen+compile` (torch.compile of each decoder layer after
fully_shard, as torchtitan compiles its blocks), `hf+liger` (Liger-Kernel's apply_liger_kernel_to_llama defaults),
`codagen` (codagen.hf.apply_codagen). A step is training.train_step: forward with labels, backward (FSDP2
reduce-scatters the gradients in fp32), AdamW, zero_grad; each rank feeds its own --batch sequences. Rank 0 writes
`<gpu>-fsdp-<world>.json` (`rows`: {variant, world, tokens_per_s_per_gpu, ms_per_step, peak_mib, loss_final, error})
and a markdown table beside it, and prints each row as a JSON line as it finishes (a variant that raises stops the
run: the ranks would fall out of step). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the GPU machines require.
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # read when the first communicator is made: before torch
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import codagen.hf  # noqa: E402
from codagen import training  # noqa: E402
from train_speed import Skipped, gpu_name, versions, with_liger  # noqa: E402

# Llama-3.1-8B's shape (its layer count cut by --layers); --tiny: a model the CPU runs through Triton's interpreter
SHAPES = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
          "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=512, tie_word_embeddings=False)}
# variant -> (what makes it out of a fresh model before sharding, whether each layer is compiled after sharding)
VARIANTS = {"hf": (lambda model: model, False), "hf+compile": (lambda model: model, True),
            "hf+liger": (with_liger, False), "codagen": (codagen.hf.apply_codagen, False),
            "codagen+compile": (codagen.hf.apply_codagen, True)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU's), not the 8B shape")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="sequences per GPU and step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}: choose among {', '.join(VARIANTS)}")
    return args


def model_of(variant: str, args, device: torch.device, mesh, policy) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**SHAPES["tiny" if args.tiny else "8b"], num_hidden_layers=args.layers,
                                      max_position_embeddings=max(args.seq, 64), attn_implementation="sdpa")
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every variant
    with device:
        model = transformers.LlamaForCausalLM(config)
    prepare, compiled = VARIANTS[variant]
    model = prepare(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return model.train()


def run_variant(variant: str, args, device, mesh, policy) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_of(variant, args, device, mesh, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    vocab = model.config.vocab_size
    losses, started = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            training.sync(device)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * world + rank)
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        losses.append(training.train_step(model, optimizer, ids))
    training.sync(device)
    dist.barrier()
    seconds = time.perf_counter() - started
    loss = torch.stack(losses[-1:]).float().sum()
    dist.all_reduce(loss)
    loss = loss.item() / world
    if not math.isfinite(loss):
        raise FloatingPointError(f"{variant}: the final loss is {loss}")
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return dict(tokens_per_s_per_gpu=args.batch * args.seq * args.steps / seconds,
                ms_per_step=1e3 * seconds / args.steps, peak_mib=peak, loss_final=loss)


def markdown(report: dict) -> str:
    lines = [f"# FSDP2 training speed: {report['gpu']}, {report['world']} processes", "",
             f"{report['date']}; {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.", "",
             f"`{report['command']}`", "",
             "| variant | tokens/s per GPU | ms/step | peak MiB per GPU | final loss | error |",
             "|---|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        if r["error"]:
            lines.append(f"| {r['variant']} | - | - | - | - | {r['error']} |")
        else:
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
            lines.append(f"| {r['variant']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['ms_per_step']:.1f} | {peak} | "
                         f"{r['loss_final']:.4f} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        policy = MixedPrecisionPolicy()  # fp32 throughout on the CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    rows = []
    for variant in args.variants.split(","):
        row = dict(variant=variant, world=world, tokens_per_s_per_gpu=None, ms_per_step=None, peak_mib=None,
                   loss_final=None, error=None)
        try:
            row.update(run_variant(variant, args, device, mesh, policy))
        except Skipped as skipped:  # the same on every rank: Liger not installed
            row["error"] = str(skipped)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
        gc.collect()  # the variant's model and optimizer, before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = None
    if rank == 0:
        report = dict(gpu=gpu_name(), world=world, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      versions=versions(), command="torchrun --nproc-per-node %d benchmarks/fsdp_speed.py %s"
                      % (world, " ".join(sys.argv[1:] if argv is None else argv)), rows=rows)
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{report['gpu']}-fsdp-{world}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
    training.leave_process_group()  # gloo may abort a rank in the interpreter's exit-time teardown
