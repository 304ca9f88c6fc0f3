"""Heterogeneous deployments sharing one L3 namespace: TP=2 -> TP=4 and PP=2 -> PP=1.

A conversation prefilled on one deployment continues on another of a different shape: the
second gets L3 hits for the shared prefix (unified keys; ``share_tp`` (1, 2, 4) and
``share_pp`` (1, 2) give one-layer, one-head objects) and its output equals its own shape's
full recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from hicache_ray.engine.request import GenerateRequest
from tests.actors.helpers import MODEL, PAGE, cache_config, prompt, recompute, store_name

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")


@pytest.fixture
def launch(ray_local: None) -> Iterator[Any]:
    """Launches deployments and shuts every one down at the end of the test."""
    with ExitStack() as stack:

        def make(
            name: str, store: str | None, *, tp: int = 1, pp: int = 1, cache: Any = None
        ) -> Any:
            config = actors.DeploymentConfig(
                name=name,
                model=MODEL,
                tp_size=tp,
                pp_size=pp,
                cache=cache or cache_config(store),
                host_budget_bytes=16 << 20,
            )
            deployment = actors.Deployment.launch(config)
            stack.callback(deployment.shutdown)
            return deployment

        yield make


@pytest.fixture
def store(ray_local: None) -> Iterator[str]:
    name = store_name()
    yield name
    actors.drop_store(name)


def _continue(first: Any, second: Any, seed: int) -> tuple[list[int], Any]:
    """A turn on ``first``, then the next turn (its prompt extends the first turn's
    prompt and answer) on ``second``; returns that prompt and ``second``'s result."""
    tokens = prompt(seed, 48)
    turn1 = first.generate([GenerateRequest("turn1", tokens, 8)])[0]
    assert turn1.output_tokens == recompute(tokens, 8)
    first.wait_idle(timeout_s=60)  # its pages are in L3
    follow = tokens + turn1.output_tokens + prompt(seed + 1, 6)
    turn2 = second.generate([GenerateRequest("turn2", follow, 8)])[0]
    # The first turn stored its prompt and 7 generated tokens: 13 full pages.
    stored_pages = (48 + 7) // PAGE
    assert turn2.storage_hit_tokens == stored_pages * PAGE, turn2
    assert turn2.device_hit_tokens == 0
    return follow, turn2


def test_tp2_conversation_continues_on_tp4(launch: Any, store: str) -> None:
    tp2 = launch("h-tp2", store, tp=2)
    tp4 = launch("h-tp4", store, tp=4)
    follow, turn2 = _continue(tp2, tp4, seed=20)
    tp2.shutdown()  # room for TP=4's own recompute
    reference = launch("h-tp4-ref", None, tp=4)
    own = reference.generate([GenerateRequest("turn2", follow, 8)])[0]
    assert own.recomputed_tokens == len(follow)
    assert turn2.output_tokens == own.output_tokens == recompute(follow, 8)


def test_tp4_conversation_continues_on_tp1(launch: Any, store: str) -> None:
    tp4 = launch("h4-tp4", store, tp=4)
    tp1 = launch("h4-tp1", store)
    follow, turn2 = _continue(tp4, tp1, seed=25)
    assert turn2.output_tokens == recompute(follow, 8)  # TP=1's own full recompute


def test_pp2_conversation_continues_on_pp1(launch: Any, store: str) -> None:
    pp2 = launch("h-pp2", store, pp=2)
    pp1 = launch("h-pp1", store)
    follow, turn2 = _continue(pp2, pp1, seed=30)
    assert turn2.output_tokens == recompute(follow, 8)  # PP=1's own full recompute
    # and back: a PP=2 turn over the PP=1 turn's pages
    again = follow + turn2.output_tokens + prompt(31, 5)
    pp1.wait_idle(timeout_s=60)
    turn3 = pp2.generate([GenerateRequest("turn3", again, 4)])[0]
    assert turn3.storage_hit_tokens + turn3.device_hit_tokens + turn3.host_hit_tokens >= 64
    assert turn3.output_tokens == recompute(again, 4)


def test_another_model_revision_on_the_same_store_shares_nothing(launch: Any, store: str) -> None:
    import msgspec

    base = cache_config(store)
    v2 = msgspec.structs.replace(
        base, storage=msgspec.structs.replace(base.storage, model_revision="v2")
    )
    old, new = launch("rev-old", store), launch("rev-new", None, cache=v2)
    tokens = prompt(50, 48)
    old.generate([GenerateRequest("r1", tokens, 4)])
    old.wait_idle(timeout_s=60)
    follow = [*tokens, 1, 2, 3, 4, 5]
    result = new.generate([GenerateRequest("r1", follow, 4)])[0]
    assert result.storage_hit_tokens == 0 and result.recomputed_tokens == 53  # disjoint keys
    assert result.output_tokens == recompute(follow, 4)
