"""How much host memory the host pools of one host may take.

The budget is the memory available to this process (the smaller of the machine's and the
cgroup's), less a reserve (10 GiB on hosts with more than 64 GiB, else 10 % of memory),
divided by the ranks sharing the host.
"""

from __future__ import annotations

from pathlib import Path

import psutil

__all__ = ["GiB", "cgroup_memory", "host_memory_budget", "reserve_bytes"]

GiB = 1 << 30
_BIG_HOST_BYTES = 64 * GiB
_BIG_HOST_RESERVE_BYTES = 10 * GiB


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-aligned number.
    return value if value < (1 << 60) else None


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int]:
    """(limit, usage) in bytes of this process's memory cgroup; limit None when unlimited."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),  # v2
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_file)
        if limit is not None:
            return limit, _read_int(usage_file) or 0
    return None, 0


def reserve_bytes(total_bytes: int) -> int:
    """Memory left to the OS and the serving process itself."""
    return _BIG_HOST_RESERVE_BYTES if total_bytes > _BIG_HOST_BYTES else total_bytes // 10


def host_memory_budget(
    ranks_on_host: int = 1, *, cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int:
    """Bytes one rank's host pool may use."""
    if ranks_on_host <= 0:
        raise ValueError(f"ranks_on_host must be positive, got {ranks_on_host}")
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    limit, usage = cgroup_memory(cgroup_root)
    if limit is not None:
        total = min(total, limit)
        available = min(available, max(0, limit - usage))
    return max(0, available - reserve_bytes(total)) // ranks_on_host
