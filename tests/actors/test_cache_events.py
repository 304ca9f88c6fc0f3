"""A deployment's cache events: a subscriber's index follows what its tree holds, and a
re-formed deployment starts a new journal that the subscriber resets from."""

from __future__ import annotations

from typing import Any

import pytest

from hicache_ray.engine.request import GenerateRequest
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import CacheIndex, Hits
from tests.actors.helpers import MODEL, PAGE, cache_config, prompt
from tests.helpers import ensure_local_ray, wait_until

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")


def _catch_up(deployment: Any, index: CacheIndex) -> bool:
    """One subscriber round: the batches since the last one, or a snapshot."""
    epoch, seq = index.position("d")
    batches = deployment.cache_events(epoch, seq)
    if batches is None or not all(index.apply("d", b) for b in batches):
        index.reset("d", deployment.cache_snapshot())
    return True


def test_the_index_follows_the_deployment_and_resets_after_a_reform(ray_local: None) -> None:
    ensure_local_ray()
    config = actors.DeploymentConfig(
        name="events", model=MODEL, tp_size=2, cache=cache_config(None), max_retries=1
    )
    deployment = actors.Deployment.launch(config)
    try:
        index = CacheIndex()
        with pytest.raises(ValueError, match="seq must be >= 0"):
            deployment.cache_events("", -1)
        with pytest.raises(ValueError, match="wait_s must be in"):
            deployment.cache_events("", 0, wait_s=60.0)
        _catch_up(deployment, index)  # an empty tree: a snapshot
        first = index.position("d")
        tokens = prompt(11, 4 * PAGE + 1)
        deployment.generate([GenerateRequest("a", tokens, 2)])
        whole = page_hashes(tokens, PAGE)  # the prompt's whole pages

        def holds_prompt() -> bool:
            _catch_up(deployment, index)
            return index.hits("d", whole).device == len(whole)

        wait_until(holds_prompt, 60, "the prompt's pages in the index")
        assert index.position("d")[0] == first[0] and index.position("d")[1] > first[1]
        other = page_hashes(prompt(12, 4 * PAGE), PAGE)
        assert index.hits("d", other) == Hits()
        rank1 = ray.get_actor(f"hicache-events-g{deployment.generation}-rank1", namespace="hicache")
        ray.kill(rank1, no_restart=True)
        deployment.generate([GenerateRequest("b", prompt(13, PAGE), 2)])  # re-forms first
        assert deployment.cache_events(*first) is None  # the old journal is gone
        _catch_up(deployment, index)
        assert index.position("d")[0] != first[0]
        assert index.hits("d", whole) == Hits()  # the new generation's tree is empty of it
    finally:
        deployment.shutdown()
