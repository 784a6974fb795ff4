# Two entry points, each works on a fresh machine: `make demo` and `make test`.
# They create .venv and install what they need.  On a machine without an NVIDIA GPU the CPU build
# of PyTorch 2.13.0 is installed; with one, any torch >= 2.11 (override with TORCH_SPEC=...).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.11' || echo 'torch==2.13.0')
PYTEST_ARGS ?=

.PHONY: demo test test-tritons gpu-check clean

$(BIN)/.tpfuse-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]" "triton==3.6.0"
	touch $@

demo: $(BIN)/.tpfuse-installed
	$(BIN)/python -m tpfuse demo

test: $(BIN)/.tpfuse-installed
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# The Triton kernels against every Triton that a supported PyTorch pins: torch 2.13 pins triton 3.7.1,
# torch 2.14 pins 3.8.0 (`make test` runs them on 3.6.0).  One venv per version, .venv-triton-<version>,
# with the CPU torch 2.13.0 (torch 2.14's x86_64 wheel is a CUDA build of several GB; the interpreter
# and the offline compile depend on Triton, not on torch's CUDA).  Only the kernel test files run there.
TRITONS ?= 3.7.1 3.8.0
KERNEL_TESTS ?= tests/cpu/test_gemm_core_interp.py tests/cpu/test_fused_interp.py \
	tests/cpu/test_sm_copy_interp.py tests/cpu/test_symm.py tests/cpu/test_tile_records.py \
	tests/cpu/test_kernel_tools.py tests/cpu/test_publish_interp.py tests/cpu/test_merged_flags_interp.py \
	tests/cpu/test_sm_workers_interp.py tests/cpu/test_gather_interp.py

.venv-triton-%/.tpfuse-installed: pyproject.toml
	$(PYTHON) -m venv .venv-triton-$*
	.venv-triton-$*/bin/python -m pip install -q "torch==2.13.0" "triton==$*" "numpy<2.3" \
		"pytest>=8" "pytest-timeout>=2.2"
	.venv-triton-$*/bin/python -m pip install -q --no-deps -e .
	touch $@

test-tritons: $(foreach v,$(TRITONS),.venv-triton-$(v)/.tpfuse-installed)
	@set -e; for v in $(TRITONS); do \
		echo "== kernel tests on triton $$v"; \
		.venv-triton-$$v/bin/python -c "import triton; assert triton.__version__ == '$$v', triton.__version__"; \
		.venv-triton-$$v/bin/python -m pytest -rs $(KERNEL_TESTS) $(PYTEST_ARGS); \
	done

# On a GPU machine: GPU tests, benchmarks and a short table (see scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-triton-* .pytest_cache build *.egg-info
