"""Frozen, validated configuration of the L3 (storage): backend, key namespace, sharing,
batching, each store's options and fault-injection rules. Re-exported by
:mod:`hicache_ray.base.config`."""

from __future__ import annotations

from typing import Literal

import msgspec

from hicache_ray.base.backends import check_backend_name
from hicache_ray.base.checks import (
    check_custom_resources,
    check_not_negative,
    check_positive,
    check_types,
)
from hicache_ray.base.errors import ConfigError

__all__ = [
    "Fault",
    "FileStorageOptions",
    "KeyScheme",
    "MemoryStorageOptions",
    "RayStorageOptions",
    "StorageConfig",
    "is_plain_name",
]

KeyScheme = Literal["unified", "rank-suffix"]


FaultOp = Literal["write", "read", "size", "remove"]
FaultKind = Literal["fail", "delay", "corrupt", "truncate"]
_FAULT_OPS: dict[str, tuple[str, ...]] = {
    "fail": ("write", "read", "size", "remove"),
    "delay": ("write", "read", "size", "remove"),
    "corrupt": ("write", "read"),
    "truncate": ("write",),
}


class Fault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class MemoryStorageOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``memory`` backend (one process; for tests and single-process runs).

    Attributes:
        capacity_bytes: most bytes held before least recently used pages are evicted;
            0 means no limit.
    """

    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        check_types(self, "memory.")
        check_not_negative("memory.capacity_bytes", self.capacity_bytes)


class FileStorageOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class RayStorageOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``ray`` backend (pages in the Ray object store, see ``actors``).

    Attributes:
        name: the store's name; deployments naming the same store (in the same Ray
            cluster) share its pages. Its shard actors are ``hicache-l3-{name}-{i}`` in
            the Ray namespace ``hicache``.
        num_shards: index shards (one detached actor each, placed on different nodes); 0
            joins an existing store with its own count, or makes one shard per node that
            can hold one. Every user of a store must agree on it (checked when connecting).
        capacity_bytes: most bytes the store keeps in the object store, split evenly
            over the shards; least recently used objects are dropped past it; 0: take
            ``capacity_fraction`` of the cluster's object store instead.
        capacity_fraction: with ``capacity_bytes`` 0, the share of the cluster's object
            store memory (when the store is made) the store keeps, split evenly over the
            shards: the default 0.5 leaves the rest for the writers' objects in flight and
            other users, so Ray has no reason to spill cache pages to disk. 0 with
            ``capacity_bytes`` 0: no limit, only Ray's object store bounds it (and spills
            past it: a warning says so when the store is made).
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
    capacity_fraction: float = 0.5
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
        if not 0 <= self.capacity_fraction <= 1:
            raise ConfigError(
                "ray.capacity_fraction", self.capacity_fraction, "outside [0, 1]", "use e.g. 0.5"
            )
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


MAX_READ_THREADS = 64


class StorageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """L3 settings: backend, key namespace, sharing and batching.

    Attributes:
        backend: registered backend name (``memory``, ``file``, ``ray``), or ``none``.
        batch_size_pages: pages per ``exists`` / ``get`` / ``put`` batch (a prefetch
            query asks at least 1,024 pages at once, and a store that reads on threads of
            its own, ``ray``, is read in calls of at least 32 MiB).
        read_threads: threads (1 to 64) that read one prefetch batch, each a consecutive
            share of its pages of at least 4 MiB (verifying a page as it is copied is one
            core's work: one thread reads far below memory bandwidth); a store that copies
            on threads of its own (``ray``) is read in one.
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
    read_threads: int = 2
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
        if not 1 <= self.read_threads <= MAX_READ_THREADS:
            raise ConfigError(
                "storage_read_threads",
                self.read_threads,
                f"outside [1, {MAX_READ_THREADS}]",
                "use about the cores a rank may spend on L3 reads (2 is the default)",
            )
        _check_sizes("share_tp", self.share_tp)
        _check_sizes("share_pp", self.share_pp)
        check_backend_name(self.backend)
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
