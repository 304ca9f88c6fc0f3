"""A deployment's cache events: a subscriber's index follows what its tree holds, a
re-formed deployment starts a new journal that the subscriber resets from, and a rank 0
found dead by the journal's reader re-forms the deployment without waiting for a call."""

from __future__ import annotations

from functools import partial
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


def _gone(actor: Any) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def _dead(deployment: Any, index: CacheIndex) -> bool:
    """Whether asking for the journal's news finds rank 0 dead."""
    try:
        deployment.cache_events(*index.position("d"))
    except ray.exceptions.ActorDiedError:
        return True
    return False


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
        wait_until(partial(_gone, rank1), 60, "rank 1's death")  # ray.kill does not wait
        deployment.generate([GenerateRequest("b", prompt(13, PAGE), 2)])  # re-forms first
        assert deployment.cache_events(*first) is None  # the old journal is gone
        _catch_up(deployment, index)
        assert index.position("d")[0] != first[0]
        assert index.hits("d", whole) == Hits()  # the new generation's tree is empty of it
        # rank 0 dies with no call in flight: its journal's reader finds out, and the
        # deployment re-forms on its own, before any call needs it
        generation, reforms = deployment.generation, len(deployment.reforms)
        rank0 = ray.get_actor(f"hicache-events-g{generation}-rank0", namespace="hicache")
        ray.kill(rank0, no_restart=True)
        wait_until(partial(_dead, deployment, index), 60, "rank 0's death seen by its reader")

        def healed() -> bool:
            return deployment.state.value == "serving" and len(deployment.reforms) > reforms

        wait_until(healed, 120, "the deployment re-formed without a call")
        assert deployment.generation == generation + 1 and deployment.reforms[-1].ok
        assert deployment.cache_events(*index.position("d")) is None  # a new journal
        (answer,) = deployment.generate([GenerateRequest("c", prompt(14, PAGE), 2)])
        assert answer.error is None
    finally:
        deployment.shutdown()
