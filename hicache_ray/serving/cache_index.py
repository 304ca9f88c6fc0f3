"""Which pages each replica holds per tier, kept from the replicas' cache events.

One :class:`CacheIndex` per Serve application (a router's): for each replica, the page
hashes it holds in L1 (``"GPU"``) and in L2 (``"CPU"``), replayed from its journal
(:mod:`hicache_ray.cache.events`). A batch whose sequence number does not follow the last one,
or that comes from another journal (a restarted or re-formed replica), is refused:
:meth:`CacheIndex.apply` returns False and the subscriber resets the replica from a
snapshot. Memory stays bounded by what the replicas hold: a page leaves the index with its
``BlockRemoved``, and a replica's pages with the replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hicache_ray.cache.events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)
from hicache_ray.cache.tree import Tier

__all__ = ["CacheIndex", "Hits", "RouteWeights", "rank_replicas"]

_L1, _L2 = MEDIUM[Tier.DEVICE], MEDIUM[Tier.HOST]


@dataclass(frozen=True)
class Hits:
    """What a replica holds of a prompt's leading pages.

    Attributes:
        device: leading pages in L1.
        host: the leading pages past those that L2 holds (so ``device + host`` leading
            pages need no prefill there).
    """

    device: int = 0
    host: int = 0


@dataclass
class _Replica:
    epoch: str = ""
    seq: int = 0
    ts: float = 0.0  # when the last batch applied was made (the journal's clock)
    pages: dict[str, set[str]] = field(default_factory=lambda: {_L1: set(), _L2: set()})


class CacheIndex:
    """The cached pages of every replica of an application (see the module docstring)."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    @property
    def size(self) -> int:
        """Page entries held (over every replica and tier)."""
        return sum(len(s) for r in self._replicas.values() for s in r.pages.values())

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
        _play(r, published.batch.events)
        r.seq, r.ts = published.seq, published.batch.ts
        return True

    def reset(self, replica: str, snapshot: EventBatch) -> None:
        """Replace what is known of ``replica`` by its snapshot (or first batch)."""
        r = _Replica(snapshot.epoch, snapshot.seq, snapshot.batch.ts)
        _play(r, snapshot.batch.events)
        self._replicas[replica] = r

    def remove(self, replica: str) -> None:
        """Forget ``replica`` (gone from the application)."""
        self._replicas.pop(replica, None)

    def held(self, replica: str) -> int:
        """Pages ``replica`` holds in L1 or L2."""
        r = self._replicas.get(replica)
        return 0 if r is None else len(r.pages[_L1] | r.pages[_L2])

    def hits(self, replica: str, hashes: Sequence[str]) -> Hits:
        """What ``replica`` holds of the prompt whose page hashes are ``hashes``."""
        r = self._replicas.get(replica)
        if r is None:
            return Hits()
        l1, l2 = r.pages[_L1], r.pages[_L2]
        device = 0
        while device < len(hashes) and hashes[device] in l1:
            device += 1
        cached = device
        while cached < len(hashes) and (hashes[cached] in l2 or hashes[cached] in l1):
            cached += 1
        return Hits(device, cached - device)


def _play(r: _Replica, events: Sequence[Event]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            r.pages.setdefault(event.medium or _L1, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            r.pages.setdefault(event.medium or _L1, set()).difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            for held in r.pages.values():
                held.clear()


@dataclass(frozen=True)
class RouteWeights:
    """How the cache router values a replica, in prompt tokens whose prefill it saves.

    Attributes:
        l1: worth of a prompt token cached in the replica's L1.
        l2: worth of one cached in its L2 only (it is copied to L1 first).
        queued: cost of one request waiting or running there (its share of the batch).
        room: cost of one token the replica caches already, for a prompt of which no
            replica caches a page: new prefixes go where the caches have most room.
    """

    l1: float = 1.0
    l2: float = 0.8
    queued: float = 64.0
    room: float = 0.25


def rank_replicas(
    replicas: Sequence[str],
    hits: Mapping[str, Hits],
    queued: Mapping[str, int],
    page_size: int,
    weights: RouteWeights = RouteWeights(),
    held: Mapping[str, int] | None = None,
) -> list[str] | None:
    """``replicas`` best first: the prefill each saves (L1 pages worth more than L2 pages)
    minus its load. When none holds a page of the prompt: the room each has (``held``:
    the pages each caches) minus its load; None when that tells them apart neither (no
    usable information). L3 pages are left out: every replica reads the same store."""
    if not any(hits.get(r, Hits()).device or hits.get(r, Hits()).host for r in replicas):
        sizes = held or {}
        if len({sizes.get(r, 0) for r in replicas}) < 2:
            return None

        def room(replica: str) -> float:
            full = weights.room * sizes.get(replica, 0) * page_size
            return -full - weights.queued * queued.get(replica, 0)

        return sorted(replicas, key=room, reverse=True)

    def score(replica: str) -> float:
        h = hits.get(replica, Hits())
        saved = (weights.l1 * h.device + weights.l2 * h.host) * page_size
        return saved - weights.queued * queued.get(replica, 0)

    return sorted(replicas, key=score, reverse=True)
