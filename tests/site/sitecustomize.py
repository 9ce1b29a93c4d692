"""Imported by Python at the start of every process that the distributed and example tests launch
(conftest.quickened puts this folder first on their PYTHONPATH): Triton's interpreter made quicker there as in
the tests' own processes (tests/interpreter.py), in the test workers and in scripts such as
examples/train_llama.py, which run unchanged."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_codagen_tests_interpreter",
                                               Path(__file__).resolve().parent.parent / "interpreter.py")
_interpreter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_interpreter)
_interpreter.quicken()
