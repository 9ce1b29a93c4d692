"""Train the small Llama of codagen/models/llama.py (generated blocks) or its plain-PyTorch reference on synthetic data,
in one process or data-parallel (DDP or FSDP2), and log loss and step time.

    python examples/train_llama.py --preset tiny --steps 3                                   # one process
    torchrun --nproc-per-node 2 examples/train_llama.py --mode ddp --preset tiny --steps 3
    torchrun --nproc-per-node 2 examples/train_llama.py --mode fsdp2 --preset llama-100m --log-file run.jsonl

Every world size trains on the same global batch (--global-batch sequences of --seq tokens, drawn from --seed and
the step number); rank r takes the r-th contiguous chunk of --global-batch / world rows. The loss is each rank's
mean cross-entropy over its tokens, and DDP and FSDP2 average gradients over ranks: with the same token count on
every rank and no ignored targets (the synthetic data has none), that is the gradient of the mean over the global
batch, so the losses match the one-process run step by step. (With ignore_index targets the per-rank means would
weigh ranks by their valid-token counts wrongly; sum-reduce and divide by the global valid count instead.)

--model plain trains codagen.models.llama.PlainLlama from the same initial weights (codagen.convert maps them), so
the two can be compared loss for loss and step time for step time.

FSDP2: fully_shard on each layer's PreAttention and PostAttention, on the LmHeadLoss block and on the root (the
embedding); for PlainLlama, on each layer's submodules as one group, and on the root (embedding, norm, LM head).
CodagenLlama reads some norm weights outside the block that owns them: layers[0].pre.wn goes into NormStats,
layers[i+1].pre.wn (or head.wn) into layers[i].post, which computes the next norm's input in its epilogue. FSDP2
unshards a block's parameters only inside that block's forward, so at those reads they would be sharded DTensors
(which the kernels cannot take). Those norm weights (dim elements each) are therefore left out of the FSDP groups
(ignored_params), kept whole on every rank, and their gradients are averaged here with one all-reduce per step.

--log-file FILE (or --log FILE outside torchrun) writes JSON lines (rank 0): {"config": ...} first, then
{"step", "loss", "step_time_s", "tokens_per_s"} per step, then {"summary": ...} (median step time after --warmup
steps). Step time is zero_grad, forward, backward, gradient averaging and the optimizer step, between two CUDA
synchronizations.

--preset names a Llama preset of codagen/presets.py (the one table of model dimensions); --dim, --layers, ... override
its dimensions.

The 2-GPU measurement (the llama-100m preset in bf16, codagen against plain, 1 GPU against DDP and FSDP2):

    A="--preset llama-100m --dtype bfloat16 --steps 20 --warmup 5 --global-batch 16 --seq 2048 --lr 3e-4 --no-progress"
    for model in codagen plain; do
      CUDA_VISIBLE_DEVICES=0 python examples/train_llama.py --mode single --model $model $A --log-file 1gpu_$model.jsonl
      for mode in ddp fsdp2; do
        torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 examples/train_llama.py \
          --mode $mode --model $model $A --log-file ${mode}_$model.jsonl
      done
    done
"""
from __future__ import annotations

import os

# The GPU machines require NVLink multicast off; both variables are read when the first communicator is made,
# and they mean nothing without NCCL, so they are set before anything else.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python examples/train_llama.py` puts examples/, not the repository, on the path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from codagen import runtime  # noqa: E402,F401  (before triton: the interpreter where there is no GPU)
from codagen.convert import LlamaShape, from_hf  # noqa: E402
from codagen import training  # noqa: E402
from codagen.presets import PRESETS  # noqa: E402
from codagen.models.llama import CodagenLlama, PlainLlama  # noqa: E402
from generated.blocks import LmHeadLoss, NormStats, PostAttention, PreAttention  # noqa: E402

