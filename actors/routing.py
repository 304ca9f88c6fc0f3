"""Several replicas of the OpenAI app, routed by what their caches hold.

``hicache-ray serve --replicas N`` runs one HTTP ingress (:class:`~actors.openai_app.
OpenAIIngress`: it parses and tokenizes) in front of N :class:`EngineReplica`, each with
its own deployment (ranks, L1, L2) and all over one shared L3 store. The ingress calls the
engines through a Serve handle whose request router picks the replica:

* ``cache`` (:class:`CacheAwareRouter`): every engine replica publishes its deployment's
  cache events to the application's :class:`IndexActor` (a :class:`~hicache_ray.
  cache_index.CacheIndex`), and each router keeps a copy of it (:mod:`hicache_ray.
  serving.index_feed`); the router hashes the call's prompt pages and sends it where
  its prefill would end first: the prefill each replica's L1, L2 and the shared L3 save
  against the work already pending there (:mod:`hicache_ray.serving.route_cost`), a
  replica whose ranks died (re-forming) last; a
  prompt no replica holds a page of goes where the caches have most room; one whose
  pages a call in flight is computing waits for them when that ends its prefill first
  (siblings of a new prefix). The index not answering in time: by the work pending
  alone. Replicas alike in all of that: one at random, its work counted there. A
  replica that is down is no candidate, and one at capacity is skipped by Serve's
  probe, whatever it holds.
* ``prefix``: Ray's ``PrefixCacheAffinityRouter`` as Ray ships it (it guesses from the
  prompt text it routed; the calls carry ``prompt`` or ``messages`` for it).
* ``pow2``: Ray Serve's default, power of two choices.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.deployment import Deployment
from actors.index_actor import POLL_S, IndexActor, Publisher, index_actor
from actors.openai_engine import EngineCall, OpenAIEngine
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import Hits
from hicache_ray.serving.index_feed import IndexCopy
from hicache_ray.serving.openai.text import text_codec
from hicache_ray.serving.route_cost import (
    InFlight,
    RouteWeights,
    hold,
    rank_replicas,
    ready_first,
    work,
)

__all__ = ["CacheAwareRouter", "EngineReplica", "IndexActor", "router_config"]

log = logging.getLogger(__name__)

INDEX_WAIT_S = 0.1  # a routing decision waits this long for the index, then goes pow2
COPY_EVERY_S = 0.02  # a router's pause after its copy of the index took changes
COPY_FRESH_S = 1.0  # a copy older than this is not read: the router asks the index


class EngineReplica:
    """One engine replica: a deployment of ``config`` running OpenAI calls, its cache
    events published to the application's index as ``app``."""

    def __init__(self, config: DeploymentConfig, app: str) -> None:
        replica = serve.get_replica_context().replica_id.unique_id
        # each replica's ranks and placement groups are named apart
        config = msgspec.structs.replace(config, name=f"{config.name}-{replica}")
        self.deployment = Deployment.launch(config)
        codec = text_codec(config.model.checkpoint)
        self.engine = OpenAIEngine(self.deployment, codec, replica)
        self._publisher = Publisher(self.deployment, app, replica)
        self._publisher.start()

    async def respond(self, call: EngineCall) -> dict[str, Any]:
        return await self.engine.respond(call)

    async def events(self, call: EngineCall) -> AsyncIterator[bytes]:
        async for event in self.engine.events(call):
            yield event

    def __del__(self) -> None:
        self._publisher.stop()
        self.deployment.shutdown()


