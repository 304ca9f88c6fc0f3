"""Pure placement planning: TP x PP ranks -> Ray bundles, strategies and rank order.

One placement group per pipeline stage: a stage's TP ranks exchange activations every layer,
so they belong on one node whenever they fit (``STRICT_PACK``); a TP group larger than any
node is spread with ``PACK``. Rank ``r = pp * tp_size + tp``.

After placement, ranks are ordered by the node id of their bundle (then bundle index),
never by IP: simulated nodes on one machine, and containers behind one address, share IPs.
Nothing here talks to Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hicache_ray.base.errors import ConfigError

__all__ = ["StagePlan", "order_ranks", "plan_stages", "rank_bundle"]

Bundle = dict[str, float]


@dataclass(frozen=True)
class StagePlan:
    """The placement group of one pipeline stage.

    Attributes:
        pp_rank: the stage.
        bundles: one bundle per TP rank of the stage, in TP order before placement.
        strategy: ``STRICT_PACK`` (the group fits one node) or ``PACK``.
    """

    pp_rank: int
    bundles: list[Bundle]
    strategy: str


def _fits(bundles: Sequence[Mapping[str, float]], node: Mapping[str, float]) -> bool:
    need: dict[str, float] = {}
    for b in bundles:
        for resource, amount in b.items():
            need[resource] = need.get(resource, 0.0) + amount
    return all(node.get(resource, 0.0) >= amount for resource, amount in need.items())


def plan_stages(
    tp_size: int,
    pp_size: int,
    *,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: int = 0,
    nodes: Sequence[Mapping[str, float]] = (),
    resources: Mapping[str, float] | None = None,
) -> list[StagePlan]:
    """Bundles and strategy of every pipeline stage.

    Args:
        tp_size, pp_size: the deployment's shape.
        cpus_per_rank: CPUs each rank reserves (its torch threads).
        gpus_per_rank: 1 on GPU clusters, 0 on CPU-only ones.
        nodes: total resources of each alive node (``ray.nodes()``); empty means "assume a
            TP group fits one node".
        resources: more resources every bundle asks for (custom node resources, e.g.
            ``{"tp4_pool": 1}``, pin a deployment to the nodes that offer them).

    Raises:
        ConfigError: a bad shape, or a rank larger than every node.
    """
    if tp_size < 1 or pp_size < 1:
        raise ConfigError("tp_size/pp_size", (tp_size, pp_size), "must be positive", "use >= 1")
    if cpus_per_rank <= 0 or gpus_per_rank < 0:
        raise ConfigError(
            "cpus_per_rank/gpus_per_rank",
            (cpus_per_rank, gpus_per_rank),
            "out of range",
            "reserve at least a fraction of a CPU per rank and 0 or more GPUs",
        )
    bundle: Bundle = {"CPU": float(cpus_per_rank)}
    if gpus_per_rank:
        bundle["GPU"] = float(gpus_per_rank)
    bundle.update({k: float(v) for k, v in (resources or {}).items()})
    if nodes and not any(_fits([bundle], n) for n in nodes):
        raise ConfigError(
            "cpus_per_rank/gpus_per_rank",
            bundle,
            "no node can hold even one rank",
            f"nodes offer {list(nodes)}; reserve less per rank or add nodes",
        )
    group = [dict(bundle) for _ in range(tp_size)]
    fits_one_node = not nodes or any(_fits(group, n) for n in nodes)
    strategy = "STRICT_PACK" if fits_one_node else "PACK"
    return [StagePlan(pp, [dict(b) for b in group], strategy) for pp in range(pp_size)]


def rank_bundle(rank: int, tp_size: int) -> tuple[int, int]:
    """``(stage, bundle index in the stage's group)`` of ``rank`` (before ordering)."""
    return rank // tp_size, rank % tp_size


def order_ranks(bundle_nodes: Sequence[str]) -> list[int]:
    """The bundle each TP rank of a stage gets, given the node id of every bundle.

    Bundles are sorted by (node id, bundle index), so ranks on one node are consecutive and
    the order is the same wherever it is computed. Returns ``order`` with rank ``tp`` ->
    bundle ``order[tp]``.
    """
    return sorted(range(len(bundle_nodes)), key=lambda i: (bundle_nodes[i], i))
