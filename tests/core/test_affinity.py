"""Pinning a rank's process to cores (``DeploymentConfig.cpu_cores``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from hicache_ray.base.affinity import check_cores, pin_process
from hicache_ray.base.errors import ConfigError
from hicache_ray.engine.spec import DeploymentConfig

pinnable = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="this OS cannot pin threads"
)


@pytest.mark.parametrize("cores", [(-1,), (4096,), (0, 0), ("1",), (1.0,), (True,)])
def test_bad_core_lists_are_refused(cores: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError, match="cpu_cores"):
        check_cores("cpu_cores", cores)
    with pytest.raises(ConfigError, match="cpu_cores"):
        DeploymentConfig(cpu_cores=cores)


def test_no_cores_changes_nothing() -> None:
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pin_process(())
    assert (os.sched_getaffinity(0) if before is not None else None) == before


@pinnable
def test_a_core_this_process_may_not_use_is_refused() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match="may use"):
        pin_process((missing,))


_CHILD = """
import os, sys, threading
from hicache_ray.base.affinity import pin_process
core = int(sys.argv[1])
ready, done, ids = threading.Event(), threading.Event(), []
def idle(): ids.append(threading.get_native_id()); ready.set(); done.wait()
before = threading.Thread(target=idle); before.start(); ready.wait()
pin_process((core,))
seen = [os.sched_getaffinity(ids[0]), os.sched_getaffinity(0)]  # the older thread, this one
after = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); after.start()
after.join(); done.set(); before.join()
print([sorted(s) for s in seen])
"""


@pinnable
def test_every_thread_moves_and_new_threads_inherit() -> None:
    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(core)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str([[core]] * 3)
