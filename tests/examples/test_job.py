"""``ray job submit`` of examples/job_multiturn.py to a ``ray start --head`` cluster, with
Ray's token authentication off (make unit) and on (make test-token).

The cluster runs in its own session (``--block``) bound to 127.0.0.1 with every port
chosen free here, and is ended by killing its process group: nothing is left behind.
"""

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
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [int(s.getsockname()[1]) for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _authorized(url: str) -> urllib.request.Request:
    """A request that carries Ray's token when the run has token auth on (the make
    target test-token)."""
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return urllib.request.Request(url, headers=headers)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gcs, dash, client, agent, agent_grpc, metrics, env_agent, nm, om = _free_ports(9)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray auth: the run's
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", f"--port={gcs}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={env_agent}", f"--node-manager-port={nm}",
        f"--object-manager-port={om}", "--num-cpus=4", "--disable-usage-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(  # started elsewhere than the project: jobs bring their code
        cmd,
        env=env,
        cwd=tmp_path_factory.mktemp("head"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job API answers once the dashboard is up
            try:
                with urllib.request.urlopen(_authorized(f"{address}/api/version"), timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the head node did not come up") from None
                time.sleep(0.5)
        yield address
    finally:
        # Every process of the cluster is in this group (its own session): kill them all.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_job_submit_runs_the_multiturn_benchmark(head: str) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray auth: the run's
    done = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            head,
            "--working-dir",
            ".",
            "--",
            sys.executable,
            "examples/job_multiturn.py",
            "--quick",
            "--modes",
            "l1_l2,l1_l2_l3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "multiturn.l1_l2_l3.oracle_ratio" in output
    assert "exactness: 2 of 2 sampled requests equal recompute" in output


def test_stats_and_store_ls_through_the_dashboard_address(head: str, tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray auth: the run's
    out = tmp_path / "stats.json"
    for argv, expect in (
        (["stats", "--address", head, "--json", str(out)], '"deployments"'),
        (["store", "ls", "--address", head], "["),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "apps.cli", *argv, "--timeout", "30"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert expect in done.stdout
    stats = json.loads(out.read_text())
    assert stats["deployments"] == {} and stats["stores"] == {}
    assert stats["object_store"]["spilled_mib"] == 0


def test_a_token_cluster_refuses_calls_without_its_token(head: str) -> None:
    """Under make test-token the cluster above really enforces Ray's token: the job API
    refuses a call without it and answers one with it."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip("Ray's token authentication is off in this run (make test-token turns it on)")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{head}/api/jobs/", timeout=10)
    assert refused.value.code in (401, 403)
    with urllib.request.urlopen(_authorized(f"{head}/api/jobs/"), timeout=10) as answer:
        assert answer.status == 200
