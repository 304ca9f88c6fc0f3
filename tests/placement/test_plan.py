"""Placement planning, table-tested without a cluster."""

from __future__ import annotations

import pytest

from hicache_ray.base.errors import ConfigError
from placement.plan import order_ranks, plan_stages, rank_bundle

GPU_NODE = {"CPU": 16.0, "GPU": 8.0}
SMALL_GPU_NODE = {"CPU": 8.0, "GPU": 2.0}


@pytest.mark.parametrize(
    ("tp", "pp", "gpus", "nodes", "strategy", "bundle"),
    [
        (2, 1, 1, [GPU_NODE], "STRICT_PACK", {"CPU": 1.0, "GPU": 1.0}),
        (8, 2, 1, [GPU_NODE, GPU_NODE], "STRICT_PACK", {"CPU": 1.0, "GPU": 1.0}),
        (4, 1, 1, [SMALL_GPU_NODE, SMALL_GPU_NODE], "PACK", {"CPU": 1.0, "GPU": 1.0}),
        (4, 2, 0, [{"CPU": 2.0}, {"CPU": 2.0}], "PACK", {"CPU": 1.0}),
        (2, 3, 0, [], "STRICT_PACK", {"CPU": 1.0}),
    ],
)
def test_stage_plans(
    tp: int, pp: int, gpus: int, nodes: list[dict[str, float]], strategy: str, bundle: dict
) -> None:
    stages = plan_stages(tp, pp, gpus_per_rank=gpus, nodes=nodes)
    assert [s.pp_rank for s in stages] == list(range(pp))
    for s in stages:
        assert s.strategy == strategy and s.bundles == [bundle] * tp
    assert rank_bundle(tp * (pp - 1) + 1, tp) == (pp - 1, 1 % tp)


@pytest.mark.parametrize(
    ("nodes", "order"),
    [
        (["b", "a", "b", "a"], [1, 3, 0, 2]),  # by node id, then bundle index
        (["n1", "n1", "n1"], [0, 1, 2]),
        (["z", "y", "x"], [2, 1, 0]),
    ],
)
def test_rank_order_is_by_node_id(nodes: list[str], order: list[int]) -> None:
    assert order_ranks(nodes) == order


def test_impossible_plans_are_refused_with_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="no node can hold even one rank"):
        plan_stages(2, 1, gpus_per_rank=1, nodes=[{"CPU": 4.0}])
    with pytest.raises(ConfigError, match="must be positive"):
        plan_stages(0, 1)
    with pytest.raises(ConfigError, match="out of range"):
        plan_stages(1, 1, cpus_per_rank=0)
