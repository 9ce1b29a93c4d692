"""Training speed of a transformers LlamaForCausalLM: Hugging Face as it is, compiled and with Liger-Kernel, against
the same model patched by codagen (as it is, compiled, and compiled with CUDA graphs; and with its FP8 blocks,
apply_codagen(fp8=True), compared apart), each variant from the same initial weights on the same random token
batches, in one process.

    python3 benchmarks/train_speed.py --out $OUT                                  # every GPU case
    python3 benchmarks/train_speed.py --cases 1b-4x1024-bf16,1b-4x1024-amp --out $OUT
    python3 benchmarks/train_speed.py --merge a/nvidia-h200-train-speed.json b/nvidia-h200-train-speed.json --out DIR
    python benchmarks/train_speed.py --cases tiny-2x16-bf16 --variants hf,codagen --out /tmp/ts   # CPU

A step is the forward with labels, the backward, a fused AdamW step and zero_grad. Per case (model, batch x seq,
precision) and variant: --warmup steps, whose host time is the warm-up (compilation, JIT, tuning); --steps steps timed
with CUDA events (tokens/s, ms/step, peak memory); --profile-steps steps under torch.profiler, for the share of
their wall time in which no kernel runs (idle) and, from Hugging Face's own kernels, the case's limit: the time
per step of its GEMM, attention and optimizer kernels, what is left if everything else were free. Precision bf16:
bfloat16 parameters; amp: fp32 parameters, the forward under torch.autocast(bfloat16), as Trainer(bf16=True).

Writes <gpu>-train-speed.json, .md and .png (the chart: when matplotlib is installed) into --out after every
variant, so a run cut off by a time limit keeps the variants it finished; --variant-limit ends a variant that runs
longer (a compilation that never finishes) with an error in its row and goes on; --traces and --host-profile
write the profiled steps' Chrome traces (with a table of their kernels by name) and a cProfile of the host's time
per variant; --merge joins the JSONs of several runs on one GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import faulthandler
import gc
import io
import importlib.util
import json
import math
import pstats
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _path in (str(HERE), str(HERE.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import codagen.hf  # noqa: E402  (without a GPU: Triton's interpreter, on before anything imports triton)
from codagen import training  # noqa: E402
from profile_train import category, kernel_events  # noqa: E402

# a case's model (the first part of its name) -> codagen.training's
MODELS = {"tiny": training.MODELS["tiny"], "1b": training.MODELS["llama3.2-1b"],
          "8b": training.MODELS["llama3.1-8b-4-layers"]}
PRECISIONS = ("bf16", "amp")
LR = 3e-4
# the kernels of the limit: what a step needs whatever else is fused away (profile_train's categories)
LIMIT_PARTS = ("GEMM (cuBLAS)", "attention", "optimizer")
PEERS = ("hf+compile", "hf+liger")
METHOD = ("A step: forward with labels, backward, AdamW (fused on the GPU), zero_grad; random tokens, the same initial "
          "weights and batches for every variant of a case. tokens/s and ms/step: the timed steps after the warm-up "
          "(CUDA events; the wall clock on the CPU); host ms: the host's time per timed step until the last step's "
          "work was queued (near ms/step: the GPU waited for the host); warm-up s: the warm-up steps' host time (compilation, tuning); "
          "peak and reserved: torch.cuda.max_memory_allocated and max_memory_reserved over the timed steps (CUDA "
          "graphs' private memory pool counts in reserved only); idle: the profiled steps' wall time in which "
          "no kernel ran; limit: Hugging Face's GEMM, attention and optimizer kernels per step; loss diff: |final "
          "loss - hf's| / hf's. bf16: bfloat16 parameters; amp: fp32 parameters, the forward under "
          "torch.autocast(bfloat16).")


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    seq: int
    precision: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.batch}x{self.seq}-{self.precision}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


GPU_CASES = [Case(model, batch, seq, precision)
             for model, batch, seq in (("1b", 2, 1024), ("1b", 4, 1024), ("1b", 4, 2048), ("1b", 8, 4096),
                                       ("8b", 4, 2048))
             for precision in PRECISIONS]
CASES = {case.name: case for case in GPU_CASES + [Case("tiny", 2, 16, p) for p in PRECISIONS]}


class Skipped(Exception):
    """A variant that cannot run here: its message is the row's error as it is."""


