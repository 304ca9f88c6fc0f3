"""The vLLM connector's halves without vLLM: the planner's loads and saves, the page mover's
layout mapping, round trips and failures, and the options (vLLM itself: tests/vllm)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import Fault
from hicache_ray.integrations.vllm.pages import PageJob, PagePlanner
from hicache_ray.integrations.vllm.setup import (
    layer_index,
    model_kv,
    parse_options,
    slot_views,
    storage_config,
)
from hicache_ray.keys import page_hashes
from hicache_ray.storage import FaultyObjects, MemoryObjects
from tests.core.vllm_kit import (
    BLOCKS,
    DIM,
    HEADS,
    LAYERS,
    MODEL,
    PAGE,
    Gated,
    backend_of,
    cpu_caches,
    mover_of,
    plan_of,
    stack,
)


def test_the_cpu_vec_layout_is_k_transposed_then_v_per_head() -> None:
    cache = cpu_caches(0)[0]
    # What vLLM 0.32's CPU kernel (vec ISA) writes per block and head: K as [D, P], V as
    # [P, D] (read off the bytes it stored for the KV hicache-ray computes; tests/vllm).
    per_head = cache.view(BLOCKS, HEADS, 2, PAGE * DIM)
    key, value = slot_views("cpu_vec", cache, HEADS, DIM)
    assert key.shape == value.shape == (BLOCKS, PAGE, HEADS, DIM)
    assert torch.equal(key[5, 3, 1], per_head[5, 1, 0].view(DIM, PAGE)[:, 3])
    assert torch.equal(value[5, 3, 1], per_head[5, 1, 1].view(PAGE, DIM)[3])


def test_the_split_content_layout_is_k_then_v_per_token() -> None:
    cache = torch.randn(BLOCKS, HEADS, PAGE, 2 * DIM)
    key, value = cache.transpose(1, 2).split(DIM, dim=-1)  # FLASH_ATTN's forward
    views = slot_views("split_content", cache, HEADS, DIM)
    assert torch.equal(views[0][2], key[2]) and torch.equal(views[1][2], value[2])


def test_a_cache_of_another_shape_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv cache"):
        slot_views("cpu_vec", torch.zeros(4, HEADS, PAGE, DIM), HEADS, DIM)
    with pytest.raises(ConfigError, match="layout"):
        slot_views("paged", torch.zeros(4, HEADS, PAGE, 2 * DIM), HEADS, DIM)


def test_saved_blocks_load_into_other_blocks_of_another_engine() -> None:
    plan, objects = plan_of(), MemoryObjects()
    writer = mover_of(cpu_caches(1), plan, backend_of(plan, objects))
    hashes = page_hashes(list(range(3 * PAGE)), PAGE)
    future = writer.save(PageJob("r", hashes, [7, 2, 9]))
    assert future is not None and future.result() == 3 * PAGE
    readers = cpu_caches(2)
    reader = mover_of(readers, plan, backend_of(plan, objects))
    assert reader.load(PageJob("r", hashes, [0, 1, 4])) == []
    for layer in range(LAYERS):
        assert torch.equal(stack(reader, layer, [0, 1, 4]), stack(writer, layer, [7, 2, 9]))
    assert reader.counts.loaded_tokens == 3 * PAGE and writer.counts.saved_tokens == 3 * PAGE
    writer.close()
    reader.close()


def test_stored_objects_are_in_page_unified_order() -> None:
    plan = plan_of()
    caches = cpu_caches(3)
    backend = backend_of(plan)
    mover = mover_of(caches, plan, backend)
    (h,) = page_hashes(list(range(PAGE)), PAGE)
    future = mover.save(PageJob("r", [h], [4]))
    assert future is not None and future.result() == PAGE
    (obj,) = plan.objects
    out = torch.empty(obj.shape)
    assert backend.get(plan.keys(h), [out]) == 1
    # [layers, K/V, tokens, heads, dim] from the CPU kernel's own per-head blocks
    per_head = [c.view(BLOCKS, HEADS, 2, PAGE * DIM)[4] for c in caches]
    key = [h[:, 0].view(HEADS, DIM, PAGE).permute(2, 0, 1) for h in per_head]
    value = [h[:, 1].view(HEADS, PAGE, DIM).transpose(0, 1) for h in per_head]
    expected = torch.stack([torch.stack(kv) for kv in zip(key, value, strict=True)])
    assert torch.equal(out, expected)
    mover.close()


def test_a_tp2_rank_stores_the_head_groups_a_tp1_rank_reads() -> None:
    objects = MemoryObjects()
    hashes = page_hashes(list(range(2 * PAGE)), PAGE)
    ranks = []
    for rank in range(2):
        plan = plan_of(rank, 2, share_tp=(1, 2))
        caches = cpu_caches(10 + rank, heads=HEADS // 2)
        mover = mover_of(caches, plan, backend_of(plan, objects))
        future = mover.save(PageJob("r", hashes, [3, 5]))
        assert future is not None and future.result() == 2 * PAGE
        ranks.append(mover)
    plan = plan_of(0, 1, share_tp=(1, 2))
    whole = mover_of(cpu_caches(0), plan, backend_of(plan, objects))
    assert whole.load(PageJob("r", hashes, [0, 1])) == []
    for layer in range(LAYERS):
        halves = [stack(m, layer, [3, 5]) for m in ranks]
        assert torch.equal(stack(whole, layer, [0, 1]), torch.cat(halves, dim=3))  # H 0-1, 2-3


def test_a_corrupt_page_fails_its_blocks_and_the_rest_for_recompute() -> None:
    plan, objects = plan_of(), MemoryObjects()
    writer = mover_of(cpu_caches(4), plan, backend_of(plan, objects))
    hashes = page_hashes(list(range(3 * PAGE)), PAGE)
    future = writer.save(PageJob("r", hashes, [0, 1, 2]))
    assert future is not None and future.result() == 3 * PAGE
    faulty = FaultyObjects(objects, (Fault(op="read", kind="corrupt", skip=1, limit=1),), 0)
    readers = cpu_caches(5)
    reader = mover_of(readers, plan, backend_of(plan, faulty))
    assert reader.load(PageJob("r", hashes, [6, 7, 8])) == [7, 8]
    assert torch.equal(stack(reader, 0, [6]), stack(writer, 0, [0]))  # the page before
    assert reader.counts.load_failed_tokens == 2 * PAGE


def test_a_dead_store_is_a_miss_and_a_failed_save_is_counted() -> None:
    plan = plan_of()
    dead = FaultyObjects(
        MemoryObjects(), (Fault(op="read", kind="fail"), Fault(op="write", kind="fail")), 0
    )
    mover = mover_of(cpu_caches(6), plan, backend_of(plan, dead))
    hashes = page_hashes(list(range(2 * PAGE)), PAGE)
    assert mover.load(PageJob("r", hashes, [1, 2])) == [1, 2]
    future = mover.save(PageJob("r", hashes, [1, 2]))
    assert future is not None and future.result() == 0
    assert mover.counts.save_dropped_tokens == 2 * PAGE


def test_saves_beyond_the_queue_are_dropped_not_waited_for() -> None:
    plan, slow = plan_of(), Gated("write")
    mover = mover_of(cpu_caches(7), plan, backend_of(plan, slow), max_pending_saves=1)
    first, second = (page_hashes([i] * PAGE, PAGE) for i in range(2))
    pending = mover.save(PageJob("a", first, [0]))
    assert pending is not None
    assert mover.save(PageJob("b", second, [1])) is None  # the queue is full: dropped
    assert mover.counts.save_dropped_tokens == PAGE
    slow.release.set()
    assert pending.result() == PAGE
    mover.close()


# ---------------------------------------------------------------- the planner


def _planner(stored_pages: int, tokens: list[int], salt: str = "") -> tuple[PagePlanner, Any]:
    plan, objects = plan_of(), MemoryObjects()
    backend = backend_of(plan, objects)
    mover = mover_of(cpu_caches(8), plan, backend)
    hashes = page_hashes(tokens, PAGE, salt=salt or None)[:stored_pages]
    if hashes:
        future = mover.save(PageJob("w", hashes, list(range(len(hashes)))))
        assert future is not None and future.result() == len(hashes) * PAGE
    suffixes = [o.suffix for o in plan.objects]
    return PagePlanner(backend_of(plan, objects), suffixes, PAGE, salt), mover


def test_lookup_counts_leading_pages_past_vllms_own_and_leaves_a_token() -> None:
    tokens = list(range(4 * PAGE))  # 4 whole pages: the last must be computed
    planner, _ = _planner(4, tokens)
    assert planner.lookup("r", tokens, 0, "") == 3 * PAGE
    assert planner.lookup("r", tokens, PAGE, "") == 2 * PAGE  # vLLM held page 0
    assert planner.lookup("r", tokens, 3 * PAGE, "") == 0
    short, _ = _planner(1, tokens)
    assert short.lookup("s", tokens, 0, "") == PAGE  # a gap after page 0


def test_a_load_is_planned_once_with_the_blocks_of_its_pages() -> None:
    tokens = list(range(3 * PAGE + 5))
    planner, _ = _planner(3, tokens)
    assert planner.lookup("r", tokens, PAGE, "") == 2 * PAGE
    planner.allocated("r", [9, 4, 6, 2], 2 * PAGE)
    plan = planner.step([("r", len(tokens), tokens, [9, 4, 6, 2])])
    hashes = page_hashes(tokens, PAGE)
    assert plan.loads == [PageJob("r", hashes[1:3], [4, 6])]
    assert plan.saves == []  # every whole page is stored already
    assert planner.step([("r", len(tokens), tokens, [9, 4, 6, 2])]).loads == []
    assert planner.counts.hit_tokens == 2 * PAGE


def test_saves_follow_the_pages_each_step_fills_generated_tokens_included() -> None:
    prompt = list(range(100, 100 + 2 * PAGE + 3))
    planner, _ = _planner(0, prompt, salt="tenant")
    assert planner.lookup("r", prompt, 0, "") == 0
    blocks = [5, 6, 7, 8]
    first = planner.step([("r", PAGE + 2, prompt, blocks)])  # a chunked prefill
    assert [len(j.hashes) for j in first.saves] == [1]
    second = planner.step([("r", len(prompt), prompt, blocks)])
    tokens = prompt + list(range(PAGE))  # the answer fills page 2
    third = planner.step([("r", 3 * PAGE, tokens, blocks)])
    saved = [h for p in (first, second, third) for j in p.saves for h in j.hashes]
    assert saved == page_hashes(tokens, PAGE, salt="tenant")
    assert third.saves[0].block_ids == [7]
    planner.finished("r")
    assert planner.tracked == 0
    assert planner.step([("r", 4 * PAGE, tokens, blocks)]).saves == []


def test_a_requests_own_salt_names_other_pages() -> None:
    tokens = list(range(3 * PAGE))
    planner, _ = _planner(2, tokens)
    assert planner.lookup("plain", tokens, 0, "") == 2 * PAGE
    assert planner.lookup("salted", tokens, 0, "someone") == 0


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ([1], "kv_connector_extra_config"),
        ({"stores": "ray"}, "kv_connector_extra_config"),
        ({"store": "s3"}, "kv_connector_extra_config"),
        ({"share_tp": "2"}, "kv_connector_extra_config"),
        ({"store": "file"}, "file.root"),
        ({"layout": "paged"}, "layout"),
        ({"max_pending_saves": 0}, "max_pending_saves"),
        # a misspelled key at any depth is refused with its path, never defaulted
        ({"store": "ray", "ray": {"nmae": "shared"}}, r"unknown field `nmae` - at `\$\.ray`"),
        ({"store": "file", "file": {"root": "/x", "scan": 1}}, r"`scan` - at `\$\.file`"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_option(extra: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_options(extra)


def test_a_bad_nested_key_is_answered_with_the_keys_of_its_level() -> None:
    with pytest.raises(ConfigError, match=r"use the keys \[.*'num_shards'.*\]") as bad:
        parse_options({"ray": {"nmae": "shared"}})
    assert "'store'" not in str(bad.value).rpartition("use the keys")[2]
    with pytest.raises(ConfigError, match=r"use the keys \[.*'layout'.*'store'"):
        parse_options({"stores": "ray"})


def test_options_make_the_storage_namespace() -> None:
    options = parse_options({"store": "file", "file": {"root": "/x"}, "model_revision": "r1"})
    storage = storage_config(options, "served/model")
    assert (storage.backend, storage.model_id, storage.model_revision) == (
        "file",
        "served/model",
        "r1",
    )
    assert parse_options(None).store == "ray"


def _vllm_config(**changes: Any) -> Any:
    model = SimpleNamespace(
        model="m",
        use_mla=False,
        dtype=torch.float32,
        get_num_layers=lambda parallel: LAYERS,
        get_total_num_kv_heads=lambda: HEADS,
        get_head_size=lambda: DIM,
    )
    cache = SimpleNamespace(cache_dtype="auto", block_size=PAGE)
    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1)
    config = SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)
    for path, value in changes.items():
        part, name = path.split(".")
        setattr(getattr(config, part), name, value)
    return config


def test_model_facts_come_from_vllms_config() -> None:
    assert model_kv(_vllm_config()) == (MODEL, PAGE)
    for change, named in [
        ({"model_config.use_mla": True}, "model"),
        ({"cache_config.cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"parallel_config.pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"model_config.dtype": torch.int8}, "dtype"),
    ]:
        with pytest.raises(ConfigError, match=named):
            model_kv(_vllm_config(**change))


def test_layer_names_give_their_decoder_layer() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ConfigError, match="layer"):
        layer_index("lm_head")


def test_a_save_reuses_the_staging_an_earlier_one_gave_back() -> None:
    plan, objects = plan_of(), MemoryObjects()
    writer = mover_of(cpu_caches(9), plan, backend_of(plan, objects))
    jobs = [
        PageJob(f"r{i}", page_hashes([i] * 2 * PAGE, PAGE), [2 * i, 2 * i + 1]) for i in range(3)
    ]
    for job in jobs:  # one after the other: each save's buffer is back before the next
        future = writer.save(job)
        assert future is not None and future.result() == 2 * PAGE
    assert len(writer._spare) == 1
    reader = mover_of(cpu_caches(10), plan, backend_of(plan, objects))
    for i, job in enumerate(jobs):
        assert reader.load(PageJob(job.req_id, job.hashes, [8, 9])) == []
        for layer in range(LAYERS):
            assert torch.equal(
                stack(reader, layer, [8, 9]), stack(writer, layer, [2 * i, 2 * i + 1])
            )


def test_an_asynchronous_load_is_planned_before_its_request_is_scheduled() -> None:
    tokens = list(range(2 * PAGE + 1))
    planner, _ = _planner(2, tokens)
    planner.load_async = True
    assert planner.lookup("r", tokens, 0, "") == 2 * PAGE
    planner.allocated("r", [3, 4, 5], 2 * PAGE)
    plan = planner.step([])  # vLLM waits for the load: the request is not scheduled
    assert plan.async_loads and plan.loads == [PageJob("r", page_hashes(tokens, PAGE), [3, 4])]
    planner.allocated("gone", [1], PAGE)  # an unknown request: nothing planned
    planner.finished("r")
    assert planner.step([]).loads == []


def test_a_waiting_request_is_looked_up_once_until_its_load_is_planned() -> None:
    tokens = list(range(2 * PAGE + 1))
    planner, _ = _planner(2, tokens)
    asked: list[int] = []
    exists = planner._backend.exists
    planner._backend.exists = lambda keys: asked.append(len(keys)) or exists(keys)  # type: ignore[method-assign]
    for _ in range(3):  # vLLM asks each step the request waits for room
        assert planner.lookup("r", tokens, 0, "") == 2 * PAGE
    assert len(asked) == 1
    planner.allocated("r", [3, 4], 2 * PAGE)
    planner.lookup("r", tokens, 0, "")  # after a failed load vLLM asks again: a new answer
    assert len(asked) == 2
