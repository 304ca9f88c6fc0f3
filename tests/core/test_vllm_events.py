"""``VllmJournal`` without vLLM: vLLM's KV-event payloads (encoded here with structs laid out
as vLLM 0.32's; ``tests/vllm/test_events.py`` checks them against vLLM's own) become cache
events named by page hashes, which rebuild the engine's block set in the cache index."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ray.cache.events import BlockStored as StoredPages
from hicache_ray.integrations.vllm.events import VllmJournal
from hicache_ray.integrations.vllm.pages import SaveAcks
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import CacheIndex

P = 4


class BlockStored(msgspec.Struct, omit_defaults=True, tag=True):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, tag=True):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def vhash(tokens: list[int], salt: str = "") -> list[bytes]:
    """vLLM-like block hashes (any function of the content does: the journal maps them)."""
    out, prev = [], salt.encode()
    for i in range(0, len(tokens) - P + 1, P):
        prev = hashlib.sha256(prev + bytes(tokens[i : i + P])).digest()
        out.append(prev)
    return out


def stored(tokens: list[int], first: int, n: int, salt: str = "", **kw: Any) -> BlockStored:
    """``n`` blocks of ``tokens`` from block ``first``, as vLLM publishes them."""
    hashes = vhash(tokens, salt)
    parent = hashes[first - 1] if first else None
    keys = [(salt,) if salt and first == 0 and i == 0 else None for i in range(n)]
    body = tokens[first * P : (first + n) * P]
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None,
                              "extra_keys": keys if any(keys) else None}  # fmt: skip
    fields.update(kw)
    return BlockStored(hashes[first : first + n], parent, body, P, **fields)


def payload(*events: Any) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(1.0, list(events)))


def _l1(index: CacheIndex) -> set[str]:
    events = index.export("r").batch.events
    return {h for e in events if isinstance(e, StoredPages) and e.medium == "GPU"
            for h in e.block_hashes}  # fmt: skip


def rebuilt(journal: VllmJournal) -> set[str]:
    """The L1 pages a cache index holds from the journal's batches (all kept), checked
    equal to what its snapshot gives."""
    feed = journal.cache_events(journal.epoch, 0) or []
    index, snap = CacheIndex(), CacheIndex()
    index.reset("r", feed[0])
    assert all(index.apply("r", b) for b in feed[1:])
    snap.reset("r", journal.cache_snapshot())
    assert _l1(snap) == _l1(index)
    return _l1(index)


def test_a_prompt_is_named_as_the_connector_names_its_pages() -> None:
    tokens = list(range(10, 30))  # 5 pages
    journal = VllmJournal(P, salt="tenant")
    assert journal.take(0, payload(stored(tokens, 0, 2), stored(tokens, 2, 3)))
    assert journal.held() == set(page_hashes(tokens, P, salt="tenant"))
    assert rebuilt(journal) == journal.held()
    # a request's own cache_salt wins over the connector's
    assert journal.take(1, payload(stored(tokens, 0, 2, salt="mine")))
    assert set(page_hashes(tokens[: 2 * P], P, salt="mine")) <= journal.held()


def test_removed_and_cleared_blocks_leave() -> None:
    tokens = list(range(40, 56))
    journal = VllmJournal(P)
    journal.take(0, payload(stored(tokens, 0, 4)))
    gone = vhash(tokens)[2:]
    journal.take(1, payload(BlockRemoved(gone, "GPU")))
    assert journal.held() == set(page_hashes(tokens[: 2 * P], P))
    assert rebuilt(journal) == journal.held()
    journal.take(2, payload(AllBlocksCleared()))
    assert journal.held() == set() and rebuilt(journal) == set()


def test_blocks_it_cannot_name_are_left_out() -> None:
    tokens = list(range(60, 76))
    journal = VllmJournal(P)
    events = [
        stored(tokens, 1, 2),  # parent never heard of
        stored(tokens, 0, 1, lora_name="adapter", lora_id=1),
        stored(tokens, 0, 1, extra_keys=[[["image", 0]]]),
        stored(tokens, 0, 1, group_idx=1),
    ]
    journal.take(0, payload(*events))
    assert journal.held() == set() and journal.unnamed == 4  # the other group: not counted
    wrong = stored(tokens, 0, 1)
    wrong.block_size = 2 * P
    journal.take(1, payload(wrong))
    assert journal.unnamed == 5


def test_a_gap_restarts_and_the_next_batch_clears() -> None:
    tokens = list(range(80, 92))
    journal = VllmJournal(P)
    journal.take(0, payload(stored(tokens, 0, 2)))
    seq = journal.seq
    assert not journal.take(2, payload(stored(tokens, 2, 1)))  # 1 is missing
    journal.restart(2)
    assert journal.take(2, payload(stored(tokens, 2, 1)))  # its parent's name is kept
    assert journal.held() == {page_hashes(tokens, P)[2]} and journal.gaps == 1
    after = journal.cache_events(journal.epoch, seq) or []
    assert type(after[0].batch.events[0]).__name__ == "AllBlocksCleared"
    assert journal.take(1, b"old")  # behind: ignored
    assert journal.take(3, b"\xc1 not msgpack") and journal.gaps == 2
    assert journal.held() == set() and journal.last_vllm_seq == 3


def test_subscribers_of_another_journal_or_too_far_behind_take_a_snapshot() -> None:
    journal = VllmJournal(P, keep_batches=2)
    tokens = list(range(100, 120))
    for i in range(4):
        journal.take(i, payload(stored(tokens, i, 1)))
    assert journal.cache_events("other", 0) is None
    assert journal.cache_events(journal.epoch, 1) is None
    assert [b.seq for b in journal.cache_events(journal.epoch, 3) or []] == [4]
    assert journal.cache_events(journal.epoch, journal.seq) == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        VllmJournal(0)
    with pytest.raises(ValueError, match="max_blocks"):
        VllmJournal(P, max_blocks=0)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(1, 6), min_size=P, max_size=6 * P), min_size=1, max_size=5
    ),
    drops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), max_size=6),
)
def test_the_index_rebuilds_the_block_set(
    prompts: list[list[int]], drops: list[tuple[int, int]]
) -> None:
    """Prompts stored block by block (shared prefixes included) and blocks removed: the
    index rebuilt from the journal holds exactly the page hashes of what remains."""
    journal, expect, seq = VllmJournal(P, max_blocks=1 << 10), {}, 0
    for tokens in prompts:
        whole = len(tokens) // P
        journal.take(seq, payload(*(stored(tokens, i, 1) for i in range(whole))))
        seq += 1
        expect.update(zip(vhash(tokens), page_hashes(tokens, P), strict=True))
    for which, block in drops:
        tokens = prompts[which % len(prompts)]
        hashes = vhash(tokens)
        if block < len(hashes):
            journal.take(seq, payload(BlockRemoved([hashes[block]], "GPU")))
            seq += 1
            expect.pop(hashes[block], None)
    assert journal.held() == set(expect.values())
    assert rebuilt(journal) == journal.held()


def test_a_feed_without_replay_restarts_at_a_gap() -> None:
    from hicache_ray.integrations.vllm.event_feed import VllmEventFeed

    tokens = list(range(130, 142))
    journal = VllmJournal(P)
    feed = VllmEventFeed(journal, "ipc:///nowhere")  # not started: batches handed in
    feed._take(4, payload(stored(tokens, 0, 2)))  # joined late: 0..3 never seen
    assert journal.gaps == 1 and journal.last_vllm_seq == 4
    assert journal.held() == set(page_hashes(tokens[: 2 * P], P))
    feed._take(5, payload(stored(tokens, 2, 1)))
    assert journal.held() == set(page_hashes(tokens, P)) and journal.gaps == 1


def test_the_connectors_saves_become_the_applications_l3_pages() -> None:
    tokens = list(range(150, 162))
    pages = page_hashes(tokens, P)
    journal = VllmJournal(P)
    saved = stored(tokens, 0, 3, medium="STORAGE")
    saved.block_hashes = [bytes.fromhex(p) for p in pages] + [b"short"]  # one malformed
    journal.take(0, payload(saved))
    assert journal.held() == set() and journal.held("STORAGE") == set()
    index = CacheIndex()
    for batch in journal.cache_events(journal.epoch, 0) or []:
        index.reset("r", batch) if batch.seq == 1 else index.apply("r", batch)
    assert index.store_pages() == pages
    assert index.hits("other", pages).shared == 3  # every replica reads the shared L3


def test_a_page_is_stored_once_every_worker_reported_it() -> None:
    acks = SaveAcks(workers=2, keep=2)
    assert acks.add(["a", "b"]) == []
    assert acks.add(["b", "c", "a"]) == ["b", "a"]
    assert acks.add(["d", "e"]) == []  # "c" falls out: kept are the last two waiting
    assert acks.add(["c", "e"]) == ["e"]
    assert SaveAcks(workers=1).add(["x", "y"]) == ["x", "y"]