def with_liger(model):
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skipped("liger_kernel not installed")
    return training.liger(model)


def codagen_cudagraphs(model):
    """The patched model's steps replayed as CUDA graphs (torch.compile's cudagraphs backend: Dynamo captures the
    forward and backward, no Inductor): no host work per launch."""
    if not torch.cuda.is_available():
        raise Skipped("CUDA graphs need a GPU: skipped on the CPU")
    return torch.compile(codagen.hf.apply_codagen(model), backend="cudagraphs")


def codagen_reduce_overhead(model, **options):
    """torch.compile's mode="reduce-overhead" over the patched model: Inductor fuses the glue between codagen's ops,
    and the compiled graphs replay as CUDA graphs."""
    if not torch.cuda.is_available():
        raise Skipped("CUDA graphs need a GPU: skipped on the CPU")
    return torch.compile(codagen.hf.apply_codagen(model, **options), mode="reduce-overhead")


# variant -> how it makes its model out of a fresh Hugging Face one
VARIANTS = {
    "hf": lambda model: model,
    "hf+compile": torch.compile,
    "hf+liger": with_liger,
    "codagen": codagen.hf.apply_codagen,
    "codagen+compile": lambda model: torch.compile(codagen.hf.apply_codagen(model)),
    "codagen+cudagraphs": codagen_cudagraphs,
    "codagen+reduce-overhead": codagen_reduce_overhead,
    # the q/k/v, gate/up and down projections in FP8 (apply_codagen(fp8=True)): compared apart from the bf16 variants
    "codagen-fp8": lambda model: codagen.hf.apply_codagen(model, fp8=True),
    "codagen-fp8+reduce-overhead": lambda model: codagen_reduce_overhead(model, fp8=True),
}
FP8_VARIANTS = ("codagen-fp8", "codagen-fp8+reduce-overhead")
# a step's outputs are overwritten at the next replay
CUDA_GRAPHS = ("codagen+cudagraphs", "codagen+reduce-overhead", "codagen-fp8+reduce-overhead")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu_name() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]", "-", name.lower())


# ---- one case ----

def token_batches(case: Case, vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    """Every step's input_ids (the labels too), the same for every variant; made before any timing."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (case.batch, case.seq), generator=generator).to(device()) for _ in range(count)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(run) -> tuple[list, float, float]:
    """run()'s result, its time (CUDA events on the GPU: the GPU's time, its waits for the host included; the wall
    clock on the CPU) and the host's time until run() returned (less than the first where the host ran ahead)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        result = run()
        ms = 1e3 * (time.perf_counter() - start)
        return result, ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_start = time.perf_counter()
    result = run()
    host_ms = 1e3 * (time.perf_counter() - host_start)
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end), host_ms


def profiled(run, trace: Path | None = None) -> tuple[list, float, list]:
    """run()'s result, its wall ms (synchronized at both ends) and its kernels (profile_train.kernel_events); the
    profile as a Chrome trace (gzipped) to trace when given."""
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        result = run()
        sync()
        wall_ms = 1e3 * (time.perf_counter() - start)
    kernels = kernel_events(prof, on_gpu)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))  # a name ending in .gz is written gzipped
        trace.with_name(trace.name.split(".")[0] + "-kernels.txt").write_text(kernel_table(kernels))
    return result, wall_ms, kernels


def kernel_table(kernels: list) -> str:
    """The profiled steps' kernels by name, the most expensive first: total us, calls, category (to compare two
    variants' GPU work kernel by kernel, with no trace viewer)."""
    totals: dict[str, list] = {}
    for event, us in kernels:
        total = totals.setdefault(event.name, [0.0, 0])
        total[0] += us
        total[1] += 1
    lines = [f"{'us':>12} {'calls':>6}  category / kernel"]
    lines += [f"{us:12.1f} {calls:6d}  {category(name)} / {name[:160]}"
              for name, (us, calls) in sorted(totals.items(), key=lambda item: -item[1][0])]
    return "\n".join(lines) + "\n"


