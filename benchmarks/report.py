"""The report: a markdown table per preset and token count (with each non-baseline variant against every
baseline), the rows as JSON, a bar chart, and a short summary for the log."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from cases import PRESETS
from measure import l2_bytes
from runners import BASELINES, CUBLAS

ROOT = Path(__file__).resolve().parent.parent


def fmt_err(e):
    return "   -    " if e is None else f"{e:.2e}"


def fmt_mib(m):
    return "-" if m is None else f"{m:,.0f} MiB"


def ratio(ms, base_passes):
    if ms is None or not base_passes:
        return "-"
    return f"{ms / statistics.fmean(base_passes):.2f}"


def spread(passes):
    if len(passes) < 2:
        return "-"
    m = statistics.fmean(passes)
    return f"{(max(passes) - min(passes)) / m * 100:.1f}%"


def environment(args) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "dtype": str(args.dtype_obj).replace("torch.", ""),
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = "not installed"
    try:
        from importlib.metadata import version
        env["liger-kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger-kernel"] = "not installed"
    if args.device_obj.type == "cuda":
        p = torch.cuda.get_device_properties(args.device_obj)
        env["device"] = p.name
        env["gpu"] = (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                      f"L2 {l2_bytes(args.device_obj) / 2**20:.0f} MiB, CUDA {torch.version.cuda}")
    else:
        env["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} threads)"
    return env


def slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-").replace("--", "-") or "device"


def write_report(rows: list, env: dict, args, out: Path, kernel_rows: tuple = (), chart: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = slug(env["device"]) + ("-quick" if args.quick else "") + (f"-{slug(args.tag)}" if args.tag else "")
    variants = []
    for r in rows:
        if r.variant not in variants:
            variants.append(r.variant)
    variants = sorted(variants, key=lambda v: (BASELINES.index(v) if v in BASELINES else len(BASELINES), v))

    L = [f"# codagen benchmarks: {env['device']}", ""]
    L += [f"- date: {env['date']}",
          f"- GPU: {env['gpu']}",
          f"- torch {env['torch']}, triton {env['triton']}, liger-kernel {env['liger-kernel']}, python {env['python']}",
          f"- dtype {env['dtype']}; command: `{' '.join(['python'] + [_rel(a) for a in sys.argv])}`",
          "- timing: "
          + (f"triton.testing.do_bench median (L2 flushed before each call), warmup {args.warmup} ms, "
             if args.device_obj.type == "cuda" else "host clock (perf_counter) median, ")
          + f"rep >= {args.rep} ms (and >= {args.min_iters} calls), "
          f"inputs rotated among up to {args.max_sets} sets when one set is under 3x L2; {args.passes} passes over all "
          f"variants, ms = mean of the passes' medians, spread = (max - min) / mean",
          "- fwd rows run under torch.no_grad(); fwd+bwd rows run forward then torch.autograd.grad w.r.t. every "
          "input except cos/sin/target with random upstream gradients (loss: 1.0)",
          "- 'x cuBLAS' = time / time of the same GEMMs alone (F.linear / torch.mm; fwd+bwd: forward, input-grad and "
          "weight-grad GEMM per linear layer); GEMM TFLOP/s = those GEMMs' FLOPs / the row's time",
          "- err = ||out - ref|| / ||ref||, worst over outputs and gradients, vs eager bf16 and vs the eager function "
          "on fp32 inputs (TF32 off; fp64 on the CPU); peak+ = max_memory_allocated during one call minus what was "
          "allocated before it; host ms = host time per call to enqueue its work, 10 calls back to back (GPU only): "
          "at or above ms, the GPU waits for the host",
          "- variants: eager = plain PyTorch HF-Llama style (baselines.py); torch.compile = the same functions, "
          "default mode, dynamic=False; torch.compile max-autotune = the same with mode='max-autotune'; liger = "
          "Liger-Kernel as apply_liger_kernel_to_llama uses it (LigerRMSNorm, "
          "LigerSiLUMulFunction, liger_rotary_pos_emb, liger_fused_linear_cross_entropy), for Qwen3 and Gemma-2 as "
          "apply_liger_kernel_to_qwen3 / _gemma2 use it (Gemma-2: LigerRMSNormForGemma2, LigerGELUMulFunction, the "
          "fused linear cross-entropy with softcap); liger+addnorm (Llama only) = also LigerFusedAddRMSNorm for "
          "residual add + RMSNorm",
          ""]
    groups = []
    for r in rows:
        if (r.preset, r.tokens) not in groups:
            groups.append((r.preset, r.tokens))
    for preset_name, tokens in groups:
        pr = PRESETS[preset_name]
        dm = pr.dims(tokens)
        L += [f"## {preset_name}, {tokens} tokens", "",
              f"{pr.describe()}; batch {dm.batch} x seq {dm.seq}", "",
              "ms (x cuBLAS GEMMs alone):", "",
              "| pattern | " + " | ".join(variants) + " |",
              "|---|" + "---|" * len(variants)]
        grows = [r for r in rows if (r.preset, r.tokens) == (preset_name, tokens)]
        pats = []
        for r in grows:
            if r.pattern not in pats:
                pats.append(r.pattern)
        for pk in pats:
            cells = []
            cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
            for v in variants:
                r = next((r for r in grows if r.pattern == pk and r.variant == v), None)
                if r is None:
                    cells.append("-")
                elif r.ms is None:
                    cells.append("failed" if r.error else "-")
                else:
                    cells.append(f"{r.ms:.3f}" + (f" ({r.ms / cub:.2f}x)" if cub else ""))
            title = next(r.title for r in grows if r.pattern == pk)   # the preset family's pattern
            L.append(f"| {title} | " + " | ".join(cells) + " |")
        for v in variants:
            if v not in BASELINES:
                L += [""] + vs_baselines_table(grows, pats, v)
        L += peak_table(grows, [pk for pk in pats if pk.startswith(PEAK_PATTERNS)], variants)
        L += ["", "<details><summary>all rows</summary>", "",
              "| pattern | variant | ms | x cuBLAS | x eager | spread | host ms | GEMM TFLOP/s | peak+ MiB | "
              "err vs eager | err vs fp32 ref | worst | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for pk in pats:
            pr_rows = [r for r in grows if r.pattern == pk]
            cub = next((r.ms for r in pr_rows if r.variant == CUBLAS), None)
            eag = next((r.ms for r in pr_rows if r.variant == "eager"), None)
            for r in sorted(pr_rows, key=lambda r: (variants.index(r.variant))):
                tf = "-" if not r.ms else f"{r.gemm_tflop / (r.ms / 1e3):.3g}"
                note = r.error or r.note
                L.append(f"| {pk} | {r.variant} | {_f(r.ms, '.3f')} | {_div(r.ms, cub)} | {_div(r.ms, eag)} | "
                         f"{spread(r.ms_passes)} | {_f(r.host_ms, '.3f')} | {tf} | "
                         f"{_f(r.peak_mib, ',.0f')} | {fmt_err(r.err_eager).strip()} | "
                         f"{fmt_err(r.err_ref).strip()} | {r.worst} | {note} |")
        L += ["", "</details>", ""]
        L += kernel_profile_lines(grows, pats, variants)
    if kernel_rows:
        import fused_kernels

        L += fused_kernels.report_lines(list(kernel_rows))
    md = out / f"{stem}.md"
    md.write_text("\n".join(L) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": [_row_json(r) for r in rows],
                                                  "kernels": [r.as_dict() for r in kernel_rows]}, indent=1) + "\n")
    if chart and groups:   # no pattern rows (--patterns kernels): no chart
        try:
            plot(rows, variants, groups, out / f"{stem}.png", env)
        except ImportError as e:
            print(f"(no chart: {e})", flush=True)
    return md


def _ms_of(rows, pattern, variant):
    return next((r.ms for r in rows if r.pattern == pattern and r.variant == variant and r.ms), None)


PEAK_PATTERNS = ("lm_ce.",)  # patterns whose memory is part of the goal: their peak gets a table of its own


def peak_table(grows: list, pats: list, variants: list) -> list:
    """Markdown lines: peak memory above the inputs (torch.cuda.max_memory_allocated during one call) of every
    variant of `pats`; none without such patterns or peaks (the CPU)."""
    have = [v for v in variants if any(r.variant == v and r.pattern in pats and r.peak_mib is not None
                                       for r in grows)]
    if not have:
        return []
    L = ["", "peak memory above the inputs, MiB (torch.cuda.max_memory_allocated during one call):", "",
         "| pattern | " + " | ".join(have) + " |", "|---|" + "---|" * len(have)]
    for pk in pats:
        cells = [_f(next((r.peak_mib for r in grows if r.pattern == pk and r.variant == v), None), ",.0f")
                 for v in have]
        L.append(f"| {pk} | " + " | ".join(cells) + " |")
    return L


def vs_baselines_table(grows: list, pats: list, variant: str) -> list:
    """Markdown lines: per pattern, the variant's time divided by each baseline's time in the same run
    (< 1: the variant is faster), with the variant's check result."""
    present = [b for b in BASELINES if any(r.variant == b for r in grows)]
    L = [f"{variant} vs each baseline: time ratio {variant} / baseline (< 1: {variant} is faster; cuBLAS GEMMs "
         f"alone is the speed of light, so there the ratio is >= 1 and 1.00 means a free epilogue):", "",
         f"| pattern | {variant} ms | " + " | ".join(f"/ {b}" for b in present)
         + f" | {variant} err vs fp32 ref | eager err vs fp32 ref |",
         "|---|---|" + "---|" * len(present) + "---|---|"]
    for pk in pats:
        r = next((r for r in grows if r.pattern == pk and r.variant == variant), None)
        if r is None:
            continue
        eag = next((e for e in grows if e.pattern == pk and e.variant == "eager"), None)
        cells = [_div(r.ms, _ms_of(grows, pk, b)) for b in present]
        flag = " (CHECK)" if "CHECK" in (r.note or "") else ""
        L.append(f"| {pk} | {'failed' if r.error else _f(r.ms, '.3f')} | " + " | ".join(cells)
                 + f" | {fmt_err(r.err_ref).strip()}{flag} | {fmt_err(eag.err_ref if eag else None).strip()} |")
    return L


