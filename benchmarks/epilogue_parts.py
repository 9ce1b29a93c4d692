"""Where a fused kernel's time goes, without hardware counters: the kernel at one shape against variants of its
spec, each with one store left out (with the steps, inputs and outputs only that store needed), and the GEMM
alone (its accumulator stored), all launched with one configuration (by default the one the kernel's tuning
table picks at that shape), beside cuBLAS's GEMM of the same shape. What a store costs is the full kernel's time
less the time of the variant without it; the GEMM alone against cuBLAS is the mainloop.

    python benchmarks/epilogue_parts.py --kernel swiglu_dgrad --shape 32768x8192x2048 [--config LABEL] [--out F]

--config picks a tuning candidate by its label (`codagen.runtime.Config.label()`, e.g. "128x128x64 g8 w4 s6
epilogue/8 in 2 gluon") instead of the table's choice. Each variant is built into a temporary package and
checked for NaN left in its outputs before it is timed; the report (markdown) goes to --out or stdout."""
from __future__ import annotations

import argparse
import copy
import datetime
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codagen import api  # noqa: E402


def _names(value) -> set[str]:
    """The value and tensor names a step's arguments mention."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*map(_names, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(_names, value)) if value else set()
    return set()


def _step(entry: dict) -> tuple[str, dict]:
    (op, args), = entry.items()
    return op, args


def prune(spec: dict) -> dict:
    """The spec without the steps whose values no later step reads and that write no output, then without the
    outputs no step writes and the inputs nothing reads (the GEMM's operands stay)."""
    spec = copy.deepcopy(spec)
    steps = spec["epilogue"]
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(steps))):
            args = _step(steps[i])[1]
            if "to" in args:  # it writes an output
                continue
            read_later = set().union(*(_names(_step(s)[1]) for s in steps[i + 1:])) if steps[i + 1:] else set()
            if args.get("out") not in read_later:
                del steps[i]
                changed = True
    written = {_step(s)[1].get("to") for s in steps}
    spec["outputs"] = {name: decl for name, decl in spec["outputs"].items() if name in written}
    read = set().union(*(_names(_step(s)[1]) for s in steps)) | {spec["gemm"]["a"], spec["gemm"]["b"]}
    spec["inputs"] = {name: decl for name, decl in spec["inputs"].items() if name in read}
    return spec


def variants(spec: dict) -> dict[str, dict]:
    """The kernel itself, one variant per output left out, and the GEMM alone, by name."""
    name = spec["kernel"]
    found = {name: spec}
    for target in spec["outputs"]:
        v = copy.deepcopy(spec)
        v["kernel"] = f"{name}_without_{target}"
        v["epilogue"] = [s for s in v["epilogue"] if _step(s)[1].get("to") != target]
        v = prune(v)
        if v["outputs"]:
            found[v["kernel"]] = v
    a, b = spec["gemm"]["a"], spec["gemm"]["b"]
    found[f"{name}_gemm_alone"] = {
        "kernel": f"{name}_gemm_alone", "doc": f"The GEMM of {name}, its accumulator stored.",
        "gemm": copy.deepcopy(spec["gemm"]),
        "inputs": {a: spec["inputs"][a], b: spec["inputs"][b]}, "outputs": {"product": ["M", "N"]},
        "epilogue": [{"store": {"x": "acc", "to": "product"}}]}
    return found


def spec_of(kernel: str, specs: Path) -> dict:
    """The YAML of the spec under `specs` that defines `kernel`, as written."""
    for c in api.load([specs]):
        if isinstance(c, api.Checked) and c.kernel.name == kernel:
            return yaml.safe_load(Path(c.kernel.source).read_text())
    raise SystemExit(f"no spec under {specs} defines a kernel named {kernel}")


