"""Counters and gauges of one rank's cache.

``CacheStats`` doubles as the live counters of the L1/L2 cache (mutated only by the cache's
own thread) and, through :meth:`CacheStats.snapshot`, as the copy handed to anyone else.
``ControllerStats`` adds the L3 pipelines, the consensus and pool gauges; it is what a rank
publishes (every field is documented in the README's metrics table).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

__all__ = [
    "HINT_OUTCOMES",
    "UNFULFILLED_REASONS",
    "CacheStats",
    "Unfulfilled",
    "ControllerStats",
    "Published",
    "counter",
    "gauge",
]


class Unfulfilled(str, enum.Enum):
    """Why pages L3 holds were not prefetched (one metric each: docs/metrics.md)."""

    HOST_CAPACITY = "host_capacity"  # no room in L2, even after evicting host-only pages
    PREFETCH_QUOTA = "prefetch_quota"  # running prefetches hold max_host_fraction of L2
    PEER_MISS = "peer_miss"  # this rank found the pages, another did not (the MIN agreed fewer)
    READ_FAILED = "read_failed"  # a read or verification failed on some rank
    TERMINATED = "terminated"  # the request ran before the prefetch finished
    SLOWER_THAN_COMPUTE = "slower_than_compute"  # reading was expected to take longer

    def __str__(self) -> str:
        return self.value


UNFULFILLED_REASONS = tuple(r.value for r in Unfulfilled)
# What became of each look-ahead hint a rank other than 0 read (hicache_ray.engine.hint_channel):
# looked up, ignored (late, or this rank would not look the prompt up), or malformed.
HINT_OUTCOMES = ("looked_up", "ignored", "malformed")


@dataclass(frozen=True)
class Published:
    """How a stats field is published as a metric (:mod:`hicache_ray.base.metrics` reads these
    annotations: a new counter is one annotated field). ``name`` is without the
    ``hicache_`` prefix and a counter's ``_total``; a dict field is one metric per key
    (``{key}`` in the name and help)."""

    kind: Literal["counter", "gauge"]
    name: str
    help: str
    keys: tuple[str, ...] = ()  # a dict field's keys (one metric each)


def counter(name: str, text: str, keys: tuple[str, ...] = ()) -> Published:
    return Published("counter", name, text, keys)


def gauge(name: str, text: str) -> Published:
    return Published("gauge", name, text)


class CacheStats(msgspec.Struct, kw_only=True):
    """Counts since the cache started (L1 and L2); latencies are summed over their copies."""

    device_hit_tokens: Annotated[
        int, counter("device_hit_tokens", "Prompt tokens served from L1 (tokens)")
    ] = 0
    host_hit_tokens: Annotated[
        int,
        counter("host_hit_tokens", "Prompt tokens loaded from L2, L3 refills included (tokens)"),
    ] = 0
    loaded_pages: Annotated[int, counter("l2_to_l1_pages", "Pages copied L2 -> L1 (pages)")] = 0
    bytes_loaded: Annotated[int, counter("l2_to_l1_bytes", "Bytes copied L2 -> L1 (bytes)")] = 0
    loads: Annotated[int, counter("l2_to_l1_copies", "L2 -> L1 copy jobs (copies)")] = 0
    load_latency_s: Annotated[
        float, counter("l2_to_l1_seconds", "Time spent in L2 -> L1 copy jobs (seconds)")
    ] = 0.0
    written_pages: Annotated[int, counter("l1_to_l2_pages", "Pages copied L1 -> L2 (pages)")] = 0
    bytes_written: Annotated[int, counter("l1_to_l2_bytes", "Bytes copied L1 -> L2 (bytes)")] = 0
    writes: Annotated[int, counter("l1_to_l2_copies", "L1 -> L2 copy jobs (copies)")] = 0
    write_latency_s: Annotated[
        float, counter("l1_to_l2_seconds", "Time spent in L1 -> L2 copy jobs (seconds)")
    ] = 0.0
    device_evicted_pages: Annotated[
        int, counter("l1_evicted_pages", "Pages evicted from L1 (pages)")
    ] = 0
    host_evicted_pages: Annotated[
        int, counter("l2_evicted_pages", "Pages evicted from L2 (pages)")
    ] = 0
    load_failures: Annotated[
        int, counter("l2_to_l1_failures", "L2 -> L1 copies that failed (copies)")
    ] = 0
    write_failures: Annotated[
        int, counter("l1_to_l2_failures", "L1 -> L2 copies that failed (copies)")
    ] = 0
    load_skipped_device_full: Annotated[
        int, counter("l2_to_l1_skipped_l1_full", "Loads skipped: L1 had no room (loads)")
    ] = 0
    write_skipped_host_full: Annotated[
        int, counter("l1_to_l2_skipped_l2_full", "Writes skipped: L2 had no room (writes)")
    ] = 0
    prompt_pages_cached: Annotated[
        int,
        counter("prompt_pages_cached", "Prompt pages in the tree while their request ran (pages)"),
    ] = 0

    def snapshot(self) -> CacheStats:
        """An independent copy."""
        return msgspec.structs.replace(self)


class ControllerStats(msgspec.Struct, kw_only=True):
    """One rank's full picture: L1/L2 counters, L3 pipelines, consensus, pool gauges."""

    cache: CacheStats
    steps: Annotated[int, counter("steps", "Scheduler steps (steps)")] = 0
    full_steps: Annotated[
        int, counter("full_steps", "Steps where some rank had new facts (steps)")
    ] = 0
    consensus_s: Annotated[
        float, counter("consensus_seconds", "Time in the cross-rank agreement (seconds)")
    ] = 0.0
    quiet_wait_s: Annotated[
        float,
        counter(
            "quiet_wait_seconds",
            "Time quiet steps waited for this rank's own L3 queries and reads (seconds)",
        ),
    ] = 0.0
    requests: Annotated[int, counter("requests", "Requests admitted (requests)")] = 0
    storage_hit_tokens: Annotated[
        int, counter("l3_hit_tokens", "Prompt tokens taken from L3, agreed by every rank (tokens)")
    ] = 0
    prefetched_pages: Annotated[
        int, counter("l3_prefetched_pages", "Pages read from L3 on this rank (pages)")
    ] = 0
    prefetched_bytes: Annotated[
        int, counter("l3_prefetched_bytes", "Bytes read from L3 on this rank (bytes)")
    ] = 0
    prefetch_latency_s: Annotated[
        float,
        counter(
            "l3_prefetch_wait_seconds",
            "Admission to take, summed over prefetched requests (seconds)",
        ),
    ] = 0.0
    prefetch_query_failures: Annotated[
        int, counter("l3_query_failures", "L3 existence queries that failed (queries)")
    ] = 0
    prefetch_queries_skipped: Annotated[
        int,
        counter(
            "l3_queries_skipped_cheaper_to_compute",
            "L3 lookups not made: computing the remainder was expected to take less time "
            "than the lookup and its reads (queries)",
        ),
    ] = 0
    prefetch_lookaheads: Annotated[
        int,
        counter(
            "l3_lookaheads",
            "L3 lookups made before admission, for a request about to be admitted (queries)",
        ),
    ] = 0
    lookahead_hints: Annotated[
        dict[str, int],
        counter(
            "l3_lookahead_hints_{key}",
            "Look-ahead hints this rank (not rank 0) read from rank 0: {key} (hints)",
            keys=HINT_OUTCOMES,
        ),
    ] = msgspec.field(default_factory=lambda: dict.fromkeys(HINT_OUTCOMES, 0))
    unfulfilled_tokens: Annotated[
        dict[str, int],
        counter(
            "l3_unfulfilled_tokens_{key}",
            "L3 hit tokens not prefetched: {key} (tokens)",
            keys=UNFULFILLED_REASONS,
        ),
    ] = msgspec.field(default_factory=lambda: dict.fromkeys(UNFULFILLED_REASONS, 0))
    refills_dropped: Annotated[
        int,
        counter("l3_refills_dropped", "L3 refills dropped under a node not backed up (refills)"),
    ] = 0
    backed_up_pages: Annotated[
        int,
        counter("l3_backed_up_pages", "Pages stored (or found stored) in L3 by every rank (pages)"),
    ] = 0
    backup_bytes: Annotated[int, counter("l3_backup_bytes", "Bytes written to L3 (bytes)")] = 0
    backup_failures: Annotated[
        int, counter("l3_backup_failures", "Backups that stopped early on some rank (backups)")
    ] = 0
    backup_skipped_gap: Annotated[
        int,
        counter("l3_backup_skipped_gap", "Backups skipped: the parent page is not in L3 (backups)"),
    ] = 0
    backup_ran_beside_forward: Annotated[
        int,
        counter(
            "l3_backup_ran_beside_forward",
            "Forward passes during which backups kept running: their backlog held 1/8 of L2 "
            "(passes)",
        ),
    ] = 0
    backup_waited_for_reads: Annotated[
        int,
        counter(
            "l3_backup_waited_for_reads",
            "Backup store calls held while this rank's L3 queries or reads ran (waits)",
        ),
    ] = 0
    peer_failures: Annotated[
        int,
        counter(
            "peer_failures", "Steps where another rank reported a failure this rank did not (steps)"
        ),
    ] = 0
    device_pages_used: Annotated[int, gauge("l1_pages_used", "L1 pages in use (pages)")] = 0
    device_pages_total: Annotated[int, gauge("l1_pages", "L1 pages (pages)")] = 0
    host_pages_used: Annotated[int, gauge("l2_pages_used", "L2 pages in use (pages)")] = 0
    host_pages_total: Annotated[int, gauge("l2_pages", "L2 pages (pages)")] = 0
    host_pages_prefetching: Annotated[
        int, gauge("l2_pages_prefetching", "L2 pages held by running L3 prefetches (pages)")
    ] = 0
    running_prefetches: Annotated[
        int, gauge("l3_running_prefetches", "L3 prefetches in flight (prefetches)")
    ] = 0
    pending_backups: Annotated[
        int, gauge("l3_pending_backups", "L3 backups queued or in flight (backups)")
    ] = 0


class ConnectorStats(msgspec.Struct, kw_only=True):
    """What the vLLM connector moved, running totals (the scheduler side counts the hits,
    each worker its moves; vLLM exports the workers' through its ``/metrics``)."""

    hit_tokens: Annotated[
        int, counter("vllm_hit_tokens", "Prompt tokens vLLM was told to load from L3 (tokens)")
    ] = 0
    loaded_tokens: Annotated[
        int, counter("vllm_loaded_tokens", "Tokens read, verified and placed in vLLM (tokens)")
    ] = 0
    load_failed_tokens: Annotated[
        int,
        counter("vllm_load_failed_tokens", "Tokens vLLM recomputed: missing or corrupt (tokens)"),
    ] = 0
    saved_tokens: Annotated[
        int, counter("vllm_saved_tokens", "Tokens of vLLM's pages the store holds (tokens)")
    ] = 0
    save_dropped_tokens: Annotated[
        int,
        counter(
            "vllm_save_dropped_tokens", "Tokens not saved: store full, failed or busy (tokens)"
        ),
    ] = 0
