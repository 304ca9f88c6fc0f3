"""``hicache-ray serve`` in its own process (and process group): it answers the OpenAI API on
127.0.0.1, and SIGINT shuts it down cleanly (its L3 store with it)."""

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

pytest.importorskip("ray")

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            data: dict[str, object] = json.loads(answer.read())
            return data
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.slow
def test_serve_command_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray auth: the run's
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            str(BIN / "hicache-ray"),
            "serve",
            "--model",
            "tiny4",
            "--port",
            str(port),
            "--device-tokens",
            "512",
            "--page-size",
            "4",
            "--store",
            "cli-serve",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        models = None
        while models is None and time.monotonic() < deadline and proc.poll() is None:
            models = _get(f"http://127.0.0.1:{port}/v1/models")
            time.sleep(0.5)
        assert models is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert models["data"][0]["id"] == "tiny4"  # type: ignore[index]
        body = json.dumps({"model": "tiny4", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            done = json.loads(answer.read())
        assert done["usage"]["completion_tokens"] == 3
        assert len(done["choices"][0]["text"].split()) == 3  # a preset answers token ids
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "shutting down" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
