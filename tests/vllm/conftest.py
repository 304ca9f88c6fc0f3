"""The vLLM connector's tests run in .venv-vllm (``make test-vllm``): vLLM's CPU build in
process (no engine subprocess), a small KV cache, threads not pinned to cores."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.model.helpers import make_checkpoint

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM names its ZMQ sockets <VLLM_RPC_BASE_PATH>/<uuid> and leaves them there: keep them in a
# folder of this run's, removed when it ends (Ray's workers inherit the variable).
_RPC_DIR = tempfile.mkdtemp(prefix="hicache-vllm-rpc-")
atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)
os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (float32, head_dim 32) both engines load."""
    root = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    return make_checkpoint(root, "llama", hidden_size=128)
