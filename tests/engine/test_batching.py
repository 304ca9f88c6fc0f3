"""Continuous batching on one rank: batched equals alone, chunked prefills interleave with
decodes, the admission queue holds what does not fit, aborts, sampling and stop tokens."""

from __future__ import annotations

import msgspec
import pytest
import torch

from hicache_ray.base.config import (
    CacheConfig,
    MemoryConfig,
    PrefetchConfig,
    SchedulerConfig,
    WriteConfig,
)
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.engine.compose import compose_rank
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest, RequestResult, SamplingParams
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.storage import MemoryObjects
from tests.engine.test_runtime import TOL, prompt, reference

PAGE = 4
MODEL = preset("tiny")


def make(
    *,
    device_tokens: int = 512,
    write_policy: str = "write_through",
    objects: MemoryObjects | None = None,
    model: object = MODEL,
    **scheduler: int,
) -> RankRuntime:
    config = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=device_tokens),
        write=WriteConfig(policy=write_policy),  # type: ignore[arg-type]
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="memory" if objects else "none", model_id="tiny"),
    )
    deployment = DeploymentConfig(
        model=model if isinstance(model, type(MODEL)) else MODEL,
        cache=config,
        scheduler=SchedulerConfig(**scheduler),
        host_budget_bytes=1 << 30,
    )
    return compose_rank(deployment, objects=objects, keep_logits=True).runtime


