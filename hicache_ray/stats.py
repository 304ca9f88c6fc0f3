"""Counters and gauges of one rank's cache.

``CacheStats`` doubles as the live counters of the L1/L2 cache (mutated only by the cache's
own thread) and, through :meth:`CacheStats.snapshot`, as the copy handed to anyone else.
``ControllerStats`` adds the L3 pipelines, the consensus and pool gauges; it is what a rank
publishes (every field is documented in the README's metrics table).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["UNFULFILLED_REASONS", "CacheStats", "ControllerStats", "RankHealth"]

# Why pages L3 holds were not prefetched (one metric each: docs/metrics.md).
UNFULFILLED_REASONS = (
    "host_capacity",  # the host pool had no room, even after evicting host-only pages
    "prefetch_quota",  # running prefetches already hold max_host_fraction of the host pool
    "peer_miss",  # this rank found the pages, another rank did not (the MIN agreed fewer)
    "read_failed",  # a read or verification failed on some rank (a corrupt page is a miss)
    "terminated",  # the request ran before the prefetch finished (best_effort / timeout)
)


class CacheStats(msgspec.Struct, kw_only=True):
    """Counts since the cache started (L1 and L2)."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    loaded_pages: int = 0
    written_pages: int = 0
    bytes_loaded: int = 0
    bytes_written: int = 0
    loads: int = 0
    writes: int = 0
    load_latency_s: float = 0.0  # summed over ``loads``
    write_latency_s: float = 0.0  # summed over ``writes``
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    load_failures: int = 0
    write_failures: int = 0
    load_skipped_device_full: int = 0
    write_skipped_host_full: int = 0

    def snapshot(self) -> CacheStats:
        """An independent copy."""
        return msgspec.structs.replace(self)


class ControllerStats(msgspec.Struct, kw_only=True):
    """One rank's full picture: L1/L2 counters, L3 pipelines, consensus, pool gauges."""

    cache: CacheStats
    steps: int = 0
    full_steps: int = 0  # steps where some rank had new facts (the full vector exchanged)
    consensus_s: float = 0.0  # time in collectives, summed over steps
    requests: int = 0
    storage_hit_tokens: int = 0  # agreed L3 tokens the requests took
    prefetched_pages: int = 0  # pages read from L3 on this rank (taken or not)
    prefetched_bytes: int = 0
    prefetch_latency_s: float = 0.0  # admission to take, summed over prefetched requests
    prefetch_query_failures: int = 0
    unfulfilled_tokens: dict[str, int] = msgspec.field(
        default_factory=lambda: dict.fromkeys(UNFULFILLED_REASONS, 0)
    )
    refills_dropped: int = 0  # refills under a node not backed up (write_through)
    backed_up_pages: int = 0  # pages stored (or found stored) in L3, agreed by every rank
    backup_bytes: int = 0
    backup_failures: int = 0  # backups that stopped early on some rank (by reason below)
    backup_skipped_gap: int = 0  # backups skipped because the parent is not stored
    peer_failures: int = 0  # steps where another rank reported a failure this rank did not
    device_pages_used: int = 0
    device_pages_total: int = 0
    host_pages_used: int = 0
    host_pages_total: int = 0
    host_pages_prefetching: int = 0
    running_prefetches: int = 0
    pending_backups: int = 0


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
