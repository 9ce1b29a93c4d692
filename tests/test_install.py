"""`pip install .` (not editable) ships the committed Llama kernels and blocks as codagen_generated: from another
directory, one that holds a user's own `generated` package, they import and patch a transformers Llama."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

# what a clean clone holds; the rest (virtual environments, build output, caches) is not part of an install
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache")

USE = """
import codagen.hf
import sys, torch, transformers, codagen, codagen_generated
config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = transformers.LlamaForCausalLM(config).to(device)
ids = torch.randint(0, 50, (2, 6), device=device)
expected = model(input_ids=ids, labels=ids).loss
got = codagen.hf.apply_codagen(model)(input_ids=ids, labels=ids).loss
got.backward()
print(codagen.__file__)
print(codagen_generated.__file__)
print(abs(got - expected).item() / expected.item())
"""


def test_pip_install_ships_the_generated_llama_under_its_own_name(tmp_path):
    pytest.importorskip("transformers")
    source, target, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    assert (target / "codagen_generated" / "tuning").is_dir()
    assert not (target / "generated").exists()
    # a user's own `codagen build` output in the working directory must not be what codagen.hf runs
    (elsewhere / "generated").mkdir(parents=True)
    (elsewhere / "generated" / "__init__.py").write_text("raise ImportError('the user\\'s generated package')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(target)
    result = subprocess.run([sys.executable, "-c", USE], cwd=elsewhere, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    codagen_file, generated_file, difference = result.stdout.split()
    assert codagen_file.startswith(str(target)) and generated_file.startswith(str(target))
    assert float(difference) < 1e-5
