"""The committed tuning tables of one GPU as a report: per preset, kernel and place in the blocks, the
chosen configuration, its time and the cuBLAS GEMM of the same shape, both measured by `codagen tune`
(triton.testing.do_bench medians, L2 flushed). The plain `matmul` rows are the mainloop against cuBLAS.

    python benchmarks/tuning_report.py [--gpu nvidia-h200] [--out benchmarks/results/h200-tuning.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from codagen import api, tablefile  # noqa: E402
from codagen.presets import PRESETS  # noqa: E402
from codagen.tune.shapes import block_uses  # noqa: E402


def read_tables(gpu: str, tuning_dir: Path) -> tuple[dict[str, dict], list[str]]:
    """kernel -> its table's valid entries (shape key as the reader writes it -> entry), read by the one reader
    of tuning tables (codagen/tablefile.py); and the reader's errors: files that are no tables, entries skipped
    (a key that is no MxNxK, a configuration that does not construct), quoted."""
    tables, skipped = {}, []
    for path in sorted((tuning_dir / gpu).glob("*.json")):
        try:
            table = tablefile.read_table(path)
        except (tablefile.TableError, FileNotFoundError) as e:
            skipped.append(str(e) if isinstance(e, tablefile.TableError) else f"{tablefile.quoted(path)}: gone")
            continue
        tables[path.stem] = table.shapes
        skipped += [str(bad) for bad in table.bad]
    return tables, skipped


def rows(gpu: str, tuning_dir: Path) -> tuple[dict[str, list[tuple]], list[tuple]]:
    """preset -> [(kernel, where, shape, entry or None)] in block order, for the presets the tables hold any
    shape of; and [(kernel, shape, entry)] for the other shapes the tables hold (tuned with --attrs, e.g. the
    LM head's other chunk sizes, or at literal shapes), by kernel and shape (the numbers, as the reader parses
    them)."""
    specs = api.load([ROOT / "specs"])
    tables, _ = read_tables(gpu, tuning_dir)
    out: dict[str, list[tuple]] = {}
    shown = set()
    for preset, model in PRESETS.items():
        found = []
        for use in block_uses(specs, model, family_only=True):
            found.append((use.kernel, use.where, use.shape, tables.get(use.kernel, {}).get(use.shape.key)))
            shown.add((use.kernel, use.shape.key))
        if any(entry is not None for *_, entry in found):
            out[preset] = found
    others = [(kernel, key, entry) for kernel, shapes in tables.items() for key, entry in shapes.items()
              if (kernel, key) not in shown]
    return out, sorted(others, key=lambda o: (o[0], tablefile.shape_order(o[1])))


def cells(name: str, entry: dict) -> str:
    """The configuration, ms, cuBLAS ms and ratio columns of an entry."""
    number = lambda v: v if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None  # noqa: E731
    ms, cublas = number(entry.get("ms")), number(entry.get("cuBLAS_ms"))
    ratio = f"{ms / cublas:.2f}" if ms and cublas else "-"
    if ms and cublas and "rounds" not in entry:
        ratio += " *"
    if name == "matmul" and ms and cublas:
        ratio += f" (throughput {cublas / ms:.2f})"
    return (f"{tablefile.config_of_entry(entry).label()} | {f'{ms:.4g}' if ms else '-'} | {cublas if cublas else '-'} | "
            f"{ratio}")


def markdown(gpu: str, tuning_dir: Path) -> str:
    meta = {}
    for path in sorted((tuning_dir / gpu).glob("*.json")):
        try:
            meta = tablefile.read_json(path)
            break
        except (tablefile.TableError, FileNotFoundError):
            continue
    triton = meta.get("triton") if isinstance(meta.get("triton"), str) else "?"
    lines = [f"# codagen tuning tables: {gpu}", "",
             f"From `generated/tuning/{gpu}/*.json` (triton {tablefile.quoted(triton)}), written by "
             "`codagen tune specs/ --shapes llama3-1b,llama3-8b`. Every candidate was checked against the float64 "
             "reference on NaN-prefilled outputs before it was timed. ms: do_bench median of the chosen "
             "configuration; cuBLAS: torch.matmul of the kernel's GEMM alone, same shape and operands; "
             "ratio = ms / cuBLAS ms (1.00: the epilogue is free). For `matmul` (no epilogue), throughput vs "
             "cuBLAS = cuBLAS ms / ms. Both times are medians of 3 do_bench medians taken in turn, the kernel's "
             "then cuBLAS's; rows marked * are older entries: the chosen configuration's time in the sweep and "
             "one cuBLAS timing after it, which moved by up to 6% from run to run.", ""]
    presets, others = rows(gpu, tuning_dir)
    for preset, found in presets.items():
        lines += [f"## {preset}", "", "| kernel | where | shape (MxNxK) | configuration | ms | cuBLAS ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for name, where, shape, entry in found:
            lines.append(f"| {name} | {where} | {shape} | "
                         f"{'not tuned | - | - | -' if entry is None else cells(name, entry)} |")
        lines.append("")
    if others:
        lines += ["## Other shapes in the tables", "",
                  "Tuned with `--attrs` (the LM head's row chunks other than the specs' 2048, e.g. "
                  "`--attrs chunk_rows=1280`) or at literal shapes; the blocks run them only when so configured.",
                  "", "| kernel | shape (MxNxK) | configuration | ms | cuBLAS ms | ratio |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {key} | {cells(name, entry)} |" for name, key, entry in others]
        lines.append("")
    _, skipped = read_tables(gpu, tuning_dir)
    if skipped:
        lines += ["## Skipped", "", "What the table reader refused (as `codagen build --check` reports it):", ""]
        lines += [f"- {why}" for why in skipped]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="nvidia-h200")
    ap.add_argument("--tuning-dir", default=str(ROOT / "generated" / "tuning"))
    ap.add_argument("--out", default=None, help="markdown file (default: stdout)")
    args = ap.parse_args()
    text = markdown(args.gpu, Path(args.tuning_dir))
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