def _rel(a: str) -> str:
    """A path argument as the report records it: relative to the repository, or (outside it, where it names
    only this machine's folder) by its name."""
    if not os.path.exists(a):
        return a
    try:
        return str(Path(a).resolve().relative_to(ROOT))
    except ValueError:
        return Path(a).name


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def kernel_profile_lines(grows: list, pats: list, variants: list, top: int = 12) -> list:
    """Where each row's call spends its time (--kernel-profile): its most expensive kernels, and their sum
    against the row's time, the difference being time the GPU spent on none of them (waiting for the host,
    or between kernels)."""
    profiled = [r for r in grows if r.kernels]
    if not profiled:
        return []
    L = ["<details><summary>kernels per call (torch.profiler, one call after the timing)</summary>", ""]
    for pk in pats:
        for r in sorted((r for r in profiled if r.pattern == pk), key=lambda r: variants.index(r.variant)):
            total = sum(ms for _, ms, _ in r.kernels)
            L += [f"**{pk}, {r.variant}**: {len(r.kernels)} kernels, {total:.3f} ms per call"
                  + (f" of the row's {r.ms:.3f} ms" if r.ms else ""), ""]
            if r.timeline:
                L += [timeline_line(r.timeline), ""]
            L += ["| kernel | ms | launches |", "|---|---|---|"]
            for name, ms, launches in r.kernels[:top]:
                short = name if len(name) <= 90 else name[:87] + "..."
                L.append(f"| `{short.replace('|', '/')}` | {ms:.3f} | {launches:g} |")
            rest = r.kernels[top:]
            if rest:
                L.append(f"| {len(rest)} others | {sum(ms for _, ms, _ in rest):.3f} | "
                         f"{sum(n for _, _, n in rest):g} |")
            L.append("")
    return L + ["</details>", ""]