class CacheAwareRouter(RequestRouter):
    """Sends a call where its prefill would end first (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``app`` (the index's name), ``page_size``, ``salt`` (the deployment's tenant salt:
        a call's own ``cache_salt`` names its pages when it has one),
        the :class:`RouteWeights` ``l1``, ``l2``, ``l3``, ``load``, ``call``, ``room``,
        ``hold_s``, and ``wait_s``: how long a decision waits for the index before it
        routes by the work pending alone."""
        self._app = str(kwargs.get("app", ""))
        self._page_size = int(kwargs.get("page_size", 0))
        self._salt = str(kwargs.get("salt", ""))
        defaults = RouteWeights()
        self._weights = RouteWeights(
            **{
                name: float(kwargs.get(name, getattr(defaults, name)))
                for name in ("l1", "l2", "l3", "load", "call", "room", "hold_s")
            }
        )
        self._holding = 0  # calls waiting for a sibling's pages
        self._wait_s = float(kwargs.get("wait_s", INDEX_WAIT_S))
        self._index: Any = None
        self._inflight = InFlight()
        self._copy, self._copy_at = IndexCopy(), float("-inf")
        self._follower: asyncio.Task[None] | None = None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        prompt = self._prompt(pending_request) if len(candidate_replicas) > 1 else None
        if prompt is not None and prompt[0] and self._page_size:
            tokens, salt = prompt
            salt = salt or self._salt  # the call's tenant, else the deployment's
            hashes = page_hashes(tokens, self._page_size, salt=salt or None)
            ranked = await self._held(candidate_replicas, len(tokens), hashes)
            best, cost = ranked[0]
            if pending_request is not None:
                request_id = pending_request.metadata.internal_request_id
                replica, weights = best.replica_id.unique_id, self._weights
                # its pages are read only by the siblings' rule (``hold_s`` > 0)
                pages = hashes if weights.hold_s > 0 else ()
                self._inflight.sent(request_id, replica, cost + weights.call, pages)
            order = [replica for replica, _ in ranked]
            return [[best], order[1:]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _prompt(self, pending_request: PendingRequest | None) -> tuple[list[int], str] | None:
        """The call's prompt token ids and its own cache salt; None when it has none."""
        call = pending_request.args[0] if pending_request and pending_request.args else None
        request = getattr(call, "request", None)
        tokens = getattr(request, "tokens", None)
        return (tokens, getattr(request, "cache_salt", "") or "") if tokens else None

    @property
    def max_num_routing_tasks(self) -> int:
        # a call waiting for a sibling's pages keeps its routing task: the others get theirs
        return min(
            self.max_num_routing_tasks_cap, 2 * len(self._replicas) + getattr(self, "_holding", 0)
        )

    async def _held(
        self, candidates: list[RunningReplica], n: int, hashes: list[str]
    ) -> list[tuple[RunningReplica, float]]:
        """:meth:`_ranked`, after waiting (up to ``hold_s``) while a call in flight is
        computing pages of this prompt and waiting for them ends its prefill first."""
        deadline, held = time.monotonic() + self._weights.hold_s, 0
        try:
            while True:
                ranked = await self._ranked(candidates, n, hashes, time.monotonic() < deadline)
                if ranked:
                    return ranked
                self._holding += 1 - held
                held = 1
                await asyncio.sleep(COPY_EVERY_S)
        finally:
            self._holding -= held

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._inflight.moved(request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.finished(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self._replicas}
        super().update_replicas(replicas)
        for replica in before - {r.unique_id for r in self._replicas}:
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        """A replica gone from the application (dead, replaced, scaled down): its work and
        its pages are forgotten now, not when the index stops hearing from it
        (``SILENT_S``)."""
        self._inflight.forget(replica)
        try:
            self._index_actor().remove.remote(replica)
        except Exception as exc:  # the index is down: it forgets the replica on its own
            self._lost(exc)

    async def _ranked(
        self, candidates: list[RunningReplica], n: int, hashes: list[str], may_wait: bool
    ) -> list[tuple[RunningReplica, float]]:
        """The candidates best first, each with the work of the call (``n`` tokens, page
        ``hashes``) there; empty when it had better wait (and ``may_wait``)."""
        by_id = {r.replica_id.unique_id: r for r in candidates}
        facts = await self._facts(list(by_id), hashes) if hashes else None
        # NOTE: with no answer from the index the work this router sent still tells the
        # replicas apart (a burst at start-up, before the copy is fresh, would otherwise
        # go by Serve's cached queue lengths, which lag the burst).
        hits, held = facts if facts is not None else ({}, {})
        ongoing = {
            rid: self._replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()
        }
        pending = self._inflight.pending(ongoing, typical=float(n))
        page, weights = self._page_size, self._weights
        if may_wait and facts is not None and weights.hold_s > 0:
            leaders = self._inflight.leaders(hashes)
            if hold(list(by_id), hits, pending, n, page, weights, leaders):
                return []
        # NOTE: replicas alike go in a random order, the first counted as chosen: left to
        # Serve's power of two choices, a burst's calls would be invisible to ``pending``.
        order = rank_replicas(list(by_id), hits, pending, n, page, weights, held)
        order = ready_first(order or random.sample(list(by_id), len(by_id)), self._down())
        return [(by_id[r], work(n, hits.get(r, Hits()), page, weights)) for r in order]

    async def _facts(
        self, replicas: list[str], hashes: list[str]
    ) -> tuple[dict[str, Hits], dict[str, int]] | None:
        """What the replicas hold of the prompt: from this router's copy of the index
        while it is fresh, else from the index actor; None when neither answers."""
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._keep_copy())
        if self._fresh():
            return self._copy.index.facts(replicas, hashes)
        try:
            ref = self._index_actor().facts.remote(replicas, hashes)
            facts = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._wait_s)
        except Exception as exc:  # gone or slow this time: by pending work alone
            self._lost(exc)
            return None
        return facts  # type: ignore[no-any-return]

    def _fresh(self) -> bool:
        """This router's copy of the index is recent enough to decide by."""
        return time.monotonic() - self._copy_at < COPY_FRESH_S

    def _down(self) -> frozenset[str]:
        """The replicas the index has down (ranks died, not re-formed yet); none known
        when the copy is not fresh (the index actor's answer does not say)."""
        return self._copy.index.down if self._fresh() else frozenset()

    async def _keep_copy(self) -> None:
        """Keep this router's copy of the index, for good: ask for the changes since it
        (the answer waits up to ``POLL_S`` for one: a long poll), and pause
        ``COPY_EVERY_S`` after changes, so that a busy index's come in batches."""
        while True:
            pause = COPY_EVERY_S
            try:
                copy = self._copy
                ref = self._index_actor().changes.remote(copy.epoch, copy.seq, POLL_S)
                update = await asyncio.wait_for(asyncio.wrap_future(ref.future()), 10.0)
                copy.update(update)
                self._copy_at = time.monotonic()
                if update.whole is None and not update.changes:
                    pause = 0.0  # it waited: nothing changed
            except Exception as exc:  # the next round asks again
                self._lost(exc)
            await asyncio.sleep(pause)

    def _index_actor(self) -> Any:
        if self._index is None:
            self._index = index_actor(self._app)
        return self._index

    def _lost(self, exc: Exception) -> None:
        if isinstance(exc, ray.exceptions.ActorDiedError):  # its maker went: made again
            self._index = None
        log.debug("cache index not answering: %s", exc)


# Ray's own prefix router, used as Ray ships it (``ray.serve.llm`` re-exports it, but that
# package needs httpx, which this environment does not install).
PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
    "PrefixCacheAffinityRouter"
)


def router_config(
    router: str, app: str, config: DeploymentConfig, weights: dict[str, float]
) -> Any:
    """The ``request_router_config`` of the engine deployment for ``router`` (``weights``:
    the cache router's, see :meth:`CacheAwareRouter.initialize_state`)."""
    from ray.serve.config import RequestRouterConfig

    if router == "pow2":
        return None
    options: dict[str, Any] = {"request_router_class": PREFIX_ROUTER}
    if router == "cache":
        options["request_router_class"] = "actors.routing:CacheAwareRouter"
        options["request_router_kwargs"] = {
            "app": app,
            "page_size": config.cache.page_size,
            "salt": config.cache.storage.tenant_salt,
            **weights,
        }
    return RequestRouterConfig(**options)
