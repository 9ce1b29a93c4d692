"""The scripts of examples/ that no other test runs, run as scripts (nothing imports examples/:
tests/test_imports.py): examples/convergence.py's tiny model, Hugging Face and codagen trained a few steps in fp32
on the CPU (on the GPU where there is one). examples/train_llama.py and train_fsdp.py are run by
tests/test_distributed.py and tests/test_parallel.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, quickened

pytest.importorskip("transformers")  # the test extra installs it; the package never needs it

CONVERGENCE = REPO / "examples" / "convergence.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 4
NOTE = "matplotlib is not installed"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def convergence(out: Path, env: dict | None = None) -> tuple[dict, str]:
    """The script's summary (losses.json) and its stderr, for a short run of the tiny model into out."""
    run = subprocess.run([sys.executable, str(CONVERGENCE), "--preset", "tiny", "--steps", str(STEPS), "--device",
                          DEVICE, "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env=quickened({**os.environ, **(env or {})}))
    assert run.returncode == 0, run.stderr
    return json.loads((out / "losses.json").read_text())["summary"], run.stderr


def test_convergence_short_run(tmp_path):
    """Patched and unpatched, from the same weights on the same data: the same losses within 1e-4, in the report
    step by step, and the plot where matplotlib is installed (else a note that it is not)."""
    summary, stderr = convergence(tmp_path)
    assert summary["steps"] == STEPS and summary["max_rel_difference"] < 1e-4
    assert f"| {STEPS} |" in (tmp_path / "report.md").read_text()
    if HAS_MATPLOTLIB:
        assert (tmp_path / "convergence.png").stat().st_size > 0
    else:
        assert [line for line in stderr.splitlines() if NOTE in line], stderr


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="without matplotlib, test_convergence_short_run sees the note")
def test_convergence_says_when_it_draws_no_plot(tmp_path):
    """Without matplotlib (here a package of that name that fails to import), the script says on stderr, in one
    line, that it skips its PNG, and writes the rest."""
    stub = tmp_path / "no_matplotlib" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('matplotlib is blocked by the test')\n")
    path = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))
    _, stderr = convergence(tmp_path / "out", {"PYTHONPATH": path})
    notes = [line for line in stderr.splitlines() if NOTE in line]
    assert len(notes) == 1 and "convergence.png" in notes[0], stderr
    assert not (tmp_path / "out" / "convergence.png").exists() and (tmp_path / "out" / "report.md").exists()
