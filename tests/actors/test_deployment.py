"""Deployments on a local Ray: requests sync/async, stats and health, re-forming on failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from actors.faults import RankFault
from hicache_ray.base.errors import ConfigError
from hicache_ray.engine.request import GenerateRequest
from tests.actors.helpers import MODEL, cache_config, prompt, recompute, store_name
from tests.helpers import ensure_local_ray

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    name = store_name()
    yield name
    if ray.is_initialized():
        actors.drop_store(name)


@pytest.fixture(scope="module")
def tp2(store: str) -> Iterator[Any]:
    ensure_local_ray()
    config = actors.DeploymentConfig(
        name="tp2",
        model=MODEL,
        tp_size=2,
        cache=cache_config(store),
        host_budget_bytes=16 << 20,
        consensus_timeout_s=5.0,
    )
    deployment = actors.Deployment.launch(config)
    yield deployment
    deployment.shutdown()


def _rank(deployment: Any, rank: int) -> Any:
    name = f"hicache-{deployment.config.name}-g{deployment.generation}-rank{rank}"
    return ray.get_actor(name, namespace="hicache")


def test_requests_are_exact_and_reuse_the_cache(ray_local: None, tp2: Any) -> None:
    first, second = prompt(1, 30), prompt(2, 22)
    results = tp2.generate([GenerateRequest("a", first, 6), GenerateRequest("b", second, 6)])
    assert [r.rid for r in results] == ["a", "b"]
    assert results[0].output_tokens == recompute(first, 6)
    assert results[1].output_tokens == recompute(second, 6)
    follow = first + results[0].output_tokens + prompt(3, 5)
    again = tp2.generate([GenerateRequest("a2", follow, 6)])[0]
    assert again.device_hit_tokens >= 32 and again.recomputed_tokens < len(follow) - 30
    assert again.output_tokens == recompute(follow, 6)


def test_bad_requests_get_errors_alone(ray_local: None, tp2: Any) -> None:
    results = tp2.generate(
        [GenerateRequest("bad", [MODEL.vocab_size + 1], 2), GenerateRequest("ok", prompt(4, 9), 2)]
    )
    assert results[0].error and "vocabulary" not in (results[1].error or "")
    assert results[1].error is None and len(results[1].output_tokens) == 2


def test_async_and_future_submission(ray_local: None, tp2: Any) -> None:
    tokens = prompt(5, 17)

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(
                tp2.generate_async(GenerateRequest("x1", tokens, 4)),
                tp2.generate_async(GenerateRequest("x2", prompt(6, 11), 4)),
            )
        )

    r1, r2 = asyncio.run(both())
    assert r1.output_tokens == recompute(tokens, 4) and r2.error is None
    future = tp2.submit(GenerateRequest("x3", tokens, 4))
    assert future.result(timeout=60).output_tokens == r1.output_tokens


def test_the_ttft_split_adds_up_to_the_callers_ttft_under_load(ray_local: None, tp2: Any) -> None:
    """16 streams and 16 calls at once: every result's parts add up to the TTFT its caller
    saw (``caller_ttft_s``), which lies within what the caller timed around the call."""

    async def streamed(i: int) -> tuple[float, Any]:
        started, first, result = time.perf_counter(), 0.0, None
        async for chunk in tp2.stream(GenerateRequest(f"ts{i}", prompt(40 + i, 20), 3)):
            first = first or (time.perf_counter() if chunk.tokens else 0.0)
            result = chunk.result or result
        return first - started, result

    async def called(i: int) -> tuple[float, Any]:
        started = time.perf_counter()
        result = await tp2.generate_async(GenerateRequest(f"tc{i}", prompt(60 + i, 20), 1))
        return time.perf_counter() - started, result

    async def load() -> list[tuple[float, Any]]:
        return list(await asyncio.gather(*(f(i) for i in range(16) for f in (streamed, called))))

    for seen, result in asyncio.run(load()):
        split = result.ttft_split
        assert result.error is None and split.call_s > 0, result
        assert abs(split.call_s + split.rank_s - result.caller_ttft_s) < 1e-6, split
        assert result.ttft_s <= result.caller_ttft_s <= seen + 1e-6, (seen, result)


def test_stats_health_and_idle(ray_local: None, tp2: Any) -> None:
    tp2.generate([GenerateRequest("s1", prompt(7, 24), 3)])
    tp2.wait_idle(timeout_s=30)
    stats = tp2.stats()
    assert stats.tp_size == 2 and len(stats.ranks) == 2
    for rank in stats.ranks:
        ctl = rank.controller
        assert ctl is not None and ctl.steps > 0 and ctl.pending_backups == 0
        assert rank.storage.backend == "ray" and rank.storage.put_pages > 0
    health = tp2.health()
    assert all(h.stepping and h.error is None for h in health)
    for rank in range(2):
        ray.get(_rank(tp2, rank).check_integrity.remote())


def _hints(deployment: Any, rank: int) -> dict[str, int]:
    ctl = deployment.stats().ranks[rank].controller
    assert ctl is not None
    return dict(ctl.lookahead_hints)


def test_rank_0_tells_its_peer_of_an_arrival_over_the_ranks_store(
    ray_local: None, tp2: Any
) -> None:
    tp2.wait_idle(timeout_s=30)  # no prefetch pending on any rank: rank 0 looks ahead
    before = sum(_hints(tp2, 1).values())
    [result] = tp2.generate([GenerateRequest("hinted", prompt(913, 48), 1)])
    assert result.error is None, result
    deadline = time.monotonic() + 60  # read in about 0.1 ms; this bounds a broken run
    while sum(_hints(tp2, 1).values()) == before:
        assert time.monotonic() < deadline, "rank 1 read no look-ahead hint"
    assert _hints(tp2, 1)["malformed"] == 0
    assert sum(_hints(tp2, 0).values()) == 0  # rank 0 tells, and reads none


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_replaced_and_requests_retried(
    ray_local: None, tp2: Any, victim: int
) -> None:
    tokens = prompt(8 + victim, 40)
    tp2.generate([GenerateRequest(f"warm{victim}", tokens, 2)])
    tp2.wait_idle(timeout_s=30)  # its pages are in L3 now
    before = tp2.generation
    future = tp2.submit(GenerateRequest(f"victim{victim}", tokens + prompt(9, 8), 24))
    ray.kill(_rank(tp2, victim), no_restart=True)
    result = future.result(timeout=120)
    assert tp2.generation == before + 1 and tp2.reforms[-1].seconds > 0
    assert tp2.reforms[-1].cause.startswith(("rank 0 stopped", "a rank actor died"))
    assert f"rank {victim} does not answer" in tp2.reforms[-1].cause
    assert result.output_tokens == recompute(tokens + prompt(9, 8), 24)
    # L1/L2 died with the ranks; the prefix came back from L3 (or, if the kill landed
    # before the backups finished, was recomputed: never wrong either way).
    assert result.device_hit_tokens == 0
    assert result.storage_hit_tokens >= 32
    assert all(h.stepping for h in tp2.health())


def test_a_stalled_rank_times_out_and_the_deployment_recovers(ray_local: None, tp2: Any) -> None:
    before = tp2.generation
    ray.get(_rank(tp2, 1).inject.remote(RankFault.pause(60)))
    tokens = prompt(10, 13)
    result = tp2.generate([GenerateRequest("stalled", tokens, 3)])[0]
    assert tp2.generation == before + 1
    cause = tp2.reforms[-1].cause
    assert "ConsensusError" in cause and "timeout 5.0s" in cause and "timed out" in cause
    assert "suspects: rank 1 stalled outside the step" in cause  # the stalled rank is named
    assert result.output_tokens == recompute(tokens, 3)


def test_a_deployment_that_cannot_form_says_why(ray_local: None) -> None:
    from placement.groups import PlacementError

    with pytest.raises(ConfigError, match="does not divide"):
        actors.DeploymentConfig(model=MODEL, tp_size=3)
    too_big = actors.DeploymentConfig(
        name="nope", model=MODEL, tp_size=2, cpus_per_rank=6, placement_timeout_s=1
    )
    with pytest.raises(PlacementError, match="CPU: need 12"):
        actors.Deployment.launch(too_big)


def test_a_second_deployment_of_a_running_name_or_another_shard_count_is_refused(
    ray_local: None, tp2: Any, store: str
) -> None:
    """Both refusals are ``ConfigError``s naming the field, before anything is created."""
    from ray.util import placement_group_table

    def groups() -> int:
        return sum(g["state"] != "REMOVED" for g in placement_group_table().values())

    before = groups()
    with pytest.raises(ConfigError, match=r"name='tp2'.*is running"):
        actors.Deployment.launch(actors.DeploymentConfig(name="tp2", model=MODEL))
    cache = cache_config(store)
    ray_options = msgspec.structs.replace(cache.storage.ray, num_shards=3)
    cache = msgspec.structs.replace(
        cache, storage=msgspec.structs.replace(cache.storage, ray=ray_options)
    )
    with pytest.raises(ConfigError, match=r"ray.num_shards=3.*created with 2 shards"):
        actors.Deployment.launch(actors.DeploymentConfig(name="other", model=MODEL, cache=cache))
    assert groups() == before


def test_stats_command_and_prometheus_metrics(
    ray_local: None, tp2: Any, store: str, tmp_path: Any
) -> None:
    import json
    import urllib.request

    from actors.metrics import flatten_stats
    from apps.cli import main
    from hicache_ray.base.metrics import METRICS
    from hicache_ray.base.stats import CacheStats, ControllerStats
    from tests.helpers import wait_until

    tp2.generate([GenerateRequest("m1", prompt(11, 20), 2)])
    tp2.wait_idle(timeout_s=30)
    out = tmp_path / "stats.json"
    assert main(["stats", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    mine = found["deployments"]["tp2"]
    assert mine["generation"] == tp2.generation and len(mine["ranks"]) == 2
    for rank in mine["ranks"]:
        assert rank["health"]["stepping"] and rank["stats"]["controller"]["steps"] > 0
    assert found["stores"][store]["shards"] == 2 and found["stores"][store]["keys"] > 0

    # every statistic is on this node's Prometheus endpoint, tagged with the deployment
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    sources = set(flatten_stats(ControllerStats(cache=CacheStats())))
    names = {f"ray_{m.name}" for m in METRICS if m.source in sources}

    def exported() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            lines = page.read().decode().splitlines()
        seen = {ln.split("{")[0] for ln in lines if 'deployment="tp2"' in ln}
        return names <= seen

    wait_until(exported, timeout_s=90, what="the rank gauges on the metrics endpoint")