def host_profile(run, path: Path) -> None:
    """run() under cProfile, synchronized at the end; its functions by own time and by cumulative time to path."""
    profile = cProfile.Profile()
    profile.runcall(run)
    sync()
    text = io.StringIO()
    for order in ("tottime", "cumtime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(50)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def busy_ms(kernels: list) -> float:
    """The union of the kernels' intervals: overlapping kernels (streams) count once."""
    total, end = 0.0, -math.inf
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e, _ in kernels):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def limit_ms(kernels: list, steps: int) -> float:
    return sum(us for event, us in kernels if category(event.name) in LIMIT_PARTS) / 1e3 / steps


def measure(case: Case, variant: str, config, state: dict, batches: list, args) -> tuple[dict, float]:
    """One variant trained on the case's batches: its row's measured fields, and its limit (GEMM, attention and
    optimizer kernels' ms per step)."""
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    model = VARIANTS[variant](training.make_model(config, state, dtype, device()).train())
    optimizer = training.adamw(model, LR, fused=torch.cuda.is_available())
    amp, cudagraphs = case.precision == "amp", variant in CUDA_GRAPHS

    def steps(first: int, count: int) -> list:
        return [training.train_step(model, optimizer, tokens, amp, cudagraphs)
                for tokens in batches[first:first + count]]

    dynamo = torch._dynamo.utils.counters
    dynamo.clear()
    start, losses = time.perf_counter(), []
    for step in range(args.warmup):  # each step's time in the log: a run cut off by its limit shows where it was
        losses += steps(step, 1)
        sync()
        print(f"  {case.name} {variant}: warm-up step {step + 1} done at {time.perf_counter() - start:.1f} s",
              flush=True)
    warmup_s = time.perf_counter() - start
    graphs = dynamo["stats"]["unique_graphs"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # after the warm-up: the steady state, not compilation's autotuning
    timed_losses, ms, host_ms = timed_ms(lambda: steps(args.warmup, args.steps))
    # CUDA graphs keep their tensors in a private pool that max_memory_allocated misses; the pool is reserved memory
    peak_mib, reserved_mib = ((torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20)
                              if torch.cuda.is_available() else (None, None))
    # torch.compile's work: the graphs of the warm-up, the graph breaks, and graphs compiled again once timed
    compiled = {"graphs": graphs, "graph_breaks": sum(dynamo["graph_break"].values()),
                "recompiles": dynamo["stats"]["unique_graphs"] - graphs} if "compile" in variant or "cuda" in variant \
        else {"graphs": None, "graph_breaks": None, "recompiles": None}
    idle, limit = None, None
    if args.profile_steps:
        trace = args.out / "traces" / f"{case.name}-{variant.replace('+', '-')}.json.gz" if args.traces else None
        profile_losses, wall_ms, kernels = profiled(lambda: steps(args.warmup + args.steps, args.profile_steps), trace)
        timed_losses += profile_losses
        idle = 1 - busy_ms(kernels) / wall_ms if torch.cuda.is_available() else None
        limit = limit_ms(kernels, args.profile_steps)
    if args.host_profile:  # the timed steps' batches once more under cProfile: where the host's time goes
        host_profile(lambda: steps(args.warmup, args.steps),
                     args.out / "host" / f"{case.name}-{variant.replace('+', '-')}.txt")
    fields = {"tokens_per_s": case.tokens * args.steps / (ms / 1e3), "ms_per_step": ms / args.steps,
              "host_ms_per_step": host_ms / args.steps,
              "peak_mib": peak_mib, "reserved_mib": reserved_mib, "warmup_s": warmup_s,
              "losses": torch.stack(losses + timed_losses).tolist(), "idle_fraction": idle, **compiled}
    return fields, limit


def free() -> None:
    torch._dynamo.reset()  # compiled graphs and CUDA graphs' memory pools
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_message(error: Exception) -> str:
    if isinstance(error, Skipped):
        return str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class VariantTimeout(Exception):
    """A variant still running after --variant-limit seconds (SIGALRM)."""


def over_time(signum, frame):
    raise VariantTimeout("did not finish within --variant-limit")


def run_case(case: Case, args, report: dict) -> None:
    """Every variant of one case into the report's rows, the report written after each; Hugging Face's kernels give
    the case's limit."""
    config = MODELS[case.model].config()
    state = training.initial_state(config, args.seed, device())
    batches = token_batches(case, config.vocab_size, args.warmup + args.steps + args.profile_steps, args.seed)
    for variant in args.variants:
        row = {"case": case.name, "variant": variant, "tokens_per_s": None, "ms_per_step": None, "peak_mib": None,
               "reserved_mib": None, "warmup_s": None, "host_ms_per_step": None, "losses": [], "loss_diff_final": None,
               "idle_fraction": None, "limit_multiple": None, "graphs": None, "graph_breaks": None, "recompiles": None, "error": None}
        try:
            signal.alarm(args.variant_limit)  # 0: none
            if args.variant_limit > 2:  # where every thread was, into the log: what a variant over its limit waits on
                faulthandler.dump_traceback_later(args.variant_limit - 2)
            with training.hugging_face_kept():
                fields, limit = measure(case, variant, config, state, batches, args)
            signal.alarm(0)
            faulthandler.cancel_dump_traceback_later()
            row.update(fields)
            if variant == "hf" and limit:
                report["limits"][case.name] = limit
        except Exception as error:  # noqa: BLE001  (out of memory included: the run goes on)
            signal.alarm(0)
            faulthandler.cancel_dump_traceback_later()
            row["error"] = error_message(error)
        if "compile" in variant or "cuda" in variant:  # where torch.compile's time went, finished or not
            print(torch._dynamo.utils.compile_times(), flush=True)
        free()  # after the except clause: the traceback held the variant's model
        report["rows"].append(row)
        compare(report["rows"], report["limits"])
        print(row_line(row), flush=True)
        print(f"wrote {write(report, args.out, args.tag)}", flush=True)


def compare(rows: list[dict], limits: dict) -> None:
    """Each row against its case: the final loss against Hugging Face's, ms/step as a multiple of the limit."""
    hf_final = {r["case"]: r["losses"][-1] for r in rows if r["variant"] == "hf" and r["losses"]}
    for row in rows:
        final, limit = hf_final.get(row["case"]), limits.get(row["case"])
        row["loss_diff_final"] = abs(row["losses"][-1] - final) / final if final and row["losses"] else None
        row["limit_multiple"] = row["ms_per_step"] / limit if limit and row["ms_per_step"] else None


def row_line(row: dict) -> str:
    if row["error"]:
        return f"{row['case']} {row['variant']}: error: {row['error']}"
    return (f"{row['case']} {row['variant']}: {row['tokens_per_s']:,.0f} tokens/s, {row['ms_per_step']:.1f} ms/step "
            f"({fmt(row['limit_multiple'], '.2f')}x limit; host {fmt(row['host_ms_per_step'], '.1f')} ms), peak {fmt(row['peak_mib'], ',.0f')} MiB "
            f"(reserved {fmt(row['reserved_mib'], ',.0f')}), warm-up "
            f"{row['warmup_s']:.1f} s, idle {fmt(row['idle_fraction'], '.0%')}, final loss {row['losses'][-1]:.4f} "
            f"(vs hf {fmt(row['loss_diff_final'], '.1e')})"
            + (f", {row['graphs']} graph(s), {row['graph_breaks']} break(s), {row['recompiles']} recompile(s)"
               if row["graphs"] is not None else ""))


# ---- the report ----

def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import transformers
    import triton

    try:
        liger = version("liger-kernel")
    except PackageNotFoundError:
        liger = None
    driver = None
    if torch.cuda.is_available():
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            driver = smi.stdout.split("\n")[0].strip() or None
        except OSError:  # no nvidia-smi on this machine
            pass
    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "liger_kernel": liger, "driver": driver}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def best(rows: list[dict], variants) -> dict | None:
    ran = [r for r in rows if r["variant"] in variants and r["tokens_per_s"]]
    return max(ran, key=lambda r: r["tokens_per_s"], default=None)


