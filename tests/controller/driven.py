"""A controller driven as the runtime's request table drives it, by request id.

The controller keeps no registry of requests: the scheduler keeps each admitted request's
:class:`~hicache_ray.cache.controller.PrefixClaim` and passes them back every step. ``Driven``
plays that part for the controller tests (the claims by id, in admission order), so a test
says ``take("r")`` where the runtime takes the claim of its record ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_ray.base.errors import HiCacheError
from hicache_ray.cache.controller import CacheController, PrefixClaim
from hicache_ray.cache.handle import CacheHandle


@dataclass
class Stepped:
    """A step's agreement, by request id."""

    step: int
    arrivals: list[Any]
    runnable: list[str]
    busy: bool
    aborted: list[str]


class Driven:
    """``ctl`` with the claims of its admitted requests kept here by id (every other
    attribute is the controller's)."""

    def __init__(self, ctl: CacheController) -> None:
        self.ctl = ctl
        self.known: dict[str, PrefixClaim] = {}  # admitted, not taken or cancelled

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctl, name)

    def step(
        self, arrivals: Sequence[Any] = (), aborts: Sequence[str] = (), *, quiet: bool = False
    ) -> Stepped:
        result = self.ctl.step(arrivals, aborts, pending=list(self.known.values()), quiet=quiet)
        self.known.update((c.rid, c) for c in result.admitted)
        for rid in result.aborted:
            if rid in self.known:
                self.cancel(rid)
        arrivals = [c.arrival for c in result.admitted]
        runnable = [c.rid for c in result.runnable]
        return Stepped(result.step, arrivals, runnable, result.busy, result.aborted)

    def take(self, rid: str, max_pages: int | None = None) -> CacheHandle:
        claim = self._claim(rid)
        try:
            return self.ctl.take(claim, max_pages)
        finally:
            if claim.done:
                del self.known[rid]

    def cancel(self, rid: str) -> None:
        self.ctl.cancel(self._claim(rid))
        del self.known[rid]

    def _claim(self, rid: str) -> PrefixClaim:
        claim = self.known.get(rid)
        if claim is None:
            raise HiCacheError(f"request {rid!r} is not admitted (or was taken)")
        return claim
