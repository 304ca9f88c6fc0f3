"""Cache events: what a deployment's tree gains and loses per tier, as vLLM KV events.

Every rank's tree is the same after each step's agreement, so rank 0's journal describes
the whole deployment. The tree tells the journal (:class:`CacheEvents`, a tree observer)
each time a node gains or loses its device (L1) or host (L2) copy; the journal names the
node's pages by their page hashes (the chained hashes of the L3 keys, tenant salt
included, so every replica and engine names a prompt's pages alike) and queues a
``BlockStored`` or ``BlockRemoved`` event. :meth:`CacheEvents.flush` closes the queued
events into a :class:`KVEventBatch` with the next sequence number; the last
``keep_batches`` batches stay for subscribers (:meth:`CacheEvents.since`). A subscriber
that missed a batch (its sequence number jumped, or the journal's ``epoch`` changed: a
restart or a re-formed deployment) asks for a :meth:`CacheEvents.snapshot` instead of
drifting.

The records follow vLLM's KV-event schema (``vllm.distributed.kv_events``: tagged,
array-like msgspec structs, ``medium`` naming the tier) so other routers can read them:
``medium`` is ``"GPU"`` for L1 (device memory, host memory on CPU-only machines) and
``"CPU"`` for L2, and ``"L3"`` (:data:`STORE_MEDIUM`, this library's own) for pages whose
backup to the shared store every rank acknowledged: the store is shared, so a subscriber
keeps those apart from the replica's own tiers, and never hears of their removal (the
store evicts on its own; a read of a page it no longer holds is a miss). Block hashes are
the 64-character hex page hashes; ``token_ids`` is left empty (every block is one whole
page of ``block_size`` tokens; the hashes name them).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import msgspec

from hicache_ray.cache.tree import HiRadixTree, Tier, TreeNode, node_page_hashes

__all__ = [
    "MEDIUM",
    "STORE_MEDIUM",
    "check_position",
    "check_wait",
    "kept_since",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvents",
    "Event",
    "EventBatch",
    "KVEventBatch",
]

MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU"}  # vLLM's names of the tiers
STORE_MEDIUM = "L3"  # pages backed up to the shared store (no vLLM name for it)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the cache events (vLLM's schema)."""


