"""Placement groups on a local Ray: created and ordered, refused clearly, or reused."""

from __future__ import annotations

import pytest

from placement.groups import PlacementError, acquire_groups, release_groups
from placement.plan import plan_stages

ray = pytest.importorskip("ray")


def test_stages_are_placed_and_ranks_ordered(ray_local: None) -> None:
    groups = acquire_groups(plan_stages(2, 2), timeout_s=60)
    try:
        assert groups.owned and len(groups.groups) == 2
        assert groups.rank_bundles == [[0, 1], [0, 1]]  # one node: bundle order
        table = ray.util.placement_group_table(groups.groups[0])
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
    finally:
        release_groups(groups)
    assert groups.groups == []


def test_an_unplaceable_plan_names_what_is_missing_and_leaves_nothing(ray_local: None) -> None:
    before = len(ray.util.placement_group_table())
    with pytest.raises(PlacementError, match=r"GPU: need 2, cluster has 0"):
        acquire_groups(plan_stages(2, 1, gpus_per_rank=1), timeout_s=1)
    tables = ray.util.placement_group_table().values()
    assert all(t["state"] == "REMOVED" for t in list(tables)[before:])


def test_a_caller_running_in_a_group_reuses_it(ray_local: None) -> None:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    outer = ray.util.placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="PACK")
    ray.get(outer.ready(), timeout=60)

    @ray.remote(num_cpus=0)
    def inside() -> tuple[bool, int, str]:
        groups = acquire_groups(plan_stages(2, 1), timeout_s=5)
        release_groups(groups)  # not ours: left alone
        current = ray.util.get_current_placement_group()
        return groups.owned, len(groups.groups), current.id.hex()

    strategy = PlacementGroupSchedulingStrategy(outer, placement_group_capture_child_tasks=True)
    owned, count, group_id = ray.get(inside.options(scheduling_strategy=strategy).remote())
    assert not owned and count == 1 and group_id == outer.id.hex()
    ray.util.remove_placement_group(outer)
