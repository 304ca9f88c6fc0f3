"""Prefill and decode as two deployments joined by the shared L3.

:class:`PDDeployment` runs a prefill deployment and a decode deployment of one model, of
any TP and PP sizes the key scheme shares (``share_tp`` / ``share_pp``), over one L3 store.
A request whose uncached part is long, while the prefill side has room
(:func:`~hicache_ray.serving.pd_split.decide`), is prefilled there first: the prefill side
computes its prompt (``max_new_tokens`` 0) and backs the prompt's pages up to L3
(write-through). The pair waits, bounded, until the prefill side's cache events say L3
holds them, then sends the request to the decode side, whose L3 lookup finds the pages,
reads them through L2 (checksums verified), loads them and decodes. Every other request
is prefilled on the decode side. With several prefill replicas, each split request goes to
the one that would finish its prompt first (:func:`~hicache_ray.serving.pd_split.pick_prefill`:
what it holds of the prompt, what was sent to it before).

Failing safe: the decode side only uses pages it read and verified from L3, and computes
whatever L3 does not hold. So a prefill that failed, was killed, or is slower than the
wait (its request is then aborted) costs decode a recompute, never a wrong token or a hang.
A caller that cancels aborts the request on whichever side runs it. Each side re-forms on
its own after a rank failure (:class:`~actors.deployment.Deployment`); the pages already
in L3 outlive it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future

import msgspec

from actors.deployment import Deployment, DeploymentError
from actors.loop_thread import LoopThread
from actors.pd_watch import JournalWatch
from hicache_ray.engine.request import (
    GenerateRequest,
    RequestError,
    RequestResult,
    StreamChunk,
    check_batch,
    check_request,
    error_result,
)
from hicache_ray.keys import page_hashes
from hicache_ray.serving.pd_config import PDConfig
from hicache_ray.serving.pd_split import Decision, decide, pick_prefill

__all__ = ["PDConfig", "PDDeployment", "PDDoor", "PDResult", "PDStats"]

log = logging.getLogger(__name__)

_FIRST_VIEW_S = 30.0  # how long a new pair waits for its first view of both caches


class PDResult(msgspec.Struct, kw_only=True):
    """One request's answer from a prefill/decode pair.

    Attributes:
        result: the decode side's result (its tokens, hits by tier, TTFT split).
        split: whether the prefill side computed the prompt first.
        reason: why (:class:`~hicache_ray.serving.pd_split.Reason` values).
        uncached_tokens: prompt tokens the decode side did not hold when it was decided.
        prefill_s: the call to the prefill side until it answered (0 when not split).
        handoff_s: its answer until L3 held the prompt's pages, or the wait ended.
        handoff_pages: the prompt's leading pages known to be in L3 when decode was called;
            ``handoff_missing``: the pages of the prompt short of that (decode computes them).
        prefill_error: why the prefill side did not deliver (``None``: it did, or no split).
        prefill_cached_tokens: prompt tokens the prefill side found cached (L1, L2 or L3:
            a conversation's history the decode side backed up, say).
        ttft_s: the caller's clock, from the call to the decode side's first token.
    """

    result: RequestResult
    split: bool = False
    reason: str = ""
    uncached_tokens: int = 0
    prefill_s: float = 0.0
    handoff_s: float = 0.0
    handoff_pages: int = 0
    handoff_missing: int = 0
    prefill_error: str | None = None
    prefill_cached_tokens: int = 0
    ttft_s: float = 0.0


class PDStats(msgspec.Struct, kw_only=True):
    """The pair's counters since launch: requests by decision (``reasons``), prefills that
    did not deliver (``prefill_failed``), handoffs cut by their wait (``wait_expired``),
    pages handed off through L3 and pages decode had to compute instead, and the requests
    sent to each prefill replica (``prefill_requests``)."""

    requests: int = 0
    split: int = 0
    reasons: dict[str, int] = msgspec.field(default_factory=dict)
    prefill_failed: int = 0
    wait_expired: int = 0
    handoff_pages: int = 0
    handoff_missing: int = 0
    inflight_tokens: int = 0
    prefill_requests: list[int] = msgspec.field(default_factory=list)


class PDDeployment:
    """A prefill deployment (or several replicas of it) and a decode deployment sharing
    one L3 (module docstring). ``prefills``: the prefill replicas; ``prefill``: the first."""

    def __init__(
        self, config: PDConfig, prefill: Deployment | Sequence[Deployment], decode: Deployment
    ) -> None:
        self.config = config
        self.prefills = [prefill] if isinstance(prefill, Deployment) else list(prefill)
        if not self.prefills:
            raise ValueError("a pair needs at least one prefill deployment")
        self.prefill = self.prefills[0]
        self.decode = decode
        self._page = config.decode.cache.memory.page_size
        self._salt = config.decode.cache.storage.tenant_salt
        # "inflight.{i}": uncached tokens sent to prefill replica i, not handed off yet;
        # "sent.{i}": requests sent to replica i
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards _counts, _pace_per_1k (callers' loops)
        self._pace_per_1k = 0.0  # the prefill side's measured seconds per 1,024 tokens
        sides = {f"prefill-{i}": p for i, p in enumerate(self.prefills)}
        self._watch = JournalWatch({**sides, "decode": decode}, config.policy.poll_s)
        self._watch.start()
        if not self._watch.first_round.wait(_FIRST_VIEW_S):  # decisions start informed
            log.warning("no view of the sides' caches after %.0f s: deciding blind", _FIRST_VIEW_S)
        self._io = LoopThread("hicache-pd-io")

    @classmethod
    def launch(cls, config: PDConfig) -> PDDeployment:
        """Launch both sides (the prefill replicas first); a side that cannot start stops
        those started.

        Raises:
            TypeError: ``config`` is not a :class:`PDConfig`.
        """
        if not isinstance(config, PDConfig):
            raise TypeError(f"expected a PDConfig, got {type(config).__name__}")
        started: list[Deployment] = []
        try:
            for side in config.prefill_sides():
                started.append(Deployment.launch(side))
            decode = Deployment.launch(config.decode)
        except BaseException:
            for deployment in started:
                deployment.shutdown()
            raise
        return cls(config, started, decode)

    # ------------------------------------------------------------- requests

    def generate(self, requests: list[GenerateRequest]) -> list[PDResult]:
        """Run ``requests`` at once; their answers in the same order (a bad request gets
        its own error result, as :meth:`Deployment.generate`)."""
        batch = check_batch(requests)
        running: list[Future[PDResult]] = [self._io.run(self._answer(r)) for r in batch]
        return [f.result() for f in running]

    async def generate_async(self, request: GenerateRequest) -> PDResult:
        """One request, prefilled apart or not (module docstring); cancelling the caller's
        task aborts the request on the side that runs it."""
        return await self._answer(request)

    async def _answer(self, request: object) -> PDResult:
        called = time.perf_counter()
        try:
            checked = check_request(request)
        except RequestError as exc:
            return PDResult(result=error_result(request, str(exc)))
        out = await self._route(checked)
        decode_called = time.perf_counter()
        try:
            out.result = await self.decode.generate_async(checked)
        except asyncio.CancelledError:
            self.decode.abort(checked.rid)
            raise
        if out.result.error is None:
            out.ttft_s = decode_called - called + out.result.caller_ttft_s
        return out

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """:meth:`generate_async` as the decode side's :meth:`Deployment.stream`: its
        tokens as they come, then a last chunk with its result (the split's parts are in
        :meth:`stats`). Closing the iterator early aborts the request where it runs."""
        try:
            checked = check_request(request)
        except RequestError as exc:
            yield StreamChunk(tokens=[], result=error_result(request, str(exc)))
            return
        await self._route(checked)
        async for chunk in self.decode.stream(checked):
            yield chunk

    async def _route(self, request: GenerateRequest) -> PDResult:
        """Decide where ``request`` is prefilled; when apart, prefill it there and wait
        for the handoff. What was decided and measured (its ``result`` still empty)."""
        hashes = page_hashes(request.tokens, self._page, salt=request.cache_salt or self._salt)
        held = self._watch.hits("decode", hashes)
        cached = (held.device + held.host + held.shared) * self._page
        n = len(request.tokens)
        replica, prior = self._pick(hashes, n)
        with self._lock:
            inflight = self._counts[f"inflight.{replica}"]
        decision = decide(self.config.policy, n, min(cached, n), inflight)
        self._count("requests", 1)
        self._count(f"reason.{decision.reason.value}", 1)
        out = PDResult(
            result=RequestResult(rid=request.rid),
            split=decision.split,
            reason=decision.reason.value,
            uncached_tokens=decision.uncached_tokens,
        )
        if decision.split:
            self._count("split", 1)
            self._count(f"sent.{replica}", 1)
            await self._hand_off(request, hashes, decision, out, (replica, prior))
        return out

    def _pick(self, hashes: list[str], n: int) -> tuple[int, int]:
        """The prefill replica for a prompt, and the pages it holds of it (L1 + L2)."""
        held = []
        for i in range(len(self.prefills)):
            hits = self._watch.hits(f"prefill-{i}", hashes)
            held.append(hits.device + hits.host)
        with self._lock:
            inflight = [self._counts[f"inflight.{i}"] for i in range(len(held))]
        i = pick_prefill(n, [min(n, h * self._page) for h in held], inflight)
        return i, held[i]

    async def _hand_off(
        self,
        request: GenerateRequest,
        hashes: list[str],
        decision: Decision,
        out: PDResult,
        where: tuple[int, int],
    ) -> None:
        """Prefill ``request`` on prefill replica ``where[0]`` and wait (bounded) for its
        pages in L3 (past its first ``where[1]`` pages, which the replica held before)."""
        (replica, held), start = where, time.monotonic()
        mine, uncached = f"inflight.{replica}", decision.uncached_tokens
        with self._lock:
            todo = self._counts[mine] + uncached  # its own and those ahead of it there
            self._counts[mine] += uncached
            pace = self._pace_per_1k
        deadline = start + self.config.policy.wait_s(todo, pace)
        try:
            out.prefill_error = await self._prefill(self.prefills[replica], request, deadline, out)
            out.prefill_s = time.monotonic() - start
            if out.prefill_error is None:
                self._observe_pace(out.prefill_s, todo)
            stored = self._watch.stored(hashes)
            if out.prefill_error is None:
                # Pages the prefill side held before, or found cached, are not backed up
                # by this request: they are in L3 already (or their backup failed, and
                # decode computes them), and no new event will name them. Only the pages
                # this request added are waited for.
                cached = max(held, out.prefill_cached_tokens // self._page)
                skip = min(len(hashes), cached)
                # A prefill side that answered gets at least wait_base_s for its backup.
                until = max(deadline, time.monotonic() + self.config.policy.wait_base_s)
                stored = await self._watch.wait_stored(hashes, until, skip=skip)
            out.handoff_s = time.monotonic() - start - out.prefill_s
        finally:
            self._count(mine, -uncached)
        out.handoff_pages, out.handoff_missing = stored, len(hashes) - stored
        self._count("handoff_pages", stored)
        self._count("handoff_missing", len(hashes) - stored)
        if out.prefill_error is not None:
            self._count("prefill_failed", 1)
            log.warning("prefill of %s did not deliver: %s", request.rid, out.prefill_error)
        elif stored < len(hashes):
            self._count("wait_expired", 1)

    async def _prefill(
        self, side: Deployment, request: GenerateRequest, deadline: float, out: PDResult
    ) -> str | None:
        """The prompt computed on prefill replica ``side`` before ``deadline``; why not
        otherwise."""
        rid = _prefill_rid(request.rid)
        prompt = GenerateRequest(rid, request.tokens, 0, request.sampling, request.cache_salt)
        call = side.generate_async(prompt)
        try:
            left = max(0.0, deadline - time.monotonic())
            result = await asyncio.wait_for(call, timeout=left)
        except TimeoutError:
            side.abort(rid)
            return "no answer within the handoff wait"
        except asyncio.CancelledError:
            side.abort(rid)
            raise
        except DeploymentError as exc:
            return f"prefill deployment: {exc}"
        if result.error is not None:
            return f"{result.error_kind}: {result.error}"
        out.prefill_cached_tokens = result.cached_tokens
        return None

    def _observe_pace(self, seconds: float, tokens: int) -> None:
        """Fold a delivered prefill's seconds per 1,024 tokens into the measured pace."""
        per_1k = seconds * 1024 / max(1, tokens)
        with self._lock:
            old = self._pace_per_1k
            self._pace_per_1k = per_1k if not old else 0.8 * old + 0.2 * per_1k

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def abort(self, rid: str) -> None:
        """Stop request ``rid`` on both sides (its result says ``abort``)."""
        for side in self.prefills:
            side.abort(_prefill_rid(rid))
        self.decode.abort(rid)

    # ------------------------------------------------------------ inspection

    def stats(self) -> PDStats:
        """The pair's counters (the sides' own: ``prefill.stats()``, ``decode.stats()``)."""
        with self._lock:
            c = Counter(self._counts)
        reasons = {k.split(".", 1)[1]: v for k, v in c.items() if k.startswith("reason.")}
        return PDStats(
            requests=c["requests"],
            split=c["split"],
            reasons=reasons,
            prefill_failed=c["prefill_failed"],
            wait_expired=c["wait_expired"],
            handoff_pages=c["handoff_pages"],
            handoff_missing=c["handoff_missing"],
            inflight_tokens=sum(c[f"inflight.{i}"] for i in range(len(self.prefills))),
            prefill_requests=[c[f"sent.{i}"] for i in range(len(self.prefills))],
        )

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Both sides' :meth:`Deployment.wait_idle`."""
        for side in self.prefills:
            side.wait_idle(timeout_s)
        self.decode.wait_idle(timeout_s)

    def release(self) -> None:
        """Stop the pair's own threads and leave both sides running (they may be paired
        again, with another policy). Safe to call twice."""
        self._watch.stop()
        self._io.close()

    def shutdown(self) -> None:
        """Stop the pair's threads and both sides (safe to call twice)."""
        self.release()
        try:
            self.decode.shutdown()
        finally:
            for side in self.prefills:
                side.shutdown()


def _prefill_rid(rid: str) -> str:
    """The id of a request's prompt on the prefill side (ids are at most 256 characters)."""
    return f"{rid[:200]}#prefill"


class PDDoor:
    """A pair as one deployment to whoever calls it as one (the OpenAI engine): results
    are the decode side's; :meth:`shutdown` stops both sides."""

    def __init__(self, pair: PDDeployment) -> None:
        self.pair = pair

    async def generate_async(self, request: GenerateRequest) -> RequestResult:
        return (await self.pair.generate_async(request)).result

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        return self.pair.stream(request)

    def abort(self, rid: str) -> None:
        self.pair.abort(rid)

    def shutdown(self) -> None:
        self.pair.shutdown()
