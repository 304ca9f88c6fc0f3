"""vLLM 0.32 (CPU build, a real engine) stores and loads its KV through hicache-ray's L3.

One engine: generate, reset vLLM's prefix cache, generate again: the whole pages come from
the store and the greedy answer is the same. Faults: a corrupt object is recomputed, a
dropped store is a miss, bad options fail at start. Across engines: a hicache-ray
Deployment (TP=1 and TP=2) gets the pages vLLM stored as L3 hits, and vLLM loads the pages
a Deployment stored; both answer as they do without a cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hicache_ray.base.errors import ConfigError
from hicache_ray.keys import page_hashes
from tests.vllm.helpers import (
    PAGE,
    corrupt_page,
    engine,
    file_store,
    generate,
    prompt_ids,
    scheduler,
    worker,
)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def llm(checkpoint: Path, store_root: Path) -> Iterator[Any]:
    with engine(checkpoint, file_store(store_root)) as running:
        yield running


def test_a_prompt_after_a_prefix_cache_reset_loads_its_pages(llm: Any) -> None:
    tokens = prompt_ids(1, 3 * PAGE + 11)  # three whole pages and a partial one
    loaded = worker().counts.loaded_tokens
    first, cached = generate(llm, tokens)
    assert cached == 0
    llm.reset_prefix_cache()
    again, cached = generate(llm, tokens)
    assert cached == 3 * PAGE  # every whole page from the store
    assert worker().counts.loaded_tokens - loaded == 3 * PAGE
    assert again == first
    assert scheduler(llm)._planner.tracked == 0  # nothing held for finished requests


def test_answers_extend_the_stored_prefix(llm: Any) -> None:
    tokens = prompt_ids(2, 2 * PAGE + 20)
    answer, _ = generate(llm, tokens, max_new=2 * PAGE)  # fills pages 2 and 3 while decoding
    llm.reset_prefix_cache()
    follow = tokens + answer + prompt_ids(3, 5)
    _, cached = generate(llm, follow)
    assert cached == (len(tokens) + len(answer)) // PAGE * PAGE


def test_a_corrupt_object_is_recomputed_and_the_answer_unchanged(
    llm: Any, store_root: Path
) -> None:
    tokens = prompt_ids(4, 3 * PAGE + 1)
    first, _ = generate(llm, tokens)
    corrupt_page(store_root, page_hashes(tokens, PAGE)[1])
    failed = worker().counts.load_failed_tokens
    llm.reset_prefix_cache()
    again, _ = generate(llm, tokens)
    assert again == first
    assert worker().counts.load_failed_tokens - failed == 2 * PAGE  # page 1 and after


def test_a_vllm_request_salt_names_other_pages(llm: Any) -> None:
    tokens = prompt_ids(5, 2 * PAGE + 1)
    first, _ = generate(llm, tokens)
    llm.reset_prefix_cache()
    salted, cached = generate(llm, tokens, salt="tenant-b")
    assert cached == 0 and salted == first


def test_bad_extra_config_fails_at_start(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="stores"), engine(checkpoint, {"stores": "ray"}):
        pass


def test_worker_counts_reach_prometheus_through_vllms_stats() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from hicache_ray.integrations.vllm.connector import HiCacheRayConnector

    registry = CollectorRegistry()

    class _Counter(Counter):  # type: ignore[misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, registry=registry, **kw)

    types = {Counter: _Counter, Gauge: Gauge, Histogram: Histogram}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = HiCacheRayConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    first = HiCacheRayConnector.build_kv_connector_stats({"loaded_tokens": 64})
    total = first.aggregate(HiCacheRayConnector.build_kv_connector_stats({"saved_tokens": 32}))
    prom.observe(total.reduce(), engine_idx=0)
    sample = registry.get_sample_value
    assert sample("hicache_vllm_loaded_tokens_total", {"engine": "0"}) == 64
    assert sample("hicache_vllm_saved_tokens_total", {"engine": "0"}) == 32


def test_requests_whose_kv_is_not_their_tokens_alone_are_not_shared() -> None:
    from hicache_ray.integrations.vllm.connector import _shareable

    plain = {"prompt_token_ids": [1, 2], "mm_features": None, "lora_request": None}
    assert _shareable(SimpleNamespace(**plain, prompt_embeds=None))
    for change in (
        {"mm_features": ["an image"]},  # placeholder tokens stand for the media
        {"lora_request": object()},  # the adapter changes the KV
        {"prompt_token_ids": None},  # embeddings, no token ids
    ):
        assert not _shareable(SimpleNamespace(**{**plain, **change}, prompt_embeds=None))
