"""In-step loads placed layer by layer (``load_async: false``): a layer is waited for alone,
every page is verified before any layer is placed, and a failure is a recompute."""

from __future__ import annotations

import threading
from typing import Any

import torch

from hicache_ray.base.storage_config import Fault
from hicache_ray.integrations.vllm.blocks import LayerByLayer
from hicache_ray.integrations.vllm.pages import PageJob
from hicache_ray.keys import page_hashes
from hicache_ray.storage import FaultyObjects, MemoryObjects
from tests.core.vllm_kit import (
    LAYERS,
    PAGE,
    Gated,
    backend_of,
    cpu_caches,
    mover_of,
    plan_of,
    stack,
)


def _saved(objects: Any, seed: int, pages: int) -> tuple[Any, list[str]]:
    plan = plan_of()
    writer = mover_of(cpu_caches(seed), plan, backend_of(plan, objects))
    hashes = page_hashes(list(range(seed, seed + pages * PAGE)), PAGE)
    future = writer.save(PageJob("w", hashes, list(range(pages))))
    assert future is not None and future.result() == pages * PAGE
    return writer, hashes


def test_each_layer_is_placed_before_its_wait_returns() -> None:
    objects = Gated("read")
    objects.release.set()
    writer, first = _saved(objects, 1, 2)
    _, second = _saved(objects, 2, 1)
    objects.release.clear()
    plan = plan_of()
    reader = mover_of(cpu_caches(3), plan, backend_of(plan, objects))
    jobs = [PageJob("a", first, [5, 6]), PageJob("b", second, [9])]
    layered = LayerByLayer(reader, jobs)
    thread = threading.Thread(target=layered.run)
    thread.start()
    assert not any(ready.is_set() for ready in layered._ready)  # nothing before the read
    objects.release.set()
    for layer in range(LAYERS):
        layered.wait(layer)
        assert torch.equal(stack(reader, layer, [5, 6]), stack(writer, layer, [0, 1]))
    assert layered.wait_all() == []
    thread.join()
    assert reader.counts.loaded_tokens == 3 * PAGE


def test_a_corrupt_page_fails_its_blocks_and_the_rest_of_its_job_only() -> None:
    objects = MemoryObjects()
    writer, first = _saved(objects, 4, 3)
    _, second = _saved(objects, 5, 1)
    plan = plan_of()
    faulty = FaultyObjects(objects, (Fault(op="read", kind="corrupt", skip=1, limit=1),), 0)
    reader = mover_of(cpu_caches(6), plan, backend_of(plan, faulty))
    layered = LayerByLayer(reader, [PageJob("a", first, [0, 1, 2]), PageJob("b", second, [7])])
    layered.run()
    assert layered.wait_all() == [1, 2]
    for layer in range(LAYERS):  # the page before the corrupt one, in every layer
        assert torch.equal(stack(reader, layer, [0]), stack(writer, layer, [0]))
    assert reader.counts.load_failed_tokens == 2 * PAGE


def test_a_load_that_raises_fails_every_block_and_frees_every_wait() -> None:
    objects = MemoryObjects()
    _, hashes = _saved(objects, 7, 2)
    plan = plan_of()
    reader = mover_of(cpu_caches(8), plan, backend_of(plan, objects))

    def broken(*args: Any, **kw: Any) -> None:
        raise RuntimeError("injected: placing failed")

    reader.place = broken  # type: ignore[method-assign]
    layered = LayerByLayer(reader, [PageJob("a", hashes, [3, 4])])
    layered.run()
    for layer in range(LAYERS):
        layered.wait(layer)
    assert layered.wait_all() == [3, 4]
