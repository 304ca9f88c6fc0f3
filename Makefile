# `make demo` and `make test` set up .venv on first use and are quick afterwards.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; GPU users install their own torch first
# (any torch already in .venv is kept: every install below is constrained to it).
TORCH_SPEC ?= torch==2.13.0
# SGLang for the storage-backend tests, without its (CUDA) dependencies: only the modules
# its storage interface, host pools and key scheme import on CPU (torchvision, whose PyPI
# wheels need a CUDA torch, is replaced by a stand-in in tests/integrations).
SGLANG_TEST := sglang==0.5.23 orjson pybase64 triton pyzmq dill apache-tvm-ffi==0.1.11 \
	sentencepiece compressed-tensors loguru gguf IPython traitlets

export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test test-fast lint typecheck unit bench gpu-check docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	$(PY) -m pip install -q -c $(VENV)/constraints.txt --no-deps $(SGLANG_TEST)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-ray demo --json demo.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

test: lint typecheck unit

# The inner loop: the library's tests without Ray, SGLang or the slow ones (make test runs
# everything; CI runs make test).
test-fast: $(STAMP)
	HICACHE_TESTS_NO_RAY=1 $(PY) -m pytest -q -m "not ray and not sglang and not slow" \
		--ignore=tests/integrations

bench: $(STAMP)
	$(VENV)/bin/hicache-ray bench micro --json bench-micro.json

# On a machine with CUDA (and a CUDA torch in .venv): the gpu-marked tests, then the
# micro, runtime and serve benchmarks on the GPU.
gpu-check: $(STAMP)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: CUDA is not available')"
	$(PY) -m pytest -q -m gpu
	$(VENV)/bin/hicache-ray bench micro --quick --device cuda --json bench-gpu-micro.json
	$(VENV)/bin/hicache-ray bench runtime --quick --json bench-gpu-runtime.json
	$(VENV)/bin/hicache-ray bench serve --quick --json bench-gpu-serve.json

# Regenerate the generated parts of docs/ (configuration and metrics tables).
docs: $(STAMP)
	$(PY) -m apps.docs_gen

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
