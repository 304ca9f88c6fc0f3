"""vLLM's own KV events (a real engine, its ZeroMQ publisher) rebuild its block set in the
cache index, named as the connector names the pages it stores in the L3; the connector's
saves, published with them, become the application's L3 pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicache_ray.integrations.vllm.event_feed import VllmEventFeed
from hicache_ray.integrations.vllm.events import VllmJournal
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import CacheIndex, Hits
from tests.vllm.helpers import PAGE, engine, file_store, generate, prompt_ids


def _stored_pages(root: Path) -> set[str]:
    """The page hashes a file store at ``root`` holds objects of."""
    return {path.name.split("_")[0] for path in root.glob("*/*_*")}


def _l3_pages(journal: VllmJournal) -> set[str]:
    """The L3 pages a cache index learns from the journal's batches (all kept)."""
    index = CacheIndex()
    for batch in journal.cache_events(journal.epoch, 0) or []:
        if batch.seq == 1:
            index.reset("r", batch)
        else:
            index.apply("r", batch)
    return set(index.store_pages())


def test_vllms_own_event_structs_decode() -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    tokens = prompt_ids(20, 2 * PAGE)
    first = BlockStored(
        block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=None, token_ids=tokens,
        block_size=PAGE, lora_id=None, medium="GPU", lora_name=None,
        extra_keys=[("tenant",), None], group_idx=0, session_id="s",
    )  # fmt: skip
    journal = VllmJournal(PAGE)
    encode = msgspec.msgpack.Encoder().encode
    assert journal.take(0, encode(KVEventBatch(1.0, [first])))
    assert journal.held() == set(page_hashes(tokens, PAGE, salt="tenant"))
    gone = BlockRemoved(block_hashes=[b"b" * 32], medium="GPU")
    assert journal.take(1, encode(KVEventBatch(2.0, [gone])))
    assert journal.held() == {page_hashes(tokens, PAGE, salt="tenant")[0]}
    assert journal.take(2, encode(KVEventBatch(3.0, [AllBlocksCleared()])))
    assert journal.held() == set() and journal.unnamed == 0 and journal.gaps == 0


@pytest.fixture
def publishing(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[Any, dict[str, str], Path]]:
    """An engine with the connector on a file store, publishing its KV events."""
    root = tmp_path / "l3"
    endpoints = {
        "endpoint": f"ipc://{tmp_path}/events",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    events = {"enable_kv_cache_events": True, "publisher": "zmq", **endpoints}
    with engine(checkpoint, file_store(root), kv_events_config=events) as llm:
        yield llm, endpoints, root


def test_a_real_engines_events_rebuild_its_blocks_in_the_index(
    publishing: tuple[Any, dict[str, str], Path],
) -> None:
    llm, endpoints, root = publishing
    first = prompt_ids(21, 3 * PAGE + 5)
    generate(llm, first)  # before the feed subscribes: its batches come from the replay
    journal = VllmJournal(PAGE)
    feed = VllmEventFeed(journal, endpoints["endpoint"], endpoints["replay_endpoint"])
    feed.start()
    try:
        assert feed.connected.wait(30)
        second = prompt_ids(22, 2 * PAGE + 3)
        generate(llm, second, salt="tenant-b")
        stored = _stored_pages(root)
        assert (
            set(page_hashes(first, PAGE)) | set(page_hashes(second, PAGE, salt="tenant-b"))
            <= stored
        )
        assert journal.wait_until(lambda: journal.held() == stored, 60), (journal.held(), stored)
        assert journal.unnamed == 0 and journal.gaps == 0

        index = CacheIndex()
        index.reset("vllm-0", journal.cache_snapshot())
        assert index.hits("vllm-0", page_hashes(first, PAGE)) == Hits(device=3)
        assert index.hits("vllm-0", page_hashes(second, PAGE)) == Hits()  # unsalted: others

        llm.reset_prefix_cache()  # vLLM clears its blocks: the index hears it
        generate(llm, prompt_ids(23, PAGE))
        assert journal.wait_until(lambda: journal.held() == set(page_hashes(
            prompt_ids(23, PAGE), PAGE)), 60), journal.held()  # fmt: skip
        # the connector's saves, acknowledged by its worker, are the application's L3 pages
        assert journal.wait_until(lambda: stored <= _l3_pages(journal), 60)
    finally:
        feed.stop()
        feed.join(10)
