"""Frozen, validated configuration, grouped by concern (the L3's in
:mod:`hicache_ray.base.storage_config`, re-exported here).

Every struct validates itself at construction (``__post_init__``) and raises
:class:`~hicache_ray.base.errors.ConfigError` naming the field, the value and what to change.
Checks that need the model's KV facts (host pool versus device pool size) live in
:mod:`hicache_ray.base.layout`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from hicache_ray.base.checks import (
    check_choice,
    check_fraction,
    check_not_negative,
    check_positive,
    check_types,
)
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import StorageConfig

__all__ = [
    "DEFAULT_HIT_THRESHOLDS",
    "CacheConfig",
    "IoBackend",
    "MemLayout",
    "MemoryConfig",
    "PrefetchConfig",
    "PrefetchPolicy",
    "SchedulerConfig",
    "WriteConfig",
    "WritePolicy",
    "compatible_io_backends",
]

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
MemLayout = Literal["layer_first", "page_first", "page_first_direct"]
IoBackend = Literal["kernel", "direct"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]

# NOTE: `kernel` copies batches of pages with gather/scatter over per-layer views, which
# needs each layer of the host pool addressable as rows of pages (layer_first, page_first).
# `direct` copies one contiguous span per page and layer group, which is what a layout made
# for direct storage I/O offers (page_first_direct); layer_first works with both.
_COMPATIBLE: dict[str, tuple[str, ...]] = {
    "kernel": ("layer_first", "page_first"),
    "direct": ("layer_first", "page_first_direct"),
}

DEFAULT_HIT_THRESHOLDS: dict[str, int] = {
    "write_through": 1,
    "write_through_selective": 2,
    "write_back": 1,
}


def compatible_io_backends(layout: str) -> tuple[str, ...]:
    """The I/O backends that can move pages of host layout ``layout``."""
    return tuple(b for b, layouts in _COMPATIBLE.items() if layout in layouts)


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """L1 (device) and L2 (host) pool settings.

    Attributes:
        page_size: tokens per page; a power of two.
        device_tokens: capacity of the device pool in tokens (rounded down to whole pages).
        hicache_ratio: host pool size as a multiple of the device pool (used when
            ``hicache_size_bytes`` is 0).
        hicache_size_bytes: host pool size in bytes; 0 means "use hicache_ratio".
        mem_layout: host pool layout.
        io_backend: how pages move between tiers; must suit ``mem_layout``.
        layer_granule: layers per group of the ``page_first_direct`` host layout; 0 means
            all layers of the rank in one group. (Which layers a storage object holds follows
            from ``StorageConfig.share_pp``.)
    """

    page_size: int = 64
    device_tokens: int = 65536
    hicache_ratio: float = 2.0
    hicache_size_bytes: int = 0
    mem_layout: MemLayout = "page_first"
    io_backend: IoBackend = "kernel"
    layer_granule: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        check_positive("page_size", self.page_size)
        if self.page_size & (self.page_size - 1):
            raise ConfigError(
                "page_size", self.page_size, "not a power of two", "use 16, 32, 64, 128, ..."
            )
        check_positive("device_tokens", self.device_tokens)
        if self.device_tokens < self.page_size:
            raise ConfigError(
                "device_tokens",
                self.device_tokens,
                f"smaller than one page ({self.page_size} tokens)",
                "give the device pool at least one page",
            )
        check_positive("hicache_ratio", self.hicache_ratio)
        if not self.hicache_size_bytes >= 0:
            raise ConfigError(
                "hicache_size_bytes", self.hicache_size_bytes, "negative", "use 0 or a byte count"
            )
        if self.layer_granule < 0:
            raise ConfigError(
                "layer_granule", self.layer_granule, "negative", "use 0 (all layers) or more"
            )
        check_choice("mem_layout", self.mem_layout, MemLayout)
        check_choice("io_backend", self.io_backend, IoBackend)
        if self.mem_layout not in _COMPATIBLE[self.io_backend]:
            raise ConfigError(
                "io_backend",
                self.io_backend,
                f"cannot move pages of mem_layout={self.mem_layout!r}",
                f"use io_backend in {compatible_io_backends(self.mem_layout)} for this layout",
            )

    @property
    def num_device_pages(self) -> int:
        return self.device_tokens // self.page_size


class WriteConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When device pages are copied to the host pool.

    Attributes:
        policy: ``write_through`` copies every insert, ``write_through_selective`` copies a
            node once its hit count reaches ``hit_threshold``, ``write_back`` copies only on
            eviction from the device.
        hit_threshold: 0 means the policy's default (1 for write_through, 2 for selective).
    """

    policy: WritePolicy = "write_through"
    hit_threshold: int = 0

    def __post_init__(self) -> None:
        check_choice("write_policy", self.policy, WritePolicy)
        check_types(self)
        if self.hit_threshold < 0:
            raise ConfigError(
                "hit_threshold", self.hit_threshold, "negative", "use 0 (default) or more"
            )

    @property
    def effective_threshold(self) -> int:
        return self.hit_threshold or DEFAULT_HIT_THRESHOLDS[self.policy]


class PrefetchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """L3 -> L2 prefetch settings.

    Attributes:
        policy: ``best_effort`` stops whenever the scheduler runs the request,
            ``wait_complete`` waits for every page, ``timeout`` waits at most
            ``timeout_base_s + timeout_per_1k_tokens_s * tokens / 1024`` (capped).
        threshold_tokens: look L3 up only when at least this many tokens lie past the L2
            hit (a floor; 0: any whole page). With the recompute guard on, a lookup is also
            skipped when this rank expects to compute the remainder sooner than the lookup
            and its reads take (their rates as it measures them), so the floor need not
            guess the machine: 256 lost 6 % of the trace replay's hits (``bench trace``).
        timeout_base_s: the ``timeout`` policy's deadline for any prompt, in seconds.
        timeout_per_1k_tokens_s: seconds the deadline grows per 1,024 prompt tokens.
        timeout_cap_s: the longest deadline, in seconds.
        max_host_fraction: most of the host pool that running prefetches may hold, so
            reads never starve writes.
        recompute_guard: with the ``timeout`` policy, never wait longer for L3 than
            computing the same tokens takes, as this rank measures both: a lookup or a
            read expected to be slower is skipped (the tokens are computed) and a read is
            cut when computing would have finished, if that is sooner than the deadline
            above.
        eager_reads: reserve host slots for a request's pages past its L2 hit when it is
            admitted, if that many are free (nothing is evicted for them), so that each
            rank starts reading the moment its own L3 query answers instead of at the
            next step (under load, after a forward pass); the ranks still agree on what
            is used. Off: the reads start once the ranks agreed on the count.
    """

    policy: PrefetchPolicy = "timeout"
    threshold_tokens: int = 0
    timeout_base_s: float = 2.0
    timeout_per_1k_tokens_s: float = 0.1
    timeout_cap_s: float = 30.0
    max_host_fraction: float = 0.5
    recompute_guard: bool = True
    eager_reads: bool = True

    def __post_init__(self) -> None:
        check_choice("prefetch_policy", self.policy, PrefetchPolicy)
        check_types(self)
        if self.threshold_tokens < 0:
            raise ConfigError(
                "prefetch_threshold", self.threshold_tokens, "negative", "use 0 or more tokens"
            )
        check_not_negative("timeout_base_s", self.timeout_base_s)
        check_not_negative("timeout_per_1k_tokens_s", self.timeout_per_1k_tokens_s)
        check_positive("timeout_cap_s", self.timeout_cap_s)
        check_fraction("max_host_fraction", self.max_host_fraction)

    def timeout_s(self, num_tokens: int) -> float:
        """The deadline of a ``timeout`` prefetch of ``num_tokens`` tokens."""
        raw = self.timeout_base_s + self.timeout_per_1k_tokens_s * num_tokens / 1024
        return min(raw, self.timeout_cap_s)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a rank batches its requests (continuous batching with chunked prefills).

    Attributes:
        max_step_tokens: tokens one forward computes at most: every running request's next
            token first, then chunks of prefills (oldest first) up to this budget, so a long
            prompt does not stall the requests that decode.
        max_running: requests running (prefilling or decoding) at once.
        max_queued: requests waiting to start (for room in the device pool or for their
            prefetches) at once; a request past it is refused as overloaded.
        hold_siblings: keep a request queued while one admitted before it has not yet
            computed (or taken from a cache) the prompt pages they share, so it hits them
            when admitted instead of computing them again beside it (``engine/hold.py``).
    """

    max_step_tokens: int = 2048
    max_running: int = 256
    max_queued: int = 1024
    hold_siblings: bool = True

    def __post_init__(self) -> None:
        check_types(self, "scheduler.")
        check_positive("scheduler.max_step_tokens", self.max_step_tokens)
        check_positive("scheduler.max_running", self.max_running)
        check_positive("scheduler.max_queued", self.max_queued)


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the per-rank cache needs, grouped by concern."""

    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    write: WriteConfig = msgspec.field(default_factory=WriteConfig)
    prefetch: PrefetchConfig = msgspec.field(default_factory=PrefetchConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check_types(self)
        mem = self.memory
        ratio_sized = self.write.policy == "write_through" and not mem.hicache_size_bytes
        if ratio_sized and mem.hicache_ratio <= 1.0:
            raise ConfigError(
                "hicache_ratio",
                mem.hicache_ratio,
                "a host pool not larger than the device pool leaves no room for L3 hits "
                "under write_through (the host tier mirrors the device tier)",
                "set hicache_ratio above 1 (default 2.0) or use write_back",
            )

    @property
    def page_size(self) -> int:
        return self.memory.page_size
