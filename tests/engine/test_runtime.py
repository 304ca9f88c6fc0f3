"""The per-rank runtime: reuse from every tier is exact against recompute; bad requests."""

from __future__ import annotations

import msgspec
import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig, WriteConfig
from hicache_ray.base.storage_config import Fault, StorageConfig
from hicache_ray.engine.compose import compose_rank
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.storage import FaultyObjects, MemoryObjects

PAGE = 4
TOL = 1e-4  # float32; see README "Reference model"
MODEL = preset("tiny")


def runtime(
    objects: MemoryObjects | None,
    write_policy: str = "write_through",
    faults: tuple[Fault, ...] = (),
) -> RankRuntime:
    config = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=256),
        write=WriteConfig(policy=write_policy),  # type: ignore[arg-type]
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="memory" if objects is not None else "none", model_id="tiny"),
    )
    store = FaultyObjects(objects, faults) if objects is not None and faults else objects
    deployment = DeploymentConfig(model=MODEL, cache=config, host_budget_bytes=1 << 30)
    return compose_rank(deployment, objects=store, keep_logits=True).runtime


def run(rt: RankRuntime, request: GenerateRequest) -> RequestResult:
    rt.submit(request)
    while True:
        for result in rt.step().results:
            if result.rid == request.rid:
                return result
        rt.ctl.settle(timeout=30)


