from __future__ import annotations

import logging

import msgspec
import pytest

from hicache_ray.config import CacheConfig, MemoryConfig, StorageConfig
from hicache_ray.errors import ConfigError
from hicache_ray.keys import KVCacheNamespace, ShardPlan, make_namespace, plan_shard
from hicache_ray.layout import ModelKV, Shard, ShardKV


def _kv(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, *, heads=8, layers=8, mla=False, cp=1):
    model = ModelKV(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=4,
        dtype="float16",
        kv_lora_rank=8 if mla else 0,
        qk_rope_head_dim=4 if mla else 0,
    )
    shard = Shard(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_size=cp
    )
    return ShardKV(model=model, shard=shard, page_size=4)


def _config(granule=4, scheme="unified", **storage) -> CacheConfig:
    return CacheConfig(
        memory=MemoryConfig(page_size=4, device_tokens=64, layer_granule=granule),
        storage=StorageConfig(backend="memory", model_id="org/model", key_scheme=scheme, **storage),
    )


def _suffixes(plan: ShardPlan) -> set[str]:
    return {o.suffix for o in plan.objects}


def test_unified_key_grammar() -> None:
    plan = plan_shard(_kv(1, 4), _config(tp_lcm_size=4))
    digest = plan.digest
    assert [o.suffix for o in plan.objects] == [f"{digest}_L0-3_H1", f"{digest}_L4-7_H1"]
    h = "ab" * 32
    assert plan.keys(h) == [f"{h}_{digest}_L0-3_H1", f"{h}_{digest}_L4-7_H1"]
    assert plan.owns(plan.keys(h)[0]) and not plan.owns(f"{h}_{'0' * 16}_L0-3_H1")


@pytest.mark.parametrize(("small", "large"), [(1, 2), (2, 4), (1, 4), (4, 8)])
def test_a_tp_rank_owns_the_union_of_the_larger_tp_ranks_it_covers(small, large) -> None:
    # eight heads: TP=8 holds one head per rank, which needs an explicit head group
    config = _config(head_group=1) if large == 8 else _config(tp_lcm_size=large)
    ratio = large // small
    for rank in range(small):
        mine = plan_shard(_kv(rank, small), config)
        covered = set().union(
            *(_suffixes(plan_shard(_kv(rank * ratio + r, large), config)) for r in range(ratio))
        )
        assert _suffixes(mine) == covered


def test_pp1_owns_the_union_of_the_stages() -> None:
    config = _config(granule=2, tp_lcm_size=2)
    whole = _suffixes(plan_shard(_kv(), config))
    for pp in (2, 4):
        stages = set().union(
            *(_suffixes(plan_shard(_kv(pp_rank=r, pp_size=pp), config)) for r in range(pp))
        )
        assert stages == whole


def test_bytes_locations_point_into_the_rank_pools() -> None:
    plan = plan_shard(_kv(1, 2, pp_rank=1, pp_size=2), _config(granule=2, tp_lcm_size=4))
    first = plan.objects[0]
    assert first.layers == (4, 6) and first.local_layers == (0, 2)
    assert first.head_group == 2 and first.local_heads == (0, 2)
    assert plan.objects[1].local_heads == (2, 4)
    assert first.shape == (2, 2, 4, 2, 4) and first.num_bytes == 2 * 2 * 4 * 2 * 4 * 2


def test_default_granule_follows_the_stage_boundaries() -> None:
    config = _config(granule=0, tp_lcm_size=2)
    assert make_namespace(_kv(), config.storage, 0).layer_granule == 8
    assert make_namespace(_kv(pp_size=2), config.storage, 0).layer_granule == 4
    assert make_namespace(_kv(pp_size=3), config.storage, 0).layer_granule == 1  # 0,3,6,8


