"""The environment of the vLLM processes the benches start: a temporary folder of the
bench's own for vLLM's sockets and rendezvous files, removed when the bench exits (vLLM
leaves them behind when Serve kills a replica)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from apps.bench.vllm_apps import REPLICA_ENV, vllm_env


def test_vllm_processes_share_one_private_temporary_folder() -> None:
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    folder = Path(env["TMPDIR"])
    assert env["VLLM_RPC_BASE_PATH"] == str(folder) and folder.is_dir()
    assert folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("hicache-vllm-")
    assert vllm_env()["TMPDIR"] == str(folder)  # one folder per process
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # what the caller sets wins
    assert all(env[k] == v for k, v in REPLICA_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING")
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(folder))  # the cache is kept
    assert env["RAY_TMPDIR"] == os.environ.get("RAY_TMPDIR", tempfile.gettempdir())  # Ray's too


def test_the_folder_goes_when_the_bench_exits() -> None:
    code = (
        "from pathlib import Path\n"
        "from apps.bench.vllm_apps import vllm_env\n"
        "folder = Path(vllm_env()['TMPDIR'])\n"
        "(folder / 'vllm_dist_0123').write_text('left by an engine')\n"
        "print(folder)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    folder = Path(done.stdout.strip())
    assert folder.name.startswith("hicache-vllm-") and not folder.exists()
