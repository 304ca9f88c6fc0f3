"""A deployment's lifecycle records: its states, errors, re-formings, statistics, and how a
failure is read (a rank's own error rather than Ray's wrapper).

States (``Deployment.state``)::

    forming --> serving <--> re-forming --> broken --> (re-forming on the next call)
                  |               |            |
                  +---------------+------------+--> shut down  (final)

Recovery: when a rank dies, stalls past the consensus timeout or a collective fails, the
requests in flight fail with :class:`~actors.rank.RankFailure` (or Ray's actor error) and
the deployment re-forms: it kills every rank, starts new ones in the same placement groups
(Ray re-places a group's bundles when a node is lost), and retries those requests. A
re-forming that fails (another rank dies while joining) leaves the deployment ``broken``;
the next attempt of any call re-forms again. A rank 0 found dead by the reader of the
cache journal (``RankSet.cache_events``) starts the re-forming at once, with no call
waiting for it. Each request has ``max_retries`` retries, and
a failed re-forming uses one. L1/L2 of the old ranks are gone; L3 is not, so the retried
requests find their prefixes there when the storage backend outlives the ranks.

Shutdown is final: ``Deployment.shutdown`` stops accepting requests, fails those in flight with
``DeploymentError("... shut down")`` within a bounded time, stops the ranks' step loops
before killing them, and never re-forms afterwards. Every wait on the request path is
bounded (waits are sliced, each slice checks for shutdown).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
from ray.exceptions import RayActorError, RayTaskError

from actors.rank import RankFailure
from actors.stats import RankStats
from hicache_ray.base.errors import HiCacheError
from hicache_ray.engine.request import ErrorKind, GenerateRequest, RequestError, RequestResult

__all__ = [
    "Attempt",
    "at_caller",
    "DeploymentError",
    "DeploymentState",
    "DeploymentStats",
    "Reform",
    "ReformFailed",
    "describe_failure",
    "door",
    "is_rank_failure",
    "replay",
    "send",
]


class DeploymentError(HiCacheError, RuntimeError):
    """The deployment could not be formed, was shut down, or a request failed after every
    retry."""


class DeploymentState(enum.Enum):
    FORMING = "forming"
    SERVING = "serving"
    REFORMING = "re-forming"
    BROKEN = "broken"
    SHUT_DOWN = "shut down"


class Reform(msgspec.Struct, frozen=True, kw_only=True):
    """One re-forming: the generation it made, why, how long it took, whether it worked."""

    generation: int
    cause: str
    seconds: float
    ok: bool = True
    error: str | None = None


class DeploymentStats(msgspec.Struct, kw_only=True):
    """What :meth:`Deployment.stats` returns (``msgspec.to_builtins`` gives JSON)."""

    name: str
    state: str
    tp_size: int
    pp_size: int
    generation: int
    reforms: list[Reform]
    ranks: list[RankStats]


def describe_failure(exc: BaseException | None) -> str:
    """The failure in one line: the rank's own error rather than Ray's wrapper."""
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, RayActorError):
        return f"a rank actor died: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return str(exc)[:500]


def is_rank_failure(exc: BaseException) -> bool:
    if isinstance(exc, RayActorError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, RankFailure)


class ReformFailed(DeploymentError):
    """A re-forming did not complete (the deployment is broken until the next one)."""


def replay(rid: str, tokens: list[int], emitted: list[int], seen: int) -> list[int]:
    """The tokens of a stream chunk not yielded yet. ``tokens`` follow the ``seen`` tokens
    of this run; those that an earlier run of request ``rid`` already yielded must equal
    them (runs are greedy or seeded).

    Raises:
        DeploymentError: a retried run made other tokens than those already yielded.
    """
    skip = min(len(tokens), max(0, len(emitted) - seen))
    if tokens[:skip] != emitted[seen : seen + skip]:
        raise DeploymentError(
            f"request {rid!r}: its retried run made other tokens than those already sent "
            f"(from token {seen + 1} on): this request does not reproduce across runs"
        )
    return tokens[skip:]


class Attempt:
    """What one asyncio request's current attempt failed with (None: nothing yet)."""

    __slots__ = ("cause", "retried")

    def __init__(self) -> None:
        self.cause: BaseException | None = None
        self.retried = False  # a rank failure ended an earlier attempt

    def refused(self, result: RequestResult | None) -> bool:
        """A retry the re-formed ranks refused as overloaded (to be offered again)."""
        return self.retried and result is not None and result.error_kind is ErrorKind.OVERLOADED


def at_caller(result: RequestResult, call_s: float) -> RequestResult:
    """``result`` with the caller's share of its first token's time: ``call_s`` (clamped at
    0) in its split and ``caller_ttft_s`` = the rank's TTFT plus it. An error result has no
    first token and is returned as it is."""
    if result.error is None:
        result.ttft_split.call_s = max(0.0, call_s)
        result.caller_ttft_s = result.ttft_s + result.ttft_split.call_s
    return result


def door(request: object) -> GenerateRequest:
    """What ``Deployment`` alone checks of one request: that it is one (and, per call, that
    no id comes twice; :func:`send`: that Ray can send it). Its fields are checked once, by
    rank 0 (``RankRuntime.check``: the same ``field: problem`` errors)."""
    if not isinstance(request, GenerateRequest):
        raise RequestError("request", f"expected a GenerateRequest, got {type(request).__name__}")
    return request


def send(method: Any, request: GenerateRequest) -> Any:
    """``method.remote(request)``; a request Ray cannot serialise is refused alone."""
    try:
        return method.remote(request)
    except TypeError as exc:
        raise RequestError("request", f"cannot be sent to the ranks: {exc}") from None