LLAMAS = sorted(name for name, shape in PRESETS.items() if shape.family == "llama")  # what CodagenLlama builds
SHAPE_ARGS = ("dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "n_layers", "vocab")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("single", "ddp", "fsdp2"), default="single")
    p.add_argument("--model", choices=("codagen", "plain"), default="codagen")
    p.add_argument("--preset", choices=LLAMAS, default="tiny", help="a Llama preset of codagen/presets.py")
    aliases = {"n_layers": ["--layers"], "n_heads": ["--heads"], "n_kv_heads": ["--kv-heads"], "ffn_dim": ["--ffn"]}
    for name in SHAPE_ARGS:
        p.add_argument("--" + name.replace("_", "-"), *aliases.get(name, []), dest=name, type=int, default=None,
                       help=f"overrides the preset's {name}")
    p.add_argument("--rope-theta", type=float, default=None, help="overrides the preset's rope_theta")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="parameter and activation dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (fixed)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--chunk-rows", type=int, default=2048, help="LmHeadLoss's backward row chunk")
    p.add_argument("--backend", default="auto", help="process-group backend (auto: nccl on CUDA, gloo on the CPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--reshard-after-forward", choices=("true", "false"), default="true",
                   help="FSDP2's reshard_after_forward for the layer blocks and the LM head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the summary's step time")
    p.add_argument("--log-file", "--log", dest="log", type=Path, default=None,
                   help="JSON-lines log (rank 0); under torchrun spell it --log-file (torchrun's own parser\n"
                        "takes a bare --log for an abbreviation of its --log-dir and fails)")
    p.add_argument("--save", type=Path, default=None, help="torch.save the final full float32 state dict (rank 0)")
    p.add_argument("--check", action="store_true",
                   help="FSDP2: assert that every block sees plain (unsharded) tensors and that the LM head's "
                        "weight is resharded between forward and backward")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    overrides = {k: getattr(args, k) for k in (*SHAPE_ARGS, "rope_theta") if getattr(args, k) is not None}
    args.shape = dataclasses.replace(PRESETS[args.preset], **overrides)
    return args


# ---- data ------------------------------------------------------------------------------------------------

def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's [batch, seq] tokens and targets, on the CPU, the same for every world size: each row counts
    through the vocabulary from a random start with a random stride (so there is something to learn), with one
    token in ten replaced by a random one. No target is ignore_index."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    rows = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    rows = torch.where(noise, torch.randint(0, vocab, (batch, seq + 1), generator=g), rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def local_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = t.shape[0] // world
    return t[rank * per_rank:(rank + 1) * per_rank]


# ---- model -----------------------------------------------------------------------------------------------

def initial_state(shape: LlamaShape, seed: int) -> dict[str, torch.Tensor]:
    """Initial weights in Hugging Face's layout, float32 on the CPU, from the seed alone: norm weights one,
    every matrix (embedding and LM head included) normal(0, 0.02)."""
    g = torch.Generator().manual_seed(seed)
    ref = PlainLlama(shape, device="meta")
    return {name: (torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02)
            for name, p in ref.named_parameters()}


def build_model(args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    state = initial_state(args.shape, args.seed)
    if args.model == "plain":
        model = PlainLlama(args.shape, device=device, dtype=dtype)
    else:
        model = CodagenLlama(args.shape, chunk_rows=args.chunk_rows, device=device, dtype=dtype)
        state = from_hf(state, args.shape)
    model.load_state_dict(state)
    return model


def cross_block_norm_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """CodagenLlama's norm weights that are read outside the forward of the block that owns them."""
    if not isinstance(model, CodagenLlama):
        return []
    return [layer.pre.wn for layer in model.layers] + [model.head.wn]


def apply_fsdp2(model: torch.nn.Module, mesh, reshard_after_forward: bool) -> list[torch.nn.Parameter]:
    """fully_shard bottom-up; returns the parameters left replicated (their gradients are averaged by hand)."""
    from torch.distributed.fsdp import fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    replicated = cross_block_norm_weights(model)
    if isinstance(model, CodagenLlama):
        for layer in model.layers:
            fully_shard(layer.pre, ignored_params={layer.pre.wn}, **kw)
            fully_shard(layer.post, **kw)
        fully_shard(model.head, ignored_params={model.head.wn}, **kw)
    else:
        # PlainLlama's layers are containers without a forward (its forward calls their submodules), so FSDP's
        # forward hooks go on the submodules: one group per layer, gathered when its first submodule runs
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            fully_shard([layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj, layer.post_attention_layernorm,
                         m.gate_proj, m.up_proj, m.down_proj], **kw)
    fully_shard(model, mesh=mesh, ignored_params=set(replicated) or None)
    return replicated


def all_reduce_mean(tensors: list[torch.Tensor], world: int) -> None:
    """Average the tensors over ranks in one collective (gloo has no ReduceOp.AVG)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def install_checks(model: torch.nn.Module, replicated: list[torch.nn.Parameter]) -> dict:
    """FSDP2 (--check): forward pre-hooks, which run after FSDP's (FSDP prepends its own), assert that every
    block's parameters and tensor arguments are plain tensors, the replicated norm weights included."""
    from torch.distributed.tensor import DTensor

    counts = {"block_calls": 0}

    def check(module, args):
        for name, p in module.named_parameters(recurse=False):
            assert type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor), \
                f"{type(module).__name__}.{name} is {type(p).__name__} in the block's forward, not a plain Parameter"
            assert p.untyped_storage().nbytes() >= p.numel() * p.element_size(), \
                f"{type(module).__name__}.{name} has no (or a freed) storage in the block's forward"
        for i, a in enumerate(args):
            assert not isinstance(a, DTensor), f"{type(module).__name__} argument {i} is a DTensor"
        counts["block_calls"] += 1

    blocks = [m for m in model.modules() if isinstance(m, (PreAttention, PostAttention, LmHeadLoss, NormStats))]
    for m in blocks:
        m.register_forward_pre_hook(check)
    assert all(not isinstance(p, DTensor) for p in replicated)
    return counts


