"""The prefill/decode split decision on crafted loads, its policy's checks, and the pair's
config checks (no Ray)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.cache_index import CacheIndex
from hicache_ray.serving.pd_config import PDConfig
from hicache_ray.serving.pd_split import Reason, SplitPolicy, decide, pick_prefill

POLICY = SplitPolicy(min_uncached_tokens=1000, min_uncached_share=0.5, max_inflight_tokens=8000)


@pytest.mark.parametrize(
    ("prompt", "cached", "inflight", "reason", "uncached"),
    [
        (4000, 0, 0, Reason.SPLIT, 4000),  # long, nothing cached, prefill idle
        (999, 0, 0, Reason.SHORT, 999),  # below min_uncached_tokens
        (5000, 4100, 0, Reason.SHORT, 900),  # long prompt, short uncached part
        (8000, 5000, 0, Reason.CACHED, 3000),  # uncached share 0.375 < 0.5
        (4000, 0, 5000, Reason.BUSY, 4000),  # 5000 + 4000 > 8000 in flight
        (4000, 0, 4000, Reason.SPLIT, 4000),  # exactly at the bound: room
        (20000, 0, 0, Reason.SPLIT, 20000),  # an idle prefill side takes any size
        (100, 500, 0, Reason.SHORT, 0),  # more cached than the prompt (a stale index)
    ],
)
def test_decisions_on_crafted_loads(
    prompt: int, cached: int, inflight: int, reason: Reason, uncached: int
) -> None:
    decision = decide(POLICY, prompt, cached, inflight)
    assert (decision.reason, decision.uncached_tokens) == (reason, uncached)
    assert decision.split == (reason is Reason.SPLIT)


def test_a_policy_that_is_off_never_splits() -> None:
    decision = decide(SplitPolicy(enabled=False), 100_000, 0, 0)
    assert (decision.split, decision.reason) == (False, Reason.OFF)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="counts must be"):
        decide(POLICY, 0, 0, 0)
    with pytest.raises(ValueError, match="counts must be"):
        decide(POLICY, 10, -1, 0)


def test_the_wait_grows_with_the_uncached_part_up_to_its_cap() -> None:
    policy = SplitPolicy(wait_base_s=1.0, wait_per_1k_s=0.5, wait_max_s=3.0)
    assert policy.wait_s(0) == 1.0
    assert policy.wait_s(2048) == 2.0
    assert policy.wait_s(1 << 20) == 3.0
    # a side measured slower than half the configured pace gets twice its own
    assert policy.wait_s(2048, observed_per_1k_s=0.2) == 2.0
    assert policy.wait_s(1024, observed_per_1k_s=0.75) == 2.5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_uncached_tokens", -1),
        ("min_uncached_share", 1.5),
        ("max_inflight_tokens", 2.0),
        ("wait_base_s", -0.1),
        ("wait_max_s", float("nan")),
        ("poll_s", 0.0),
        ("enabled", 1),
    ],
)
def test_a_bad_policy_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        SplitPolicy(**{field: value})


def _base(
    name: str = "pd", page: int = 4, store: str = "pd-store", threshold: int = 0
) -> DeploymentConfig:
    storage = StorageConfig(backend="ray", model_id="m", ray=RayStorageOptions(name=store))
    memory = MemoryConfig(page_size=page, device_tokens=512)
    prefetch = PrefetchConfig(threshold_tokens=threshold)
    cache = CacheConfig(memory=memory, storage=storage, prefetch=prefetch)
    return DeploymentConfig(name=name, cache=cache)


def test_a_pair_shares_its_store_across_both_sides_sizes() -> None:
    config = PDConfig.pair(_base(), prefill_tp=2, decode_tp=1, prefill_pp=2)
    p, d = config.prefill, config.decode
    assert (p.name, d.name) == ("pd-prefill", "pd-decode")
    assert (p.tp_size, p.pp_size, d.tp_size, d.pp_size) == (2, 2, 1, 1)
    assert p.cache.storage.share_tp == d.cache.storage.share_tp == (1, 2)
    assert p.cache.storage.share_pp == (1, 2)
    # decode looks every handed-off prompt up in L3; prefill keeps the base's threshold
    assert d.cache.prefetch.threshold_tokens == 0 == p.cache.prefetch.threshold_tokens
    high = PDConfig.pair(_base(threshold=256)).prefill  # a floor set by hand
    assert high.cache.prefetch.threshold_tokens == 256
    low = PDConfig.pair(_base(threshold=256), policy=SplitPolicy(min_uncached_tokens=64))
    assert low.decode.cache.prefetch.threshold_tokens == 64
    with pytest.raises(ConfigError, match=r"decode\.prefetch\.threshold_tokens"):
        PDConfig(
            prefill=low.prefill, decode=msgspec.structs.replace(high, name="d"), policy=low.policy
        )


def test_sides_that_cannot_hand_pages_over_are_refused() -> None:
    good = PDConfig.pair(_base())
    with pytest.raises(ConfigError, match=r"decode\.name"):
        PDConfig(prefill=good.prefill, decode=good.prefill)
    with pytest.raises(ConfigError, match=r"decode\.page_size"):
        PDConfig(prefill=good.prefill, decode=_base("other", page=8))
    with pytest.raises(ConfigError, match=r"decode\.storage"):
        PDConfig(prefill=good.prefill, decode=_base("other", store="elsewhere"))
    none = msgspec.structs.replace(
        good.prefill, cache=CacheConfig(memory=MemoryConfig(page_size=4, device_tokens=512))
    )
    with pytest.raises(ConfigError, match=r"storage\.backend"):
        PDConfig(prefill=none, decode=msgspec.structs.replace(none, name="pd-decode"))
    with pytest.raises(ConfigError, match="prefill"):
        PDConfig(prefill="tp2", decode=good.decode)  # type: ignore[arg-type]


def test_prefill_replicas_are_named_apart_and_bounded() -> None:
    three = PDConfig.pair(_base(), prefill_replicas=3)
    names = [side.name for side in three.prefill_sides()]
    assert names == ["pd-prefill-0", "pd-prefill-1", "pd-prefill-2"]
    assert {side.tp_size for side in three.prefill_sides()} == {three.prefill.tp_size}
    assert PDConfig.pair(_base()).prefill_sides() == [PDConfig.pair(_base()).prefill]
    for bad in (0, 65, 1.0, "2"):
        with pytest.raises(ConfigError, match="prefill_replicas"):
            PDConfig.pair(_base(), prefill_replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"decode\.name"):  # a replica's name
        msgspec.structs.replace(three, decode=msgspec.structs.replace(three.decode, name=names[1]))


@pytest.mark.parametrize(
    ("prompt", "held", "inflight", "chosen"),
    [
        (2048, [0, 0], [0, 0], 0),  # idle and cold: the first
        (2048, [0, 0], [4096, 0], 1),  # the idle one
        (2048, [2048, 0], [1024, 0], 0),  # it holds the prompt: 1,024 to do there, 2,048 here
        (2048, [1024, 0], [2048, 0], 1),  # its queue outweighs what it holds
        (2048, [4096, 4096], [512, 256], 1),  # both hold it all: the less loaded
        (100, [0, 0, 0], [50, 10, 10], 1),  # a tie on both: the first of them
    ],
)
def test_a_split_prompt_goes_to_the_replica_that_finishes_it_first(
    prompt: int, held: list[int], inflight: list[int], chosen: int
) -> None:
    assert pick_prefill(prompt, held, inflight) == chosen


def test_bad_replica_counts_are_refused() -> None:
    for args in ((10, [], []), (10, [0], [0, 0]), (0, [0], [0]), (10, [-1], [0]), (10, [0], [-1])):
        with pytest.raises(ValueError):
            pick_prefill(*args)


def test_the_index_counts_leading_pages_in_l3() -> None:
    index = CacheIndex()
    index.add_store(["a", "b", "d"])
    assert index.stored(["a", "b", "c", "d"]) == 2
    assert index.stored(["x", "a"]) == 0
    assert index.stored([]) == 0
