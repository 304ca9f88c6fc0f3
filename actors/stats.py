"""What the Ray layer's actors report: a rank's statistics and health, an L3 shard's counts
(plain data across the actor boundary; ``msgspec.to_builtins`` gives JSON)."""

from __future__ import annotations

from typing import Any

import msgspec

from hicache_ray.base.stats import ControllerStats
from hicache_ray.engine.step_loop import StepLoop

__all__ = ["RankHealth", "RankStats", "ShardStats", "loop_health"]


class ShardStats(msgspec.Struct, kw_only=True):
    """One L3 shard's counts (``PageShard.stats``), or a store's summed over its shards.

    Attributes:
        objects / keys / bytes: what it holds; capacity_bytes: its budget (0: none).
        evicted_objects: dropped past the budget; quota_evicted_objects: dropped past their
        tenant's quota; lost_objects: gone with their writer.
        adopting: written objects whose own copies are still being made.
    """

    objects: int = 0
    keys: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    evicted_objects: int = 0
    quota_evicted_objects: int = 0
    lost_objects: int = 0
    adopting: int = 0

    def __add__(self, other: ShardStats) -> ShardStats:
        return ShardStats(
            **{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__}
        )


class RankStats(msgspec.Struct, kw_only=True):
    """One rank's statistics as ``RankActor.stats`` returns them (plain data across the
    actor boundary; ``msgspec.to_builtins`` gives JSON).

    Attributes:
        rank: the rank; error: why its step loop stopped, else None.
        device: where its pools and model live; model_backend: ``gloo`` or ``nccl``.
        controller: its cache controller's statistics (None before it is formed).
        storage: its L3 client's counters (``StorageStats``; None without L3).
    """

    rank: int
    error: str | None = None
    device: str = "cpu"
    model_backend: str = ""
    controller: ControllerStats | None = None
    storage: Any = None  # hicache_ray.storage.StorageStats (the storage package imports this)


class RankHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank stands (what ``RankActor.health`` returns).

    Attributes:
        rank: the rank; generation: the deployment generation it belongs to.
        stepping: its step thread runs.
        steps: steps it has made.
        error: why it stopped stepping (or why it is not there), else None.
        in_step: the thread is inside a step (possibly waiting in a collective).
        outside_step_s: seconds since its last step ended (None while in a step): a
            stalled rank's grows past the consensus timeout.
    """

    rank: int
    generation: int = 0
    stepping: bool = False
    steps: int = 0
    error: str | None = None
    in_step: bool = False
    outside_step_s: float | None = None


def loop_health(rank: int, generation: int, loop: StepLoop | None, error: str | None) -> RankHealth:
    """A rank's health from its step loop (None: not started yet)."""
    if loop is None:
        return RankHealth(rank=rank, generation=generation, error=error)
    return RankHealth(
        rank=rank,
        generation=generation,
        stepping=loop.running and not loop.stopping,
        steps=loop.steps,
        error=error,
        in_step=loop.in_step,
        outside_step_s=loop.outside_step_s,
    )
