"""Keeping a process on chosen host cores (``DeploymentConfig.cpu_cores``).

Ray reserves CPUs by count, not by core: two deployments on one node share every core.
:func:`pin_process` moves every thread of the calling process onto ``cores`` (threads
started later inherit it from the thread that starts them), so two deployments of a
comparison, or a latency-critical deployment beside a batch one, stay off each other's
cores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hicache_ray.base.errors import ConfigError

__all__ = ["MAX_CORE", "check_cores", "pin_process"]

MAX_CORE = 4095  # Linux's default CPU-number limit is below this


def check_cores(field: str, cores: Sequence[int]) -> None:
    """Refuse a core list that is not distinct ints in ``[0, MAX_CORE]``."""
    for core in cores:
        if type(core) is not int or not 0 <= core <= MAX_CORE:
            raise ConfigError(field, core, f"not a core number in [0, {MAX_CORE}]", "use 0, 1, ...")
    if len(set(cores)) != len(cores):
        raise ConfigError(field, list(cores), "names a core twice", "name each core once")


def pin_process(cores: Sequence[int], field: str = "cpu_cores") -> None:
    """Run every thread of this process on ``cores`` only (empty: change nothing).

    Raises:
        ConfigError: the OS cannot pin threads, or ``cores`` names a core this process may
            not use (not on this host, or outside its cgroup).
    """
    if not cores:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(
            field, list(cores), "this OS cannot pin threads to cores", "leave it empty"
        )
    allowed = os.sched_getaffinity(0)
    if not set(cores) <= allowed:
        raise ConfigError(
            field,
            list(cores),
            f"not among the cores this process may use ({sorted(allowed)})",
            "name cores of the host the ranks run on, or leave it empty",
        )
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, set(cores))
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def _threads() -> list[int]:
    """This process's thread ids (the calling thread's alone where ``/proc`` is missing)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