def run_all(rt: RankRuntime, requests: list[GenerateRequest]) -> dict[str, RequestResult]:
    for r in requests:
        rt.submit(r)
    results: dict[str, RequestResult] = {}
    while len(results) < len(requests):
        results.update({r.rid: r for r in rt.step().results})
        rt.ctl.wait_requests(timeout=30)
    return results


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_a_batch_equals_each_request_run_alone(policy: str) -> None:
    objects = MemoryObjects()
    shared = prompt(70, 24)
    prompts = [shared + prompt(71 + i, 3 + 5 * i) for i in range(5)] + [prompt(90, 41)]
    warm = make(objects=objects, write_policy=policy)
    run_all(warm, [GenerateRequest("warm", shared + prompt(71, 3), 2)])  # L1 hits for some
    results = run_all(warm, [GenerateRequest(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    assert any(r.device_hit_tokens for r in results.values())
    for i, p in enumerate(prompts):
        ref_logits, ref_tokens = reference(p)
        assert results[f"r{i}"].output_tokens == ref_tokens[:12], i
        got = warm.first_logits[f"r{i}"]
        assert torch.allclose(got, ref_logits, atol=TOL, rtol=0), (got - ref_logits).abs().max()
    warm.ctl.settle(timeout=30)
    warm.ctl.check_integrity()


def test_a_long_prefill_is_chunked_and_does_not_stall_decodes() -> None:
    rt = make(max_step_tokens=16)
    rt.submit(GenerateRequest("short", prompt(1, 5), 40))
    while "short" not in rt.step().tokens:  # until it decodes
        pass
    long_prompt = prompt(2, 100)
    rt.submit(GenerateRequest("long", long_prompt, 3))
    steps = []  # tokens each request got per step, until "long" has its first token
    results: dict[str, RequestResult] = {}
    while True:
        out = rt.step()
        results.update({r.rid: r for r in out.results})
        steps.append((len(out.tokens.get("short", [])), len(out.tokens.get("long", []))))
        if out.tokens.get("long"):
            break
    # the 100-token prompt took several steps of at most 16 tokens, and in every one of
    # them "short" decoded a token
    assert len(steps) >= 100 // 16 and all(short == 1 for short, _ in steps)
    while "long" not in results:
        results.update({r.rid: r for r in rt.step().results})
    assert results["long"].output_tokens == reference(long_prompt)[1][:3]


def test_requests_that_do_not_fit_wait_in_order_and_all_succeed() -> None:
    # 64 device tokens: room for two requests of 6 + 24 tokens (8 pages each) at once
    rt = make(device_tokens=64)
    requests = [GenerateRequest(f"q{i}", prompt(20 + i, 6), 24) for i in range(8)]
    results = run_all(rt, requests)
    assert all(r.error is None for r in results.values())
    for r in requests:
        assert results[r.rid].output_tokens[:16] == reference(r.tokens)[1]
    waits = [results[f"q{i}"].queue_s for i in range(8)]
    # FIFO: two at a time, so each pair waits longer than every pair before it (the two of
    # a pair start in the same step: which of them waited longer is microseconds' noise)
    assert waits[2] > waits[1] and min(waits[-2:]) > max(waits[:-2])


def test_past_the_queue_bound_requests_are_refused_as_overloaded() -> None:
    rt = make(device_tokens=64, max_queued=2)
    requests = [GenerateRequest(f"q{i}", prompt(30 + i, 6), 24) for i in range(6)]
    for r in requests:
        rt.submit(r)
    results = {r.rid: r for r in rt.step().results}  # the refusals come at once
    refused = [rid for rid, r in results.items() if r.error and "overloaded" in r.error]
    assert len(refused) == 4  # two queued, the other four turned away
    while len(results) < 6:
        results.update({r.rid: r for r in rt.step().results})
    assert sum(r.error is None for r in results.values()) == 2


def test_aborted_requests_stop_with_what_they_made() -> None:
    rt = make(device_tokens=64)
    rt.submit(GenerateRequest("runs", prompt(40, 6), 24))
    rt.submit(GenerateRequest("queued", prompt(41, 6), 24))
    rt.submit(GenerateRequest("queued2", prompt(42, 6), 24))
    for _ in range(4):
        rt.step()
    rt.abort("runs")
    rt.abort("queued2")
    results: dict[str, RequestResult] = {}
    while len(results) < 3:
        results.update({r.rid: r for r in rt.step().results})
    assert results["runs"].finish_reason == "abort"
    assert 0 < len(results["runs"].output_tokens) < 24
    assert results["queued2"].finish_reason == "abort"
    assert (
        results["queued"].finish_reason == "length" and len(results["queued"].output_tokens) == 24
    )
    rt.ctl.settle(timeout=30)
    rt.ctl.check_integrity()


def test_seeded_sampling_is_reproducible_alone_and_batched() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    p = prompt(50, 9)
    alone = run_all(make(), [GenerateRequest("s", p, 16, params)])["s"].output_tokens
    batched = run_all(
        make(),
        [GenerateRequest("s", p, 16, params), GenerateRequest("other", prompt(51, 30), 16)],
    )["s"].output_tokens
    greedy = reference(p)[1]
    assert alone == batched and alone != greedy[:16]
    unseeded = msgspec.structs.replace(params, seed=None)
    a = run_all(make(), [GenerateRequest("same-id", p, 16, unseeded)])["same-id"].output_tokens
    b = run_all(make(), [GenerateRequest("same-id", p, 16, unseeded)])["same-id"].output_tokens
    assert a == b  # no seed: derived from the request id


def test_eos_and_stop_tokens_end_a_request() -> None:
    p = prompt(60, 9)
    greedy = reference(p)[1]
    stop = greedy[3]
    eos_model = msgspec.structs.replace(MODEL, eos_token_ids=(stop,))
    out = run_all(make(model=eos_model), [GenerateRequest("e", p, 16)])["e"]
    first = greedy.index(stop)
    assert out.finish_reason == "stop" and out.output_tokens == greedy[: first + 1]
    ignored = SamplingParams(ignore_eos=True)
    out = run_all(make(model=eos_model), [GenerateRequest("i", p, 16, ignored)])["i"]
    assert out.finish_reason == "length" and out.output_tokens == greedy
    by_request = SamplingParams(stop_token_ids=(stop,))
    out = run_all(make(), [GenerateRequest("s", p, 16, by_request)])["s"]
    assert out.finish_reason == "stop" and out.output_tokens == greedy[: first + 1]
