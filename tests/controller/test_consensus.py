"""Consensus groups: the identity group, the protocol header, and a gloo group's errors."""

from __future__ import annotations

import socket

import pytest

from hicache_ray.cache.controller import (
    ConsensusError,
    GlooConsensus,
    LocalConsensus,
    start_rendezvous,
)
from hicache_ray.cache.controller.protocol import Header


def test_local_consensus_is_the_identity() -> None:
    c = LocalConsensus()
    assert c.all_reduce_min([3, -1, 7], step=1) == [3, -1, 7]
    assert c.broadcast_bytes(b"abc", 3, step=1) == b"abc"
    with pytest.raises(ValueError, match="announced"):
        c.broadcast_bytes(b"abc", 4, step=1)
    c.close()


def test_header_round_trip_and_divergent_ranks_are_named() -> None:
    local = Header(
        arrivals=2, payload_bytes=99, acks=[5, 4, 1 << 62], failed=True, busy=False, num_requests=3
    )
    assert Header.decode(local.encode(), step=1) == local
    other = Header(
        arrivals=0, payload_bytes=0, acks=[5, 4, 1 << 62], failed=False, busy=True, num_requests=4
    ).encode()
    agreed = [min(a, b) for a, b in zip(local.encode(), other, strict=True)]
    with pytest.raises(ConsensusError, match="step 7: ranks hold 3 to 4 requests"):
        Header.decode(agreed, step=7)


def test_joining_a_group_nobody_serves_fails_with_a_clear_error() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConsensusError, match="rank 1 of 2 could not join"):
        GlooConsensus(1, 2, "127.0.0.1", port, timeout_s=1.0)
    # the rank 0 of a subgroup connects to a store someone else serves, like the others
    with pytest.raises(ConsensusError, match="rank 0 of 2 could not join"):
        GlooConsensus(0, 2, "127.0.0.1", port, timeout_s=1.0)
    rendezvous = start_rendezvous(2, timeout_s=1.0)
    with pytest.raises(ValueError, match="only rank 0"):
        GlooConsensus(1, 2, "127.0.0.1", port, timeout_s=1.0, rendezvous=rendezvous)
