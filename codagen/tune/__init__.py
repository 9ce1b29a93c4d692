"""`codagen tune`: choose each generated kernel's tile configuration per shape on this GPU, and commit it.

For every selected kernel and shape (shapes.py: literal, or a model preset's as the block specs run the
kernel), each candidate Config (candidates.py) is first checked: it runs on NaN-prefilled outputs over a
ragged slice of the rows (all of N and K), and every output is compared with the float64 reference
(codagen.reference). A candidate that fails to compile, runs out of resources or is wrong is discarded and
reported, never chosen. Worker processes compile every candidate first (precompile.py; `--compile-jobs`).
The survivors are timed at the full shape on random bf16 data (harness.py), the fastest again in turn with
cuBLAS's GEMM of the shape, and it goes into generated/tuning/<gpu>/<kernel>.json (tables.py), keyed by the
shape (runtime.tables.shape_key) and by the kernel's fingerprint (what it computes), which runtime.pick_config
reads. The run (command.py) stops cleanly when its time budget is spent: every shape finished by then is
written (tables are written shape by shape), and `--missing-only` continues later.

This package imports torch only in the modules that time kernels, so that `codagen build --check` can read
tables (tables.py) without it.
"""


class TuneError(Exception):
    """A request that cannot be tuned as given (unknown preset or kernel, stale generated code, no GPU)."""
