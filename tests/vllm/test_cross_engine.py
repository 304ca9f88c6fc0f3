"""vLLM and hicache-ray deployments share pages: what one stores, the other loads.

vLLM (TP=1) stores a prompt's pages; hicache-ray Deployments of the same checkpoint at TP=1
and TP=2 get them as L3 hits and answer as a run without any cache does. A Deployment
stores another prompt's pages; a fresh vLLM engine loads them and answers as vLLM does
with nothing shared (the same prompt under another salt). A dropped Ray store is a miss.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from actors import Deployment, DeploymentConfig, drop_store
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import FileStorageOptions, StorageConfig
from hicache_ray.engine.model.checkpoint import load_config
from hicache_ray.engine.reference import recompute
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.keys import page_hashes
from tests.vllm.helpers import (
    MODEL_ID,
    PAGE,
    corrupt_page,
    engine,
    file_store,
    generate,
    prompt_ids,
    scheduler,
    worker,
)

_names = itertools.count()


def _deployment(checkpoint: Path, root: Path, tp: int) -> Deployment:
    storage = StorageConfig(
        backend="file",
        model_id=MODEL_ID,
        share_tp=(1, 2),
        file=FileStorageOptions(root=str(root)),
    )
    cache = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=16 * PAGE),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=storage,
    )
    config = DeploymentConfig(
        name=f"vllm-share-{next(_names)}",
        model=str(checkpoint),
        cache=cache,
        tp_size=tp,
        host_budget_bytes=64 << 20,
    )
    return Deployment.launch(config)


def _stored(root: Path, tokens: list[int]) -> int:
    """Objects of the whole pages of ``tokens`` in the file store at ``root``."""
    return sum(len(list(root.glob(f"{h[:2]}/{h}_*"))) for h in page_hashes(tokens, PAGE))


def test_vllm_and_deployments_load_each_others_pages(
    checkpoint: Path, tmp_path: Path, ray_local: None
) -> None:
    ours, theirs = prompt_ids(10, 3 * PAGE + 7), prompt_ids(11, 3 * PAGE + 7)
    with engine(checkpoint, file_store(tmp_path)) as llm:
        generate(llm, ours)
        reference, _ = generate(llm, theirs, salt="nothing-shared")
    expected = recompute(load_config(str(checkpoint)), ours, 8)
    for tp in (1, 2):
        dep = _deployment(checkpoint, tmp_path, tp)
        try:
            got = dep.generate([GenerateRequest(f"ours-{tp}", ours, 8)])[0]
            if tp == 1:
                dep.generate([GenerateRequest("theirs", theirs, 8)])
                dep.wait_idle()  # its L3 backups run behind the answer
                assert _stored(tmp_path, theirs) == 3 * 2  # pages x head groups
        finally:
            dep.shutdown()
        assert got.error is None and got.storage_hit_tokens == 3 * PAGE, got
        assert got.output_tokens == expected, f"TP={tp}"
    with engine(checkpoint, file_store(tmp_path)) as llm:
        loaded = worker().counts.loaded_tokens
        answer, cached = generate(llm, theirs)
        assert cached == 3 * PAGE and worker().counts.loaded_tokens - loaded == 3 * PAGE
        assert answer == reference


def test_a_dropped_ray_store_is_a_miss_and_vllm_keeps_serving(
    checkpoint: Path, ray_local: None
) -> None:
    name = f"vllm-store-{next(_names)}"
    extra = {"store": "ray", "ray": {"name": name, "num_shards": 1}, "model_id": MODEL_ID}
    tokens = prompt_ids(12, 2 * PAGE + 3)
    with engine(checkpoint, extra) as llm:
        first, _ = generate(llm, tokens)
        llm.reset_prefix_cache()
        assert generate(llm, tokens) == (first, 2 * PAGE)
        drop_store(name)
        llm.reset_prefix_cache()
        failed = worker().counts.load_failed_tokens
        again, cached = generate(llm, tokens)
        assert again == first  # recomputed
        # A lookup within the metadata TTL still finds the pages; their read fails.
        assert cached == 0 or worker().counts.load_failed_tokens - failed == 2 * PAGE
        other, cached = generate(llm, prompt_ids(13, 2 * PAGE + 3))
        assert cached == 0 and len(other) == 8


def test_synchronous_loads_are_placed_layer_by_layer_as_the_forward_reaches_them(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_ray.integrations.vllm.blocks import LayerByLayer

    waited: list[int] = []
    wait = LayerByLayer.wait
    monkeypatch.setattr(
        LayerByLayer, "wait", lambda self, layer: (waited.append(layer), wait(self, layer))[1]
    )
    tokens = prompt_ids(14, 3 * PAGE + 11)
    with engine(checkpoint, file_store(tmp_path, load_async=False)) as llm:
        first, _ = generate(llm, tokens)
        assert waited == []  # nothing to load
        llm.reset_prefix_cache()
        assert generate(llm, tokens) == (first, 3 * PAGE)
        assert not scheduler(llm)._planner.load_async
        layers = len(worker()._positions)
        assert waited == list(range(layers))  # vLLM's attention waited for each layer
        corrupt_page(tmp_path, page_hashes(tokens, PAGE)[2])
        failed = worker().counts.load_failed_tokens
        llm.reset_prefix_cache()
        assert generate(llm, tokens)[0] == first  # the failed page is recomputed
        assert worker().counts.load_failed_tokens - failed == PAGE
