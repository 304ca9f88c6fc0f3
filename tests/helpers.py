"""Helpers shared by the suites: a fake clock; for the Ray tests, object-store usage and
bounded waits."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


class FakeClock:
    """A clock that stands still until a test moves ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


RAY_CPUS = 8  # logical CPUs of the shared local Ray (a TP=4 and a TP=2 deployment fit)


def ensure_local_ray() -> None:
    """Connect the shared local Ray (started on first use, and again after a module that
    ran its own cluster); the session fixture in conftest shuts it down at the end."""
    import os

    import pytest
    import ray

    if os.environ.get("HICACHE_TESTS_NO_RAY"):
        pytest.fail("this test starts Ray: the fast lane (make test-fast) has none; mark it")
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            # metrics reach the node's exporter within a second (the scrape test waits)
            _system_config={"metrics_report_interval_ms": 1000},
        )


def plasma_usage() -> tuple[int, int]:
    """(MiB, objects) in the object stores of the cluster this driver is connected to."""
    from actors.inspect import object_store_usage

    return object_store_usage()


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until it holds (Ray frees objects asynchronously); fail after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test server to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
