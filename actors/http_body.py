"""Reading an HTTP request body under a size limit without resetting the sender.

A server that answers 413 mid-upload and closes leaves unread bytes in its socket; the
kernel answers them with a reset, and the sender sees ``Connection reset by peer`` instead
of the 413. So a body over the limit but within ``DRAIN_FACTOR`` times it is read to its end
and dropped first, as nginx's lingering close does. A larger one (declared or sent) is
refused at once: not worth the bytes, the sender may see the reset.
"""

from __future__ import annotations

from starlette.requests import Request

__all__ = ["DRAIN_FACTOR", "read_body"]

DRAIN_FACTOR = 4


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is longer than ``limit`` bytes."""
    drain = DRAIN_FACTOR * limit
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > drain:
        return None
    data = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > drain:
            return None
        if seen <= limit:
            data += chunk
    return bytes(data) if seen <= limit else None
