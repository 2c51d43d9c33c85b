# `make demo` and `make test` work from a clean clone: each creates .venv if missing and installs the
# project into it. On machines without an NVIDIA GPU torch is pinned to the CPU build (constraints-cpu.txt)
# so pip never pulls the multi-GB CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints-cpu.txt")
PYTEST_WORKERS ?= 2

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[dev,cli,data,logging]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q tests

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -m "not slow" tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/preprocess.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/throughput.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/pipeline.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
