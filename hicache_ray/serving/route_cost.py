"""The cache router's cost: the replica where a request's prefill would end first.

For a prompt of ``n`` tokens and each candidate replica ``r``, in prompt tokens of prefill:

    work(r)  = n - page_size * (l1 * device(r) + l2 * host(r) + l3 * shared(r))
    score(r) = -(work(r) + load * pending(r))

``device`` and ``host`` are the prompt's leading pages in ``r``'s L1 and (past those) L2;
``shared`` the pages past those that the shared L3 holds (the same store for every
replica: a replica that never saw the prefix still reads it at the store's speed);
``pending(r)`` the work of the requests already sent to ``r`` that have not finished,
plus ``call`` for each (:class:`InFlight`). If every replica computed prefill tokens at
the same rate, the best score is the replica whose prefill of this prompt would end
first: locality wins until the queue it builds costs more than the pages it saves. The
credits ``l2`` and ``l3`` are the share of a page's prefill that a hit from that tier
saves (an L1 hit: all of it).

A prompt of which no replica holds a page in L1 or L2 is a new prefix: it goes where the
caches have most room and the least work waits, ``score(r) = -(room * page_size *
held(r) + load * pending(r))`` (``held``: the pages ``r`` caches in all), so new
conversations spread over the replicas' caches, siblings of a new prefix arriving
together spread over the replicas (each counts as pending work where it went), and an
empty replica (restarted in place) fills first.

A request whose leading pages a request still in flight will compute (a sibling sent
before it, over a prefix no cache holds yet: a *leader*, ``ahead`` tokens of work from
the end of its prefill on its replica ``q``) may be held until those pages are in the
index (:func:`hold`). Waiting ends this prefill first when, for some leader,

    load * ahead + min_r(later(r) + load * max(0, pending(r) - ahead)) < min_r(-score(r))

``later(r)`` being ``work(r)`` with the leader's pages credited at ``l1`` on ``q`` and
at ``l3`` elsewhere (they reach the shared store). So the first siblings of a new
prefix spread over idle replicas, and the rest wait for the pages instead of computing
them again behind the others; once one replica's pages are in the index, a sibling
goes there, or waits for another replica's leader when that ends its prefill first. A
leader whose pages its replica already shows has ended its prefill: nothing comes of
waiting for it (its pages reach the store, if ever, when its replica writes them).

A replica that is *down* (its ranks died; it re-forms before it computes anything: the
index's :attr:`~hicache_ray.serving.cache_index.CacheIndex.down`) comes after every other
whatever its score (:func:`ready_first`): it holds nothing, so by the score it would look
like the emptiest cache for a new prefix, and a call sent there waits out the re-forming.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from hicache_ray.serving.cache_index import Hits

__all__ = ["InFlight", "Leader", "RouteWeights", "hold", "rank_replicas", "ready_first", "work"]


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
        call: what a request costs its replica beyond its prefill (its decode steps,
            its scheduling), in tokens of prefill: each pending request adds it.
        room: cost of one token the replica caches already, for a new prefix.
        hold_s: the longest a request waits for a leader's pages (0, the default: never
            waits; on this project's engine, which admits a replica's calls in order and
            so runs a sibling queued behind its leader from the leader's pages anyway,
            spreading measured as well as waiting on ``bench route``'s ``burst`` and
            better on its ``trace``).
    """

    l1: float = 1.0
    l2: float = 1.0
    l3: float = 0.97
    load: float = 1.0
    call: float = 0.0
    room: float = 0.25
    hold_s: float = 0.0


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
    the same): the caller picks one at random."""
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


def ready_first(order: Sequence[str], down: Collection[str]) -> list[str]:
    """``order`` with the replicas that are ``down`` after the others, each part in its
    order: last, not left out (with every other at capacity, Serve's probe goes on to
    them)."""
    return [r for r in order if r not in down] + [r for r in order if r in down]


@dataclass(frozen=True)
class Leader:
    """A request in flight whose prompt starts with ``pages`` of another's leading pages:
    sent to ``replica``, ``ahead`` tokens of work (its own and those sent there before
    it) from its prefill's end."""

    replica: str
    pages: int
    ahead: float


