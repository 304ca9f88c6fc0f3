"""Look-ahead hints from rank 0 to the other ranks, over the store the ranks meet on.

Rank 0 tells every other rank which prompt to look up in L3 before its admission step
(:mod:`hicache_ray.engine.hints`). As a Ray call a hint reached a TP=2 peer 1.1-5.1 ms after
the admitting step began on 2 cores (the peer's event loop, then its interpreter), and the
peer's lookup was then the later one. A key in the deployment's rendezvous store (the TCP
store every group of the deployment meets on) reaches a peer in about 0.1 ms: each peer has
a thread blocked reading the next key of its own sequence (``hicache-hints/{rank}/{n}``),
which rank 0 writes, and deletes each key it read.

Anyone who reaches the store can write there, so a hint is decoded and checked
(:func:`~hicache_ray.engine.hints.hint_problem`) before it is used, and one that fails is
counted and dropped. A hint is a guess: a lost, late or malformed one costs a lookup at
most and never fails a request.

Threads: the sender is called on rank 0's step thread only. Each receiver has one thread
(``hicache-hints``), which ends at :meth:`HintReceiver.close` or when the store goes away.
"""

from __future__ import annotations

import datetime
import logging
import struct
import threading
from collections.abc import Callable

from torch.distributed import DistError, TCPStore  # type: ignore[attr-defined]

from hicache_ray.base.stats import HINT_OUTCOMES
from hicache_ray.engine.hints import Lookups, hint_problem
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig

__all__ = [
    "HINT_PREFIX",
    "HintReceiver",
    "HintSender",
    "decode_hint",
    "encode_hint",
    "open_hints",
]

log = logging.getLogger(__name__)

HINT_PREFIX = "hicache-hints"
_HEAD = struct.Struct("<qqI")  # first page, admitting step, salt bytes; then salt, tokens
_BLOCK = datetime.timedelta(days=1)  # a receiver waits this long for the next hint
_POKE_S = 2.0  # how long closing waits to reach the store (gone: the read ended with it)

Hint = tuple[bytes, str, int, int]  # encoded tokens, cache salt, first page, admitting step


def encode_hint(key: bytes, cache_salt: str, start: int, step: int) -> bytes:
    """One hint as the bytes a peer reads."""
    salt = cache_salt.encode()
    return _HEAD.pack(start, step, len(salt)) + salt + key


def decode_hint(data: bytes) -> Hint | str:
    """The hint in ``data``, or what is wrong with it."""
    if len(data) < _HEAD.size:
        return f"{len(data)} bytes, shorter than a hint's {_HEAD.size}-byte head"
    start, step, salt_bytes = _HEAD.unpack_from(data)
    end = _HEAD.size + salt_bytes
    if end > len(data):
        return f"a cache salt of {salt_bytes} bytes in a hint of {len(data)}"
    try:
        salt = data[_HEAD.size : end].decode()
    except UnicodeDecodeError:
        return "a cache salt that is not UTF-8"
    key = data[end:]
    problem = hint_problem(key, salt, start, step)
    return problem if problem is not None else (key, salt, start, step)


def _key(rank: int, seq: int) -> str:
    return f"{HINT_PREFIX}/{rank}/{seq}"


def _client(host: str, port: int, timeout_s: float) -> TCPStore:
    timeout = datetime.timedelta(seconds=timeout_s)
    return TCPStore(host, port, None, False, timeout=timeout)