def build(found: dict[str, dict], workdir: Path) -> Path:
    """Each variant's spec written under workdir/specs and built into the package workdir/parts_<kernel>."""
    (workdir / "specs").mkdir(parents=True)
    for name, spec in found.items():
        (workdir / "specs" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = workdir / f"parts_{next(iter(found))}"
    api.build([workdir / "specs"], out)
    return out


def measure(args) -> list[str]:
    import torch

    from codagen.runtime import autotune
    from codagen.tune.command import load_module
    from codagen.tune.harness import do_bench_timer, make_inputs, new_outputs, time_against_cublas
    from codagen.tune.shapes import Shape

    device = torch.device("cuda")
    m, n, k = (int(x) for x in args.shape.split("x"))
    shape = Shape(m, n, k)
    spec = spec_of(args.kernel, args.specs)
    found = variants(spec)
    with tempfile.TemporaryDirectory() as tmp:
        out = build(found, Path(tmp))
        checked = {c.kernel.name: c for c in api.load([Path(tmp) / "specs"]) if isinstance(c, api.Checked)}
        main = load_module(ROOT / "generated", args.kernel)
        if args.config:
            from codagen.tune.candidates import candidates

            pool = {c.label(): c for c in candidates(checked[args.kernel].kernel, ("gluon",))}
            if args.config not in pool:
                raise SystemExit(f"--config: no candidate labelled {args.config!r}; the candidates: "
                                 + "; ".join(pool))
            config = pool[args.config]
        else:
            config = autotune.pick_config(main.NAME, main.FINGERPRINT, ROOT / "generated" / "tuning", m, n, k, device,
                                          decls=main.DECLS, split=main.DEFAULT_SPLIT)
        rows, cublas = [], None
        for name in found:
            kernel = checked[name].kernel
            module = load_module(out, name)
            inputs = make_inputs(kernel, module, shape, device)
            inplace = {o.name for o in kernel.outputs if o.inplace}
            outs = new_outputs(kernel, module, shape, config, device, initial={x: inputs[x] for x in inplace})
            launch_args = {x: v for x, v in inputs.items() if x not in inplace}

            def fn():
                module.launch(**launch_args, **outs, config=config)

            fn()
            torch.cuda.synchronize()
            unwritten = [o for o, t in outs.items() if t.is_floating_point() and torch.isnan(t).any()]
            if unwritten:
                raise SystemExit(f"{name}: {', '.join(unwritten)} left NaN at {args.shape} with {config.label()}")
            if cublas is None:  # the full kernel, timed in turn with its plain GEMM
                timed = time_against_cublas(kernel, fn, inputs, do_bench_timer)
                if timed is None:
                    raise SystemExit(f"torch.matmul failed at {args.shape}: no cuBLAS yardstick")
                ms, cublas = timed
            else:
                ms = do_bench_timer(fn)
            moved = sum(t.numel() * t.element_size() for t in (*inputs.values(), *outs.values())
                        if isinstance(t, torch.Tensor)) - sum(
                inputs[x].numel() * inputs[x].element_size() for x in (kernel.gemm.a, kernel.gemm.b))
            rows.append((name, ms, moved))
            del inputs, outs
            torch.cuda.empty_cache()
    full = rows[0][1]
    lines = [f"# {args.kernel} at {args.shape}: where its time goes", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; GPU: "
             f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {__import__('triton').__version__}",
             f"- configuration of every row: {config.label()}"
             + (" (given)" if args.config else " (the kernel's tuning table, else its default)"),
             f"- command: `python benchmarks/epilogue_parts.py --kernel {args.kernel} --shape {args.shape}"
             + (f" --config '{args.config}'" if args.config else "") + "`",
             "- epilogue GB: bytes the epilogue reads and writes (tile inputs, outputs), once each; "
             "time less: the full kernel's time less this row's (what the part left out costs)", "",
             "| kernel | ms | x cuBLAS | epilogue GB | time less (ms) |", "|---|---|---|---|---|"]
    lines.append(f"| cuBLAS GEMM | {cublas:.4f} | 1.00 | - | - |")
    for name, ms, moved in rows:
        less = "-" if name == args.kernel else f"{full - ms:.4f}"
        lines.append(f"| {name} | {ms:.4f} | {ms / cublas:.2f} | {moved / 1e9:.2f} | {less} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--shape", required=True, help="MxNxK")
    ap.add_argument("--config", help="a tuning candidate's label (default: the tuning table's choice)")
    ap.add_argument("--specs", type=Path, default=ROOT / "specs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = measure(args)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
