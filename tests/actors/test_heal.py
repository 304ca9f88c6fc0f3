"""A deployment's ranks healing themselves when the reader of their cache journal finds
rank 0 dead, on fakes (no Ray cluster): the re-forming of the generation it saw starts at
once in the background (``_reform`` does it once however many ask), a failed one is
logged, never raised into the reader (the deployment stays as the re-forming left it: the
next call tries again), and a shut-down deployment does not heal."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import ray

from actors import forming
from actors.forming import RankSet
from actors.lifecycle import ReformFailed
from hicache_ray.engine.spec import DeploymentConfig
from tests.actors.helpers import MODEL, cache_config


class _DeadRank:
    class cache_events:  # the actor method's name
        @staticmethod
        def remote(*args: Any) -> str:
            return "ref"


def _ranks(monkeypatch: pytest.MonkeyPatch, reform: Any) -> RankSet:
    def get(ref: Any, timeout: float | None = None) -> Any:
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(forming.ray, "get", get)
    ranks = RankSet(DeploymentConfig(name="heal", model=MODEL, cache=cache_config(None)), None)  # type: ignore[arg-type]
    ranks.ranks = [_DeadRank()]
    monkeypatch.setattr(ranks, "_reform", reform)
    return ranks


def test_a_dead_rank_0_seen_by_the_journals_reader_re_forms_the_generation_it_saw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, str]] = []
    ranks = _ranks(
        monkeypatch, lambda generation, cause: calls.append((generation, type(cause).__name__))
    )
    ranks.generation = 3
    for _ in range(2):
        with pytest.raises(ray.exceptions.ActorDiedError):
            ranks.cache_events("e", 0)
    ranks._executor.shutdown(wait=True)
    # each reader's sighting asks for the re-forming of the generation it saw; _reform
    # does it once (it returns at once when the generation moved on)
    assert calls == [(3, "ActorDiedError")] * 2


def test_a_failed_healing_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def reform(generation: int, cause: BaseException) -> None:
        raise ReformFailed("rank 1 died while joining")

    ranks = _ranks(monkeypatch, reform)
    with caplog.at_level(logging.WARNING, logger="actors.deployment"):
        with pytest.raises(ray.exceptions.ActorDiedError):
            ranks.cache_events("e", 0)
        ranks._executor.shutdown(wait=True)
    assert "healing failed: rank 1 died while joining" in caplog.text


def test_a_shut_down_deployment_does_not_heal(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    ranks = _ranks(monkeypatch, lambda generation, cause: calls.append(generation))
    ranks._closed.set()
    with pytest.raises(ray.exceptions.ActorDiedError):
        ranks.cache_events("e", 0)
    ranks._executor.shutdown(wait=True)
    assert calls == []
