# `make demo` and `make test` work from a clean clone: each creates .venv if missing and installs the
# project into it. On machines without an NVIDIA GPU torch is pinned to the CPU build (constraints-cpu.txt)
# so pip never pulls the multi-GB CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints-cpu.txt")
# 3 workers on 2 cores: much of a test's wall time is rendezvous, launches and waits for a peer, which a third
# worker fills (whole suite 443 s instead of 482 s on a quiet 2-core machine, 2026-11-27; docs/test-budget.md)
PYTEST_WORKERS ?= 3

.PHONY: install demo lint test test-fast bench reliability docs clean gpu-wheels gpu-check

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[dev,cli,data,logging]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The habits that keep the code in shape, a few seconds each: lint and formatting (ruff), types of the core (mypy),
# the layer contracts (import-linter; PYTHONPATH: this checkout's code, whatever the venv's editable install points at).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q tests

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -m "not slow" tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/preprocess.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/throughput.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/pipeline.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/context_parallel.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/generate.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/checkpoint.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/post_training.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/moe.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/lora.py

# The one-GPU check (benchmarks/gpu_check.py; docs/benchmarks.md#one-gpu-check-make-gpu-check) on a borrowed GPU
# machine that has torch, lightning and transformers but no network: `make gpu-wheels` here (network) puts the
# pure-Python rest into build/gpu-wheels; copy the checkout over; `make gpu-check` there installs them from that folder
# (no index) into build/gpu-deps, beside the machine's own packages, and runs the check (~8 minutes on one H100/H200).
# Without CUDA it runs the CPU smoke mode. GPU_PYTHON: the interpreter that has torch there; GPU_CHECK_ARGS: e.g. --skip-tests.
GPU_PYTHON ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_WHEELS ?= build/gpu-wheels
GPU_DEPS := build/gpu-deps
GPU_REQUIREMENTS := benchmarks/gpu-check-requirements.txt
gpu-wheels:
	$(GPU_PYTHON) -m pip download -q --no-deps --only-binary=:all: --platform any --implementation py --abi none \
		--python-version 3.10 -d $(GPU_WHEELS) -r $(GPU_REQUIREMENTS)

gpu-check:
	test ! -d $(GPU_WHEELS) || $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --no-deps \
		--upgrade --target $(GPU_DEPS) -r $(GPU_REQUIREMENTS)
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(GPU_DEPS) $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The documentation site (mkdocs.yml) into build/site; --strict: a broken link or a page missing from the nav fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

# The fault tests write what they saw into build/reliability; docs/reliability.md is rendered from it.
FAULT_TESTS := tests/integration/test_torchrun_restart.py tests/integration/test_graceful_exit.py \
	tests/integration/test_checkpoint_kill.py tests/integration/test_async_checkpoint_kill.py \
	tests/integration/test_corrupt_checkpoint_resume.py tests/integration/test_watchdog.py \
	tests/integration/test_rerun.py tests/integration/test_bad_config_table.py tests/integration/test_clean_exit.py
reliability: $(STAMP)
	rm -rf build/reliability
	MEGATRON_LITE_RELIABILITY_DIR=build/reliability OMP_NUM_THREADS=1 $(PY) -m pytest -n 0 -q -o timeout=3600 $(FAULT_TESTS)
	$(PY) docs/make_reliability.py build/reliability docs/reliability.md

clean:
	rm -rf $(VENV) build *.egg-info
