"""Create (or reuse) the placement groups of a plan on a running Ray cluster.

The one module of ``placement`` that talks to Ray (imported lazily). Inside a Serve replica
or an actor that already runs in a placement group with enough bundles, that group is reused
(it belongs to the caller and is never removed here). Otherwise one group per pipeline stage
is created and waited for; if any cannot be placed in time, every group made so far is
removed and :class:`PlacementError` says which resources the cluster lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache_ray.base.errors import HiCacheError
from placement.plan import StagePlan, order_ranks

__all__ = ["PlacementError", "StageGroups", "acquire_groups", "release_groups"]


class PlacementError(HiCacheError, RuntimeError):
    """The cluster cannot place the deployment (the message names what is missing)."""


@dataclass
class StageGroups:
    """Placement groups of a deployment's stages and the bundle of each rank.

    Attributes:
        groups: one per stage (or the caller's group, reused for every stage).
        owned: created here (``release_groups`` removes them) or the caller's.
        rank_bundles: per stage, the bundle index of TP rank ``tp`` (ordered by node id).
        bundle_offsets: per stage, where its bundles start in its group (reused groups
            hold every stage's bundles one after the other).
    """

    groups: list[Any]
    owned: bool
    rank_bundles: list[list[int]] = field(default_factory=list)
    bundle_offsets: list[int] = field(default_factory=list)


def _missing(stages: list[StagePlan], total: dict[str, float]) -> str:
    need: dict[str, float] = {}
    for s in stages:
        for b in s.bundles:
            for resource, amount in b.items():
                need[resource] = need.get(resource, 0.0) + amount
    short = {r: (a, total.get(r, 0.0)) for r, a in need.items() if total.get(r, 0.0) < a}
    if short:
        parts = ", ".join(f"{r}: need {a:g}, cluster has {h:g}" for r, (a, h) in short.items())
        return f"the cluster lacks resources ({parts})"
    return (
        f"the cluster has the resources in total ({total}) but not free or not on one node "
        f"where STRICT_PACK needs them; free resources or add nodes"
    )


def _node_order(group: Any, offset: int, count: int) -> list[int]:
    from ray.util import placement_group_table

    table = placement_group_table(group)
    nodes = table.get("bundles_to_node_id", {})
    return order_ranks([str(nodes.get(offset + i, "")) for i in range(count)])


def acquire_groups(
    stages: list[StagePlan], *, timeout_s: float = 60.0, name: str = "hicache"
) -> StageGroups:
    """The placement groups for ``stages``: the caller's current group if it has enough
    bundles, else new ones (``{name}-pp{stage}``), each ready within ``timeout_s``.

    Raises:
        PlacementError: a group could not be placed in time (nothing is left behind).
    """
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util import get_current_placement_group, placement_group, remove_placement_group

    needed = sum(len(s.bundles) for s in stages)
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= needed:
        out = StageGroups([current] * len(stages), owned=False)
        offset = 0
        for s in stages:
            out.bundle_offsets.append(offset)
            out.rank_bundles.append(_node_order(current, offset, len(s.bundles)))
            offset += len(s.bundles)
        return out
    made: list[Any] = []
    try:
        for s in stages:
            group = placement_group(s.bundles, strategy=s.strategy, name=f"{name}-pp{s.pp_rank}")
            made.append(group)
            ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        for group in made:
            remove_placement_group(group)
        reason = _missing(stages, ray.cluster_resources())  # type: ignore[no-untyped-call]
        raise PlacementError(
            f"placement of {len(stages)} stage(s) x {len(stages[0].bundles)} rank(s) "
            f"({stages[0].bundles[0]} each, {stages[0].strategy}) did not complete in "
            f"{timeout_s:g}s: {reason}"
        ) from None
    out = StageGroups(made, owned=True, bundle_offsets=[0] * len(stages))
    out.rank_bundles = [
        _node_order(g, 0, len(s.bundles)) for g, s in zip(made, stages, strict=True)
    ]
    return out


def release_groups(groups: StageGroups) -> None:
    """Remove the groups created by :func:`acquire_groups` (a reused group is left alone)."""
    if not groups.owned:
        return
    from ray.util import remove_placement_group

    for group in groups.groups:
        remove_placement_group(group)
    groups.groups = []