# ---- progress --------------------------------------------------------------------------------------------

class Progress:
    """tqdm when it is installed, else one line per step (rewritten in place on a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, seconds: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{seconds:.3f}")
            self.bar.update(1)
            return
        done = (step + 1) * 30 // self.total
        line = f"[{'#' * done}{'.' * (30 - done)}] {step + 1}/{self.total} loss {loss:.4f} {seconds:.3f} s/step"
        sys.stderr.write(("\r" + line + ("\n" if step + 1 == self.total else "")) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- training --------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.mode == "single" and world != 1:
        raise SystemExit("--mode single runs in one process; use --mode ddp or fsdp2 under torchrun")
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if use_cuda else torch.float32)
    distributed = args.mode != "single"
    if distributed:
        backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend, **({"device_id": device} if use_cuda else {}))

    torch.manual_seed(args.seed)
    model = build_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    replicated: list[torch.nn.Parameter] = []
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    elif args.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
        replicated = apply_fsdp2(model, mesh, args.reshard_after_forward == "true")
    checks = install_checks(model, replicated) if args.check and args.mode == "fsdp2" else None

    # DTensor (sharded) and plain parameters go in separate groups: foreach kernels do not mix the two
    ids = {id(p) for p in replicated}
    groups = [g for g in ([p for p in model.parameters() if id(p) not in ids], replicated) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=args.lr, weight_decay=args.weight_decay)

    config = dict(mode=args.mode, model=args.model, world=world, device=str(device), dtype=str(dtype).split(".")[1],
                  shape=vars(args.shape), params=n_params, steps=args.steps, global_batch=args.global_batch,
                  seq=args.seq, lr=args.lr, seed=args.seed, torch=torch.__version__,
                  interpreted=runtime.INTERPRETED, gpu=torch.cuda.get_device_name(device) if use_cuda else None)
    if args.mode == "fsdp2":
        config["reshard_after_forward"] = args.reshard_after_forward == "true"
    log = open(args.log, "w") if args.log and rank == 0 else None
    if log:
        log.write(json.dumps({"config": config}) + "\n")
    if rank == 0:
        print(f"{args.model} Llama, {n_params / 1e6:.1f}M parameters, {args.mode} x{world} on {device}, "
              f"{config['dtype']}, global batch {args.global_batch} x {args.seq} tokens", file=sys.stderr)

    progress = Progress(args.steps, rank == 0 and not args.no_progress)
    tokens_per_step = args.global_batch * args.seq
    records = []
    for step in range(args.steps):
        tokens, targets = (local_rows(t, rank, world).to(device)
                           for t in global_batch(step, args.global_batch, args.seq, args.shape.vocab, args.seed))
        if use_cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        if checks is not None and args.reshard_after_forward == "true" and isinstance(model, CodagenLlama):
            from torch.distributed.tensor import DTensor
            assert isinstance(model.head.w_vocab, DTensor), "the LM head was not resharded after its forward"
        loss.backward()
        if distributed:
            all_reduce_mean([p.grad for p in replicated], world)
        opt.step()
        if use_cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        value = loss.detach().float().reshape(1)
        if distributed:
            dist.all_reduce(value)  # the mean over the global batch: every rank has the same token count
            value /= world
        record = dict(step=step, loss=value.item(), step_time_s=seconds, tokens_per_s=tokens_per_step / seconds)
        records.append(record)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        progress.update(step, record["loss"], seconds)
    progress.close()

    timed = [r["step_time_s"] for r in records[args.warmup:]] or [r["step_time_s"] for r in records]
    summary = dict(config, median_step_time_s=statistics.median(timed), timed_steps=len(timed),
                   tokens_per_s=tokens_per_step / statistics.median(timed),
                   first_loss=records[0]["loss"] if records else None,
                   last_loss=records[-1]["loss"] if records else None)
    if checks is not None:
        summary["checked_block_calls"] = checks["block_calls"]
    if use_cuda:
        summary["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    if args.save is not None:
        full = {}
        for name, p in (model.module if args.mode == "ddp" else model).state_dict().items():
            full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
        if rank == 0:
            torch.save(full, args.save)
    if log:
        log.write(json.dumps({"summary": summary}) + "\n")
        log.close()
    if rank == 0:
        print(f"median step {summary['median_step_time_s'] * 1e3:.1f} ms over {len(timed)} steps, "
              f"{summary['tokens_per_s']:.0f} tokens/s; loss {summary['first_loss']:.4f} -> "
              f"{summary['last_loss']:.4f}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
    if "WORLD_SIZE" in os.environ:
        training.leave_process_group()  # gloo may abort a rank in the interpreter's exit-time teardown