def compile_counts(row: dict) -> str:
    if row.get("graphs") is None:
        return "-"
    return f"{row['graphs']} / {row['graph_breaks']} / {row['recompiles']}"


def case_table(rows: list[dict], limit: float | None) -> list[str]:
    peer = best(rows, PEERS)
    lines = ["| variant | tokens/s | vs best peer | ms/step | x limit | host ms | peak MiB | reserved MiB | warm-up s | "
             "idle | loss diff | graphs / breaks / recompiles | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        vs_peer = r["tokens_per_s"] / peer["tokens_per_s"] if peer and r["tokens_per_s"] else None
        lines.append(f"| {r['variant']} | {fmt(r['tokens_per_s'], ',.0f')} | {fmt(vs_peer, '.2f')} | "
                     f"{fmt(r['ms_per_step'], '.1f')} | {fmt(r['limit_multiple'], '.2f')} | "
                     f"{fmt(r.get('host_ms_per_step'), '.1f')} | {fmt(r['peak_mib'], ',.0f')} | {fmt(r['reserved_mib'], ',.0f')} | {fmt(r['warmup_s'], '.1f')} | "
                     f"{fmt(r['idle_fraction'], '.0%')} | "
                     f"{fmt(r['loss_diff_final'], '.1e')} | {compile_counts(r)} | "
                     f"{(r['error'] or '')[:200].replace('|', '/')} |")
    title = f"limit {limit:.1f} ms/step" if limit else "no limit: hf did not run"
    return [f"({title}; vs best peer: tokens/s over the best of {' and '.join(PEERS)})", ""] + lines


def summary_table(by_case: dict[str, list[dict]]) -> list[str]:
    """Per case: the best peer, the best bf16 codagen variant against it, and the best FP8 one (FP8_VARIANTS)."""
    lines = ["| case | best peer | tokens/s | best codagen | tokens/s | codagen / peer | "
             "reserved memory codagen / peer | best codagen FP8 / peer |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for name, rows in by_case.items():
        peer = best(rows, PEERS)
        ours = best(rows, [v for v in VARIANTS if v.startswith("codagen") and v not in FP8_VARIANTS])
        fp8 = best(rows, FP8_VARIANTS)
        speed = ours["tokens_per_s"] / peer["tokens_per_s"] if peer and ours else None
        fp8_speed = fp8["tokens_per_s"] / peer["tokens_per_s"] if peer and fp8 else None
        # reserved, not allocated: CUDA graphs' pool counts there only
        memory = ours["reserved_mib"] / peer["reserved_mib"] if peer and ours and peer["reserved_mib"] else None
        lines.append(f"| {name} | {peer['variant'] if peer else '-'} | {fmt(peer and peer['tokens_per_s'], ',.0f')} "
                     f"| {ours['variant'] if ours else '-'} | {fmt(ours and ours['tokens_per_s'], ',.0f')} | "
                     f"{fmt(speed, '.2f')} | {fmt(memory, '.2f')} | {fmt(fp8_speed, '.2f')} |")
    return lines


def markdown(report: dict, chart: str | None) -> str:
    by_case = {}
    for row in report["rows"]:
        by_case.setdefault(row["case"], []).append(row)
    v = report["versions"]
    models = sorted({CASES[name].model for name in by_case if name in CASES})
    lines = [f"# Training speed: {report['gpu']}", "",
             f"{report['date']}; torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, "
             f"liger_kernel {v['liger_kernel'] or '-'}, driver {v['driver'] or '-'}.", "",
             METHOD, ""]
    lines += [f"- `{m}`: {MODELS[m].note}" for m in models]
    lines += ["", "```sh", report["command"], "```", "", "## Summary", ""] + summary_table(by_case)
    for name, rows in by_case.items():
        lines += ["", f"## {name}", ""] + case_table(rows, report["limits"].get(name))
    lines += ["", f"![tokens/s]({chart})" if chart else "(no chart: matplotlib is not installed)"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """A grouped bar chart of tokens/s: a group per case, a bar per variant."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(dict.fromkeys(r["case"] for r in report["rows"]))
    variants = list(dict.fromkeys(r["variant"] for r in report["rows"]))
    speed = {(r["case"], r["variant"]): r["tokens_per_s"] or 0 for r in report["rows"]}
    width = 0.8 / len(variants)
    figure, axis = plt.subplots(figsize=(max(8, 1.2 * len(cases)), 4.5))
    for i, variant in enumerate(variants):
        axis.bar([c + (i - (len(variants) - 1) / 2) * width for c in range(len(cases))],
                 [speed.get((case, variant), 0) for case in cases], width, label=variant)
    axis.set_xticks(range(len(cases)), cases, rotation=30, ha="right")
    axis.set_ylabel("tokens/s")
    axis.set_title(f"Llama training step, {report['gpu']}")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over them
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write(report: dict, out: Path, tag: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['gpu']}-train-speed" + (f"-{tag}" if tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    chart = f"{stem}.png" if plot(report, out / f"{stem}.png") else None
    (out / f"{stem}.md").write_text(markdown(report, chart))
    return out / f"{stem}.md"


def merge(paths: list[Path]) -> dict:
    """The runs' rows in one report (a later run's row replaces an earlier one of the same case and variant)."""
    reports = [json.loads(p.read_text()) for p in paths]
    gpus = {r["gpu"] for r in reports}
    if len(gpus) > 1:
        raise SystemExit(f"--merge: runs on different GPUs: {', '.join(sorted(gpus))}")
    if any(r["versions"] != reports[-1]["versions"] for r in reports):
        print("--merge: the runs' versions differ; the report gives the last run's", file=sys.stderr)
    rows, limits = {}, {}
    for r in reports:
        rows.update({(row["case"], row["variant"]): row for row in r["rows"]})
        limits.update(r["limits"])
    merged = {**reports[-1], "command": "\n".join(r["command"] for r in reports), "rows": list(rows.values()),
              "limits": limits}
    compare(merged["rows"], limits)
    return merged


def names(text: str, known) -> list[str]:
    chosen = [n for n in text.split(",") if n]
    if not chosen:
        raise argparse.ArgumentTypeError("none named")
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=lambda s: names(s, CASES), default=[c.name for c in GPU_CASES],
                    help="comma-separated (default: every GPU case)")
    ap.add_argument("--variants", type=lambda s: names(s, VARIANTS), default=list(VARIANTS),
                    help="comma-separated (default: all)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the timing (compilation, tuning)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (0: no idle, no limit)")
    ap.add_argument("--variant-limit", type=int, default=0, metavar="SECONDS",
                    help="a variant still running after this long ends with an error in its row (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", action="store_true", help="the profiled steps as Chrome traces in OUT/traces/")
    ap.add_argument("--host-profile", action="store_true",
                    help="the timed steps once more under cProfile, after the timing: OUT/host/<case>-<variant>.txt")
    ap.add_argument("--tag", default="", help="file-name suffix: <gpu>-train-speed-TAG.*")
    ap.add_argument("--merge", type=Path, nargs="+", help="join these runs' JSONs into one report in --out")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.steps < 1 or min(args.warmup, args.profile_steps, args.variant_limit) < 0:
        ap.error("--steps must be positive, --warmup, --profile-steps and --variant-limit not negative")
    return args


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.merge:
        report = merge(args.merge)
        print(f"wrote {write(report, args.out, args.tag)}", flush=True)
        return report
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu_name(), "versions": versions(),
              "command": shlex.join(["python3", "benchmarks/train_speed.py", *argv]), "rows": [], "limits": {}}
    signal.signal(signal.SIGALRM, over_time)
    for name in args.cases:
        run_case(CASES[name], args, report)
    return report


if __name__ == "__main__":
    main()
