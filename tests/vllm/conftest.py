"""The vLLM connector's tests run in .venv-vllm (``make test-vllm``): vLLM's CPU build in
process (no engine subprocess), a small KV cache, threads not pinned to cores."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from apps.bench.vllm_apps import vllm_scratch_env
from tests.model.helpers import make_checkpoint

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM leaves its ZMQ sockets and rendezvous files where it made them: make them in a folder
# of this run's, removed when it ends (Ray's workers inherit the variables; this process's
# engines read the temporary folder set below).
os.environ.update(vllm_scratch_env())
tempfile.tempdir = os.environ["TMPDIR"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (float32, head_dim 32) both engines load."""
    root = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    return make_checkpoint(root, "llama", hidden_size=128)
