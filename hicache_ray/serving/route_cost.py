"""The cache router's cost: the replica where a request's prefill would end first.

For a prompt of ``n`` tokens and each candidate replica ``r``, in prompt tokens of prefill:

    work(r)  = n - page_size * (l1 * device(r) + l2 * host(r) + l3 * shared(r))
    score(r) = -(work(r) + load * pending(r))

``device`` and ``host`` are the prompt's leading pages in ``r``'s L1 and (past those) L2;
``shared`` the pages past those that the shared L3 holds (the same store for every
replica: a replica that never saw the prefix still reads it at the store's speed);
``pending(r)`` the work of the requests already sent to ``r`` that have not finished
(:class:`InFlight`). If every replica computed prefill tokens at the same rate, the best
score is the replica whose prefill of this prompt would end first: locality wins until
the queue it builds costs more than the pages it saves. The credits ``l2`` and ``l3``
are the share of a page's prefill that a hit from that tier saves (an L1 hit: all of it).

A prompt of which no replica holds a page in L1 or L2 is a new prefix: it goes where the
caches have most room and the least work waits, ``score(r) = -(room * page_size *
held(r) + load * pending(r))`` (``held``: the pages ``r`` caches in all), so new
conversations spread over the replicas' caches, siblings of a new prefix arriving
together spread over the replicas (each counts as pending work where it went), and an
empty replica (restarted in place) fills first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hicache_ray.serving.cache_index import Hits

__all__ = ["InFlight", "RouteWeights", "rank_replicas", "work"]


@dataclass(frozen=True)
class RouteWeights:
    """How the cache router values a replica (see the module docstring).

    Attributes:
        l1: share of a page's prefill that an L1 hit saves.
        l2: share that an L2 hit saves (the page is copied to L1 first).
        l3: share that a hit in the shared L3 saves (read from the store, then to L1).

    The defaults of ``l2`` and ``l3`` are what ``hicache-ray bench runtime`` measured on a
    2-core CPU machine (``runtime.l2_hit.credit`` 1.005, ``runtime.l3_hit.credit.tp{1,2,4}``
    0.98, 0.98, 0.97): there a prefill costs seconds and a copy milliseconds. On a GPU
    the hits save less of a far faster prefill: measure there and set them.
        load: weight of one token of prefill already pending on the replica.
        room: cost of one token the replica caches already, for a new prefix.
    """

    l1: float = 1.0
    l2: float = 1.0
    l3: float = 0.97
    load: float = 1.0
    room: float = 0.25


def work(prompt_tokens: int, hits: Hits, page_size: int, weights: RouteWeights) -> float:
    """The prefill left to do for a prompt of ``prompt_tokens`` on a replica with
    ``hits`` (at least one token: the last one is always computed)."""
    pages = weights.l1 * hits.device + weights.l2 * hits.host + weights.l3 * hits.shared
    return max(1.0, prompt_tokens - page_size * pages)


def rank_replicas(
    replicas: Sequence[str],
    hits: Mapping[str, Hits],
    pending: Mapping[str, float],
    prompt_tokens: int,
    page_size: int,
    weights: RouteWeights = RouteWeights(),
    held: Mapping[str, int] | None = None,
) -> list[str] | None:
    """``replicas`` best first (see the module docstring); None when nothing tells them
    apart (no replica holds a page, their caches hold alike and their pending work is
    the same): the caller routes by power of two choices."""
    if not any(hits.get(r, Hits()).device or hits.get(r, Hits()).host for r in replicas):
        sizes = held or {}
        if len({(sizes.get(r, 0), pending.get(r, 0.0)) for r in replicas}) < 2:
            return None

        def room(replica: str) -> float:
            full = weights.room * sizes.get(replica, 0) * page_size
            return -full - weights.load * pending.get(replica, 0.0)

        return sorted(replicas, key=room, reverse=True)

    def score(replica: str) -> float:
        own = work(prompt_tokens, hits.get(replica, Hits()), page_size, weights)
        return -own - weights.load * pending.get(replica, 0.0)

    return sorted(replicas, key=score, reverse=True)


class InFlight:
    """The work a router has sent to each replica and not seen finish.

    A request counts where it was routed from :meth:`sent` until :meth:`finished` (its
    stream ended, or it failed); one never finished (dropped before it was sent) stops
    counting after ``max_age_s``. Requests other routers sent (several ingresses) are
    known only by the replica's request count: :meth:`pending` adds the mean work of
    this router's own requests for each of those.
    """

    def __init__(self, max_age_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self._max_age_s, self._clock = max_age_s, clock
        self._requests: dict[str, tuple[str, float, float]] = {}  # id -> replica, work, when

    def sent(self, request: str, replica: str, cost: float) -> None:
        """``request`` (of ``cost`` tokens of work) went to ``replica`` (again: moved)."""
        self._requests.pop(request, None)
        self._requests[request] = (replica, cost, self._clock())

    def moved(self, request: str, replica: str) -> None:
        """``request`` reached ``replica`` after all (the first choice was full)."""
        entry = self._requests.get(request)
        if entry is not None and entry[0] != replica:
            self._requests[request] = (replica, entry[1], entry[2])

    def finished(self, request: str) -> None:
        self._requests.pop(request, None)

    def forget(self, replica: str) -> None:
        """``replica`` died: its requests count no more."""
        for request in [k for k, v in self._requests.items() if v[0] == replica]:
            del self._requests[request]

    def pending(
        self, ongoing: Mapping[str, int] | None = None, typical: float = 0.0
    ) -> dict[str, float]:
        """Work pending per replica: this router's requests, plus, for each request a
        replica runs beyond them (``ongoing``: the replicas' request counts), the mean
        work of this router's requests (``typical`` when it has none in flight)."""
        self._expire()
        load: dict[str, float] = {}
        count: dict[str, int] = {}
        for replica, cost, _ in self._requests.values():
            load[replica] = load.get(replica, 0.0) + cost
            count[replica] = count.get(replica, 0) + 1
        if ongoing:
            mean = sum(load.values()) / len(self._requests) if self._requests else typical
            for replica, n in ongoing.items():
                others = n - count.get(replica, 0)
                if others > 0:
                    load[replica] = load.get(replica, 0.0) + others * mean
        return load

    def __len__(self) -> int:
        return len(self._requests)

    def _expire(self) -> None:
        horizon = self._clock() - self._max_age_s
        while self._requests:
            request, (_, _, when) = next(iter(self._requests.items()))
            if when >= horizon:
                break
            del self._requests[request]