class HintSender:
    """Rank 0's side: one key per hint and peer. A store that fails stops the hints (the
    peers then look up at admission, as without them); a warning says so once."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 10.0) -> None:
        self._store: TCPStore | None = _client(host, port, timeout_s)
        self._next = dict.fromkeys(range(1, world_size), 0)

    def tell(self, key: bytes, cache_salt: str, start: int, step: int) -> None:
        """Every other rank looks pages ``start``... of prompt ``key`` up (rank 0 admits it
        in step ``step``); a :data:`~hicache_ray.engine.hints.Tell`."""
        if self._store is None:
            return
        data = encode_hint(key, cache_salt, start, step)
        try:
            for peer, seq in self._next.items():
                self._store.set(_key(peer, seq), data)  # type: ignore[arg-type]  # bytes as is
                self._next[peer] = seq + 1
        except DistError as exc:
            log.warning("look-ahead hints stopped: the ranks' store failed: %s", exc)
            self._store = None


class HintReceiver:
    """A peer's side: reads rank ``rank``'s hints in order on a thread of its own and looks
    each up (``lookups.look_ahead_from``) unless the rank has begun a step past the one
    that admits it (``steps()``: the steps begun so far; the admission's own query ran);
    ``counts`` (keys :data:`~hicache_ray.base.stats.HINT_OUTCOMES`) counts what became of
    each."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        lookups: Lookups,
        steps: Callable[[], int],
        counts: dict[str, int],
        timeout_s: float = 10.0,
    ) -> None:
        if rank < 1:
            raise ValueError(f"rank {rank} receives no hints: only ranks 1... do")
        self._address, self._timeout_s = (host, port), timeout_s
        self._rank, self._lookups, self._steps, self._counts = rank, lookups, steps, counts
        for outcome in HINT_OUTCOMES:  # every key now: a snapshot may copy it meanwhile
            counts.setdefault(outcome, 0)
        self._store = _client(host, port, timeout_s)
        self._store.set_timeout(_BLOCK)
        self._seq = 0  # the key being waited for (the thread's; close reads it)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hicache-hints", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        while not self._closed.is_set():
            key = _key(self._rank, self._seq)
            try:
                data = self._store.get(key)
                self._store.delete_key(key)
            except DistError as exc:  # the store is gone: the deployment is going down
                if not self._closed.is_set():
                    log.info("rank %d: look-ahead hints ended: %s", self._rank, exc)
                return
            self._seq += 1
            if not self._closed.is_set():
                self._take(bytes(data))

    def _take(self, data: bytes) -> None:
        hint = decode_hint(data)
        if isinstance(hint, str):
            log.debug("rank %d: a look-ahead hint dropped: %s", self._rank, hint)
            outcome = "malformed"
        else:
            key, salt, start, step = hint
            try:  # on this thread, which has nothing else to do
                late = self._steps() > step
                looked = not late and self._lookups.look_ahead_from(key, salt, start, here=True)
            except Exception as exc:  # a pipeline closing under it: a guess lost, not the thread
                log.debug("rank %d: a look-ahead hint not looked up: %s", self._rank, exc)
                looked = False
            outcome = "looked_up" if looked else "ignored"
        self._counts[outcome] += 1

    def close(self, timeout_s: float = 5.0) -> bool:
        """End the thread: wake its read with an empty hint (to the key it waits for and
        the next, as it may be between two); whether it ended within ``timeout_s``."""
        self._closed.set()
        if not self._thread.is_alive():
            return True
        seq = self._seq
        try:
            poke = _client(*self._address, min(self._timeout_s, _POKE_S))
            for n in (seq, seq + 1):
                poke.set(_key(self._rank, n), "")
        except DistError as exc:  # the store is gone: so is the read
            log.debug("rank %d: no store to end the hints with: %s", self._rank, exc)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def open_hints(
    address: tuple[str, int], rank: int, config: DeploymentConfig, runtime: RankRuntime
) -> HintReceiver | None:
    """Look-ahead hints over the store at ``address`` (the one the ranks meet on): rank 0's
    look-ahead tells the other ranks (None returned); any other rank gets a receiver. None
    also for a deployment of one rank, and when the store cannot be reached (each rank then
    looks up at admission; a warning says so)."""
    world, ctl = config.world_size, runtime.ctl
    if world < 2:
        return None
    host, port = address
    timeout = config.consensus_timeout_s
    try:
        if rank == 0:
            runtime.look_ahead.tell = HintSender(host, port, world, timeout).tell
            return None
        steps, counts = (lambda: ctl.counters.steps), ctl.counters.lookahead_hints
        return HintReceiver(host, port, rank, ctl.claims, steps, counts, timeout)
    except DistError as exc:
        log.warning("rank %d: no look-ahead hints: %s", rank, exc)
        return None
