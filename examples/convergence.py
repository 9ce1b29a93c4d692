"""A transformers LlamaForCausalLM and the same model patched by codagen.hf.apply_codagen, trained on the same data
from the same weights: loss curves overlaid in a PNG (matplotlib, when installed), their largest difference, and
with --bench-steps the training throughput of Hugging Face, Hugging Face + torch.compile, Hugging Face + Liger
(when liger_kernel is installed) and codagen, in one markdown report.

    python examples/convergence.py --preset tiny --steps 5 --out runs/tiny          # CPU, a few seconds
    python examples/convergence.py --preset llama3.2-1b --out runs/llama3.2-1b       # GPU, bf16, < 6 min on an H200

The models are codagen.training's: llama3.2-1b is Llama-3.2-1B's configuration (tied embeddings, llama3 rope scaling,
GQA) with random weights, tiny the tiny preset, tied and scaled alike. The data is synthetic but learnable
(codagen.training.BigramData): token sequences of a fixed random sparse bigram chain, drawn from --seed and the step.
In bf16 the same unpatched model is also trained in fp32: the bf16-vs-fp32 difference of Hugging Face is the scale
that codagen's difference from Hugging Face (both bf16) is measured against.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python examples/convergence.py` puts examples/, not the repository, on the path

import torch  # noqa: E402

import codagen.hf  # noqa: E402  (without a GPU: Triton's interpreter, on before anything imports triton)
from codagen.training import (MODELS, BigramData, hugging_face_kept, initial_state, liger,  # noqa: E402
                              make_model, train)

NEARBY = 5  # steps either side over which Hugging Face's bf16-vs-fp32 difference sets a step's scale (bf16 runs)
# per model: batch, seq, steps, bench steps, dtype, learning rate
DEFAULTS = {"tiny": (2, 16, 20, 0, "float32", 3e-3), "llama3.2-1b": (4, 1024, 100, 10, "bfloat16", 3e-4)}


def plot(curves: dict[str, list[float]], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} is not drawn (pip install matplotlib); the losses are "
              "in losses.json and report.md", file=sys.stderr)
        return False
    figure, axis = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        axis.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(DEFAULTS), default="tiny", help="a model of codagen.training")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--bench-steps", type=int, help="steps per throughput measurement (0: none)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for convergence.png, report.md, losses.json")
    args = parser.parse_args(argv)
    batch, seq, steps, bench_steps, dtype, lr = DEFAULTS[args.preset]
    args.batch, args.seq, args.steps = args.batch or batch, args.seq or seq, args.steps or steps
    args.bench_steps = bench_steps if args.bench_steps is None else args.bench_steps
    args.dtype, args.lr = args.dtype or dtype, args.lr or lr
    args.out.mkdir(parents=True, exist_ok=True)

    config = MODELS[args.preset].config()
    state = initial_state(config, args.seed, args.device)
    data = BigramData(config.vocab_size, args.seed)
    dtype = getattr(torch, args.dtype)
    run_args = dict(batch=args.batch, seq=args.seq, lr=args.lr, device=args.device)

    def run(label, dtype, patch=None):
        model = make_model(config, state, dtype, args.device)
        model = patch(model) if patch else model
        print(f"{label}: {args.steps} steps", flush=True)
        start = time.perf_counter()
        result = train(model, data, args.steps, **run_args)
        print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
        del model
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        return result

    curves = {f"Hugging Face ({args.dtype})": run("hf", dtype)[0],
              f"codagen ({args.dtype})": run("codagen", dtype, codagen.hf.apply_codagen)[0]}
    hf_curve, codagen_curve = curves.values()
    difference = [abs(a - b) for a, b in zip(codagen_curve, hf_curve)]
    summary = {"preset": args.preset, "dtype": args.dtype, "device": args.device, "steps": args.steps,
               "batch": args.batch, "seq": args.seq, "lr": args.lr,
               "max_abs_difference": max(difference),
               "max_rel_difference": max(d / h for d, h in zip(difference, hf_curve))}
    if dtype != torch.float32:
        curves["Hugging Face (float32)"] = run("hf-fp32", torch.float32)[0]
        scale = [abs(a - b) for a, b in zip(hf_curve, curves["Hugging Face (float32)"])]
        summary["max_abs_hf_vs_fp32"] = max(scale)
        summary["steps_within_2x_hf_vs_fp32"] = sum(d <= 2 * s for d, s in zip(difference, scale))
        # the two differences are rounding noise of like size, so step by step one exceeds twice the other at
        # some steps where bf16 and fp32 happen to meet; against HF's difference over the steps around (+-5)
        nearby = [max(scale[max(0, i - NEARBY):i + NEARBY + 1]) for i in range(len(scale))]
        summary["steps_within_2x_nearby_hf_vs_fp32"] = sum(d <= 2 * s for d, s in zip(difference, nearby))
        summary["max_within_2x_max_hf_vs_fp32"] = max(difference) <= 2 * max(scale)

    throughput, left_out = {}, {}
    summary["tokens_per_s"], summary["left_out"] = throughput, left_out
    write(summary, curves, args)  # the curves are on disk before the throughput runs start
    if args.bench_steps > 0:
        def compiled(model):
            model.compile()
            return model
        for label, patch in (("Hugging Face", None), ("Hugging Face + torch.compile", compiled),
                             ("Hugging Face + Liger-Kernel", liger), ("codagen", codagen.hf.apply_codagen)):
            print(f"throughput: {label}", flush=True)
            model = make_model(config, state, dtype, args.device)
            try:
                with hugging_face_kept():
                    model = patch(model) if patch else model
                    # warm-up steps (compilation, autotuning), then the timed steps
                    train(model, data, 2, first_step=args.steps, **run_args)
                    throughput[label] = train(model, data, args.bench_steps + 1, first_step=args.steps + 2,
                                              **run_args)[1]
            except Exception as error:  # Liger-Kernel is optional: any failure of it only drops its row
                if patch is not liger:
                    raise
                left_out[label] = f"{type(error).__name__}: {error}".splitlines()[0]
                print(f"{label} left out: {left_out[label]}", flush=True)
            del model
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
        write(summary, curves, args)
    print(json.dumps(summary, indent=1))
    return summary


def write(summary, curves, args) -> None:
    """convergence.png (when matplotlib is installed), losses.json and report.md in --out."""
    title = f"{args.preset}, {args.dtype}, batch {args.batch} x seq {args.seq}"
    plotted = plot(curves, args.out / "convergence.png", title)
    (args.out / "losses.json").write_text(json.dumps({"summary": summary, "curves": curves}, indent=1) + "\n")
    (args.out / "report.md").write_text(report(summary, curves, plotted, args))


def report(summary, curves, plotted, args) -> str:
    import transformers
    import triton

    throughput = summary["tokens_per_s"]
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device
    versions = f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    lines = [f"# codagen vs Hugging Face: {args.preset}", "", f"{date}; {versions}.", "",
             f"{device}; {args.dtype}; {args.steps} steps of AdamW (lr {args.lr}) on batch {args.batch} x seq "
             f"{args.seq} of a random sparse bigram chain; same initial weights (seed {args.seed}).", "",
             f"- largest |loss difference|, codagen vs Hugging Face ({args.dtype}): "
             f"{summary['max_abs_difference']:.3g} (relative {summary['max_rel_difference']:.3g})"]
    if "max_abs_hf_vs_fp32" in summary:
        lines += [f"- largest |loss difference|, Hugging Face {args.dtype} vs float32: "
                  f"{summary['max_abs_hf_vs_fp32']:.3g}",
                  f"- steps where codagen's difference is within 2x Hugging Face's {args.dtype}-vs-float32 "
                  f"difference at the same step: {summary['steps_within_2x_hf_vs_fp32']} of {args.steps}; at most "
                  f"{NEARBY} steps away: {summary['steps_within_2x_nearby_hf_vs_fp32']} of {args.steps}; largest "
                  f"within 2x largest: {summary['max_within_2x_max_hf_vs_fp32']}"]
    lines += ["", "| step | " + " | ".join(curves) + " |", "|---:|" + "---:|" * len(curves)]
    shown = sorted({0, args.steps - 1, *range(0, args.steps, max(1, args.steps // 10))})
    lines += [f"| {s + 1} | " + " | ".join(f"{c[s]:.4f}" for c in curves.values()) + " |" for s in shown]
    if throughput:
        base = throughput.get("Hugging Face", math.nan)
        lines += ["", f"Training throughput ({args.bench_steps} timed steps after warm-up; forward, backward, "
                      "AdamW):", "", "| model | tokens/s | vs Hugging Face |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:,.0f} | {v / base:.2f}x |" for k, v in throughput.items()]
        lines += [f"| {k} | left out: {why} | |" for k, why in summary["left_out"].items()]
    if plotted:
        lines += ["", "![loss curves](convergence.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
