# Set-up on a fresh machine is two commands (README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU path: torch's CPU build (a bare `torch` would pull a multi-GB CUDA build) and triton for its
# interpreter, which runs the generated kernels on the CPU. A GPU machine brings its own torch and triton.
CPU_PINS := torch==2.13.0 triton==3.9.0 "numpy==2.4.*"

.PHONY: demo test fuzz build check clean

$(BIN)/codagen: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(CPU_PINS)
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: $(BIN)/codagen
	$(BIN)/codagen build specs/
	$(BIN)/python -m examples.demo

# on every core (pytest-xdist); about 9 minutes on a 2-core machine without a GPU
test: $(BIN)/codagen
	$(BIN)/python -m pytest -q -n auto

# The spec and tuning-table fuzzers at length: random examples (a new seed each run), 20 times the bounded run's number
fuzz: $(BIN)/codagen
	CODAGEN_FUZZ_EXAMPLES=$${CODAGEN_FUZZ_EXAMPLES:-20} $(BIN)/python -m pytest -q tests/test_fuzz.py tests/test_fuzz_tables.py \
		--hypothesis-show-statistics

build: $(BIN)/codagen
	$(BIN)/codagen build specs/
	$(BIN)/python -m codagen.primitives.docs

check: $(BIN)/codagen
	$(BIN)/codagen build specs/ --check
	$(BIN)/python -m codagen.primitives.docs --check

clean:
	rm -rf $(VENV) .pytest_cache