def test_mla_is_one_object_per_granule_written_by_tp_rank_0() -> None:
    config = _config(granule=4)
    plans = [plan_shard(_kv(r, 4, mla=True), config) for r in range(4)]
    assert all(_suffixes(p) == _suffixes(plans[0]) for p in plans)
    assert all("_H" not in s for s in _suffixes(plans[0]))
    assert [p.objects[0].writer for p in plans] == [True, False, False, False]
    assert plans[0].objects[0].shape == (4, 1, 4, 1, 12)


def test_rank_suffix_keys() -> None:
    config = _config(scheme="rank-suffix")
    assert _suffixes(plan_shard(_kv(1, 2), config)) == {"org-model_1_2"}
    assert _suffixes(plan_shard(_kv(1, 2, 1, 2), config)) == {"org-model_1_2_2_1"}
    mla = [plan_shard(_kv(r, 2, mla=True), config) for r in range(2)]
    assert _suffixes(mla[0]) == _suffixes(mla[1]) == {"org-model"}
    assert [p.objects[0].writer for p in mla] == [True, False]
    plan = plan_shard(_kv(0, 2), config)
    assert plan.owns("a" * 64 + "_org-model_0_2") and not plan.owns("a" * 64 + "_org-model2_0_2")


@pytest.mark.parametrize(
    ("kv_args", "config_args", "field", "hint"),
    [
        ({}, {"head_group": 3}, "head_group", "divisor"),
        ({"tp_size": 4}, {"head_group": 4}, "head_group", "tile"),
        ({"tp_size": 8}, {"tp_lcm_size": 8}, "head_group", "ambiguous"),
        ({"tp_size": 2}, {"tp_lcm_size": 3}, "tp_lcm_size", "multiple"),
        ({"tp_size": 2, "heads": 6}, {"tp_lcm_size": 4}, "tp_lcm_size", "divide"),
        ({"cp": 2}, {"tp_lcm_size": 2}, "key_scheme", "rank-suffix"),
        ({"pp_size": 2}, {"tp_lcm_size": 2, "granule": 3}, "layer_granule", "grid"),
    ],
)
def test_shards_that_do_not_tile_are_refused(kv_args, config_args, field, hint) -> None:
    granule = config_args.pop("granule", 4)
    tp_size = kv_args.pop("tp_size", 1)
    pp_size = kv_args.pop("pp_size", 1)
    kv = _kv(tp_size - 1, tp_size, pp_size - 1, pp_size, **kv_args)
    with pytest.raises(ConfigError, match=hint) as info:
        plan_shard(kv, _config(granule=granule, **config_args))
    assert info.value.field == field


def test_one_head_per_rank_is_fine_with_an_explicit_head_group() -> None:
    plan = plan_shard(_kv(7, 8), _config(head_group=1))
    assert _suffixes(plan) == {f"{plan.digest}_L0-3_H7", f"{plan.digest}_L4-7_H7"}


def test_sharing_only_with_this_tp_size_is_logged(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hicache_ray.keys.namespace"):
        plan = plan_shard(_kv(0, 2), _config())
    assert "only with TP=2" in caplog.text
    assert plan.namespace.head_group_size == 4


def test_every_namespace_field_changes_the_digest() -> None:
    base = make_namespace(_kv(), _config(tp_lcm_size=2).storage, 4)
    changes = {
        "schema_version": 2,
        "model_id": "other",
        "revision": "r2",
        "dtype": "bfloat16",
        "page_size": 8,
        "rank_replicated": True,
        "num_kv_heads": 16,
        "head_group_size": 2,
        "layer_granule": 2,
        "object_layout": "LPSHD",
        "tenant_salt": "t",
    }
    assert set(changes) == set(KVCacheNamespace.__struct_fields__)
    digests = {msgspec.structs.replace(base, **{k: v}).digest for k, v in changes.items()}
    assert len(digests) == len(changes) and base.digest not in digests


def test_namespace_and_plan_round_trip_through_msgpack() -> None:
    plan = plan_shard(_kv(1, 2), _config(tp_lcm_size=4))
    data = msgspec.msgpack.encode(plan)
    assert msgspec.msgpack.decode(data, type=ShardPlan) == plan
