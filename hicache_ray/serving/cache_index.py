"""Which pages each replica holds per tier, kept from the replicas' cache events.

One :class:`CacheIndex` per Serve application (a router's): for each replica, the page
hashes it holds in L1 (``"GPU"``) and in L2 (``"CPU"``), replayed from its journal
(:mod:`hicache_ray.cache.events`). A batch whose sequence number does not follow the last one,
or that comes from another journal (a restarted or re-formed replica), is refused:
:meth:`CacheIndex.apply` returns False and the subscriber resets the replica from a
snapshot. Memory stays bounded by what the replicas hold: a page leaves the index with its
``BlockRemoved``, and a replica's pages with the replica.

Pages a replica backed up to the shared L3 (``"L3"`` events) go to one set for the whole
application, whichever replica wrote them: every replica reads the same store. The store
evicts without telling anyone, so that set keeps the ``store_pages`` most recently stored
pages; a page it names that the store no longer holds costs the replica that reads it a
miss (it computes the page), never a wrong answer.

A replica whose ranks died is *down* (:func:`down_snapshot`: a snapshot of nothing, of no
journal) until its re-formed ranks' first snapshot: it holds nothing, and a call sent
there waits for the re-forming (:attr:`CacheIndex.down`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache_ray.cache.events import (
    MEDIUM,
    STORE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    KVEventBatch,
)
from hicache_ray.cache.tree import Tier

__all__ = ["CacheIndex", "Hits", "down_snapshot"]

_L1, _L2 = MEDIUM[Tier.DEVICE], MEDIUM[Tier.HOST]


@dataclass(frozen=True)
class Hits:
    """What a replica holds of a prompt's leading pages.

    Attributes:
        device: leading pages in L1.
        host: the leading pages past those that L2 holds (so ``device + host`` leading
            pages need no prefill there).
        shared: the leading pages past those that the shared L3 holds (read from the
            store there).
    """

    device: int = 0
    host: int = 0
    shared: int = 0


@dataclass
class _Replica:
    epoch: str = ""
    seq: int = 0
    ts: float = 0.0  # when the last batch applied was made (the journal's clock)
    pages: dict[str, set[str]] = field(default_factory=lambda: {_L1: set(), _L2: set()})


def down_snapshot(ts: float) -> EventBatch:
    """The snapshot of a replica whose ranks died at ``ts``: nothing held, and no journal
    (every journal has an epoch; this one's is empty, so its next snapshot replaces it)."""
    return EventBatch("", 0, KVEventBatch(ts, [AllBlocksCleared()]))


class CacheIndex:
    """The cached pages of every replica of an application (see the module docstring)."""

    def __init__(self, store_pages: int = 1 << 18) -> None:
        if type(store_pages) is not int or store_pages < 0:
            raise ValueError(f"store_pages must be an int >= 0, got {store_pages!r}")
        self._replicas: dict[str, _Replica] = {}
        self._store: OrderedDict[str, None] = OrderedDict()  # the L3's pages, oldest first
        self._store_pages = store_pages

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    @property
    def down(self) -> frozenset[str]:
        """The replicas whose ranks died and have not re-formed (:func:`down_snapshot`)."""
        return frozenset(name for name, r in self._replicas.items() if not r.epoch)

    @property
    def size(self) -> int:
        """Page entries held (over every replica and tier, and the shared L3's)."""
        own = sum(len(s) for r in self._replicas.values() for s in r.pages.values())
        return own + len(self._store)

    def lag_s(self, replica: str, now: float) -> float:
        """Seconds between ``now`` and the making of ``replica``'s last batch applied."""
        r = self._replicas.get(replica)
        return 0.0 if r is None or not r.ts else max(0.0, now - r.ts)

    def position(self, replica: str) -> tuple[str, int]:
        """The journal and the last batch of ``replica`` applied ("", 0: none)."""
        r = self._replicas.get(replica)
        return ("", 0) if r is None else (r.epoch, r.seq)

    def apply(self, replica: str, published: EventBatch) -> bool:
        """Apply ``replica``'s next batch; False (and nothing changed) when it is not the
        next one of the journal already applied: reset the replica from a snapshot."""
        r = self._replicas.get(replica)
        if r is None or published.epoch != r.epoch or published.seq != r.seq + 1:
            return False
        self._play(r, published.batch.events)
        r.seq, r.ts = published.seq, published.batch.ts
        return True

    def reset(self, replica: str, snapshot: EventBatch) -> None:
        """Replace what is known of ``replica`` by its snapshot (or first batch)."""
        r = _Replica(snapshot.epoch, snapshot.seq, snapshot.batch.ts)
        self._play(r, snapshot.batch.events)
        self._replicas[replica] = r

    def remove(self, replica: str) -> None:
        """Forget ``replica`` (gone from the application)."""
        self._replicas.pop(replica, None)

    def facts(
        self, replicas: Sequence[str], hashes: Sequence[str]
    ) -> tuple[dict[str, Hits], dict[str, int]]:
        """What each of ``replicas`` holds of the prompt, and, when none holds a page of
        it in L1 or L2, how many pages each holds in all (what a new prefix is placed by)."""
        hits = {r: self.hits(r, hashes) for r in replicas}
        if any(h.device or h.host for h in hits.values()):
            return hits, {}
        return hits, {r: self.held(r) for r in replicas}

    def export(self, replica: str) -> EventBatch:
        """What is known of ``replica`` as a snapshot (its journal's position and clock
        kept): :meth:`reset` with it rebuilds the same."""
        r = self._replicas.get(replica) or _Replica()
        events: list[Event] = [AllBlocksCleared()]
        for medium, pages in r.pages.items():
            if pages:
                events.append(BlockStored(sorted(pages), None, [], 0, medium=medium))
        return EventBatch(r.epoch, r.seq, KVEventBatch(r.ts, events))

    def store_pages(self) -> list[str]:
        """The shared L3's pages known, oldest first."""
        return list(self._store)

    def add_store(self, pages: Sequence[str]) -> None:
        """Pages now in the shared L3 (newest last)."""
        self._play_store(BlockStored(list(pages), None, [], 0, medium=STORE_MEDIUM))

    def held(self, replica: str) -> int:
        """Pages ``replica`` holds in L1 or L2."""
        r = self._replicas.get(replica)
        return 0 if r is None else len(r.pages[_L1] | r.pages[_L2])

    def hits(self, replica: str, hashes: Sequence[str]) -> Hits:
        """What ``replica`` holds of the prompt whose page hashes are ``hashes`` (one not
        heard of yet holds nothing of its own, and reads the shared L3 as any other)."""
        r = self._replicas.get(replica)
        l1, l2 = (r.pages[_L1], r.pages[_L2]) if r is not None else (set(), set())
        device = 0
        while device < len(hashes) and hashes[device] in l1:
            device += 1
        cached = device
        while cached < len(hashes) and (hashes[cached] in l2 or hashes[cached] in l1):
            cached += 1
        shared = cached
        while shared < len(hashes) and hashes[shared] in self._store:
            shared += 1
        return Hits(device, cached - device, shared - cached)

    def stored(self, hashes: Sequence[str]) -> int:
        """Leading pages of ``hashes`` that the shared L3 holds, as far as is known."""
        n = 0
        while n < len(hashes) and hashes[n] in self._store:
            n += 1
        return n

    def _play(self, r: _Replica, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                for held in r.pages.values():
                    held.clear()
            elif event.medium == STORE_MEDIUM:
                self._play_store(event)
            elif isinstance(event, BlockStored):
                r.pages.setdefault(event.medium or _L1, set()).update(event.block_hashes)
            else:
                r.pages.setdefault(event.medium or _L1, set()).difference_update(event.block_hashes)

    def _play_store(self, event: BlockStored | BlockRemoved) -> None:
        store = self._store
        if isinstance(event, BlockRemoved):
            for page in event.block_hashes:
                store.pop(page, None)
            return
        for page in event.block_hashes:
            store[page] = None
            store.move_to_end(page)
        while len(store) > self._store_pages:
            store.popitem(last=False)
