"""Shared memory that processes killed mid-run leave behind: the segments and semaphores of
Python's ``multiprocessing`` (vLLM's message queues among them) in ``/dev/shm`` when a
Serve replica's engine is killed before it could unlink them (each run of the vLLM tests
left 24 segments and 12 semaphores). :func:`remove_orphans` removes those that appeared
since a given listing and that no live process maps or holds open."""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["SHM", "in_use", "remove_orphans", "shm_names"]

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")  # multiprocessing's SharedMemory and its semaphores


def shm_names(root: Path | None = None) -> set[str]:
    """The names of ``multiprocessing``'s segments and semaphores under ``root`` (``SHM``)."""
    root = root or SHM
    try:
        return {p.name for p in root.iterdir() if p.name.startswith(PREFIXES)}
    except OSError:
        return set()


def in_use(root: Path | None = None) -> set[str]:
    """Names under ``root`` (``SHM``) that a live process maps or holds open (``/proc``)."""
    prefix, used = f"{root or SHM}/", set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").partition(prefix)[2]
                    if path:
                        used.add(path.removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix) :])
        except OSError:  # gone, or not ours to read
            continue
    return used


def remove_orphans(before: set[str], root: Path | None = None) -> list[str]:
    """Remove the segments and semaphores under ``root`` (``SHM``) that are not in
    ``before`` and that no live process uses; the names removed."""
    root = root or SHM
    new = shm_names(root) - before
    if not new:
        return []
    removed = []
    for name in sorted(new - in_use(root)):
        try:
            (root / name).unlink()
            removed.append(name)
        except OSError as exc:
            log.debug("left %s: %s", root / name, exc)
    return removed
