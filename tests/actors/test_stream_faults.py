"""A rank killed while requests stream loses none and duplicates no token.

One kill lands on a TP=2 (and a PP=2) deployment while it decodes a batch: streams that
had sent several tokens, one that had sent exactly one, one not started yet, and requests
that are not streamed. Every caller gets exactly the tokens a full recompute gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_ray.engine.request import GenerateRequest, RequestResult
from tests.actors.helpers import MODEL, cache_config, prompt, recompute
from tests.helpers import ensure_local_ray

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")

MAX_NEW = 96  # long enough that every request is still decoding when the rank dies


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Any]:
    ensure_local_ray()
    tp, pp = request.param
    config = actors.DeploymentConfig(
        name=f"streams-tp{tp}-pp{pp}",
        model=MODEL,
        tp_size=tp,
        pp_size=pp,
        cache=cache_config(None, device_tokens=2048),
        host_budget_bytes=32 << 20,
        consensus_timeout_s=10.0,
    )
    deployment = actors.Deployment.launch(config)
    yield deployment
    deployment.shutdown()


class _Stream:
    """Consumes one stream; after ``pause_after`` tokens it waits for ``resume``."""

    def __init__(self, deployment: Any, request: GenerateRequest, pause_after: int) -> None:
        self.tokens: list[int] = []
        self.result: RequestResult | None = None
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(deployment, request, pause_after))

    async def _run(self, deployment: Any, request: GenerateRequest, pause_after: int) -> None:
        async for chunk in deployment.stream(request):
            self.tokens += chunk.tokens
            if chunk.result is not None:
                self.result = chunk.result
            if len(self.tokens) >= pause_after and not self.resume.is_set():
                self.paused.set()
                await self.resume.wait()


def _kill_rank(deployment: Any, rank: int) -> None:
    name = f"hicache-{deployment.config.name}-g{deployment.generation}-rank{rank}"
    ray.kill(ray.get_actor(name, namespace="hicache"), no_restart=True)


async def _kill_during_batched_decode(deployment: Any, prompts: list[list[int]]) -> list[Any]:
    def request(i: int) -> GenerateRequest:
        return GenerateRequest(f"s{deployment.generation}-{i}", prompts[i], MAX_NEW)

    several = [_Stream(deployment, request(i), pause_after=3) for i in range(8)]
    plain = [asyncio.ensure_future(deployment.generate_async(request(i))) for i in (8, 9, 10)]
    for stream in several:
        await asyncio.wait_for(stream.paused.wait(), 120)
    one = _Stream(deployment, request(11), pause_after=1)
    await asyncio.wait_for(one.paused.wait(), 120)
    before_first = _Stream(deployment, request(12), pause_after=MAX_NEW + 1)
    await asyncio.get_running_loop().run_in_executor(None, _kill_rank, deployment, 1)
    streams = [*several, one, before_first]
    assert [len(s.tokens) for s in several] >= [3] * 8 and len(one.tokens) == 1
    for stream in streams:
        stream.resume.set()
    await asyncio.gather(*(s.task for s in streams))
    results = await asyncio.gather(*plain)
    return [*((s.tokens, s.result) for s in streams), *((r.output_tokens, r) for r in results)]


def test_streams_and_plain_requests_survive_a_killed_rank(ray_local: None, deployment: Any) -> None:
    prompts = [prompt(300 + i, 8 + i) for i in range(13)]
    generation = deployment.generation
    outcomes = asyncio.run(_kill_during_batched_decode(deployment, prompts))
    assert deployment.generation > generation  # the kill re-formed the deployment
    order = [*range(8), 11, 12, 8, 9, 10]  # the streams, then the plain requests
    for i, (tokens, result) in zip(order, outcomes, strict=True):
        expected = recompute(prompts[i], MAX_NEW)
        assert result is not None and result.error is None, (i, result)
        assert tokens == expected, f"request {i}: {len(tokens)} tokens, wrong or duplicated"
        assert result.output_tokens == expected, i


def test_streams_beyond_the_pool_wait_instead_of_failing(ray_local: None) -> None:
    """8 streams of 11-16 pages each on a 64-page pool, after a warm-up that left a shared
    prefix in the tree: those that do not fit wait in the queue; none fails."""
    config = actors.DeploymentConfig(
        name="small-pool",
        model=MODEL,
        tp_size=2,
        cache=cache_config(None, device_tokens=64 * 4),
        host_budget_bytes=16 << 20,
    )
    deployment = actors.Deployment.launch(config)
    system = prompt(400, 18)
    prompts = [system + prompt(401 + i, 3 + 3 * i) for i in range(8)]
    lengths = [18 + 2 * i for i in range(8)]

    async def run() -> list[tuple[list[int], RequestResult | None]]:
        warm = await deployment.generate_async(GenerateRequest("warm", [*system, 1], 8))
        assert warm.error is None, warm
        streams = [
            _Stream(deployment, GenerateRequest(f"p{i}", prompts[i], lengths[i]), 10**6)
            for i in range(8)
        ]
        await asyncio.gather(*(s.task for s in streams))
        return [(s.tokens, s.result) for s in streams]

    try:
        outcomes = asyncio.run(run())
    finally:
        deployment.shutdown()
    for i, (tokens, result) in enumerate(outcomes):
        assert result is not None and result.error is None, (i, result)
        assert tokens == recompute(prompts[i], lengths[i]), i
