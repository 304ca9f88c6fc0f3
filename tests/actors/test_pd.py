"""Prefill and decode apart, joined by L3: exact across TP and PP sizes, failing safe.

The pair's prefill side is TP=2 and its decode side TP=1 unless a test says otherwise. The
decode side's answer must equal a no-cache recompute whatever happens to the prefill side
(slow, failing to store, storing corrupt pages, killed), and a cancel must leave no page
held on either side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from actors.faults import RankFault
from hicache_ray.base.storage_config import Fault
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.keys import page_hashes
from hicache_ray.serving.pd_split import SplitPolicy
from tests.actors.helpers import MODEL, PAGE, cache_config, prompt, recompute, store_name
from tests.helpers import ensure_local_ray, wait_until

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")
pd = pytest.importorskip("actors.pd")

POLICY = SplitPolicy(min_uncached_tokens=16, min_uncached_share=0.5, wait_per_1k_s=0.0)


def _base(name: str, store: str, cpus: float) -> Any:
    return actors.DeploymentConfig(
        name=name,
        model=MODEL,
        cache=cache_config(store),
        host_budget_bytes=16 << 20,
        consensus_timeout_s=30.0,  # a paused rank stalls its peers' collectives
        cpus_per_rank=cpus,
    )


def _launch(name: str, store: str, cpus: float = 1.0, **sizes: int) -> Any:
    ensure_local_ray()
    base = _base(name, store, cpus)
    return pd.PDDeployment.launch(pd.PDConfig.pair(base, policy=POLICY, **sizes))


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    name = store_name()
    yield name
    actors.drop_store(name)


@pytest.fixture(scope="module")
def pair(store: str) -> Iterator[Any]:
    deployment = _launch("pd", store, prefill_tp=2, decode_tp=1)
    yield deployment
    deployment.shutdown()


def _actor(deployment: Any, rank: int) -> Any:
    name = f"hicache-{deployment.config.name}-g{deployment.generation}-rank{rank}"
    return ray.get_actor(name, namespace="hicache")


def _paired_again(pair: Any, **policy: Any) -> Any:
    """``pair``'s two sides paired again (a watch of its own) under ``POLICY`` with
    ``policy``'s changes; the caller releases it."""
    config = msgspec.structs.replace(pair.config, policy=msgspec.structs.replace(POLICY, **policy))
    return pd.PDDeployment(config, pair.prefill, pair.decode)


def _pause(deployment: Any, rank: int, seconds: float) -> None:
    """Stall ``rank``'s step loop for ``seconds``; return once the stall has begun (the
    loop steps every 0.2 s when idle, so a second without a step is the pause)."""
    ray.get(_actor(deployment, rank).inject.remote(RankFault.pause(seconds)))

    def stalled() -> bool:
        health = deployment.health()[rank]
        return health.outside_step_s is not None and health.outside_step_s > 1.0

    wait_until(stalled, timeout_s=30, what=f"rank {rank} of {deployment.config.name} to stall")


def _nothing_held(*deployments: Any) -> None:
    """Every rank of ``deployments`` holds no page once idle (no lock leaked)."""
    for deployment in deployments:
        deployment.wait_idle(timeout_s=60)
        ranks = deployment.config.tp_size * deployment.config.pp_size
        for rank in range(ranks):
            used = ray.get(_actor(deployment, rank).evict_all.remote(), timeout=60)
            assert used == {"device_pages_used": 0, "host_pages_used": 0}, (deployment, used)


