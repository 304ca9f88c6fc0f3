"""A request that arrives while another with its prefix decodes hits that prefix in L1
(the prompt is in the tree once its prefill is done), and what it computes is exact."""

from __future__ import annotations

import pytest

from hicache_ray.base.config import CacheConfig, MemoryConfig, SchedulerConfig
from hicache_ray.engine.compose import compose_rank
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from tests.engine.test_runtime import MODEL, PAGE, assert_exact, drain, prompt, runtime


def _until(rt: RankRuntime, rid: str, done: dict[str, RequestResult]) -> RequestResult:
    while rid not in done:
        for result in rt.step().results:
            done[result.rid] = result
        rt.ctl.settle(timeout=30)
    return done[rid]


def test_a_request_hits_the_prompt_of_one_still_decoding() -> None:
    rt = runtime(None)
    base = prompt(1, 30)  # 7 whole pages of 4 tokens
    rt.submit(GenerateRequest("long", base, 12))
    done: dict[str, RequestResult] = {}
    while not rt.table.running or not rt.table.running[0].generated:  # its prefill is done
        for result in rt.step().results:
            done[result.rid] = result
    tokens = [*base, *prompt(2, 9)]
    rt.submit(GenerateRequest("sibling", tokens, 4))
    sibling = _until(rt, "sibling", done)
    assert "long" not in done  # it still decoded when the sibling was admitted
    assert sibling.device_hit_tokens == 28 and sibling.recomputed_tokens == len(tokens) - 28
    assert_exact(rt, sibling, tokens)
    assert len(_until(rt, "long", done).output_tokens) == 12
    assert rt.ctl.cache.counters.prompt_pages_cached >= 7
    drain(rt)
    rt.ctl.check_integrity()


def test_an_aborted_request_leaves_its_prompt_for_the_next() -> None:
    rt = runtime(None)
    base = prompt(3, 30)
    rt.submit(GenerateRequest("gone", base, 12))
    done: dict[str, RequestResult] = {}
    while not rt.table.running or not rt.table.running[0].generated:
        for result in rt.step().results:
            done[result.rid] = result
    rt.abort("gone")
    _until(rt, "gone", done)
    rt.ctl.check_integrity()
    tokens = [*base, *prompt(4, 5)]
    rt.submit(GenerateRequest("next", tokens, 4))
    result = _until(rt, "next", done)
    assert result.device_hit_tokens == 28
    assert_exact(rt, result, tokens)
    drain(rt)
    rt.ctl.check_integrity()


def _chunked(hold: bool) -> RankRuntime:
    """A rank that prefills in chunks of 12 tokens."""
    cache = CacheConfig(memory=MemoryConfig(page_size=PAGE, device_tokens=256))
    deployment = DeploymentConfig(
        model=MODEL,
        cache=cache,
        scheduler=SchedulerConfig(max_step_tokens=12, hold_siblings=hold),
        host_budget_bytes=1 << 30,
    )
    return compose_rank(deployment, keep_logits=True).runtime


@pytest.mark.parametrize("hold", [True, False])
def test_a_request_hits_the_chunks_of_a_prompt_still_prefilling(hold: bool) -> None:
    """Prefill in chunks of 12 tokens; a request sharing 5 pages with the first arrives
    after its first chunk (3 pages). Held (the default), it waits until the first has
    computed all 5 and hits them; not held, it hits the 3 and computes the rest beside
    it. Either way before the first request has sampled a token."""
    rt = _chunked(hold)
    base = prompt(5, 30)
    rt.submit(GenerateRequest("long", base, 4))
    done: dict[str, RequestResult] = {}
    while not rt.table.running or rt.table.running[0].computed < 12:
        for result in rt.step().results:
            done[result.rid] = result
    assert not rt.table.running[0].generated  # still prefilling
    tokens = [*base[:20], *prompt(6, 7)]
    rt.submit(GenerateRequest("early", tokens, 4))
    early = _until(rt, "early", done)
    assert early.device_hit_tokens == (20 if hold else 12)
    assert_exact(rt, early, tokens)
    _until(rt, "long", done)
    drain(rt)
    rt.ctl.check_integrity()


@pytest.mark.parametrize("hold", [True, False])
def test_requests_arriving_together_compute_their_shared_prefix_once(hold: bool) -> None:
    """Three requests sharing 7 pages arrive in one step: held, the second and third wait
    for the first's prefill and hit all 7 pages; not held, all three compute them."""
    rt = _chunked(hold)
    base = prompt(7, 28)
    prompts = {f"r{i}": [*base, *prompt(8 + i, 5)] for i in range(3)}
    for rid, tokens in prompts.items():
        rt.submit(GenerateRequest(rid, tokens, 3))
    done: dict[str, RequestResult] = {}
    results = {rid: _until(rt, rid, done) for rid in prompts}
    assert results["r0"].device_hit_tokens == 0
    for rid in ("r1", "r2"):
        assert results[rid].device_hit_tokens == (28 if hold else 0)
        assert_exact(rt, results[rid], prompts[rid])
    drain(rt)
    rt.ctl.check_integrity()
