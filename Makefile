# Two entry points, each works on a fresh machine: `make demo` and `make test`.
# They create .venv and install what they need.  On a machine without an NVIDIA GPU the CPU build
# of PyTorch 2.13.0 is installed; with one, any torch >= 2.11 (override with TORCH_SPEC=...).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.11' || echo 'torch==2.13.0')
PYTEST_ARGS ?=

.PHONY: demo test gpu-check clean

$(BIN)/.tpfuse-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]" "triton==3.6.0"
	touch $@

demo: $(BIN)/.tpfuse-installed
	$(BIN)/python -m tpfuse demo

test: $(BIN)/.tpfuse-installed
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# On a GPU machine: GPU tests, benchmarks and a short table (see scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