def timeline_line(t: dict) -> str:
    """measure.gpu_idle's figures in a sentence."""
    def short(name):
        return name if len(name) <= 40 else name[:37] + "..."
    longest = "; ".join(f"{ms:.3f} ms after `{short(a)}`, before `{short(b)}`" for ms, a, b in t["longest"][:3])
    return (f"Timeline of the profiled calls, back to back: {t['span_ms']:.3f} ms per call from the first kernel's "
            f"start to the last one's end, {t['idle_ms']:.3f} ms of it with no kernel running "
            f"({t['gaps_per_call']:g} gaps over 5 us a call)" + (f"; longest: {longest}" if longest else "") + ".")


def _div(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"


def _row_json(r) -> dict:
    return {k: v for k, v in r.__dict__.items() if not k.startswith("_")}


def plot(rows, variants, groups, path: Path, env):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(groups)
    fig, axes = plt.subplots(n, 1, figsize=(14, 4.2 * n), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, (preset_name, tokens) in zip(axes[:, 0], groups):
        grows = [r for r in rows if (r.preset, r.tokens) == (preset_name, tokens)]
        pats = []
        for r in grows:
            if r.pattern not in pats:
                pats.append(r.pattern)
        width = 0.8 / max(len(variants), 1)
        for j, v in enumerate(variants):
            xs, ys = [], []
            for i, pk in enumerate(pats):
                cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
                r = next((r for r in grows if r.pattern == pk and r.variant == v), None)
                if r is not None and r.ms and cub:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r.ms / cub)
            bars = ax.bar(xs, ys, width, label=v, color=colors(j))
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(pats)))
        ax.set_xticklabels(pats, fontsize=8)
        ax.set_ylabel("time / cuBLAS GEMMs alone")
        ax.set_title(f"{preset_name}, {tokens} tokens, {env['dtype']} — {env['device']} "
                     f"(torch {env['torch']}, triton {env['triton']}, liger {env['liger-kernel']})", fontsize=9)
        ax.legend(fontsize=7, ncol=len(variants))
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows) -> str:
    lines = []
    groups = []
    for r in rows:
        if (r.preset, r.tokens) not in groups:
            groups.append((r.preset, r.tokens))
    for g in groups:
        lines.append(f"\n{g[0]} T={g[1]}   ms (x cuBLAS)")
        grows = [r for r in rows if (r.preset, r.tokens) == g]
        for pk in dict.fromkeys(r.pattern for r in grows):
            cub = next((r.ms for r in grows if r.pattern == pk and r.variant == CUBLAS), None)
            cells = []
            for r in grows:
                if r.pattern != pk:
                    continue
                val = "FAILED" if r.error else (f"{r.ms:.3f}" + (f"({r.ms / cub:.2f})" if cub else "") if r.ms else "-")
                cells.append(f"{r.variant}={val}")
            lines.append(f"  {pk:20s} " + "  ".join(cells))
            for r in grows:
                if r.pattern == pk and r.variant not in BASELINES and r.ms:
                    ratios = [f"{b}={_div(r.ms, _ms_of(grows, pk, b))}" for b in BASELINES if _ms_of(grows, pk, b)]
                    check = "  CHECK FAILED" if "CHECK" in (r.note or "") else ""
                    lines.append(f"  {'':20s} {r.variant} / " + "  ".join(ratios) + check)
            peaks = [f"{r.variant}={r.peak_mib:,.0f}" for r in grows
                     if r.pattern == pk and pk.startswith(PEAK_PATTERNS) and r.peak_mib is not None]
            if peaks:
                lines.append(f"  {'':20s} peak MiB: " + "  ".join(peaks))
    return "\n".join(lines)