class BlockStored(KVCacheEvent):
    """Pages now held in ``medium``: ``block_hashes`` in prefix order, the first one
    following ``parent_block_hash`` (None: the prompt's first page)."""

    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages no longer held in ``medium``."""

    block_hashes: list[str]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Nothing is held any more (a journal starts with it)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events in the order they happened (vLLM's batch)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class EventBatch(msgspec.Struct, frozen=True):
    """One published batch: the journal it belongs to and its place there.

    Attributes:
        epoch: the journal's id (new for every deployment generation).
        seq: 1 for the first batch of the journal, then one more per batch.
        batch: the events.
    """

    epoch: str
    seq: int
    batch: KVEventBatch


def check_position(epoch: object, seq: object) -> tuple[str, int]:
    """A subscriber's position (the journal and its last batch applied), checked.

    Raises:
        TypeError: ``epoch`` is not a str or ``seq`` not an int.
        ValueError: ``seq`` is negative.
    """
    if not isinstance(epoch, str):
        raise TypeError(f"epoch must be the journal's id (a str), got {type(epoch).__name__}")
    if type(seq) is not int:
        raise TypeError(f"seq must be an int (0: none applied), got {type(seq).__name__}")
    if seq < 0:
        raise ValueError(f"seq must be >= 0 (0: none applied), got {seq}")
    return epoch, seq


MAX_WAIT_S = 10.0  # the longest a subscriber's long poll may wait for the next batch


def check_wait(wait_s: object) -> float:
    """How long a subscriber's long poll waits for a batch (seconds), checked.

    Raises:
        TypeError: ``wait_s`` is not a number.
        ValueError: it is not in ``[0, MAX_WAIT_S]``.
    """
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float):
        raise TypeError(f"wait_s must be a number of seconds, got {type(wait_s).__name__}")
    if not 0.0 <= wait_s <= MAX_WAIT_S:
        raise ValueError(f"wait_s must be in [0, {MAX_WAIT_S}] seconds, got {wait_s}")
    return float(wait_s)


def kept_since(kept: deque[EventBatch], last: int, seq: int) -> list[EventBatch] | None:
    """The batches of ``kept`` (the last of them ``last``) after ``seq``; None when some
    of them are no longer kept."""
    if seq >= last:
        return []
    if not kept or kept[0].seq > seq + 1:
        return None
    return [b for b in kept if b.seq > seq]


class CacheEvents:
    """The journal of one tree (attach with ``tree.observer = journal``).

    Args:
        tree: the tree it describes (its roots' salts name the pages: the L3 keys').
        keep_batches: batches kept for subscribers that fall behind.
        clock: wall-clock seconds (the batches' ``ts``).
    """

    def __init__(
        self,
        tree: HiRadixTree,
        *,
        keep_batches: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._tree = tree
        self._clock = clock
        self.epoch = uuid.uuid4().hex
        self._pending: list[Event] = [AllBlocksCleared()]
        self._kept: deque[EventBatch] = deque(maxlen=keep_batches)
        self._lock = threading.Lock()  # guards _kept and seq (subscribers read them)
        self.seq = 0  # of the last batch flushed
        self._flushed: list[Callable[[], None]] = []  # told of each new batch

    # ---------------------------------------------------------- tree observer

    def stored(self, node: TreeNode, tier: Tier) -> None:
        """``node`` gained a copy in ``tier`` (called by the tree)."""
        self._pending.append(self._stored(node, tier))

    def removed(self, node: TreeNode, tier: Tier) -> None:
        """``node`` lost its copy in ``tier`` (called by the tree)."""
        hashes = self._hashes(node)
        self._pending.append(BlockRemoved(list(hashes), MEDIUM[tier]))

    def backed_up(self, node: TreeNode) -> None:
        """``node``'s pages are in the shared store (its backup was acknowledged)."""
        self._pending.append(self._stored(node, STORE_MEDIUM))

    def _stored(self, node: TreeNode, tier: Tier | str) -> BlockStored:
        hashes = self._hashes(node)
        parent = node.parent
        prior = None
        if parent is not None and not parent.is_root:
            prior = self._hashes(parent)[-1]
        medium = tier if isinstance(tier, str) else MEDIUM[tier]
        return BlockStored(list(hashes), prior, [], self._tree.page_size, medium=medium)

    def _hashes(self, node: TreeNode) -> list[str]:
        return node_page_hashes(node, self._tree.page_size, self._tree.roots.salt_of)

    # -------------------------------------------------------------- publishing

    def flush(self) -> int:
        """Close the queued events into the next batch (none queued: no batch); returns
        the sequence number of the last batch. On the thread that owns the tree."""
        if self._pending:
            events, self._pending = self._pending, []
            with self._lock:
                self.seq += 1
                batch = KVEventBatch(self._clock(), events)
                self._kept.append(EventBatch(self.epoch, self.seq, batch))
            for tell in self._flushed:
                tell()
        return self.seq

    def on_flush(self, tell: Callable[[], None]) -> None:
        """Call ``tell`` (on the flushing thread: it must be quick) after each new batch;
        a subscriber's long poll wakes on it."""
        self._flushed.append(tell)

    def since(self, seq: int) -> list[EventBatch] | None:
        """The batches after ``seq`` (any thread); None when some of them are no longer
        kept (the subscriber takes a :meth:`snapshot` instead)."""
        with self._lock:
            return kept_since(self._kept, self.seq, seq)

    def snapshot(self) -> EventBatch:
        """The whole tree as one batch (``AllBlocksCleared``, then every node's copies,
        parents first), numbered with the last flushed batch it includes. On the thread
        that owns the tree; queued events are flushed first."""
        seq = self.flush()
        events: list[Event] = [AllBlocksCleared()]
        for node in self._tree.nodes():
            for tier in Tier:
                if node.pages(tier) is not None:
                    events.append(self._stored(node, tier))
        return EventBatch(self.epoch, seq, KVEventBatch(self._clock(), events))