def drain(rt: RankRuntime) -> None:
    while True:
        rt.ctl.settle(timeout=30)
        if not rt.ctl.step().busy:
            return


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def reference(tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    rt = runtime(None)
    result = run(rt, GenerateRequest("ref", tokens, 16))
    assert result.device_hit_tokens == result.host_hit_tokens == 0
    logits = rt.first_logits["ref"]
    rt.ctl.close()
    return logits, result.output_tokens


def assert_exact(rt: RankRuntime, result: RequestResult, tokens: list[int]) -> None:
    ref_logits, ref_tokens = reference(tokens)
    got = rt.first_logits[result.rid]
    assert torch.allclose(got, ref_logits, atol=TOL, rtol=0), (got - ref_logits).abs().max()
    assert result.output_tokens == ref_tokens[: len(result.output_tokens)]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("tier", ["device", "host", "storage", "mixed"])
def test_reuse_from_every_tier_is_exact(tier: str, policy: str) -> None:
    objects = MemoryObjects()
    base, more = prompt(1, 30), prompt(2, 9)
    rt = runtime(objects, policy)
    first = run(rt, GenerateRequest("a", base, 4))
    assert first.recomputed_tokens == 30
    run(rt, GenerateRequest("a2", base, 1))  # a second hit makes selective writes happen
    drain(rt)
    tree, cache = rt.ctl.cache.tree, rt.ctl.cache
    if tier == "mixed":
        run(rt, GenerateRequest("head", base[:13], 1))  # pages 0-2: a node, used last
    if tier != "device":  # evict from L1 (under write_back, writing back first)
        hook = cache._write_back if policy == "write_back" else None
        keep = 3 if tier == "mixed" else 0  # mixed: pages 0-2 stay on the device
        cache.device_pool.allocator.free(tree.evict_device(tree.num_device_pages - keep, hook))
        drain(rt)
    if tier == "storage":
        rt.ctl.close()
        rt = runtime(objects, policy)  # a new deployment: only L3 holds the prefix
    tokens = base + more
    result = run(rt, GenerateRequest("b", tokens, 16))
    hits = {
        "device": result.device_hit_tokens,
        "host": result.host_hit_tokens,
        "storage": result.storage_hit_tokens,
    }
    cached = len(tokens) - result.recomputed_tokens
    assert cached > 0, hits
    if tier != "mixed":
        assert hits[tier] == cached, hits
    else:
        assert hits["device"] > 0 and hits["host"] > 0, hits
    assert_exact(rt, result, tokens)
    page_bytes = rt.ctl.cache.kv.page_bytes
    assert result.load_bytes == result.host_hit_tokens // PAGE * page_bytes
    assert result.prefetch_bytes == result.storage_hit_tokens // PAGE * page_bytes
    assert (result.load_s > 0) == (result.host_hit_tokens > 0)
    split = result.ttft_split  # disjoint parts that add up to the TTFT
    assert abs(split.rank_s - result.ttft_s) < 1e-6 and split.forward_s > 0, split
    assert split.call_s == 0  # set by the caller's door, not by the rank
    assert min(msgspec.structs.astuple(split)) >= 0, split
    drain(rt)
    rt.ctl.check_integrity()
    rt.ctl.close()


def _until(rt: RankRuntime, rids: set[str]) -> dict[str, RequestResult]:
    results: dict[str, RequestResult] = {}
    while not rids <= set(results):
        results.update({r.rid: r for r in rt.step().results})
    return results


def test_bad_requests_are_refused_alone() -> None:
    rt = runtime(None)
    good = GenerateRequest("ok", prompt(3, 10), 2)
    for bad in (
        GenerateRequest("empty", [], 2),
        GenerateRequest("vocab", [MODEL.vocab_size], 2),
        GenerateRequest("negative", [1, 2], -1),
        GenerateRequest("huge", [1] * 300, 2),
        GenerateRequest("float", [1.0, 2.0], 2),  # type: ignore[list-item]
        GenerateRequest("str-max", [1, 2], "4"),  # type: ignore[arg-type]
    ):
        rt.submit(bad)
    rt.submit(good)
    results = _until(rt, {"ok", "empty", "vocab", "negative", "huge", "float", "str-max"})
    assert results["ok"].error is None and len(results["ok"].output_tokens) == 2
    for rid in ("empty", "vocab", "negative", "huge", "float", "str-max"):
        assert results[rid].error, rid
    assert results["float"].error.startswith("tokens: element 0 is float")
    assert results["str-max"].error.startswith("max_new_tokens:")
    rt.ctl.close()


def test_bad_requests_between_good_ones_leave_them_exact() -> None:
    from tests.engine.test_request import BAD

    tokens_a, tokens_b = prompt(31, 13), prompt(32, 9)
    expected_a, expected_b = reference(tokens_a)[1][:3], reference(tokens_b)[1][:3]
    rt = runtime(MemoryObjects())
    for i, (bad, _) in enumerate(BAD):
        rt.submit(GenerateRequest(f"a{i}", tokens_a, 3))
        rt.submit(bad)
        rt.submit(GenerateRequest(f"b{i}", tokens_b, 3))
        results = _until(rt, {f"a{i}", f"b{i}"})
        assert results[f"a{i}"].output_tokens == expected_a, bad
        assert results[f"b{i}"].output_tokens == expected_b, bad
        errors = [r for r in results.values() if r.rid not in (f"a{i}", f"b{i}")]
        assert len(errors) == 1 and errors[0].error, bad
    drain(rt)
    rt.ctl.check_integrity()
    rt.ctl.close()


def test_a_request_that_raises_fails_alone() -> None:
    rt = runtime(MemoryObjects())

    def poison(phase: str, rid: str) -> None:
        if rid == "poison" and phase == "decode":
            raise ValueError("broken request")

    rt.on_phase = poison
    tokens = prompt(41, 11)
    rt.submit(GenerateRequest("poison", prompt(40, 9), 4))
    rt.submit(GenerateRequest("fine", tokens, 4))
    results = _until(rt, {"poison", "fine"})
    assert results["poison"].error == "ValueError: broken request"
    assert results["fine"].output_tokens == reference(tokens)[1][:4]
    drain(rt)
    rt.ctl.check_integrity()  # the failed request's pages were released
    assert rt.ctl.cache.device_pool.allocator.num_used_pages == rt.ctl.cache.tree.num_device_pages
    rt.ctl.close()


def test_multi_turn_hits_the_generated_tokens_too() -> None:
    rt = runtime(MemoryObjects())
    user1, user2 = prompt(5, 21), prompt(6, 7)
    turn1 = run(rt, GenerateRequest("t1", user1, 12))
    history = user1 + turn1.output_tokens + user2  # the next turn's prompt
    turn2 = run(rt, GenerateRequest("t2", history, 8))
    cached = len(history) - turn2.recomputed_tokens
    # KV of the prompt and all generated tokens but the last was inserted: 32 tokens.
    assert cached == (len(user1) + len(turn1.output_tokens) - 1) // PAGE * PAGE == 32
    assert turn2.device_hit_tokens == cached
    assert_exact(rt, turn2, history)
    rt.ctl.close()


def test_a_request_waiting_on_its_prefetch_does_not_hold_others_back() -> None:
    objects = MemoryObjects()
    stored_prompt = prompt(9, 40)
    writer = runtime(objects)
    run(writer, GenerateRequest("w", stored_prompt, 1))
    drain(writer)
    writer.ctl.close()
    slow = Fault(op="read", kind="delay", delay_s=0.05)  # 10 pages: half a second of reads
    rt = runtime(objects, faults=(slow,))
    rt.submit(GenerateRequest("slow", stored_prompt, 2))
    rt.step()  # admitted; its prefetch reads crawl
    rt.submit(GenerateRequest("quick", prompt(10, 9), 2))
    finished: list[str] = []
    while "slow" not in finished:
        finished += [r.rid for r in rt.step().results]
        rt.ctl.wait_requests(timeout=0.01)
    assert finished.index("quick") < finished.index("slow")
    rt.ctl.close()


def test_a_prompt_is_encoded_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission encodes the prompt; take, the tree walks and finish reuse the key. Rank 0's
    look-ahead, before the admission step, encodes it once more (hints.py)."""
    import hicache_ray.cache.controller.claims
    import hicache_ray.cache.hicache
    import hicache_ray.cache.tree.radix_tree
    import hicache_ray.engine.hints
    import hicache_ray.engine.runtime
    import hicache_ray.keys.page_hash
    from hicache_ray.base.tokens import encode_tokens

    tokens = prompt(7, 30)
    encoded: list[int] = []

    def counting(ids: object) -> bytes:
        if not isinstance(ids, bytes) and len(ids) >= len(tokens):  # type: ignore[arg-type]
            encoded.append(len(ids))  # type: ignore[arg-type]
        return encode_tokens(ids)  # type: ignore[arg-type]

    for module in (
        hicache_ray.cache.hicache,
        hicache_ray.cache.controller.claims,
        hicache_ray.keys.page_hash,
        hicache_ray.engine.runtime,
        hicache_ray.engine.hints,
        hicache_ray.cache.tree.radix_tree,
    ):
        monkeypatch.setattr(module, "encode_tokens", counting)
    rt = runtime(MemoryObjects())
    run(rt, GenerateRequest("once", tokens, 4))
    drain(rt)
    assert encoded == [len(tokens), len(tokens)]  # the look-ahead's, then admission's
    rt.ctl.close()


def test_pages_being_backed_up_leave_the_device_for_a_new_request() -> None:
    """A backup to L3 reads the host copy: it pins the host slots, not the device pages,
    so a request that needs the device pool evicts them instead of failing."""
    rt = runtime(MemoryObjects(), faults=(Fault(op="write", kind="delay", delay_s=0.3),))
    warm = run(rt, GenerateRequest("warm", prompt(1, 120), 4))  # 31 of the 64 pages
    assert warm.error is None
    for _ in range(100):  # until its (slow) backup is in flight
        if rt.ctl.acks.pending_backups:
            break
        rt.step()
        rt.ctl.cache.flush()
    assert rt.ctl.acks.pending_backups
    tokens = prompt(2, 150)
    big = run(rt, GenerateRequest("big", tokens, 8))  # 40 pages: the warm-up's must go
    assert big.error is None, big.error
    reference = runtime(None)
    assert big.output_tokens == run(reference, GenerateRequest("ref", tokens, 8)).output_tokens
    rt.ctl.check_integrity()
