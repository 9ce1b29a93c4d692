"""Imported by Python at the start of every process that the distributed and example tests launch (their
environments put this folder first on PYTHONPATH): Triton's interpreter made quicker there too
(tests/interpreter.py), so scripts such as examples/train_llama.py run as they are."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_codagen_tests_interpreter",
                                               Path(__file__).resolve().parent.parent / "interpreter.py")
_interpreter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_interpreter)
_interpreter.quicken()
