"""Frozen, validated configuration, grouped by concern.

Every struct validates itself at construction (``__post_init__``) and raises
:class:`~hicache_ray.errors.ConfigError` naming the field, the value and what to change.
Checks that need the model's KV facts (host pool versus device pool size) live in
:mod:`hicache_ray.layout`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from hicache_ray.backends import backend_names, is_backend_path
from hicache_ray.checks import (
    check_choice,
    check_custom_resources,
    check_fraction,
    check_not_negative,
    check_positive,
    check_types,
)
from hicache_ray.errors import ConfigError

__all__ = [
    "DEFAULT_HIT_THRESHOLDS",
    "CacheConfig",
    "Fault",
    "FileStorageOptions",
    "IoBackend",
    "KeyScheme",
    "MemLayout",
    "MemoryConfig",
    "MemoryStorageOptions",
    "PrefetchConfig",
    "PrefetchPolicy",
    "RayStorageOptions",
    "SchedulerConfig",
    "StorageConfig",
    "WriteConfig",
    "WritePolicy",
    "compatible_io_backends",
]

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
MemLayout = Literal["layer_first", "page_first", "page_first_direct"]
IoBackend = Literal["kernel", "direct"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
KeyScheme = Literal["unified", "rank-suffix"]

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


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True):
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


class WriteConfig(msgspec.Struct, frozen=True, kw_only=True):
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


class PrefetchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """L3 -> L2 prefetch settings.

    Attributes:
        policy: ``best_effort`` stops whenever the scheduler runs the request,
            ``wait_complete`` waits for every page, ``timeout`` waits at most
            ``timeout_base_s + timeout_per_1k_tokens_s * tokens / 1024`` (capped).
        threshold_tokens: prefetch only when at least this many tokens lie past the L2 hit.
        timeout_base_s: the ``timeout`` policy's deadline for any prompt, in seconds.
        timeout_per_1k_tokens_s: seconds the deadline grows per 1,024 prompt tokens.
        timeout_cap_s: the longest deadline, in seconds.
        max_host_fraction: most of the host pool that running prefetches may hold, so
            reads never starve writes.
    """

    policy: PrefetchPolicy = "timeout"
    threshold_tokens: int = 256
    timeout_base_s: float = 2.0
    timeout_per_1k_tokens_s: float = 0.1
    timeout_cap_s: float = 30.0
    max_host_fraction: float = 0.5

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


FaultOp = Literal["write", "read", "size", "remove"]
FaultKind = Literal["fail", "delay", "corrupt", "truncate"]
_FAULT_OPS: dict[str, tuple[str, ...]] = {
    "fail": ("write", "read", "size", "remove"),
    "delay": ("write", "read", "size", "remove"),
    "corrupt": ("write", "read"),
    "truncate": ("write",),
}


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One fault-injection rule for L3 storage: which operation, what happens, how often.

    Applied by :class:`hicache_ray.storage.faults.FaultyObjects` under the verification
    layer, so it acts on real stored bytes.

    Attributes:
        op: ``write``, ``read``, ``size`` (the lookup behind ``exists``) or ``remove``.
        kind: ``fail`` raises :class:`InjectedFault`; ``delay`` waits ``delay_s`` first;
            ``corrupt`` flips a payload byte (of the stored object on write, of the bytes
            delivered on read); ``truncate`` stores the object without its last half.
        probability: chance that a matching call is hit.
        skip: matching calls let through before the rule can fire.
        limit: most calls hit; 0 for no limit.
        delay_s: the wait of ``delay``.
    """

    op: FaultOp
    kind: FaultKind
    probability: float = 1.0
    skip: int = 0
    limit: int = 0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        check_types(self, "fault.")
        if self.op not in _FAULT_OPS.get(self.kind, ()):
            raise ConfigError(
                "fault", f"{self.kind} on {self.op}", "not supported", f"use {_FAULT_OPS}"
            )
        if not 0 <= self.probability <= 1:
            raise ConfigError("fault.probability", self.probability, "outside [0, 1]", "fix it")
        for name in ("skip", "limit", "delay_s"):
            check_not_negative(f"fault.{name}", getattr(self, name))


class MemoryStorageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of the ``memory`` backend (one process; for tests and single-process runs).

    Attributes:
        capacity_bytes: most bytes held before least recently used pages are evicted;
            0 means no limit.
    """

    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        check_types(self, "memory.")
        check_not_negative("memory.capacity_bytes", self.capacity_bytes)


class FileStorageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of the ``file`` backend (any ``pyarrow.fs`` filesystem).

    Attributes:
        root: a local directory or a URI pyarrow resolves (``s3://bucket/prefix?...``,
            ``gs://...``, ``hdfs://...``); required.
        capacity_bytes: most bytes this process keeps under ``root`` before evicting least
            recently used pages; 0 means no limit.
        metadata_ttl_s: how long a cached "this page exists" answer is trusted before the
            filesystem is asked again (pages other processes delete show up after this).
        scan_on_start: list ``root`` at start-up to learn this namespace's existing pages.
        timeout_s: for S3 roots, how long one request may take (connecting included) before
            it fails; requests are not retried, so a batch against an unreachable endpoint
            fails within about this long (a miss, never an error to the request).
    """

    root: str = ""
    capacity_bytes: int = 0
    metadata_ttl_s: float = 5.0
    scan_on_start: bool = True
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_types(self, "file.")
        check_not_negative("file.capacity_bytes", self.capacity_bytes)
        check_not_negative("file.metadata_ttl_s", self.metadata_ttl_s)
        check_positive("file.timeout_s", self.timeout_s)


class RayStorageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of the ``ray`` backend (pages in the Ray object store, see ``actors``).

    Attributes:
        name: the store's name; deployments naming the same store (in the same Ray
            cluster) share its pages. Its shard actors are ``hicache-l3-{name}-{i}`` in
            the Ray namespace ``hicache``.
        num_shards: index shards (one detached actor each, placed on different nodes); 0
            joins an existing store with its own count, or makes one shard per node that
            can hold one. Every user of a store must agree on it (checked when connecting).
        capacity_bytes: most bytes the store keeps in the object store, split evenly
            over the shards; least recently used objects are dropped past it; 0 means
            no limit (then only Ray's own object store capacity bounds it).
        object_bytes: pages of one put are grouped into objects of about this size
            (larger objects: fewer references to fetch per read, coarser eviction).
        timeout_s: how long one call to a shard or one object fetch may take before the
            batch counts as failed (a miss, never an error to the request).
        metadata_ttl_s: how long a client trusts "this page exists" before asking the
            shard again (a page the shard evicted meanwhile reads as a miss); 0 asks every
            time. Absence is never cached.
        shard_resources: custom resources each shard actor asks for, to keep the shards
            (and the objects they own) on chosen nodes, e.g. ``{"l3_owner": 0.01}`` for the
            nodes started with ``--resources '{"l3_owner": 1}'``; a shard whose node is lost
            restarts on another node that offers them. Empty: anywhere.
        address: the Ray cluster a process that is not connected yet joins when it opens
            the store (``"auto"``, ``"ray://host:10001"``, a GCS address); empty: such a
            process is refused (call ``ray.init()`` first). Connected processes ignore it.
    """

    name: str = "default"
    num_shards: int = 0
    capacity_bytes: int = 0
    object_bytes: int = 32 << 20
    timeout_s: float = 30.0
    metadata_ttl_s: float = 2.0
    shard_resources: dict[str, float] = msgspec.field(default_factory=dict)
    address: str = ""

    def __post_init__(self) -> None:
        check_types(self, "ray.")
        if not is_plain_name(self.name):
            raise ConfigError(
                "ray.name", self.name, "not a plain name", "use letters, digits, '-' and '_'"
            )
        check_not_negative("ray.num_shards", self.num_shards)
        check_not_negative("ray.capacity_bytes", self.capacity_bytes)
        check_positive("ray.object_bytes", self.object_bytes)
        check_positive("ray.timeout_s", self.timeout_s)
        check_not_negative("ray.metadata_ttl_s", self.metadata_ttl_s)
        check_custom_resources(
            "ray.shard_resources",
            self.shard_resources,
            "name a custom node resource (CPUs and GPUs are not for shards)",
        )


def is_plain_name(name: str) -> bool:
    """Letters, digits, ``-`` and ``_``; non-empty; at most 64 characters."""
    return (
        0 < len(name) <= 64 and name.replace("-", "").replace("_", "").isalnum() and name.isascii()
    )


def _check_sizes(field: str, sizes: tuple[int, ...]) -> None:
    for size in sizes:
        check_positive(field, size)
    if len(set(sizes)) != len(sizes):
        raise ConfigError(field, sizes, "lists a size twice", "list each size once")


class StorageConfig(msgspec.Struct, frozen=True, kw_only=True):
    """L3 settings: backend, key namespace, sharing and batching.

    Attributes:
        backend: registered backend name (``memory``, ``file``, ``ray``), or ``none``.
        batch_size_pages: pages per ``exists`` / ``get`` / ``put`` batch.
        key_scheme: ``unified`` (SGLang's topology-free keys, shared across TP and PP
            sizes) or ``rank-suffix``.
        model_id: model name in the namespace; required with a backend (a deployment of a
            checkpoint fills it, and ``model_revision``, from the checkpoint).
        model_revision: model revision (weights change -> different pages); it becomes
            part of the namespace's model id (``{model_id}@{revision}``).
        tenant_salt: seeds the page-hash chain (SGLang's ``cache_salt``), so tenants never
            share pages; empty for none.
        share_tp: the TP sizes of every deployment (hicache-ray or SGLang) that shares
            this store; the KV heads per stored object follow from it (total heads / lcm
            of the sizes). Empty: only deployments of this TP size share (logged at
            launch).
        share_pp: the PP sizes that share this store; the layers per stored object follow
            from it (the gcd of every split's stage boundaries). Empty: only this PP
            split shares.
        memory: options of the ``memory`` backend.
        file: options of the ``file`` backend.
        ray: options of the ``ray`` backend.
        faults: fault-injection rules applied to the backend's stored objects (tests,
            ``bench faults``, soak runs); empty in production.
        fault_seed: seed of the generator that decides which calls are hit.
    """

    backend: str = "none"
    batch_size_pages: int = 128
    key_scheme: KeyScheme = "unified"
    model_id: str = ""
    model_revision: str = ""
    tenant_salt: str = ""
    share_tp: tuple[int, ...] = ()
    share_pp: tuple[int, ...] = ()
    memory: MemoryStorageOptions = msgspec.field(default_factory=MemoryStorageOptions)
    file: FileStorageOptions = msgspec.field(default_factory=FileStorageOptions)
    ray: RayStorageOptions = msgspec.field(default_factory=RayStorageOptions)
    faults: tuple[Fault, ...] = ()
    fault_seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        check_positive("storage_batch_size", self.batch_size_pages)
        _check_sizes("share_tp", self.share_tp)
        _check_sizes("share_pp", self.share_pp)
        _check_backend_name(self.backend)
        if self.backend == "file" and not self.file.root:
            raise ConfigError(
                "file.root", self.file.root, "empty", "give a directory or a URI such as s3://b/p"
            )

    def check_model_id(self) -> None:
        """Raise ``ConfigError`` when a backend is on and no model id names the pages."""
        if self.backend != "none" and not self.model_id:
            raise ConfigError(
                "model_id",
                self.model_id,
                f"empty while storage backend {self.backend!r} is on",
                "name the model (e.g. its hub id) so pages of different models never mix",
            )

    @property
    def namespace_model_id(self) -> str:
        """The model id the key namespace hashes: ``model_id``, with ``@revision`` if set."""
        return f"{self.model_id}@{self.model_revision}" if self.model_revision else self.model_id


def _check_backend_name(name: str) -> None:
    if name not in backend_names() and not is_backend_path(name):
        raise ConfigError(
            "storage_backend",
            name,
            "no backend is registered under this name",
            f"use one of {', '.join(backend_names())}, a 'module:attribute' path, "
            "or register_backend() yours first",
        )


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a rank batches its requests (continuous batching with chunked prefills).

    Attributes:
        max_step_tokens: tokens one forward computes at most: every running request's next
            token first, then chunks of prefills (oldest first) up to this budget, so a long
            prompt does not stall the requests that decode.
        max_running: requests running (prefilling or decoding) at once.
        max_queued: requests waiting to start (for room in the device pool or for their
            prefetches) at once; a request past it is refused as overloaded.
    """

    max_step_tokens: int = 2048
    max_running: int = 256
    max_queued: int = 1024

    def __post_init__(self) -> None:
        check_types(self, "scheduler.")
        check_positive("scheduler.max_step_tokens", self.max_step_tokens)
        check_positive("scheduler.max_running", self.max_running)
        check_positive("scheduler.max_queued", self.max_queued)


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
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
