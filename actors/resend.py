"""Calls sent again when the engine replica they went to died before answering.

An ingress calls its engine replicas through a Serve handle. When the replica a call went
to dies (killed, its node lost, its process crashed) the handle raises ``ActorDiedError``
or ``ActorUnavailableError`` (or a ``RayTaskError`` caused by one). Such a call is sent
again, to whichever replica the router picks then (the dead one is gone from its list),
at most :data:`RESENDS` times: a call answered in one response loses nothing, and a
stream only while it has sent nothing. A stream cut after its first chunk ends with the
error: its tokens were sent, and a replay would send them twice. Any other failure is the
call's own and is raised at once. Used by this library's ingress
(:class:`~actors.openai_app.OpenAIIngress`) and the vLLM cluster's
(:class:`~actors.vllm_serve.HiCacheIngress`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from ray.exceptions import RayActorError, RayTaskError

__all__ = ["RESENDS", "replica_gone", "resent_call", "resent_stream"]

log = logging.getLogger(__name__)

RESENDS = 2  # a call whose replica died before answering is sent again at most this often

T = TypeVar("T")


def replica_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (from a Serve handle's call) says the replica died or cannot be
    reached, rather than that the call itself failed."""
    if isinstance(exc, RayTaskError):
        return isinstance(exc.cause, RayActorError)
    return isinstance(exc, RayActorError)


async def resent_call(send: Callable[[], Awaitable[T]]) -> T:
    """``await send()``, sent again when its replica died before answering."""
    for attempt in range(RESENDS):
        try:
            return await send()
        except (RayActorError, RayTaskError) as exc:
            if not replica_gone(exc):
                raise
            _resending(exc, attempt)
    return await send()  # the last try: whatever it raises is the answer


async def resent_stream(send: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of ``send()``, sent again when its replica died before the first."""
    for attempt in range(RESENDS):
        started = False
        try:
            async for item in send():
                started = True
                yield item
            return
        except (RayActorError, RayTaskError) as exc:
            if started or not replica_gone(exc):
                raise
            _resending(exc, attempt)
    async for item in send():  # the last try
        yield item


def _resending(exc: BaseException, attempt: int) -> None:
    log.warning(
        "an engine replica died before answering (%s): sending the call again (%d of %d)",
        str(exc).splitlines()[0],
        attempt + 1,
        RESENDS,
    )
