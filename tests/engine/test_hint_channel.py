"""Look-ahead hints over the store the ranks meet on (:mod:`hicache_ray.engine.hint_channel`):
each peer reads rank 0's hints in order and looks each up unless it is late; a malformed
one is counted and dropped; a receiver ends when closed or when the store goes away, and a
sender whose store failed stops telling without raising. Real TCP stores, no Ray."""

from __future__ import annotations

import datetime
import queue
import struct
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from hicache_ray.base.tokens import encode_tokens
from hicache_ray.engine.hint_channel import (
    HINT_PREFIX,
    HintReceiver,
    HintSender,
    decode_hint,
    encode_hint,
)

_WAIT_S = 30.0  # a hint reaches a peer in about 0.1 ms; this only bounds a broken run


class _Lookups:
    """Records each lookup a receiver asks for; one for the salt "closing" raises."""

    def __init__(self) -> None:
        self.seen: queue.Queue[tuple[bytes, str, int]] = queue.Queue()

    def look_ahead_from(
        self, key: bytes, cache_salt: str, start: int, *, here: bool = False
    ) -> bool:
        assert here  # the receiver's thread runs the lookup itself
        if cache_salt == "closing":
            raise RuntimeError("the prefetch pipeline is closed")
        self.seen.put((key, cache_salt, start))
        return True

    def look_ahead_start(self, key: bytes, cache_salt: str) -> int:
        raise AssertionError("a receiver never picks the first page itself")

    def next(self) -> tuple[bytes, str, int]:
        return self.seen.get(timeout=_WAIT_S)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    timeout = datetime.timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    yield server
    del server


def _receiver(server: TCPStore, rank: int, steps: int = 0) -> tuple[HintReceiver, _Lookups]:
    lookups, counts = _Lookups(), {}  # type: ignore[var-annotated]
    receiver = HintReceiver("127.0.0.1", server.port, rank, lookups, lambda: steps, counts)
    return receiver, lookups


def test_a_hint_decodes_to_what_was_encoded_and_a_malformed_one_says_what_is_wrong() -> None:
    key = encode_tokens([5, 6, 7])
    assert decode_hint(encode_hint(key, "tenant-é", 2, 9)) == (key, "tenant-é", 2, 9)
    head = struct.pack("<qqI", 0, 1, 4)
    for data, why in [
        (b"", "shorter"),
        (head + b"ab", "cache salt of 4 bytes"),
        (head + b"\xff\xfe\xfd\xfc" + key, "UTF-8"),
        (struct.pack("<qqI", 0, 1, 0) + b"abc", "encoded tokens"),
        (encode_hint(key, "", 4, 1), "first page"),
        (encode_hint(key, "", 0, -1), "admitting step"),
    ]:
        found = decode_hint(data)
        assert isinstance(found, str) and why in found, (data, found)


def test_every_peer_reads_rank_0s_hints_in_order_and_looks_each_up(store: TCPStore) -> None:
    receivers = [_receiver(store, rank) for rank in (1, 2)]
    sender = HintSender("127.0.0.1", store.port, world_size=3)
    hints = [(encode_tokens(list(range(n, n + 8))), f"salt{n}", n % 3, n) for n in range(5)]
    for key, salt, start, step in hints:
        sender.tell(key, salt, start, step)
    for _, lookups in receivers:
        assert [lookups.next() for _ in hints] == [(k, s, p) for k, s, p, _ in hints]
    assert store.num_keys() == 0  # each hint read was deleted before it was looked up
    for receiver, _ in receivers:
        assert receiver.close() and not receiver.running
        assert receiver._counts == {"looked_up": 5, "ignored": 0, "malformed": 0}


def test_a_late_malformed_or_failing_hint_is_counted_and_the_next_one_still_taken(
    store: TCPStore,
) -> None:
    receiver, lookups = _receiver(store, 1, steps=10)  # the peer has begun 10 steps
    key = encode_tokens([1, 2, 3, 4])
    store.set(f"{HINT_PREFIX}/1/0", "not a hint")  # anyone who reaches the store can write
    sender = HintSender("127.0.0.1", store.port, world_size=2)
    sender._next[1] = 1  # rank 0 goes on after the key written above
    sender.tell(key, "", 0, 9)  # admitted in step 9: the peer's own query ran
    sender.tell(key, "closing", 0, 10)  # the lookup raises: the thread goes on
    sender.tell(key, "", 1, 10)
    assert lookups.next() == (key, "", 1)
    assert receiver._counts == {"looked_up": 1, "ignored": 2, "malformed": 1}
    assert lookups.seen.empty() and receiver.close()


def test_a_receiver_ends_when_the_store_goes_away_and_a_sender_stops_telling() -> None:
    timeout = datetime.timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    receiver, _ = _receiver(server, 1)
    sender = HintSender("127.0.0.1", server.port, world_size=2)
    del server  # rank 0's process is gone
    receiver._thread.join(_WAIT_S)
    assert not receiver.running
    key = encode_tokens([1, 2])
    for step in range(3):  # a write is not answered: the socket fails at the second
        sender.tell(key, "", 0, step)  # and never raises: hints stop
    assert sender._store is None
    assert receiver.close()  # nothing left to wake


def test_rank_0_receives_no_hints(store: TCPStore) -> None:
    with pytest.raises(ValueError, match="rank 0 receives no hints"):
        HintReceiver("127.0.0.1", store.port, 0, _Lookups(), lambda: 0, {})
