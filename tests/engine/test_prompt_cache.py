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


def _siblings(rt: RankRuntime, seed: int) -> tuple[dict[str, list[int]], dict[str, RequestResult]]:
    """Three prompts sharing 7 pages, submitted in one step and run to their ends."""
    base = prompt(seed, 28)
    prompts = {f"r{i}": [*base, *prompt(seed + 1 + i, 5)] for i in range(3)}
    for rid, tokens in prompts.items():
        rt.submit(GenerateRequest(rid, tokens, 3))
    done: dict[str, RequestResult] = {}
    return prompts, {rid: _until(rt, rid, done) for rid in prompts}


@pytest.mark.parametrize("hold", [True, False])
def test_requests_arriving_together_compute_their_shared_prefix_once(hold: bool) -> None:
    """Three requests sharing 7 pages arrive in one step: held, the second and third wait
    for the first's prefill and hit all 7 pages; not held, all three compute them."""
    rt = _chunked(hold)
    prompts, results = _siblings(rt, 7)
    assert results["r0"].device_hit_tokens == 0
    for rid in ("r1", "r2"):
        assert results[rid].device_hit_tokens == (28 if hold else 0)
        assert_exact(rt, results[rid], prompts[rid])
    drain(rt)
    rt.ctl.check_integrity()


def _leader_fails_at(rt: RankRuntime, rid: str, chunk: int) -> None:
    """Fault injection: request ``rid`` raises before its prefill chunk ``chunk`` (0 is its
    first) and every one after (run alone again, it fails again)."""
    seen = {"n": 0}

    def on_phase(phase: str, who: str) -> None:
        if phase == "prefill" and who == rid:
            seen["n"] += 1
            if seen["n"] > chunk:
                raise RuntimeError("injected prefill failure")

    rt.on_phase = on_phase


@pytest.mark.parametrize("chunk", [0, 1])
def test_siblings_held_behind_a_request_that_fails_compute_the_prefix_themselves(
    chunk: int,
) -> None:
    """Three requests sharing 7 pages arrive together; the first, which the others wait
    for, fails before its first (or second) prefill chunk. It fails alone: the others are
    released, hit what it left in the tree (nothing, or its first chunk's 3 pages) and
    answer exactly; no page is left locked or lost."""
    rt = _chunked(hold=True)
    _leader_fails_at(rt, "r0", chunk)
    prompts, results = _siblings(rt, 11)
    assert results["r0"].error is not None and "injected" in results["r0"].error
    r1, r2 = results["r1"], results["r2"]
    assert r1.error is None and r2.error is None
    assert r1.device_hit_tokens == 12 * chunk  # the failed request's chunk, or nothing
    assert r2.device_hit_tokens == 28  # held behind r1 once r1 computes them
    for rid in ("r1", "r2"):
        assert_exact(rt, results[rid], prompts[rid])
    drain(rt)
    rt.ctl.check_integrity()


def test_siblings_held_behind_an_aborted_request_run_without_it() -> None:
    """The request the others wait for is aborted before its prefill ends: the held ones
    run, hit the chunk it computed, and answer exactly."""
    rt = _chunked(hold=True)
    base = prompt(15, 28)
    prompts = {f"r{i}": [*base, *prompt(16 + i, 5)] for i in range(2)}
    for rid, tokens in prompts.items():
        rt.submit(GenerateRequest(rid, tokens, 3))
    done: dict[str, RequestResult] = {}
    while not rt.table.running or rt.table.running[0].computed < 12:
        for result in rt.step().results:
            done[result.rid] = result
    assert rt.table.running[0].rid == "r0" and "r1" not in {s.rid for s in rt.table.running}
    rt.abort("r0")
    late = _until(rt, "r1", done)
    assert _until(rt, "r0", done).finish_reason == "abort"
    assert late.error is None and late.device_hit_tokens == 12
    assert_exact(rt, late, prompts["r1"])
    drain(rt)
    rt.ctl.check_integrity()
