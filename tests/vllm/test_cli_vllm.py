"""``hicache-ray serve --engine vllm`` in its own process group: vLLM replicas on Ray Serve
LLM answer the OpenAI API on 127.0.0.1 and store their pages in the shared L3; SIGINT
stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.vllm.helpers import PAGE, prompt_ids

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _models(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
            data: dict[str, object] = json.loads(answer.read())
            return data
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.timeout(600)  # a cold start of the replica takes a minute or two here
def test_serve_engine_vllm_answers_stores_and_stops(checkpoint: Path, tmp_path: Path) -> None:
    port, root = _free_port(), tmp_path / "l3"
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    command = [str(BIN / "hicache-ray"), "serve", "--engine", "vllm", "--model",
               str(checkpoint), "--dtype", "float32",  # vec kernels, AMX or not
               "--eager", "true",  # no compile: it would take minutes here
               "--storage", "file", "--storage-root", str(root),
               "--page-size", str(PAGE), "--port", str(port)]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a vLLM replica starts in about a minute here
        models = None
        while models is None and time.monotonic() < deadline and proc.poll() is None:
            models = _models(port)
            time.sleep(1)  # polling a server another process starts
        assert models is not None, log_path.read_text()[-3000:]
        assert models["data"][0]["id"] == "tiny-llama"  # type: ignore[index]
        body = {"model": "tiny-llama", "prompt": prompt_ids(40, 2 * PAGE + 3),
                "max_tokens": 3, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        # eager, the first call compiles nothing (with a compile, 120 s timed out once in a
        # fresh clone's make test); 120 s is the margin of a loaded 2-core machine
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.loads(answer.read())["usage"]["completion_tokens"] == 3
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        assert len({p.name.split("_")[0] for p in root.glob("*/*_*")}) >= 2  # its pages
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
