from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ray.cache.memory.budget import GiB, cgroup_memory, host_memory_budget, reserve_bytes


def test_reserve_is_10_gib_on_big_hosts_else_ten_percent() -> None:
    assert reserve_bytes(128 * GiB) == 10 * GiB
    assert reserve_bytes(24 * GiB) == int(2.4 * GiB)


def test_cgroup_v2_and_v1_and_unlimited(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory(tmp_path) == (None, 0)
    (tmp_path / "memory.max").write_text(str(4 * GiB))
    (tmp_path / "memory.current").write_text(str(GiB))
    assert cgroup_memory(tmp_path) == (4 * GiB, GiB)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1 "no limit"
    assert cgroup_memory(v1) == (None, 0)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text("100")
    assert cgroup_memory(v1) == (2 * GiB, 100)


def test_budget_respects_cgroup_limit_and_ranks(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(str(2 * GiB))
    (tmp_path / "memory.current").write_text(str(GiB // 2))
    one = host_memory_budget(1, cgroup_root=tmp_path)
    assert one == (2 * GiB - GiB // 2) - reserve_bytes(2 * GiB)
    assert host_memory_budget(4, cgroup_root=tmp_path) == one // 4
    with pytest.raises(ValueError, match="ranks_on_host"):
        host_memory_budget(0)
