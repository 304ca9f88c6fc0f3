"""One admitted request's prefix claim and the facts its ranks agree on (:mod:`.claims`
makes, agrees and hands them over); what one step agreed (:class:`StepResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from hicache_ray.base.config import PrefetchPolicy
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.cache.controller.protocol import ArrivalLike
from hicache_ray.cache.tree import TreeNode

__all__ = ["FACTS", "Facts", "PrefixClaim", "StepResult"]


class Facts(NamedTuple):
    """One request's facts in the step vector, in this order (MIN-agreed across ranks).

    Attributes:
        ready: leading pages in L1/L2 here (read from L3 included).
        total: leading pages in L1/L2/L3 here; -1 while the storage query runs.
        finished: 1 when this rank's reads are done (the MIN: every rank's).
        timed_out: -1 when the prefetch deadline passed (negated: the MIN is "any rank").
    """

    ready: int
    total: int
    finished: int
    timed_out: int


FACTS = len(Facts._fields)  # integers per request in the step vector


class PrefixClaim:
    """One admitted request's claim on its cached prefix, from admission to ``take`` or
    ``cancel``: the tree node it locks, its L3 prefetch, and the facts agreed for it.

    The controller hands it out (:meth:`CacheController.step`) and keeps no registry of its
    own: the scheduler's request table holds it and passes the claims of its admitted
    requests back to every step, in admission order.

    Attributes:
        arrival: the request as the step broadcast it (of the controller's arrival type).
        rid: its id.
        agreed: the facts every rank agreed for it at the last exchange (None: not yet).
    """

    __slots__ = (
        "admitted_at",
        "agreed",
        "agreed_on_arrival",
        "arrival",
        "cached",
        "deadline",
        "done",
        "fetch_started",
        "final",
        "key",
        "node",
        "prompt_key",
        "rid",
        "task",
    )

    def __init__(
        self, arrival: ArrivalLike, prompt_key: bytes, whole_bytes: int, node: TreeNode, cached: int
    ) -> None:
        self.arrival = arrival
        self.rid = arrival.rid
        self.prompt_key = prompt_key  # the prompt encoded once, reused at take and finish
        self.key = prompt_key[:whole_bytes]  # its whole pages
        self.node = node  # locked from admission to take
        self.cached = cached
        self.task: FetchTask | None = None
        self.agreed: Facts | None = None
        self.agreed_on_arrival = False  # only the admitting step's round has agreed yet
        self.fetch_started = False
        self.final: Facts | None = None  # facts that can no longer change
        self.admitted_at = 0.0
        self.deadline = math.inf
        self.done = False  # taken or cancelled

    @property
    def agreed_ready(self) -> int:
        """Pages every rank holds in L1/L2 as of the last step (-1: not agreed yet)."""
        return -1 if self.agreed is None else self.agreed.ready

    def runnable(self, policy: PrefetchPolicy) -> bool:
        """Whether the prefetch ``policy`` lets the request run now (from agreed facts only)."""
        facts = self.agreed
        if facts is None:
            return False
        if policy == "timeout" and facts.timed_out < 0:
            return True
        # best_effort gives a query one step (as long as a forward) before it gives up
        effort = policy == "best_effort" and not self.agreed_on_arrival
        return effort or facts.finished == 1


@dataclass
class StepResult:
    """What one step agreed (identical on every rank).

    Attributes:
        step: the step number (1 for the first call).
        admitted: the claims of the requests admitted this step, in rank 0's order (each
            claim's ``arrival`` is the request as broadcast).
        runnable: the claims (pending ones, then admitted ones) whose prefetch policy lets
            them run now, oldest first; aborted ones left out.
        busy: some rank still has background work (writes, queries, reads, backups) or
            requests in flight.
        aborted: request ids rank 0 aborted this step (admitted ones are cancelled here;
            the caller drops those it runs).
        agreement_s: seconds this step spent agreeing (its all-reduces and broadcast).
    """

    step: int
    admitted: list[PrefixClaim] = field(default_factory=list)
    runnable: list[PrefixClaim] = field(default_factory=list)
    busy: bool = False
    aborted: list[str] = field(default_factory=list)
    agreement_s: float = 0.0