def hold(
    replicas: Sequence[str],
    hits: Mapping[str, Hits],
    pending: Mapping[str, float],
    prompt_tokens: int,
    page_size: int,
    weights: RouteWeights,
    leaders: Mapping[str, Leader],
) -> bool:
    """Whether waiting for the pages of one of ``leaders`` (the best per replica) ends
    this prompt's prefill sooner than starting it now anywhere (see the module
    docstring)."""
    if not leaders or weights.hold_s <= 0 or not replicas:
        return False
    load = weights.load

    def now(r: str) -> float:
        own = work(prompt_tokens, hits.get(r, Hits()), page_size, weights)
        return own + load * pending.get(r, 0.0)

    def later(r: str, leader: Leader) -> float:
        h = hits.get(r, Hits())
        extra = max(0, leader.pages - (h.device + h.host + h.shared))
        credit = weights.l1 if r == leader.replica else weights.l3
        left = max(1.0, work(prompt_tokens, h, page_size, weights) - page_size * credit * extra)
        return load * leader.ahead + left + load * max(0.0, pending.get(r, 0.0) - leader.ahead)

    def computing(leader: Leader) -> bool:  # its pages are not in the index yet
        h = hits.get(leader.replica, Hits())
        return leader.pages > h.device + h.host + h.shared

    busy = [leader for leader in leaders.values() if computing(leader)]
    if not busy:
        return False
    waiting = min(later(r, leader) for leader in busy for r in replicas)
    return waiting < min(map(now, replicas))


class InFlight:
    """The work a router has sent to each replica and not seen finish.

    A request counts where it was routed from :meth:`sent` until :meth:`finished` (its
    stream ended, or it failed); one never finished (dropped before it was sent) stops
    counting after ``max_age_s``. Requests other routers sent (several ingresses) are
    known only by the replica's request count: :meth:`pending` adds the mean work of
    this router's own requests for each of those (of those in flight, else of the last
    ``RECENT`` it sent).
    """

    RECENT = 64

    def __init__(self, max_age_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self._max_age_s, self._clock = max_age_s, clock
        self._requests: dict[str, tuple[str, float, float]] = {}  # id -> replica, work, when
        self._pages: dict[str, _Pages] = {}  # id -> its prompt's page hashes
        self._recent: deque[float] = deque(maxlen=self.RECENT)  # the last ones' work

    def sent(self, request: str, replica: str, cost: float, hashes: Sequence[str] = ()) -> None:
        """``request`` (of ``cost`` tokens of work, its prompt's page ``hashes``) went to
        ``replica`` (again: moved)."""
        self.finished(request)
        self._requests[request] = (replica, cost, self._clock())
        self._recent.append(cost)
        if hashes:
            self._pages[request] = _Pages(hashes)

    def leaders(self, hashes: Sequence[str]) -> dict[str, Leader]:
        """Per replica, the request in flight there whose prompt shares most of
        ``hashes``' leading pages (the least work ahead of it among equals)."""
        self._expire()
        best: dict[str, Leader] = {}
        for request, pages in self._pages.items() if hashes else ():
            shared = pages.leading(hashes)
            replica = self._requests[request][0]
            known = best.get(replica)
            if shared and (known is None or shared >= known.pages):
                ahead = self._ahead(request, replica)
                if known is None or shared > known.pages or ahead < known.ahead:
                    best[replica] = Leader(replica, shared, ahead)
        return best

    def _ahead(self, request: str, replica: str) -> float:
        """The work sent to ``replica`` up to and with ``request``, in sending order."""
        total = 0.0
        for other, (where, cost, _) in self._requests.items():
            if where == replica:
                total += cost
            if other == request:
                break
        return total

    def moved(self, request: str, replica: str) -> None:
        """``request`` reached ``replica`` after all (the first choice was full)."""
        entry = self._requests.get(request)
        if entry is not None and entry[0] != replica:
            self._requests[request] = (replica, entry[1], entry[2])

    def finished(self, request: str) -> None:
        self._requests.pop(request, None)
        self._pages.pop(request, None)

    def forget(self, replica: str) -> None:
        """``replica`` died: its requests count no more."""
        for request in [k for k, v in self._requests.items() if v[0] == replica]:
            self.finished(request)

    def pending(
        self, ongoing: Mapping[str, int] | None = None, typical: float = 0.0
    ) -> dict[str, float]:
        """Work pending per replica: this router's requests, plus, for each request a
        replica runs beyond them (``ongoing``: the replicas' request counts), the mean
        work of this router's requests (``typical`` when it has sent none)."""
        self._expire()
        load: dict[str, float] = {}
        count: dict[str, int] = {}
        for replica, cost, _ in self._requests.values():
            load[replica] = load.get(replica, 0.0) + cost
            count[replica] = count.get(replica, 0) + 1
        if ongoing:
            # NOTE: not the call's own prompt length: another ingress's calls are mostly
            # cached turns like this router's, and counting each as a whole prompt sent
            # turns away from the replica that holds their history.
            costs = [cost for _, cost, _ in self._requests.values()] or self._recent
            mean = sum(costs) / len(costs) if costs else typical
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
            self.finished(request)


class _Pages:
    """One prompt's page hashes. Each hash names its page and every page before it, so
    the pages two prompts share are a leading run found by bisection."""

    def __init__(self, hashes: Sequence[str]) -> None:
        self._count, self._members = len(hashes), frozenset(hashes)

    def leading(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes``' leading pages this prompt starts with."""
        lo, hi = 0, min(len(hashes), self._count)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self._members:
                lo = mid
            else:
                hi = mid - 1
        return lo
