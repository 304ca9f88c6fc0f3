"""Reaching a running cluster from the command line, bounded by ``--timeout``.

``HOST:PORT`` (the GCS) and ``ray://HOST:PORT`` (Ray Client) are joined as a driver after a
TCP check, so an address nothing listens on fails in ``--timeout`` seconds with one line,
not after Ray's own minutes of retries. A dashboard URL (``http://HOST:8265``, what
``ray job submit`` takes) cannot be joined as a driver: the same command runs in the cluster
as a Ray job (``--address auto`` there) and its output and exit code are relayed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from apps.cli_args import Address

__all__ = ["connected", "run_in_cluster"]


def _fail(message: str) -> SystemExit:
    print(f"hicache-ray: {message}", file=sys.stderr)
    return SystemExit(1)


def _reachable(addr: Address, timeout_s: float) -> None:
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise _fail(f"cannot reach {addr} within {timeout_s:g} s ({exc})") from None


@contextlib.contextmanager
def connected(addr: Address, timeout_s: float) -> Iterator[None]:
    """This process joined to the cluster at ``addr`` (left again at the end, unless it
    was connected before)."""
    import ray

    if ray.is_initialized():
        yield
        return
    if addr.kind != "auto":
        _reachable(addr, timeout_s)
    target = addr.text if addr.kind != "gcs" else f"{addr.host}:{addr.port}"
    _init_within(target, addr, timeout_s)
    try:
        yield
    finally:
        ray.shutdown()


def _init_within(target: str, addr: Address, timeout_s: float) -> None:
    """``ray.init`` on a helper thread, given up after ``timeout_s`` (something that
    accepts connections but is not a Ray cluster makes Ray retry for minutes)."""
    import ray

    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=target, log_to_driver=False, logging_level=logging.ERROR)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=init, name="hicache-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _fail(f"{addr} did not answer as a Ray cluster within {timeout_s:g} s")
    if failure:
        first = str(failure[0]).splitlines()[0] if str(failure[0]) else type(failure[0]).__name__
        raise _fail(f"cannot join the Ray cluster at {addr}: {first}")


def run_in_cluster(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``hicache-ray ARGV --address auto`` as a job of the cluster whose dashboard is
    ``args.address``; print its output (and write ``--json`` from it); its exit code."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    addr: Address = args.address
    _reachable(addr, args.timeout)
    try:
        client = JobSubmissionClient(addr.text)
    except Exception as exc:
        raise _fail(f"no Ray dashboard at {addr}: {str(exc).splitlines()[0]}") from None
    entry = shlex.join([sys.executable, "-m", "apps.cli", *argv, "--address", "auto"])
    job = client.submit_job(entrypoint=entry)
    deadline = time.monotonic() + 60 + 2 * args.timeout  # the job's start, then the command
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while (status := client.get_job_status(job)) not in terminal:
        if time.monotonic() > deadline:
            client.stop_job(job)
            raise _fail(f"the job {job} on {addr} did not finish in time")
        time.sleep(0.2)
    output = client.get_job_logs(job)
    start = output.find("\n{") + 1 if not output.startswith(("{", "[")) else 0
    start = start or output.find("\n[") + 1
    payload = output[start:] if start else ""
    if getattr(args, "json", None) and payload:
        json.loads(payload)  # what is written is the command's JSON, nothing else
        Path(args.json).write_text(payload)
    print(payload or output, end="" if output.endswith("\n") else "\n")
    return 0 if status == JobStatus.SUCCEEDED else 1
