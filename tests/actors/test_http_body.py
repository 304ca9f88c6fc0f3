"""``read_body``: a body within the limit comes back whole; one over it is refused, read to
its end when within the drain bound (so the sender gets the 413, not a reset) and left at
once past it or when its declared length is past it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("starlette")
from starlette.requests import Request

from actors.http_body import DRAIN_FACTOR, read_body

LIMIT = 100


def _request(chunks: list[bytes], declared: int | None = None) -> tuple[Request, list[int]]:
    """A request sending ``chunks``, and the count of receive calls it answered."""
    calls = [0]
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        calls[0] += 1
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    return Request(scope, receive), calls


def _read(request: Request) -> bytes | None:
    return asyncio.run(read_body(request, LIMIT))


def test_within_the_limit_comes_back_whole() -> None:
    request, _ = _request([b"a" * 60, b"b" * 40])
    assert _read(request) == b"a" * 60 + b"b" * 40


def test_over_the_limit_is_read_to_its_end_and_refused() -> None:
    chunks = [b"x" * 50] * 6  # 300 bytes: over the limit, within the drain bound
    request, calls = _request(chunks, declared=300)
    assert _read(request) is None
    assert calls[0] == len(chunks)  # every byte read, none kept


def test_past_the_drain_bound_is_left_unread() -> None:
    chunks = [b"x" * LIMIT] * (DRAIN_FACTOR + 3)
    request, calls = _request(chunks)
    assert _read(request) is None
    assert calls[0] == DRAIN_FACTOR + 1  # stops at the first chunk past the bound

    declared, calls = _request(chunks, declared=LIMIT * (DRAIN_FACTOR + 3))
    assert _read(declared) is None
    assert calls[0] == 0  # refused on its header
