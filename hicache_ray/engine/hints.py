"""Prompts about to be admitted, looked up in L3 before the step that admits them.

Rank 0 learns of a request when it arrives; the other ranks only when rank 0's admission
step broadcasts it, and each then sends its own L3 lookup: on 2 cores a TP=2 L3 hit's
lookups went out 7-13 ms after its admission step began. So rank 0, before that step's
rounds, looks its arrivals up itself and tells every other rank which pages to look up
(over the store the ranks meet on: :mod:`hicache_ray.engine.hint_channel`): each rank's
lookup then runs while the ranks agree, and the query at admission finds its answers in
the store client (:meth:`~hicache_ray.cache.controller.claims.Claims.look_ahead_from`).
Which pages: those past what rank 0's tree holds (every rank's tree holds the same
prefixes).

A hint is a guess: one that is wrong, late or malformed costs a lookup at most and never
fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hicache_ray.base.tokens import TOKEN_BYTES, encode_tokens

__all__ = ["MAX_SALT_CHARS", "LookAhead", "Lookups", "Tell", "hint_problem"]

log = logging.getLogger(__name__)

MAX_SALT_CHARS = 1024  # as GenerateRequest.cache_salt

# (encoded tokens, cache salt, first page, the step that admits it)
Tell = Callable[[bytes, str, int, int], None]


class Lookups(Protocol):
    """Where a rank's look-aheads go (:class:`~hicache_ray.cache.controller.claims.Claims`)."""

    def look_ahead_start(self, key: bytes, cache_salt: str) -> int:
        """The first page of a prompt to look up, or -1 for none."""

    def look_ahead_from(
        self, key: bytes, cache_salt: str, start: int, *, here: bool = False
    ) -> bool:
        """Look the prompt's pages up from ``start`` (``here``: on the calling thread, now);
        whether a lookup was made or queued."""


class LookAhead:
    """Rank 0's look-ahead of its arrivals: for each, the first page to look up
    (``lookups.look_ahead_start``), then ``tell`` the other ranks (set by the rank actor of
    a deployment of more than one rank) which step admits it (``steps()``, the steps begun
    so far, + 1), then the lookup on this rank (``lookups.look_ahead_from``). A peer past
    that step drops the hint (the admission's own query ran there). The peers are told
    first: rank 0's own lookup wakes a thread that competes for the interpreter, and the
    hint then left 1-2.5 ms later on 2 cores, the peer's lookup with it."""

    def __init__(self, lookups: Lookups, steps: Callable[[], int]):
        self._lookups, self._steps = lookups, steps
        self.tell: Tell | None = None

    def arrivals(self, requests: Sequence[Any]) -> int:
        """Look up ``requests`` (with ``tokens`` and ``cache_salt``) on the step thread;
        how many were looked up."""
        looked = 0
        for request in requests:
            try:
                key = encode_tokens(request.tokens)  # once more than admission (24 us at 4k)
                start = self._lookups.look_ahead_start(key, request.cache_salt)
                if start < 0:
                    continue
                if self.tell is not None:
                    self.tell(key, request.cache_salt, start, self._steps() + 1)
                looked += self._lookups.look_ahead_from(key, request.cache_salt, start)
            except Exception as exc:  # a closed store, an unreachable peer: a guess lost
                log.debug("look-ahead of %s skipped: %s", getattr(request, "rid", "?"), exc)
        return looked


def hint_problem(key: object, cache_salt: object, start: object, step: object) -> str | None:
    """What is wrong with a look-ahead hint a peer received; None if nothing."""
    if type(key) is not bytes or not key or len(key) % TOKEN_BYTES:
        return "the prompt is not non-empty encoded tokens (bytes)"
    if type(cache_salt) is not str or len(cache_salt) > MAX_SALT_CHARS:
        return f"the cache salt is not a str of at most {MAX_SALT_CHARS} characters"
    if type(start) is not int or not 0 <= start <= len(key) // TOKEN_BYTES:
        return "the first page is not an int within the prompt"
    if type(step) is not int or step < 0:
        return "the admitting step is not a non-negative int"
    return None