def test_a_long_prompt_is_prefilled_apart_and_decoded_exactly(ray_local: None, pair: Any) -> None:
    long, short = prompt(40, 48), prompt(41, 8)
    out = pair.generate([GenerateRequest("long", long, 6), GenerateRequest("short", short, 6)])
    handed = out[0]
    assert (handed.split, handed.reason, handed.prefill_error) == (True, "split", None)
    assert (handed.handoff_pages, handed.handoff_missing) == (48 // PAGE, 0)
    # every page but the one holding the last prompt token came from L3
    assert handed.result.storage_hit_tokens >= 48 - PAGE, handed
    assert handed.result.output_tokens == recompute(long, 6)
    assert handed.ttft_s >= handed.prefill_s + handed.handoff_s > 0
    assert (out[1].split, out[1].reason) == (False, "short")
    assert out[1].result.output_tokens == recompute(short, 6)
    # The next turn finds the first turn in the decode side's own cache: not split.
    follow = long + handed.result.output_tokens + prompt(42, 4)
    turn2 = pair.generate([GenerateRequest("turn2", follow, 4)])[0]
    assert (turn2.split, turn2.reason) == (False, "short")
    assert turn2.result.output_tokens == recompute(follow, 4)
    stats = pair.stats()
    counts = (stats.requests, stats.split, stats.prefill_failed, stats.inflight_tokens)
    assert counts == (3, 1, 0, 0)
    assert stats.reasons == {"split": 1, "short": 2}


def test_a_next_turn_prefilled_apart_reads_the_answer_decode_stored(
    ray_local: None, pair: Any
) -> None:
    eager = _paired_again(pair, min_uncached_share=0.1)
    try:
        first_prompt = prompt(51, 48)
        first = eager.generate([GenerateRequest("first", first_prompt, 6)])[0]
        pair.decode.wait_idle(timeout_s=60)  # the answer's pages are in L3
        follow = first_prompt + first.result.output_tokens + prompt(52, 40)
        turn = eager.generate([GenerateRequest("next", follow, 5)])[0]
        assert turn.split and turn.result.output_tokens == recompute(follow, 5)
        # the prefill side held the first prompt, and read the answer's page from L3
        stored = (48 + 6 - 1) // PAGE * PAGE  # the last answer token has no KV yet
        assert turn.prefill_cached_tokens >= stored, turn
        # the same pair, streamed
        tokens = prompt(53, 48)
        chunks = asyncio.run(_collect(eager.stream(GenerateRequest("streamed", tokens, 5))))
        assert [t for c in chunks for t in c.tokens] == recompute(tokens, 5)
        assert chunks[-1].result is not None and chunks[-1].result.storage_hit_tokens >= 44
        assert eager.stats().split == 3
    finally:
        eager.release()


def test_pages_the_prefill_side_had_cached_are_not_waited_for(ray_local: None, pair: Any) -> None:
    tokens = prompt(54, 48)
    pair.prefill.generate([GenerateRequest("before", tokens, 0)])
    pair.prefill.wait_idle(timeout_s=60)  # in L3 before the new pair's watch starts
    late = _paired_again(pair)
    try:
        out = late.generate([GenerateRequest("cached", tokens, 6)])[0]
        # no cache event names them for this watch: the prefill side's answer does
        assert out.split and out.prefill_cached_tokens == 48 - PAGE, out
        assert (out.handoff_missing, late.stats().wait_expired) == (0, 0)
        assert out.result.storage_hit_tokens >= 48 - PAGE
        assert out.result.output_tokens == recompute(tokens, 6)
    finally:
        late.release()


async def _collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


def _cancel_when(pair: Any, request: GenerateRequest, ready: Any) -> None:
    """Start ``request``, cancel it once ``ready(pair.stats())`` holds."""

    async def run() -> None:
        task = asyncio.ensure_future(pair.generate_async(request))
        while not ready(pair.stats()):
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_cancel_while_prefilling_frees_both_sides(ray_local: None, pair: Any) -> None:
    _pause(pair.prefill, 0, 8.0)
    request = GenerateRequest("cancel-prefill", prompt(43, 48), 4)
    _cancel_when(pair, request, lambda s: s.inflight_tokens > 0)
    _nothing_held(pair.prefill, pair.decode)
    assert pair.stats().inflight_tokens == 0


def test_a_cancel_while_decoding_frees_both_sides(ray_local: None, pair: Any) -> None:
    before = pair.stats().handoff_pages
    _pause(pair.decode, 0, 8.0)
    request = GenerateRequest("cancel-decode", prompt(44, 48), 4)
    _cancel_when(pair, request, lambda s: s.handoff_pages > before)
    _nothing_held(pair.prefill, pair.decode)


def _with_faulty_prefill(pair: Any, name: str, fault: Fault, policy: SplitPolicy) -> Any:
    """``pair``'s decode side with a new prefill side whose L3 calls hit ``fault``."""
    config = pair.config.prefill
    storage = msgspec.structs.replace(config.cache.storage, faults=(fault,))
    cache = msgspec.structs.replace(config.cache, storage=storage)
    prefill_config = msgspec.structs.replace(config, name=name, cache=cache)
    prefill = actors.Deployment.launch(prefill_config)
    config = pd.PDConfig(prefill=prefill_config, decode=pair.config.decode, policy=policy)
    return pd.PDDeployment(config, prefill, pair.decode)


@pytest.mark.parametrize(
    ("kind", "stored"),
    [("fail", False), ("corrupt", True)],
    ids=["pages-never-stored", "pages-stored-corrupt"],
)
def test_a_prefill_that_hands_off_nothing_usable_costs_a_recompute(
    ray_local: None, pair: Any, kind: str, stored: bool
) -> None:
    fault = Fault(op="write", kind=kind)  # type: ignore[arg-type]
    policy = msgspec.structs.replace(POLICY, wait_base_s=1.0)
    faulty = _with_faulty_prefill(pair, f"pd-{kind}", fault, policy)
    try:
        tokens = prompt(45 if stored else 46, 48)
        out = faulty.generate([GenerateRequest(kind, tokens, 6)])[0]
        assert out.split and out.prefill_error is None
        # a failed write never reaches L3 (the wait expires); a corrupt one does, and
        # decode's checksums refuse it
        assert out.handoff_missing == (0 if stored else 48 // PAGE), out
        assert faulty.stats().wait_expired == (0 if stored else 1)
        assert out.result.storage_hit_tokens == 0, out.result
        assert out.result.output_tokens == recompute(tokens, 6)
    finally:
        faulty.release()
        faulty.prefill.shutdown()
    _nothing_held(pair.decode)


def test_a_prefill_slower_than_the_wait_is_aborted_and_recomputed(
    ray_local: None, pair: Any
) -> None:
    hasty = _paired_again(pair, wait_base_s=0.5)
    try:
        _pause(pair.prefill, 0, 4.0)
        tokens = prompt(47, 48)
        out = hasty.generate([GenerateRequest("hasty", tokens, 6)])[0]
        assert out.split and out.prefill_error == "no answer within the handoff wait"
        assert out.result.output_tokens == recompute(tokens, 6)
        assert hasty.stats().prefill_failed == 1
    finally:
        hasty.release()
    _nothing_held(pair.prefill, pair.decode)


def test_killed_ranks_on_either_side_cost_time_not_tokens(ray_local: None, pair: Any) -> None:
    generations = (pair.prefill.generation, pair.decode.generation)
    ray.get(_actor(pair.prefill, 1).inject.remote(RankFault.crash("prefill")))
    tokens = prompt(48, 48)
    out = pair.generate([GenerateRequest("kill-prefill", tokens, 6)])[0]
    assert out.split and out.result.output_tokens == recompute(tokens, 6)
    assert pair.prefill.generation == generations[0] + 1
    # the decode side re-forms while reading the handoff, and reads it again
    ray.get(_actor(pair.decode, 0).inject.remote(RankFault.crash("prefill")))
    tokens = prompt(49, 48)
    out = pair.generate([GenerateRequest("kill-decode", tokens, 6)])[0]
    assert out.split and out.handoff_missing == 0
    assert out.result.output_tokens == recompute(tokens, 6)
    assert out.result.storage_hit_tokens >= 48 - PAGE, out.result
    assert pair.decode.generation == generations[1] + 1


def test_a_decode_rank_killed_mid_stream_loses_no_token(ray_local: None, pair: Any) -> None:
    """The decode side's rank dies while a split request streams: the side re-forms, reads
    the handoff from L3 again, and the stream carries exactly the whole answer."""
    # decoding outlasts the pause's injection by far (24 tokens could all be decoded
    # before it landed on a loaded machine: the kill then met an idle rank)
    tokens, max_new = prompt(56, 48), 200
    generation = pair.decode.generation

    async def run() -> tuple[list[int], Any]:
        got: list[int] = []
        result, killed = None, False
        loop = asyncio.get_running_loop()
        async for chunk in pair.stream(GenerateRequest("kill-stream", tokens, max_new)):
            got += chunk.tokens
            result = chunk.result or result
            if got and not killed:
                # stalled first: the request cannot end before the kill lands
                await loop.run_in_executor(None, _pause, pair.decode, 0, 60.0)
                await loop.run_in_executor(None, ray.kill, _actor(pair.decode, 0))
                killed = True
        assert killed and len(got) == max_new
        return got, result

    got, result = asyncio.run(run())
    assert pair.decode.generation == generation + 1
    assert result is not None and result.error is None, result
    assert got == result.output_tokens == recompute(tokens, max_new)
    assert result.storage_hit_tokens >= 48 - PAGE, result  # the handoff, read again
    _nothing_held(pair.prefill, pair.decode)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes",
    [{"prefill_tp": 2, "decode_tp": 4}, {"prefill_pp": 2, "decode_pp": 1}],
    ids=["tp2-to-tp4", "pp2-to-pp1"],
)
def test_other_shapes_hand_off_exactly(ray_local: None, store: str, sizes: dict[str, int]) -> None:
    # half a CPU per rank: six more ranks beside the module's pair on the shared local Ray
    name = "pd-" + "-".join(f"{v}" for v in sizes.values())
    shaped = _launch(name, store, cpus=0.5, **sizes)
    try:
        tokens = prompt(60 + 3 * sizes.get("decode_tp", 0), 48)
        out = shaped.generate([GenerateRequest("shaped", tokens, 6)])[0]
        assert out.split and out.handoff_missing == 0
        assert out.result.storage_hit_tokens >= 48 - PAGE, out.result
        assert out.result.output_tokens == recompute(tokens, 6)
    finally:
        shaped.shutdown()


def test_prefill_replicas_share_the_load_and_keep_their_prompts(
    ray_local: None, store: str
) -> None:
    base = _base("pd-replicas", store, 0.5)
    policy = msgspec.structs.replace(POLICY, min_uncached_share=0.1)
    config = pd.PDConfig.pair(base, policy=policy, prefill_replicas=2)
    pair3 = pd.PDDeployment.launch(config)
    try:
        assert [p.config.name for p in pair3.prefills] == [
            "pd-replicas-prefill-0",
            "pd-replicas-prefill-1",
        ]
        a, b = prompt(70, 48), prompt(71, 48)
        # Both cold and idle: the first goes to replica 0, the second to the idle one.
        out = pair3.generate([GenerateRequest("a", a, 4), GenerateRequest("b", b, 4)])
        assert [o.split for o in out] == [True, True]
        assert [o.handoff_missing for o in out] == [0, 0]
        assert out[0].result.output_tokens == recompute(a, 4)
        assert out[1].result.output_tokens == recompute(b, 4)
        assert pair3.stats().prefill_requests == [1, 1]
        # A longer prompt over a's goes to the replica holding a's pages.
        hashes = page_hashes(a, PAGE)
        wait_until(
            lambda: pair3._watch.hits("prefill-0", hashes).device == len(hashes),
            timeout_s=30,
            what="the pair to see replica 0's pages",
        )
        longer = a + prompt(72, 40)
        turn = pair3.generate([GenerateRequest("longer", longer, 4)])[0]
        assert turn.split and turn.prefill_cached_tokens >= 48, turn
        assert turn.result.output_tokens == recompute(longer, 4)
        assert pair3.stats().prefill_requests == [2, 1]
        _nothing_held(*pair3.prefills, pair3.decode)
    finally:
        pair3.shutdown()
