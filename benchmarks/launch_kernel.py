"""One generated kernel launched a few times at one shape, untimed, for a profiler to watch: with the config its
tuning table picks there (or a tuning candidate named by its label), on random arguments like a model's.

    ncu --clock-control none --kernel-name regex:'^swiglu_dgrad_(gluon_)?kernel$' --launch-skip 1 --launch-count 1 \\
        python benchmarks/launch_kernel.py --kernel swiglu_dgrad --shape 32768x14336x4096

The first launch compiles; profile a later one (--launch-skip 1)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codagen import api  # noqa: E402


def prepare(kernel_name: str, shape: str, config_label: str | None = None, device: str = "cuda"):
    """`kernel_name` ready to launch at `shape` ("MxNxK") with its table's config or the candidate labelled
    `config_label`, on random bf16 arguments like a model's; returns (the config, the outputs, a function that
    launches it once)."""
    import torch

    from codagen.tune.candidates import candidates
    from codagen.tune.command import load_module
    from codagen.tune.harness import inplace_names, launch_choice, make_inputs, new_outputs
    from codagen.tune.shapes import Shape

    m, n, k = (int(x) for x in shape.split("x"))
    checked = {c.kernel.name: c for c in api.load([ROOT / "specs"]) if isinstance(c, api.Checked)}
    if kernel_name not in checked:
        raise SystemExit(f"no spec under specs/ defines a kernel named {kernel_name}")
    kernel = checked[kernel_name].kernel
    module = load_module(ROOT / "generated", kernel_name)
    if config_label:
        pool = {c.label(): c for c in candidates(kernel, ("gluon",))}
        if config_label not in pool:
            raise SystemExit(f"--config: no candidate labelled {config_label!r}; the candidates: " + "; ".join(pool))
        config = pool[config_label]
    else:
        config = launch_choice(kernel, module, Shape(m, n, k), torch.device(device))
    dev = torch.device(device)
    inputs = make_inputs(kernel, module, Shape(m, n, k), dev)
    inplace = inplace_names(kernel)
    outs = new_outputs(kernel, module, Shape(m, n, k), config, dev, initial={x: inputs[x] for x in inplace})
    args = {x: v for x, v in inputs.items() if x not in inplace}
    return config, outs, lambda: module.launch(**args, **outs, config=config)


def launch(kernel_name: str, shape: str, config_label: str | None = None, launches: int = 3,
           device: str = "cuda") -> tuple[object, dict]:
    """Launch `kernel_name` `launches` times at `shape` (see prepare); returns (the config, the outputs)."""
    import torch

    config, outs, run = prepare(kernel_name, shape, config_label, device)
    for _ in range(launches):
        run()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return config, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--shape", required=True, help="MxNxK")
    ap.add_argument("--config", help="a tuning candidate's label (default: the tuning table's choice)")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    config, _ = launch(args.kernel, args.shape, args.config, args.launches, args.device)
    print(f"{args.kernel} at {args.shape}: {args.launches} launches with {config.label()}")


if __name__ == "__main__":
    main()
