"""Thread pools whose threads all run before their first job."""

from __future__ import annotations

import threading

from hicache_ray.base.workers import started_pool


def _alive(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_started_pool_runs_every_thread_before_its_first_job() -> None:
    pool = started_pool(3, "hicache-test-started")
    try:
        assert _alive("hicache-test-started") == 3
        # A job submitted now runs on a thread already there: no thread is started.
        assert pool.submit(lambda: 7).result() == 7
        assert _alive("hicache-test-started") == 3
    finally:
        pool.shutdown(wait=True)
    assert _alive("hicache-test-started") == 0
