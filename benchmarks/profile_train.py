"""Where a training step's GPU time goes: a transformers Llama as it is, compiled, with Liger-Kernel and patched by
codagen (codagen.training's models and data), each profiled with torch.profiler over a few steps after
warm-up. Writes profile.md: per model, its step time split into GEMMs, codagen's kernels, attention, the optimizer
and the rest, and its most expensive kernels.

    python benchmarks/profile_train.py --preset llama3.2-1b --out runs/profile   # GPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from codagen import training  # noqa: E402

# kernel name -> category, first match wins (lower-cased substrings)
CATEGORIES = [("optimizer", ("multi_tensor", "adam", "foreach")),
              ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
              ("GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
              ("Inductor's Triton kernels", ("triton_",)),
              ("PyTorch's own kernels", ("at::native", "at::cuda", "elementwise", "reduce_kernel")),
              ("other Triton kernels (codagen's or Liger's)", ("_kernel",))]


def category(name: str) -> str:
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other"


def kernel_events(prof, on_gpu: bool) -> list[tuple[object, float]]:
    """The profile's kernels as (event, us): on the GPU every kernel (and copy) by its duration, on the CPU every
    operator by its own time (outside the operators it calls: the times add up to the whole)."""
    found = []
    for event in prof.events():
        if getattr(event, "is_user_annotation", False):
            continue  # a range such as Optimizer.step#AdamW.step: its kernels are counted themselves
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            found.append((event, event.time_range.elapsed_us()))
        elif not on_gpu and event.device_type == torch.autograd.DeviceType.CPU:
            found.append((event, event.self_cpu_time_total))
    return found


def profile(model, data, args, steps: int) -> tuple[float, float, list[tuple[str, float, int]]]:
    """Wall ms per step (profiled, so a little slower than unprofiled), kernel ms per step, and every kernel's
    (name, total ms per step, calls per step); on the CPU, the operators' own time."""
    run = dict(batch=args.batch, seq=args.seq, lr=args.lr, device=args.device)
    training.train(model, data, 3, **run)  # warm-up: compilation, autotuning
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _, tokens_per_s = training.train(model, data, steps + 1, first_step=3, **run)  # the first step is not timed
    kernels = {}
    for event, us in kernel_events(prof, torch.device(args.device).type == "cuda"):
        total, calls = kernels.get(event.name, (0.0, 0))
        kernels[event.name] = (total + us / 1e3 / (steps + 1), calls + 1)
    rows = sorted(((n, t, c // (steps + 1)) for n, (t, c) in kernels.items()), key=lambda r: -r[1])
    wall = 1e3 * args.batch * args.seq / tokens_per_s
    return wall, sum(t for _, t, _ in rows), rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(training.MODELS), default="llama3.2-1b",
                    help="a model of codagen.training")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.lr = 3e-4
    args.out.mkdir(parents=True, exist_ok=True)

    import codagen.hf
    import transformers

    config = training.MODELS[args.preset].config()
    state = training.initial_state(config, 0, args.device)
    data = training.BigramData(config.vocab_size, 0)

    def compiled(model):
        model.compile()
        return model

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"# Training step profile: {args.preset}, bfloat16, batch {args.batch} x seq {args.seq}", "",
             f"{where}; torch {torch.__version__}, transformers {transformers.__version__}; "
             f"A step's wall time (under the profiler) and its kernels' time, the mean of {args.steps + 1} profiled "
             "steps after 3 warm-up steps; where the kernels' time is well below the wall time, the GPU waits for "
             "the host.", ""]
    for label, patch in (("Hugging Face", None), ("Hugging Face + torch.compile", compiled),
                         ("Hugging Face + Liger-Kernel", training.liger), ("codagen", codagen.hf.apply_codagen)):
        print(label, flush=True)
        model = training.make_model(config, state, torch.bfloat16, args.device)
        try:
            with training.hugging_face_kept():
                model = patch(model) if patch else model
                wall, busy, rows = profile(model, data, args, args.steps)
        except Exception as error:  # Liger-Kernel is optional, as in examples/convergence.py
            if patch is not training.liger:
                raise
            lines += [f"## {label}", "", f"left out: {error}", ""]
            continue
        finally:
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
        split = {}
        for name, ms, _ in rows:
            split[category(name)] = split.get(category(name), 0.0) + ms
        lines += [f"## {label}: {wall:.1f} ms per step, {busy:.1f} ms of it in kernels", "",
                  "| part | ms per step | share of the kernels' time |",
                  "|---|---:|---:|"]
        lines += [f"| {k} | {v:.2f} | {v / busy:.0%} |" for k, v in sorted(split.items(), key=lambda kv: -kv[1])]
        lines += ["", "| kernel | ms per step | calls per step |", "|---|---:|---:|"]
        lines += [f"| `{n[:90]}` | {t:.2f} | {c} |" for n, t, c in rows[:args.top]]
        lines.append("")
        (args.out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
