"""Calls sent again when their engine replica died before answering, and only those."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from actors.resend import RESENDS, replica_gone, resent_call, resent_stream


def _died() -> Exception:
    return ActorDiedError()


def _task_error(cause: Exception) -> RayTaskError:
    """What a Serve handle raises for a call that failed on its replica (``cause``)."""
    return RayTaskError("respond", "traceback", cause)  # type: ignore[no-untyped-call]


def test_only_a_replica_gone_counts() -> None:
    assert replica_gone(ActorDiedError())
    assert replica_gone(ActorUnavailableError("unreachable", None))
    assert replica_gone(_task_error(ActorDiedError()))
    assert not replica_gone(_task_error(ValueError("bad prompt")))
    assert not replica_gone(ValueError("bad prompt"))


class _Replicas:
    """Serve's handle, whose first ``dead`` calls reach a replica that dies."""

    def __init__(self, dead: int, error: Exception | None = None) -> None:
        self.dead, self.calls, self.error = dead, 0, error

    async def call(self) -> str:
        self.calls += 1
        if self.calls <= self.dead:
            raise _died()
        if self.error is not None:
            raise self.error
        return "answer"

    async def stream(self, die_after: int = -1) -> AsyncIterator[str]:
        self.calls += 1
        for i in range(3):
            if i == die_after or (i == 0 and self.calls <= self.dead):
                raise _died()
            yield f"chunk{i}"


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _collect(stream: AsyncIterator[str]) -> list[str]:
    return [item async for item in stream]


def test_a_call_is_sent_again_until_a_live_replica_answers() -> None:
    replicas = _Replicas(dead=RESENDS)
    assert _run(resent_call(replicas.call)) == "answer"
    assert replicas.calls == RESENDS + 1
    gone = _Replicas(dead=RESENDS + 1)  # every try reached a dying replica: it fails
    with pytest.raises(ActorDiedError):
        _run(resent_call(gone.call))
    assert gone.calls == RESENDS + 1


def test_a_call_that_failed_on_its_own_is_not_sent_again() -> None:
    replicas = _Replicas(dead=0, error=_task_error(ValueError("bad")))
    with pytest.raises(RayTaskError):
        _run(resent_call(replicas.call))
    assert replicas.calls == 1


def test_a_stream_is_sent_again_only_before_its_first_chunk() -> None:
    replicas = _Replicas(dead=1)
    assert _run(_collect(resent_stream(replicas.stream))) == ["chunk0", "chunk1", "chunk2"]
    assert replicas.calls == 2
    cut = _Replicas(dead=0)  # dies after a chunk was sent: the error, not a replay
    seen: list[str] = []

    async def consume() -> None:
        async for item in resent_stream(lambda: cut.stream(die_after=1)):
            seen.append(item)

    with pytest.raises(ActorDiedError):
        _run(consume())
    assert seen == ["chunk0"] and cut.calls == 1
