"""The per-step consensus protocol: what the vector holds, in order (the design is in
docs/architecture.md, "Consensus protocol").

Every step, every rank makes exactly these collectives, whatever its local state:

1. a MIN all-reduce of one integer: -2 when rank 0 admits requests or aborts some, -1 when
   this rank's facts differ from what it contributed at the last exchange, else 0;
2. only when that agreed value says some rank has news: one element-wise MIN all-reduce
   over ``Header.encode() + per-request facts``. When it is -1 (no arrivals) in a quiet
   step (nothing runs, no pending request is runnable: the same on every rank), each rank
   whose own L3 queries or reads run waits for them (``QUIET_WAIT_S`` at most, nor past a
   prefetch deadline) before taking its facts, while the others wait in this round: the
   step that sees the last rank's read end is this one, not a later poll;
3. only when the agreed number of new requests is non-zero, a broadcast from rank 0 of
   their msgpack encoding (its byte length travels in the header).

When no rank has news, every MIN of round 2 would equal the last agreement, so skipping it
changes nothing: an idle step costs one small all-reduce. Each round depends only on the
previous round's agreed values, never on a local one.

Values only rank 0 knows, or where "any rank" matters, are negated so the MIN carries them:
rank 0's arrival count and payload size, the failure and busy flags. The request part lists
the admitted requests in admission order, four integers each (see
:mod:`hicache_ray.cache.controller.requests`); every rank derives that order from the same
broadcasts, so the vectors line up. Counts of requests in flight travel both ways (n and
-n) so a rank that diverged is caught by name instead of corrupting the agreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from hicache_ray.cache.controller.consensus import ConsensusError

__all__ = ["Arrival", "ArrivalLike", "Header", "StepBroadcast", "StepCodec"]


class ArrivalLike(Protocol):
    """What the controller reads of an arrival: its id, its prompt and its cache salt."""

    @property
    def rid(self) -> str: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def cache_salt(self) -> str: ...


class Arrival(msgspec.Struct, frozen=True):
    """The smallest arrival: a request id (unique among those in flight), its prompt's
    token ids and its cache salt (``""``: the deployment's). A scheduler broadcasts its own
    request struct instead (its controller's ``arrival_type``), so every rank gets the
    whole request from one decode."""

    rid: str
    tokens: list[int]
    cache_salt: str = ""


A = TypeVar("A")


class StepBroadcast(msgspec.Struct, Generic[A], frozen=True):
    """What rank 0 broadcasts in a step: new requests, and requests its callers aborted
    (every rank drops those at the same step)."""

    arrivals: list[A]
    aborts: list[str] = msgspec.field(default_factory=list)


class StepCodec:
    """Encodes rank 0's broadcast and decodes it on every rank, as ``arrival_type``
    structs. Arrivals are trusted: the scheduler checked them at its door."""

    def __init__(self, arrival_type: type[Any] = Arrival) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepBroadcast[arrival_type])  # type: ignore[valid-type]

    def encode(self, arrivals: Sequence[Any], aborts: Sequence[str] = ()) -> bytes:
        return self._encoder.encode(StepBroadcast(list(arrivals), list(aborts)))

    def decode(self, data: bytes) -> StepBroadcast[Any]:
        broadcast: StepBroadcast[Any] = self._decoder.decode(data)
        return broadcast


# The header's layout, declared once: (field, slots, how the MIN agrees it). "max": negated
# on the way in and out, so the MIN carries the largest (rank 0's counts, any rank's flag);
# "min": the smallest (acknowledged counts); "both": sent as n and -n, so the agreement
# shows the smallest and the largest and a rank that diverged is caught.
_LAYOUT: tuple[tuple[str, int, str], ...] = (
    ("arrivals", 1, "max"),
    ("payload_bytes", 1, "max"),
    ("acks", 3, "min"),  # completed writes, completed backups, first failed backup
    ("failed", 1, "max"),
    ("busy", 1, "max"),
    ("num_requests", 1, "both"),
)


def _slots(slots: int, how: str) -> int:
    return 2 * slots if how == "both" else slots


@dataclass(frozen=True)
class Header:
    """The fixed part of the step vector (one rank's view before the MIN, agreed after),
    laid out as ``_LAYOUT`` declares."""

    SIZE = sum(_slots(n, how) for _, n, how in _LAYOUT)

    arrivals: int
    payload_bytes: int
    acks: list[int]
    failed: bool
    busy: bool
    num_requests: int

    def encode(self) -> list[int]:
        out: list[int] = []
        for name, _, how in _LAYOUT:
            value = getattr(self, name)
            values = [int(v) for v in value] if isinstance(value, list) else [int(value)]
            if how == "max":
                out += [-v for v in values]
            elif how == "min":
                out += values
            else:
                out += values + [-v for v in values]
        return out

    @staticmethod
    def local(
        arrivals: int,
        payload_bytes: int,
        acks: list[int],
        failed: bool,
        busy: bool,
        num_requests: int,
    ) -> list[int]:
        """One rank's header, encoded (what :meth:`encode` gives)."""
        return Header(arrivals, payload_bytes, acks, failed, busy, num_requests).encode()

    @classmethod
    def decode(cls, agreed: Sequence[int], step: int) -> Header:
        values: dict[str, list[int]] = {}
        pos = 0
        for name, n, how in _LAYOUT:
            part = list(agreed[pos : pos + _slots(n, how)])
            pos += len(part)
            if how == "both":
                lowest, highest = part[:n], [-v for v in part[n:]]
                if lowest != highest:
                    raise ConsensusError(
                        f"step {step}: ranks hold {lowest[0]} to {highest[0]} requests in "
                        "flight; take() and cancel() must be called for the same requests "
                        "on every rank"
                    )
                part = lowest
            values[name] = [-v for v in part] if how == "max" else part
        return cls(
            arrivals=values["arrivals"][0],
            payload_bytes=values["payload_bytes"][0],
            acks=values["acks"],
            failed=values["failed"][0] > 0,
            busy=values["busy"][0] > 0,
            num_requests=values["num_requests"][0],
        )
