"""One generated kernel launched a few times at one shape, untimed, for a profiler to watch: with the config its
tuning table picks there (or a tuning candidate named by its label), on random arguments like a model's.

    ncu --clock-control none --kernel-name regex:'^swiglu_dgrad_kernel$' --launch-skip 1 --launch-count 1 \\
        python benchmarks/launch_kernel.py --kernel swiglu_dgrad --shape 32768x14336x4096

The first launch compiles; profile a later one (--launch-skip 1)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codagen import api  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--shape", required=True, help="MxNxK")
    ap.add_argument("--config", help="a tuning candidate's label (default: the tuning table's choice)")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()

    import torch

    from codagen.runtime import configs
    from codagen.tune.candidates import candidates
    from codagen.tune.command import load_module
    from codagen.tune.harness import inplace_names, make_inputs, new_outputs
    from codagen.tune.shapes import Shape

    device = torch.device("cuda")
    m, n, k = (int(x) for x in args.shape.split("x"))
    checked = {c.kernel.name: c for c in api.load([ROOT / "specs"]) if isinstance(c, api.Checked)}
    if args.kernel not in checked:
        raise SystemExit(f"no spec under specs/ defines a kernel named {args.kernel}")
    kernel = checked[args.kernel].kernel
    module = load_module(ROOT / "generated", args.kernel)
    if args.config:
        pool = {c.label(): c for c in candidates(kernel, hopper=True)}
        if args.config not in pool:
            raise SystemExit(f"--config: no candidate labelled {args.config!r}; the candidates: " + "; ".join(pool))
        config = pool[args.config]
    else:
        config = configs.pick_config(module.NAME, module.FINGERPRINT, ROOT / "generated" / "tuning", m, n, k, device,
                                     decls=module.DECLS)
    inputs = make_inputs(kernel, module, Shape(m, n, k), device)
    inplace = inplace_names(kernel)
    outs = new_outputs(kernel, module, Shape(m, n, k), config, device, initial={x: inputs[x] for x in inplace})
    for _ in range(args.launches):
        module.launch(**{x: v for x, v in inputs.items() if x not in inplace}, **outs, config=config)
    torch.cuda.synchronize()
    print(f"{args.kernel} at {args.shape}: {args.launches} launches with {config.label()}")


if __name__ == "__main__":
    main()
